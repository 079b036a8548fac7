"""Save and restore time of a 256 MB sharded state: 2 processes (jax.distributed, 4 CPU devices each) vs 1 (8).

    .venv/bin/python -m benchmarks.multihost_checkpoint [--mb 256] [--dir /tmp/mh_bench]

Both runs shard the same arrays over 8 devices on this machine and write to
the same disk, so the ratio shows what the multi-process protocol costs or
saves (per-process writers, barriers, the primary's commit), not what more
hosts' disks would add. Each run saves once to warm up, then times a save
(Checkpoint.write, committed) and a restore onto the same shardings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def _worker(mb: int, directory: str, process_id: int, processes: int, port: int) -> None:
    devices = 8 // processes
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                                   process_id=process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import checkpoint
    import varstate

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = NamedSharding(mesh, P("x", None))
    n_arrays, cols = 8, 1024
    rows_each = mb * (1 << 20) // (n_arrays * cols * 4)
    registry = varstate.Registry()

    def full(value: float) -> jax.Array:
        return jax.jit(lambda: jnp.full((rows_each, cols), value, jnp.float32), out_shardings=rows)()

    def make(fill: float) -> dict:
        return {f"w{i}": varstate.Variable(full(fill + i), name=f"w{i}", registry=registry) for i in range(n_arrays)}

    state = make(1.0)
    path = os.path.join(directory, "ckpt")
    checkpoint.Checkpoint(model=state).write(path)  # warm-up: compiles, creates the files' directories
    t0 = time.perf_counter()
    checkpoint.Checkpoint(model=state).write(path)
    save_s = time.perf_counter() - t0
    template = make(0.0)
    t0 = time.perf_counter()
    restored = checkpoint.Checkpoint(model=template).restore(path).assert_consumed().model
    jax.block_until_ready([v.value for v in restored.values()])
    restore_s = time.perf_counter() - t0
    ok = all(float(v.value.addressable_shards[0].data[0, 0]) == 1.0 + i for i, v in enumerate(restored.values()))
    if jax.process_index() == 0:
        print("BENCH " + json.dumps({"save_s": save_s, "restore_s": restore_s, "ok": ok}), flush=True)
    if processes > 1:
        sys.stdout.flush()
        os._exit(0)


def _run(processes: int, mb: int, directory: str) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    children = [subprocess.Popen([sys.executable, "-m", "benchmarks.multihost_checkpoint", "--worker", str(i),
                                  str(processes), str(port), "--mb", str(mb), "--dir", directory],
                                 stdout=subprocess.PIPE, text=True, cwd=root)
                for i in range(processes)]
    outputs = [c.communicate(timeout=900)[0] for c in children]
    if any(c.returncode for c in children):
        raise SystemExit(f"a benchmark process failed: {[c.returncode for c in children]}")
    line = next(line for line in outputs[0].splitlines() if line.startswith("BENCH "))
    return json.loads(line[len("BENCH "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--dir", default=None)
    p.add_argument("--worker", nargs=3, type=int, metavar=("PROCESS_ID", "PROCESSES", "PORT"))
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="mh_bench_")
    if args.worker:
        _worker(args.mb, directory, *args.worker)
        return
    one = _run(1, args.mb, os.path.join(directory, "one"))
    two = _run(2, args.mb, os.path.join(directory, "two"))
    shutil.rmtree(directory, ignore_errors=True)
    for name, r in (("1 process x 8 devices", one), ("2 processes x 4 devices", two)):
        print(f"{name:26s} save {r['save_s']:.2f} s  restore {r['restore_s']:.2f} s  values ok: {r['ok']}")
    print(f"ratio 2 processes / 1 process: save {two['save_s'] / one['save_s']:.2f}, "
          f"restore {two['restore_s'] / one['restore_s']:.2f}")


if __name__ == "__main__":
    main()
