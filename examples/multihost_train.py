"""Training sharded over processes with jax.distributed: varstate Adam, CheckpointManager, resume.

    python examples/multihost_train.py --dir /tmp/mh --steps 20      # launches itself as 2 local processes
    # on real hosts, the same command on every host, one process each:
    python examples/multihost_train.py --dir /shared/run --steps 20 \\
        --coordinator 10.0.0.1:1234 --num-processes 2 --process-id <0 or 1>

Every process runs this same program: it creates the same variables in the
same order (so names and resource ids agree), places them on one mesh of all
processes' devices, and takes the same SPMD steps. Each process saves only its
own shards; process 0 writes the object graph and the ``checkpoint`` state
file once every process has written. `--dir` must be a directory every host
sees (a shared filesystem). Run it again to resume from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def _launch_locally(argv: list[str], processes: int) -> int:
    """Runs this script as `processes` local processes of one group (4 CPU devices each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = [
        subprocess.Popen([sys.executable, __file__, *argv, "--coordinator", f"127.0.0.1:{port}",
                          "--num-processes", str(processes), "--process-id", str(i), "--cpu-devices", "4"])
        for i in range(processes)
    ]
    codes = [c.wait() for c in children]
    return max(codes, key=abs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="checkpoint directory, shared by all hosts")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--coordinator", help="host:port of process 0 (omit to launch 2 local processes)")
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--process-id", type=int)
    p.add_argument("--cpu-devices", type=int, default=0, help="fake CPU devices per process (local demo)")
    args = p.parse_args(argv)
    if args.coordinator is None:
        return _launch_locally(argv, args.num_processes)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if args.cpu_devices:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
    return _train(args)


def _train(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import checkpoint
    import varstate
    from varstate.optimizers import Adam

    mesh = Mesh(np.array(jax.devices()), ("x",))  # every process's devices: one global mesh
    cols, rows, rep = (NamedSharding(mesh, s) for s in (P(None, "x"), P("x", None), P()))

    def put(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
        # Every process computes the same numbers and keeps the shards of its own devices.
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    rng = np.random.default_rng(0)
    registry = varstate.Registry()
    width = 8 * len(jax.devices())
    model = {
        "hidden": {"kernel": varstate.Variable(put(rng.normal(0, 0.3, (16, width)).astype(np.float32), cols),
                                               name="hidden/kernel", registry=registry),
                   "bias": varstate.Variable(put(np.zeros(width, np.float32), rep), name="hidden/bias",
                                             registry=registry)},
        "out": varstate.Variable(put(rng.normal(0, 0.3, (width, 1)).astype(np.float32), rows), name="out/kernel",
                                 registry=registry),
    }
    opt = Adam(1e-2)
    state = opt.init(model)
    step = varstate.Variable(put(np.zeros((), np.int64), rep), name="step", registry=registry)

    @jax.jit
    def loss_and_grads(model, x, y):
        def loss(m):
            h = jax.nn.relu(x @ m["hidden"]["kernel"].value + m["hidden"]["bias"].value)
            return jnp.mean(((h @ m["out"].value)[:, 0] - y) ** 2)

        return jax.value_and_grad(loss)(model)

    def batch(i: int) -> tuple[jax.Array, jax.Array]:
        data = np.random.default_rng(1000 + i)  # a pure function of the step: a resumed run sees the same data
        x = data.normal(size=(64, 16)).astype(np.float32)
        return put(x, rows), put(np.sin(x[:, 0]) + x[:, 1] * x[:, 2], NamedSharding(mesh, P("x")))

    manager = checkpoint.CheckpointManager(args.dir, max_to_keep=2)
    if manager.latest_checkpoint:
        status = manager.restore(model=model, optimizer=state, global_step=step).assert_consumed()
        model, state, step = status.model, status.optimizer, status.global_step
    first = int(step.value)
    chief = jax.process_index() == 0
    if chief:
        print(f"{jax.process_count()} processes, {len(jax.devices())} devices; starting at step {first}", flush=True)
    for i in range(first, args.steps):
        loss, grads = loss_and_grads(model, *batch(i))
        model, state = opt.apply_gradients(grads, model, state)  # one SPMD step over all processes
        step = step.assign_add(1)
        if (i + 1) % args.save_every == 0 or i + 1 == args.steps:
            manager.save(i + 1, model=model, optimizer=state, global_step=step)
            if chief:
                print(f"step {i + 1}: loss {float(loss):.4f}, saved {manager.latest_checkpoint}", flush=True)
    manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
