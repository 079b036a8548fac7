"""Optimizer step speed and memory: varstate vs optax.adam, optax.flatten(optax.adam) (jit + donation) and nnx.

Run by hand: ``.venv/bin/python -m benchmarks.optimizers`` (over 15 minutes on 2 CPU cores, most of it
compiling steps over 1,000 tensors). First the default path's rows (issue 25): Adam as ``init(params)`` makes
it, no ``fused=``, against ``optax.adam`` in the four setups below of each size, each setup in a fresh process
where the two take turns in rounds of bursts (`_paired`); target <= 1.0x in each, varstate's slowest setup within
10% of its fastest. Then the full table. Setups: Adam on 1,000 x 16x4 and 200 x 256x64, params as a list and as a
dict, gradients fresh from ``jnp.full`` and made by a jitted function, each unfused and fused
(``init(params, fused=True)``), then fused against unfused over one total size split into params of several
sizes (where packing pays, which sets `FUSE_MAX_SIZE`). Times are the minimum over repeats of the
mean step time of a burst of steps (the machine is noisy; CPU time is the steadier figure); a ratio < 1 means
varstate is faster. Also: the first step of a freshly built model identical to one already stepped (the compiled
step is reused) against a jit over Variables, which traces and compiles again; the compiled peak memory of one
donated step; lazy against dense Adam on a large embedding table.
Last, the sweep row: 8 learning rates as one vmapped, jitted step over stacked runs (``traced``) against a
Python loop over 8 optimizers, wall time and compiles. ``--accelerator-rows`` runs only the rows issue 15 asks
of a GPU (see benchmarks/gpu.sh); ``--default-path`` only the default path's rows (about 3 minutes);
``--sweep`` only the sweep row; ``--first-step`` only the first-step row (a fresh process per contender);
``--mixed-precision`` only the AutoCastVariable row; ``--compile-order`` why the default path's setups
run in processes of their own (`compile_order_row`).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import varstate
from varstate.optimizers import Adam
from varstate.optimizers._core import _packed, _step

REPEATS = 5


def _time(runners, n_steps):
    """Min over REPEATS of each runner's mean step time, wall clock and process CPU time.

    Repeats are interleaved across runners (fair under noise). CPU time (all
    threads) is the steadier figure on a shared machine. `runners` maps a
    name to (step, carry); `carry = step(carry)` is one step.
    """
    carries = {}
    for name, (step, carry) in runners.items():
        carries[name] = jax.block_until_ready(step(step(carry)))  # compile and settle
    wall = dict.fromkeys(runners, float("inf"))
    cpu = dict.fromkeys(runners, float("inf"))
    for _ in range(REPEATS):
        for name, (step, _) in runners.items():
            carry = carries[name]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n_steps):
                carry = step(carry)
            carries[name] = jax.block_until_ready(carry)
            wall[name] = min(wall[name], (time.perf_counter() - t0) / n_steps)
            cpu[name] = min(cpu[name], (time.process_time() - c0) / n_steps)
    return {name: (wall[name], cpu[name]) for name in runners}


def _optax_step(tx):
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


class _Model(nnx.Module):
    def __init__(self, shapes):
        for i, shape in enumerate(shapes):
            setattr(self, f"p{i}", nnx.Param(jnp.zeros(shape)))


@nnx.jit
def _nnx_step(model, optimizer, grads):
    optimizer.update(model, grads)


# Gradients as a training step makes them: outputs of a jitted function (committed arrays).
_jitted_full = jax.jit(lambda like: jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), like))


def _setup(count, shape, container, grads_from):
    """(grads for varstate/optax, a params-like maker) for one setup: params as a list or a dict of arrays."""
    names = [f"p{i}" for i in range(count)]

    def arrange(arrays):
        return list(arrays) if container == "list" else dict(zip(names, arrays, strict=True))

    zeros = arrange([jnp.zeros(shape) for _ in names])
    grads = arrange([jnp.full(shape, 0.01) for _ in names]) if grads_from == "full" else _jitted_full(zeros)
    return arrange, grads


def bench_dense(count, shape, n_steps, container="list", grads_from="full", with_nnx=False):
    lr = 1e-3
    arrange, grads = _setup(count, shape, container, grads_from)

    opt = Adam(lr)
    params = arrange([varstate.Variable(jnp.zeros(shape), name=f"p{i}") for i in range(count)])
    fused_params = arrange([varstate.Variable(jnp.zeros(shape), name=f"f{i}") for i in range(count)])

    tx = optax.adam(lr)
    step = _optax_step(tx)
    flat_tx = optax.flatten(optax.adam(lr))
    flat_step = _optax_step(flat_tx)

    def fresh_arrays():
        return arrange([jnp.zeros(shape) for _ in range(count)])

    a1, a2 = fresh_arrays(), fresh_arrays()
    runners = {
        "varstate": (lambda c: opt.apply_gradients(grads, *c), (params, opt.init(params))),
        "fused": (lambda c: opt.apply_gradients(grads, *c), (fused_params, opt.init(fused_params, fused=True))),
        "optax": (lambda c: step(*c, grads), (a1, tx.init(a1))),
        "flatten": (lambda c: flat_step(*c, grads), (a2, flat_tx.init(a2))),
    }
    if with_nnx:
        model = _Model([shape] * count)
        optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
        nnx_grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.01), nnx.state(model, nnx.Param))

        def nnx_step(carry):
            _nnx_step(model, optimizer, nnx_grads)
            return nnx.state(model, nnx.Param)

        runners["nnx"] = (nnx_step, None)
    return _time(runners, n_steps)


def _paired(runners, rounds, burst):
    """Per runner, its mean step time in each of `rounds` rounds: a burst of `burst` steps of each runner per round,
    waited for at its end (a training loop waits for its results now and then, not after every step).

    Adjacent bursts see the same machine: a shared machine's slow spells,
    which move a burst's time by 10-20% from one burst to the next, hit every
    runner of a round alike, so the per-round ratios are the steady figure.
    Each round starts one runner later than the last: the first burst of a
    round runs up to 30% faster than the others (for optax as for varstate),
    and each runner takes that place as often. `runners` maps a name to
    (step, carry); `carry = step(carry)` is one step.
    """
    carries = {name: jax.block_until_ready(step(step(carry))) for name, (step, carry) in runners.items()}
    times = {name: [] for name in runners}
    order = list(runners)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            step, carry = runners[name][0], carries[name]
            t0 = time.perf_counter()
            for _ in range(burst):
                carry = step(carry)
            carries[name] = jax.block_until_ready(carry)
            times[name].append((time.perf_counter() - t0) / burst)
    return {name: np.array(t) for name, t in times.items()}


DEFAULT_SIZES = {"1000 x 16x4": (1000, (16, 4)), "200 x 256x64": (200, (256, 64))}


def default_setup(size, container, grads_from, rounds=40, burst=5):
    """One setup of the default path's rows, in this process: varstate's Adam (``init(params)``) and optax.adam
    taking turns (`_paired`); prints {"varstate": [...], "optax": [...]} (each round's mean step seconds) as JSON."""
    import json

    count, shape = DEFAULT_SIZES[size]
    arrange, grads = _setup(count, shape, container, grads_from)
    opt = Adam(1e-3)
    params = arrange([varstate.Variable(jnp.zeros(shape), name=f"d{i}") for i in range(count)])
    tx = optax.adam(1e-3)
    step = _optax_step(tx)
    arrays = arrange([jnp.zeros(shape) for _ in range(count)])
    runners = {"varstate": (lambda c: opt.apply_gradients(grads, *c), (params, opt.init(params))),
               "optax": (lambda c: step(*c, grads), (arrays, tx.init(arrays)))}
    print(json.dumps({name: t.tolist() for name, t in _paired(runners, rounds, burst).items()}))


def compile_order_row():
    """Why `default_rows` runs each setup in its own process, without varstate: optax.adam's step jitted twice,
    one for gradients of a weak float32 type (``jnp.full(shape, 0.01)``) and one for a strong one (a jitted
    function's output), both stepped in turns; a fresh process per compile order. Prints the median step ms."""
    for first in ("weak", "strong"):
        print(_in_child("--compile-order-child", first).strip(), flush=True)


def _in_child(*args: str) -> str:
    """The stdout of this module run with `args` in a fresh Python process."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "benchmarks.optimizers", *args],
                          capture_output=True, text=True, check=True).stdout


def _compile_order_child(first, count=1000, shape=(16, 4), rounds=30, burst=5):
    grads = {"weak": _setup(count, shape, "list", "full")[1], "strong": _setup(count, shape, "list", "jit")[1]}
    assert grads["weak"][0].weak_type and not grads["strong"][0].weak_type
    tx = optax.adam(1e-3)
    order = [first, "strong" if first == "weak" else "weak"]
    runners = {}
    for kind in order:  # compiled in this order by _paired's first steps
        step, arrays = _optax_step(tx), [jnp.zeros(shape) for _ in range(count)]
        runners[kind] = (lambda c, step=step, g=grads[kind]: step(*c, g), (arrays, tx.init(arrays)))
    t = _paired(runners, rounds, burst)
    print(f"optax.adam, {count} x {shape[0]}x{shape[1]}, compiled first with {order[0]} gradients: "
          + ", ".join(f"{kind} {np.median(t[kind]) * 1e3:.2f} ms" for kind in order))


def default_rows():
    """Issue 25's default path: Adam as ``Adam(lr).init(params)`` makes it (no ``fused=``) against optax.adam,
    both jitted with donation, in the four setups of each size; each setup in a fresh process, as a training
    process has one model and one step.

    In one process, every setup's program is one more executable, and which of them runs slower depends on the
    order they were compiled in: with all eight setups of a size in one process, the varstate setup compiled
    second ran 10-25% slower than the first. Without varstate too (`compile_order_row`): optax's own step,
    jitted twice and called with gradients of a weak and of a strong float32 type, ran 9-20% slower in
    whichever of the two was compiled second; the same gradients through two jit functions did not. The
    setups are compared with each other through their processes' medians.
    """
    import json

    print("default path: Adam(1e-3).init(params) against optax.adam, jitted with donation; a fresh process per "
          "setup, 40 rounds of 5 steps of each per round; median step ms; ours/adam: median of the per-round "
          "ratios; target <= 1.0 each, varstate's slowest setup within 10% of its fastest")
    print(f"{'setup':<34}{'varstate':>10}{'optax.adam':>12}{'ours/adam':>11}")
    for size in DEFAULT_SIZES:
        ours, ref = {}, {}
        for container in ("list", "dict"):
            for grads_from in ("full", "jit"):
                out = _in_child("--default-setup", size, container, grads_from)
                t = {name: np.array(v) for name, v in json.loads(out.splitlines()[-1]).items()}
                label = (container, grads_from)
                ours[label], ref[label] = np.median(t["varstate"]), np.median(t["optax"])
                ratio = np.median(t["varstate"] / t["optax"])
                print(f"{f'{size}, {container}, grads {grads_from}':<34}{ours[label] * 1e3:>10.2f}"
                      f"{ref[label] * 1e3:>12.2f}{ratio:>11.3f}", flush=True)
        print(f"    slowest / fastest setup: varstate {max(ours.values()) / min(ours.values()):.3f}, "
              f"optax.adam {max(ref.values()) / min(ref.values()):.3f}", flush=True)
    print()


def bench_fresh_model(count, shape):
    """Time of the first step of a freshly built model identical to one already stepped.

    Ours now: the compiled step is reused (no trace, no compile). Before: the
    jit over Variables (identity in the treedef) traced and compiled again; such
    a jit is timed the same way here.
    """
    opt = Adam(1e-3)
    grads = {f"p{i}": jnp.full(shape, 0.01) for i in range(count)}

    def model():
        params = {f"p{i}": varstate.Variable(jnp.zeros(shape), name=f"p{i}") for i in range(count)}
        return params, opt.init(params)

    jax.block_until_ready(opt.apply_gradients(grads, *model()))  # the first model: traced and compiled once
    params, state = model()
    t0 = time.perf_counter()
    jax.block_until_ready(opt.apply_gradients(grads, params, state))
    ours = time.perf_counter() - t0

    trees = jax.jit(lambda params, state: opt.update(grads, params, state), donate_argnums=(0, 1))

    jax.block_until_ready(trees(*model()))
    params, state = model()
    t0 = time.perf_counter()
    jax.block_until_ready(trees(params, state))
    before = time.perf_counter() - t0
    return ours, before


def peak_bytes(compiled):
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def bench_memory(count, shape):
    shapes = [shape] * count
    grads = [jnp.full(s, 0.01) for s in shapes]
    opt = Adam(1e-3)
    params = [varstate.Variable(jnp.zeros(s), name=f"p{i}") for i, s in enumerate(shapes)]
    ours = peak_bytes(_step.lower(opt, grads, params, opt.init(params)).compile())
    tx = optax.adam(1e-3)
    arrays = [jnp.zeros(s) for s in shapes]
    ref = peak_bytes(_optax_step(tx).lower(arrays, tx.init(arrays), grads).compile())
    return ours, ref


def bench_lazy(rows, dim, touched, n_steps):
    rng = np.random.default_rng(0)
    indices = jnp.asarray(rng.integers(0, rows, touched).astype(np.int32))
    sparse = [varstate.IndexedSlices(jnp.full((touched, dim), 0.01), indices, (rows, dim))]
    lazy = Adam(1e-3, lazy=True)
    table = [varstate.Variable(jnp.zeros((rows, dim)), name="embedding")]
    lazy_t = _time({"lazy": (lambda c: lazy.apply_gradients(sparse, *c), (table, lazy.init(table)))}, n_steps)["lazy"]
    del table  # 3 x 256 MB; free it before the dense run

    dense = Adam(1e-3)
    table = [varstate.Variable(jnp.zeros((rows, dim)), name="embedding")]
    grad = [jnp.full((rows, dim), 0.01)]
    dense_t = _time({"dense": (lambda c: dense.apply_gradients(grad, *c), (table, dense.init(table)))}, 2)["dense"]
    return lazy_t, dense_t


def bench_threshold(total, sizes, n_steps):
    """Fused vs unfused Adam over `total` float32 elements split into params of each size: where packing pays."""
    out = {}
    opt = Adam(1e-3)
    for size in sizes:
        count = total // size
        grads = [jnp.full((size,), 0.01) for _ in range(count)]
        runners = {}
        for fused in (False, True):
            params = [varstate.Variable(jnp.zeros((size,)), name=f"t{fused}{i}") for i in range(count)]
            runners[fused] = (lambda c, g=grads: opt.apply_gradients(g, *c), (params, opt.init(params, fused=fused)))
        # Packing is what is measured: lift the size limit for this row.
        limit, _packed.FUSE_MAX_SIZE = _packed.FUSE_MAX_SIZE, max(size, _packed.FUSE_MAX_SIZE)
        try:
            t = _time(runners, n_steps)
        finally:
            _packed.FUSE_MAX_SIZE = limit
        out[size] = t[True][0] / t[False][0]
    return out


def accelerator_rows():
    """Issue 15's rows for a GPU (benchmarks/gpu.sh): fused Adam against optax.adam on 1,000 x 16x4 (target:
    at least 3x faster) and on 200 x 256x64 (target: no slower), params as a list, gradients from a jit."""
    print(f"jax {jax.__version__} on {jax.devices()[0]}; min over {REPEATS} interleaved repeats; wall ms")
    targets = {1000: ("fused/adam", "<= 0.33"), 200: ("fused/adam", "<= 1.0")}
    for count, shape in [(1000, (16, 4)), (200, (256, 64))]:
        t = bench_dense(count, shape, 50, "list", "jit")
        ours, fused, ref, flat = (t[k][0] for k in ("varstate", "fused", "optax", "flatten"))
        what, target = targets[count]
        print(f"{count} x {shape[0]}x{shape[1]}: varstate {ours * 1e3:.3f}, fused {fused * 1e3:.3f}, optax.adam "
              f"{ref * 1e3:.3f}, optax.flatten {flat * 1e3:.3f}; ours/adam {ours / ref:.3f}, {what} "
              f"{fused / ref:.3f} (target {target}), fused/flatten {fused / flat:.3f}")


def bench_packed(count=1000, shape=(16, 4), n_steps=20):
    """Packed params (`varstate.pack`) on `count` tensors of `shape`: (a) the Adam step alone against one jitted
    Adam over a single buffer of the same floats (the limit) and optax.adam / optax.flatten over the separate
    arrays; (b) a whole training step (forward, backward, update, one jit) of a model reading every tensor,
    packed against optax.adam over the separate arrays. Returns {name: (wall s, CPU s)} for each part."""
    lr = 1e-3
    n = count * int(np.prod(shape))
    x = jnp.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape)

    opt = Adam(lr)
    packed = varstate.pack([varstate.Variable(jnp.zeros(shape), name=f"p{i}") for i in range(count)])
    grads_packed = jax.tree.map(lambda b: jnp.full(b.shape, 0.01, b.dtype), packed)
    buffer = [jnp.zeros(n)]
    limit_grads = [jnp.full(n, 0.01)]
    limit = jax.jit(opt.update, donate_argnums=(1, 2))
    arrays = [jnp.zeros(shape) for _ in range(count)]
    grads = [jnp.full(shape, 0.01) for _ in range(count)]
    tx, flat_tx = optax.adam(lr), optax.flatten(optax.adam(lr))
    step, flat_step = _optax_step(tx), _optax_step(flat_tx)
    a2 = [jnp.zeros(shape) for _ in range(count)]
    steps = _time({
        "packed": (lambda c: opt.apply_gradients(grads_packed, *c), (packed, opt.init(packed))),
        "limit": (lambda c: limit(limit_grads, *c), (buffer, opt.init(buffer))),
        "optax": (lambda c: step(*c, grads), (arrays, tx.init(arrays))),
        "flatten": (lambda c: flat_step(*c, grads), (a2, flat_tx.init(a2))),
    }, n_steps)

    def loss_of(tensors):
        return sum(jnp.sum(jnp.tanh(w * x)) for w in tensors)

    @jax.jit
    def train_packed(carry):
        packed, state = carry
        g = jax.grad(lambda p: loss_of([v.value for v in p.unpack()]))(packed)
        return opt.update(g, packed, state)

    @jax.jit
    def train_optax(carry):
        params, opt_state = carry
        updates, opt_state = tx.update(jax.grad(loss_of)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    packed2 = varstate.pack([varstate.Variable(jnp.zeros(shape), name=f"q{i}") for i in range(count)])
    arrays2 = [jnp.zeros(shape) for _ in range(count)]
    train = _time({"packed": (train_packed, (packed2, opt.init(packed2))),
                   "optax": (train_optax, (arrays2, tx.init(arrays2)))}, n_steps)
    return steps, train


def packed_rows():
    steps, train = bench_packed()
    p, lim, ref, flat = (steps[k][0] for k in ("packed", "limit", "optax", "flatten"))
    print(f"packed params (varstate.pack), Adam on 1000 x 16x4: step {p * 1e3:.3f} ms, one jitted Adam over a single "
          f"buffer {lim * 1e3:.3f} ms, packed/limit {p / lim:.1f}x (target <= 3x); optax.adam {ref * 1e3:.3f} ms, "
          f"optax.flatten {flat * 1e3:.3f} ms (optax.adam/packed {ref / p:.0f}x)")
    tp, to = train["packed"][0], train["optax"][0]
    print(f"whole training step (forward, backward, update in one jit), 1000 x 16x4: packed {tp * 1e3:.3f} ms, "
          f"optax.adam over separate arrays {to * 1e3:.3f} ms, optax/packed {to / tp:.1f}x (target >= 5x)")


def bench_sweep(n_runs=8, count=16, shape=(64, 64), n_steps=50):
    """A sweep of `n_runs` learning rates: one vmapped, jitted step over stacked runs (``Adam(traced(lr))``)
    against a Python loop of `n_runs` optimizers ``Adam(lr)`` (``apply_gradients``), each with its own jitted
    gradient. Returns {name: (wall seconds of the whole sweep, programs of the steps and gradients compiled)},
    counted through jax's monitoring events."""
    from varstate.optimizers import traced

    names: list[str] = []
    event = "/jax/core/compile/jaxpr_to_mlir_module_duration"

    def listen(e, _duration, *, fun_name="", **_kwargs):
        if e == event:
            names.append(fun_name)

    def compiled(since):  # the steps' and gradients' programs (eager ops such as jnp.full compile too)
        return sum(n in ("jit(sweep_step)", "jit(_flat_step)", "jit(loss)") for n in names[since:])

    jax.monitoring.register_event_duration_secs_listener(listen)
    lrs = np.geomspace(1e-4, 1e-1, n_runs)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, shape[0])), jnp.float32)

    def make_params():
        return [jnp.full(shape, 0.01 * (i + 1), jnp.float32) for i in range(count)]

    def loss(params):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    out = {}
    try:
        start, before = time.perf_counter(), len(names)
        opt = Adam(traced(1e-3))
        params = make_params()
        stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_runs, *jnp.shape(a))), (params, opt.init(params)))
        p_b, s_b = stacked[0], stacked[1].with_hyperparameters(learning_rate=lrs)

        @jax.jit
        @jax.vmap
        def sweep_step(p, s):
            return opt.update(jax.grad(loss)(p), p, s)

        for _ in range(n_steps):
            p_b, s_b = sweep_step(p_b, s_b)
        jax.block_until_ready(p_b)
        out["vmapped"] = (time.perf_counter() - start, compiled(before))
        start, before = time.perf_counter(), len(names)
        for lr in lrs:
            opt_i = Adam(float(lr))
            p = [varstate.Variable(w, name=f"w{i}") for i, w in enumerate(make_params())]
            s = opt_i.init(p)
            grad = jax.jit(jax.grad(loss))  # one per run, as a script looping over runs makes
            for _ in range(n_steps):
                p, s = opt_i.apply_gradients(grad([v.value for v in p]), p, s)
            jax.block_until_ready(p[0].value)
        out["loop"] = (time.perf_counter() - start, compiled(before))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return out


