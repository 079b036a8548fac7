"""2 processes: one good save, then process 1 dies inside the next save, between two collectives.

Process 1 exits (status 17) as it lays out its values (orbax's writer not yet
started); process 0 is then in a collective (the shards' checksums) with a
dead peer: gloo reports a reset connection, which must come out as a
ProcessGroupError naming process 1, at once rather than after a timeout.
"""

import os
import sys

import group
import model as sm

import checkpoint
import varstate
from checkpoint._storage import _orbax

params = sm.make(sm.mesh(), varstate.Registry())
ckpt = checkpoint.Checkpoint(model=params)
prefix = os.path.join(group.WORKDIR, "dying_collective", "model")
ckpt.save(prefix)
real_layout = _orbax.layout


def dying_layout(*args, **kwargs):
    if group.PROCESS_ID == 1:
        print("process 1 exits as it lays out its values", flush=True)
        os._exit(17)
    return real_layout(*args, **kwargs)


_orbax.layout = dying_layout
try:
    ckpt.save(prefix)
    group.report("dying_save", None)
except Exception as e:
    group.report("dying_save", [type(e).__name__, str(e)])
sys.stdout.flush()
os._exit(0)  # jax's shutdown would wait for the dead process
