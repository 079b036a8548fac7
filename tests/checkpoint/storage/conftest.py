"""`plain_orbax`: reads the values item of an orbax-format checkpoint with orbax alone, as `Checkpoint.write`
documents it, every array onto the host."""

import os

import jax
import numpy as np
import pytest


@pytest.fixture
def plain_orbax():
    """`plain_orbax(path)`: {orbax array name: numpy array} of the checkpoint at `path` (its ``values`` item)."""
    import orbax.checkpoint as ocp

    def read(path: str) -> dict:
        values = os.path.join(path, "values")
        ckptr = ocp.PyTreeCheckpointer()
        tree = ckptr.metadata(values).item_metadata.tree
        return ckptr.restore(values,
                             restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))

    return read