def sweep_row():
    t = bench_sweep()
    (vm, vm_c), (lp, lp_c) = t["vmapped"], t["loop"]
    print(f"sweep of 8 learning rates, Adam on 16 x 64x64 (tanh MLP), 50 steps each, compile included: vmapped "
          f"{vm:.2f} s ({vm_c} compiled program), loop of 8 optimizers {lp:.2f} s ({lp_c} compiled: a step and a "
          f"gradient each), loop/vmapped {lp / vm:.1f}x")


def mixed_precision_rows(count=1000, shape=(16, 4), rounds=30, burst=5):
    """Adam over `count` AutoCastVariables (mixed_precision.autocast_variables) against the same params as plain
    Variables and optax.adam over arrays, gradients in each params' structure, taking turns (`_paired`)."""
    from varstate import mixed_precision

    opt, tx = Adam(1e-3), optax.adam(1e-3)
    runners = {}
    for label, wrap in (("Variable", lambda p: p), ("AutoCastVariable", mixed_precision.autocast_variables)):
        params = wrap({f"p{i}": varstate.Variable(jnp.zeros(shape), name=f"{label}{i}") for i in range(count)})
        grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.01), params)
        runners[label] = (lambda c, grads=grads: opt.apply_gradients(grads, *c), (params, opt.init(params)))
    arrays = {f"p{i}": jnp.zeros(shape) for i in range(count)}
    step, grads = _optax_step(tx), {f"p{i}": jnp.full(shape, 0.01) for i in range(count)}
    runners["optax.adam"] = (lambda c: step(*c, grads), (arrays, tx.init(arrays)))
    t = _paired(runners, rounds, burst)
    print(f"mixed precision: Adam on {count} x {shape[0]}x{shape[1]}, {rounds} rounds of {burst}-step bursts, median "
          "step ms; ratios: median of the per-round ratios")
    for name in runners:
        print(f"  {name:<17}{np.median(t[name]) * 1e3:8.2f} ms   /Variable {np.median(t[name] / t['Variable']):.3f}"
              f"   /optax.adam {np.median(t[name] / t['optax.adam']):.3f}")


