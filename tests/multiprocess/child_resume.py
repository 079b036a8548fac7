"""2 processes: restore a checkpoint one process wrote (1x8) onto the 2x4 mesh; then process 1 dies in a save.

argv: the path of the 1-process checkpoint. Process 1 exits (status 17) after
writing its shards of the second managed save, before it reports them
written; process 0 must fail at the next barrier, naming process 1.
"""

import os
import sys

import group
import jax
import model as sm
import numpy as np
from jax.experimental import multihost_utils

import checkpoint
import varstate
from checkpoint._storage import _distributed

mesh = sm.mesh()
template = sm.make(mesh, varstate.Registry(), zeros=True)
status = checkpoint.Checkpoint(model=template, optimizer=sm.Adam(1e-2).init(template)).restore(group.args()[0])
status.assert_consumed()
leaves = jax.tree.leaves(status.model, is_leaf=lambda x: isinstance(x, varstate.Variable))
restored = {v.name: v for v in varstate.expand_variables(leaves)}
group.report("restored", {n: np.asarray(multihost_utils.process_allgather(v.value, tiled=True)).tolist()
                          for n, v in restored.items()})
group.report("restored_sharding", {n: [v.value.is_fully_addressable, str(v.value.sharding.spec)]
                                   for n, v in restored.items()})

# 8. Lazy Adam on a row-sharded table split over both processes, from IndexedSlices.
table, slots, collectives = sm.lazy_embedding_step(mesh)
group.report("lazy", {"table": np.asarray(multihost_utils.process_allgather(table.value, tiled=True)).tolist(),
                      "slots": [np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()
                                for x in jax.tree.leaves(slots)],
                      "addressable": table.value.is_fully_addressable, "spec": str(table.value.sharding.spec),
                      "collectives": collectives})

mgr = checkpoint.CheckpointManager(os.path.join(group.WORKDIR, "dying"), max_to_keep=3)
mgr.save(1, model=status.model)
real_barrier = _distributed.barrier


def dying_barrier(name, timeout_s=None):
    if group.PROCESS_ID == 1 and name.startswith("varstate-written:"):
        print("process 1 exits in the middle of a save", flush=True)
        os._exit(17)
    real_barrier(name, timeout_s)


_distributed.barrier = dying_barrier
# Only this save waits briefly at its barriers: before it, a loaded machine may hold one process back for
# seconds (compiling), which must not read as a dead peer.
_distributed.BARRIER_TIMEOUT_S = float(group.args()[1])
try:
    mgr.save(2, model=status.model)
    group.report("dying_save", None)
except Exception as e:
    group.report("dying_save", [type(e).__name__, str(e)])
sys.stdout.flush()
os._exit(0)  # jax's shutdown would wait for the dead process
