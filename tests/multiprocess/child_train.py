"""2 processes: train the model SPMD, save it (Checkpoint and CheckpointManager, sync and async), check agreement.

Reports (RESULT lines) what the test compares: the variables' names and
resource ids, the losses and final values, the files each process wrote, and
the error a mismatched program gets.
"""

import os
import sys

import group  # joins the jax.distributed group first
import jax
import model as sm
import numpy as np
from jax.experimental import multihost_utils

import checkpoint
import varstate

work = group.WORKDIR
mesh = sm.mesh()
registry = varstate.Registry()
params, opt, state, losses = sm.train(mesh, registry)
flat = {v.name: v for v in varstate.expand_variables(jax.tree.leaves(params, is_leaf=lambda x: isinstance(
    x, varstate.Variable)))}
group.report("names", sorted(flat))
group.report("ids", [flat[n].resource_id for n in sorted(flat)])
group.report("addressable", {n: v.value.is_fully_addressable for n, v in flat.items()})
group.report("losses", losses)
group.report("values", {n: np.asarray(multihost_utils.process_allgather(v.value, tiled=True)).tolist()
                        for n, v in flat.items()})
slot_sharding = {str(k): str(getattr(x, "sharding", None)) for k, x in enumerate(jax.tree.leaves(state))}
group.report("slot_shardings", slot_sharding)

# Checkpoint.save from both processes; then new roots for the same Checkpoint (the counter continues).
ckpt = checkpoint.Checkpoint(model=params, optimizer=state)
first = ckpt.save(os.path.join(work, "ckpt", "model"))
second = ckpt.save(os.path.join(work, "ckpt", "model"), model=params, optimizer=state)
group.report("saved", [first, second, ckpt.save_counter])
values = os.path.join(second, "values")
group.report("files", {name: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(values, name))
                                 for f in fs) for name in os.listdir(values) if name.startswith("ocdbt.process_")})

# CheckpointManager: sync and async, max_to_keep=2; every process sees the same steps.
with checkpoint.CheckpointManager(os.path.join(work, "managed"), max_to_keep=2) as mgr:
    for step in (1, 2, 3):
        mgr.save(step, model=params, optimizer=state)
    group.report("managed", [mgr.all_steps(), mgr.latest_step()])
with checkpoint.CheckpointManager(os.path.join(work, "managed_async"), max_to_keep=2, async_save=True) as mgr:
    for step in (1, 2, 3):
        mgr.save(step, model=params, optimizer=state)
    mgr.wait_until_finished()
    group.report("managed_async", [mgr.all_steps(), mgr.latest_step()])
    restored = mgr.restore(model=sm.make(mesh, varstate.Registry(), zeros=True)).model
    back = varstate.expand_variables(jax.tree.leaves(restored, is_leaf=lambda x: isinstance(x, varstate.Variable)))
    group.report("restored_2x4", {v.name: np.asarray(multihost_utils.process_allgather(v.value, tiled=True)).tolist()
                                  for v in back})

# A program that differs between processes: process 1 has one variable more.
extra = {"model": params}
if group.PROCESS_ID == 1:
    extra["stray"] = varstate.Variable(np.zeros(3, np.float32), name="stray", registry=registry)
try:
    checkpoint.Checkpoint(**extra).save(os.path.join(work, "mismatch", "model"))
    group.report("mismatch", None)
except Exception as e:
    group.report("mismatch", [type(e).__name__, str(e)])
try:
    checkpoint.Checkpoint(**extra).restore(second)
    group.report("mismatch_restore", None)
except Exception as e:
    group.report("mismatch_restore", [type(e).__name__, str(e)])
sys.stdout.flush()

# The TF format: each process writes its own data file, process 0 the merged index.
tf_path = checkpoint.Checkpoint(model=params, optimizer=state).save(os.path.join(work, "tf", "model"), format="tf")
group.report("tf", tf_path)
sys.stdout.flush()