_FIRST_STEP_CHILD = r"""
import sys, time
import jax, jax.numpy as jnp, optax
import varstate
from varstate.optimizers import Adam
contender, count = sys.argv[1], int(sys.argv[2])
grads = {f"p{i}": jnp.full((16, 4), 0.01) for i in range(count)}
if contender == "optax.adam":
    tx = optax.adam(1e-3)
    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    carry = ({f"p{i}": jnp.zeros((16, 4)) for i in range(count)},)
    carry = (carry[0], tx.init(carry[0]))
    step = lambda c: update(*c, grads)
else:
    opt = Adam(1e-3)
    params = {f"p{i}": varstate.Variable(jnp.zeros((16, 4)), name=f"p{i}") for i in range(count)}
    carry = (params, opt.init(params, fused=contender == "fused"))
    step = lambda c: opt.apply_gradients(grads, *c)
t0 = time.perf_counter()
carry = jax.block_until_ready(step(carry))
first = time.perf_counter() - t0
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(20):
        carry = step(carry)
    jax.block_until_ready(carry)
    best = min(best, (time.perf_counter() - t0) / 20)
print(first, best)
"""


def first_step_rows(count=1000, rounds=2):
    """The first step (trace, compile, run) of Adam on `count` x 16x4 in a fresh process per contender
    (unfused, fused, optax.adam), rounds interleaved; then the step time there. Prints the minimum of each."""
    import subprocess

    contenders = ("unfused", "fused", "optax.adam")
    got: dict[str, list[tuple[float, float]]] = {c: [] for c in contenders}
    for _ in range(rounds):
        for c in contenders:
            done = subprocess.run([sys.executable, "-c", _FIRST_STEP_CHILD, c, str(count)], capture_output=True,
                                  text=True, check=True)
            first, step = map(float, done.stdout.split()[-2:])
            got[c].append((first, step))
    ref = min(f for f, _ in got["optax.adam"])
    print(f"first step (trace, compile, run) of Adam on {count} x 16x4 (dict), a fresh process each, min of {rounds}:")
    for c in contenders:
        first, step = min(f for f, _ in got[c]), min(s for _, s in got[c])
        print(f"  {c:<11} first step {first:6.2f} s ({first / ref:.2f}x optax.adam's)   then {step * 1e3:6.2f} ms/step")


