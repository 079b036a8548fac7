"""2 processes: a graph that differs (the error names the Variable), then a save only process 0 calls.

Process 1 skips the second save and leaves; process 0's error must say that
every process must call save, not only that a peer died.
"""

import os
import sys

import group
import numpy as np

import checkpoint
import varstate

registry = varstate.Registry()
roots = {"w": varstate.Variable(np.zeros(4, np.float32), name="w", registry=registry)}
if group.PROCESS_ID == 1:
    roots["stray"] = varstate.Variable(np.zeros(3, np.float32), name="stray", registry=registry)
try:
    checkpoint.Checkpoint(**roots).save(os.path.join(group.WORKDIR, "mismatch", "model"))
    group.report("mismatch", None)
except Exception as e:
    group.report("mismatch", [type(e).__name__, str(e)])
sys.stdout.flush()

if group.PROCESS_ID == 1:  # does not call save: leaves once process 0 is inside it
    import time

    time.sleep(2)
    os._exit(0)
try:
    checkpoint.Checkpoint(w=roots["w"]).save(os.path.join(group.WORKDIR, "lone", "model"))
    group.report("lone_save", None)
except Exception as e:
    group.report("lone_save", [type(e).__name__, str(e)])
sys.stdout.flush()
os._exit(0)  # jax's shutdown would wait for the process that left
