"""The large restore row of `benchmarks.checkpoint_io`: 16 float32 arrays (2 GiB by default), one process each.

Contenders, each restoring onto one CPU device in a fresh process (peak RSS is
per process: VmHWM after /proc/self/clear_refs, minus the RSS before):
  ours orbax   Checkpoint.restore of our default format into uninitialized templates
  ours tf      the same from our TF-format checkpoint
  orbax        ocp.StandardCheckpointer().restore(abstract tree) of the same arrays
  raw 1 thread one file, each array read with readinto into a 64-byte-aligned buffer, then device_put
  raw threads  the same with the 16 reads in 16 threads
Rounds are interleaved, each in another order (a slow spell of the shared machine hits every contender alike);
the minimum time and the minimum peak of the rounds are kept. Every file is read once before each contender, so
all read from the page cache.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

CONTENDERS = ("ours orbax", "ours tf", "orbax", "raw 1 thread", "raw threads")
ARRAYS = 16

_CHILD = r"""
import os, sys, time
import jax, numpy as np
contender, root, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
if contender.startswith("ours"):
    import checkpoint, varstate
    path = os.path.join(root, contender.split()[1])
    templates = {f"v{i:02d}": varstate.uninitialized((size,), np.float32, sharding=one) for i in range(n)}
    load = lambda: [v.value for v in checkpoint.Checkpoint(model=templates).restore(path).model.values()]
elif contender == "orbax":
    import orbax.checkpoint as ocp
    std = ocp.StandardCheckpointer()
    abstract = {f"v{i:02d}": jax.ShapeDtypeStruct((size,), np.float32, sharding=one) for i in range(n)}
    load = lambda: list(std.restore(os.path.join(root, "std"), abstract).values())
else:
    from concurrent.futures import ThreadPoolExecutor
    def part(i):
        raw = np.empty(size * 4 + 64, np.uint8)  # 64-byte aligned: device_put takes it without a copy
        out = raw[-raw.ctypes.data % 64:][:size * 4].view(np.float32)
        with open(os.path.join(root, "raw.bin"), "rb", buffering=0) as f:
            f.seek(i * size * 4)
            f.readinto(out)
        return jax.device_put(out, one)
    threads = 1 if contender == "raw 1 thread" else n
    load = lambda: list(ThreadPoolExecutor(threads).map(part, range(n)))
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak of the imports and the setup is not the restore's
before = rss("VmRSS:")
t0 = time.perf_counter()
out = jax.block_until_ready(load())
seconds = time.perf_counter() - t0
print(seconds, rss("VmHWM:") - before, sum(x.nbytes for x in out))
"""


def _warm(path: str) -> None:
    for d, _, names in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [path])]:
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                while f.read(64 << 20):
                    pass


def restore_row(total_bytes: int, root: str, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """{contender: (min seconds, min peak RSS over the data)} restoring 16 float32 arrays of `total_bytes` in all."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    import checkpoint
    import varstate

    size = total_bytes // 4 // ARRAYS
    rng = np.random.default_rng(0)
    arrays = {f"v{i:02d}": rng.standard_normal(size, dtype=np.float32) for i in range(ARRAYS)}
    model = {k: varstate.Variable(jnp.asarray(a)) for k, a in arrays.items()}
    checkpoint.Checkpoint(model=model).write(os.path.join(root, "orbax"))
    checkpoint.Checkpoint(model=model).write(os.path.join(root, "tf"), format="tf")
    with ocp.StandardCheckpointer() as std:
        std.save(os.path.join(root, "std"), {k: v.value for k, v in model.items()})
    with open(os.path.join(root, "raw.bin"), "wb") as f:
        for a in arrays.values():
            f.write(a.tobytes())
    del model, arrays
    files = {"ours orbax": "orbax", "ours tf": "tf", "orbax": "std"}
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    peaks: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for r in range(rounds):
        for c in CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]:
            for name in os.listdir(root):  # the TF files sit beside the directories
                if name.startswith(files.get(c, "raw.bin")):
                    _warm(os.path.join(root, name))
            done = subprocess.run([sys.executable, "-c", _CHILD, c, root, str(ARRAYS), str(size)],
                                  capture_output=True, text=True, env=env, check=True)
            seconds, peak, total = done.stdout.split()[-3:]
            times[c].append(float(seconds))
            peaks[c].append(int(peak) / int(total))
    return {c: (min(times[c]), min(peaks[c])) for c in CONTENDERS}


def print_restore(total_bytes: int, row: dict[str, tuple[float, float]]) -> None:
    print(f"restore, {ARRAYS} float32 arrays / {total_bytes >> 20} MiB onto one device, one process per contender, "
          "min of rounds")
    print(f"{'contender':<15}{'seconds':>9}{'peak RSS/data':>15}{'vs orbax':>10}")
    for c, (t, peak) in row.items():
        print(f"{c:<15}{t:>9.3f}{peak:>14.2f}x{t / row['orbax'][0]:>9.2f}x")
    print("targets (issue 27): ours <= 1.0x orbax, peak RSS <= 1.15x the data plus the staging bound "
          "(docs/guides/performance.md).")