def main():
    if sys.argv[1:] == ["--compile-order"]:
        return compile_order_row()
    if sys.argv[1:2] == ["--compile-order-child"]:
        return _compile_order_child(sys.argv[2])
    if sys.argv[1:2] == ["--default-setup"]:
        return default_setup(*sys.argv[2:5])
    if sys.argv[1:] == ["--first-step"]:
        return first_step_rows()
    if sys.argv[1:] == ["--mixed-precision"]:
        return mixed_precision_rows()
    if sys.argv[1:] == ["--accelerator-rows"]:
        return accelerator_rows()
    if sys.argv[1:] == ["--sweep"]:
        return sweep_row()
    if sys.argv[1:] == ["--packed"]:
        return packed_rows()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    default_rows()
    if sys.argv[1:] == ["--default-path"]:
        return None
    print(f"min over {REPEATS} interleaved repeats")
    print("each cell: wall ms / CPU ms; ratios of wall times (of CPU times); < 1: varstate is faster")
    print("varstate: Adam(...).init(params); fused: .init(params, fused=True) (slots of params up to "
          f"{_packed.FUSE_MAX_SIZE} elements packed)\n")
    print(f"{'Adam step':<34}{'varstate':>15}{'fused':>15}{'optax.adam':>15}{'optax.flatten':>15}"
          f"{'ours/adam':>16}{'fused/adam':>16}{'fused/flatten':>16}{'nnx/ours':>16}")
    for count, shape, n in [(1000, (16, 4), 20), (200, (256, 64), 20)]:
        for container in ("list", "dict"):
            for grads_from in ("full", "jit"):
                with_nnx = container == "list" and grads_from == "full"
                t = bench_dense(count, shape, n, container, grads_from, with_nnx)
                ours, fused, ref, flat = t["varstate"], t["fused"], t["optax"], t["flatten"]
                cells = "".join(f"{w * 1e3:>8.2f}/{c * 1e3:<6.2f}" for w, c in (ours, fused, ref, flat))
                nnx_cell = f"{t['nnx'][0] / ours[0]:>9.1f}x ({t['nnx'][1] / ours[1]:.1f}x)" if with_nnx else ""
                label = f"{count} x {shape[0]}x{shape[1]}, {container}, grads {grads_from}"
                print(f"{label:<34}{cells}{ours[0] / ref[0]:>9.3f} ({ours[1] / ref[1]:.3f})"
                      f"{fused[0] / ref[0]:>9.3f} ({fused[1] / ref[1]:.3f})"
                      f"{fused[0] / flat[0]:>9.3f} ({fused[1] / flat[1]:.3f}){nnx_cell}")

    sizes = (64, 1024, 4096, 16384)
    ratios = bench_threshold(1 << 18, sizes, 10)
    print("\nfused/unfused over 262,144 elements split into params of n elements: "
          + ", ".join(f"n={n}: {r:.2f}" for n, r in ratios.items()))

    ours_f, before_f = bench_fresh_model(1000, (16, 4))
    print(f"\nfirst step of a freshly built, identical model (1000 x 16x4, dict): {ours_f * 1e3:.0f} ms "
          f"(compiled step reused), before: {before_f * 1e3:.0f} ms (traced and compiled again), "
          f"{before_f / ours_f:.0f}x")

    ours_b, ref_b = bench_memory(200, (256, 64))
    print(f"\npeak memory of one donated step (compiled memory analysis), 200 x 256x64: varstate "
          f"{ours_b / 2**20:.1f} MB, optax {ref_b / 2**20:.1f} MB, ratio {ours_b / ref_b:.3f}")

    lazy_t, dense_t = bench_lazy(1_000_000, 64, 1024, 20)
    print(f"\nAdam step on a 1,000,000 x 64 table, 1,024 rows touched: lazy {lazy_t[0] * 1e3:.3f} ms, "
          f"dense {dense_t[0] * 1e3:.1f} ms, dense/lazy {dense_t[0] / lazy_t[0]:.0f}x "
          f"(CPU {dense_t[1] / lazy_t[1]:.0f}x)")
    print()
    packed_rows()
    print()
    sweep_row()
    print()
    mixed_precision_rows()


if __name__ == "__main__":
    main()
