"""2 processes: one save together, then process 1 dies (status 17) while process 0 waits at the next save's barrier.

jax's coordination service is set (by the test) to declare a silent process dead after a few seconds more than
varstate's pulse timeout, and then ends the others with SIGABRT; process 0 must raise ProcessGroupError naming
process 1 before that, and leave cleanly.
"""

import os
import sys
import time

import group
import numpy as np

import checkpoint
import varstate
from checkpoint._storage import _distributed

registry = varstate.Registry()
ckpt = checkpoint.Checkpoint(w=varstate.Variable(np.arange(4, dtype=np.float32), name="w", registry=registry))
prefix = os.path.join(group.WORKDIR, "dying_barrier", "model")
ckpt.save(prefix)  # both processes pulse from here
if group.PROCESS_ID == 1:
    print("process 1 exits before the next barrier", flush=True)
    os._exit(17)
start = time.monotonic()
try:
    _distributed.barrier("varstate-test")
    group.report("barrier", None)
except Exception as e:
    group.report("barrier", [type(e).__name__, str(e), time.monotonic() - start])
sys.stdout.flush()
os._exit(0)  # jax's shutdown would wait for the dead process
