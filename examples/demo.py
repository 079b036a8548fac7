"""`make demo`: train, interrupt, resume, compare (examples/train.py run as separate processes).

1. an uninterrupted run to step 200;
2. a second run stopped with --stop-after 60, resumed and sent SIGTERM
   (it saves and exits), then resumed to step 200;
3. the final parameters of both runs compared bit for bit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
STEPS = 200


def run(title: str, *args: str, sigterm_at: str | None = None) -> None:
    print(f"\n== {title}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--steps", str(STEPS), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    sent = False
    for line in proc.stdout:
        if line.startswith(("WARNING:absl", "I0000", "W0000")):
            continue  # library chatter
        print("   " + line.rstrip(), flush=True)
        if sigterm_at and not sent and sigterm_at in line:
            print("   -> sending SIGTERM", flush=True)
            proc.send_signal(signal.SIGTERM)
            sent = True
    if proc.wait() != 0:
        raise SystemExit(f"train.py failed with exit code {proc.returncode}")


def main() -> int:
    start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="varstate-demo-")
    try:
        full, resumed = os.path.join(work, "full.npz"), os.path.join(work, "resumed.npz")
        run("1. uninterrupted run", "--dir", os.path.join(work, "a"), "--log-every", "40", "--out", full)
        b = os.path.join(work, "b")
        run("2a. second run (saving asynchronously), stopped after 60 steps",
            "--dir", b, "--async-save", "--stop-after", "60", "--log-every", "20")
        run("2b. resumed, then SIGTERM", "--dir", b, "--async-save", "--log-every", "20", sigterm_at="step  120")
        run("2c. resumed to the end", "--dir", b, "--async-save", "--log-every", "40", "--out", resumed)

        a, r = np.load(full), np.load(resumed)
        print("\n== 3. final parameters: uninterrupted vs interrupted twice and resumed")
        print(f"   {'parameter':<16}{'shape':<12}{'max |diff|':>12}  bit-identical")
        same = True
        for name in a.files:
            diff = float(np.max(np.abs(a[name] - r[name])))
            equal = a[name].tobytes() == r[name].tobytes()
            same &= equal
            print(f"   {name:<16}{a[name].shape!s:<12}{diff:>12.3g}  {'yes' if equal else 'NO'}")
        print(f"\n{'OK' if same else 'MISMATCH'}: the resumed run "
              f"{'ends with exactly' if same else 'does NOT end with'} the parameters of the uninterrupted one "
              f"({time.perf_counter() - start:.0f}s).")
        return 0 if same else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
