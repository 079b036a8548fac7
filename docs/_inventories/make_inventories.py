"""Writes the small intersphinx inventories of numpy, jax, flax, optax and orbax under docs/_inventories/.

The build is offline, so it cannot download these projects' objects.inv. Each inventory here lists exactly the
objects our pages and docstrings cross-reference, with the URL of the object's page in that project's docs.
After adding a cross-reference to one of these projects, add the object below and run
`.venv/bin/python docs/_inventories/make_inventories.py`.
Python's inventory is not made here: it is Debian's (see README.md beside this file).
"""

import pathlib
import zlib

HERE = pathlib.Path(__file__).resolve().parent

# project: (version, {name: (role, uri relative to the project's docs root)}); "$" in a uri stands for the name.
_SHARDING = "jax.sharding.html#$"
INVENTORIES = {
    "numpy": ("2.4", {
        "numpy.ndarray": ("class", "reference/generated/numpy.ndarray.html#$"),
        "numpy.dtype": ("class", "reference/generated/numpy.dtype.html#$"),
        "numpy.bool": ("class", "reference/arrays.scalars.html#$"),  # both from jax.typing.ArrayLike in hints
        "numpy.number": ("class", "reference/arrays.scalars.html#$"),
    }),
    "jax": ("0.10", {
        "jax.Array": ("class", "_autosummary/jax.Array.html#$"),
        "jax.sharding.Sharding": ("class", _SHARDING),
        "jax.sharding.NamedSharding": ("class", _SHARDING),
        "jax.sharding.Mesh": ("class", _SHARDING),
        "jax.sharding.PartitionSpec": ("class", _SHARDING),
    }),
    "flax": ("0.12", {
        "flax.nnx.Module": ("class", "api_reference/flax.nnx/module.html#$"),
    }),
    "optax": ("0.2", {
        "optax.GradientTransformation": ("class", "api/transformations.html#$"),
        "optax.GradientTransformationExtraArgs": ("class", "api/transformations.html#$"),
    }),
    "orbax": ("0.12", {
        "orbax.checkpoint.CheckpointManager": ("class", "api_reference/checkpoint.checkpoint_manager.html#$"),
        "orbax.checkpoint.CheckpointManagerOptions": ("class", "api_reference/checkpoint.checkpoint_manager.html#$"),
    }),
}


def write(project, version, objects):
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: {version}\n"
              "# The remainder of this file is compressed using zlib.\n")
    body = "".join(f"{name} py:{role} 1 {uri} -\n" for name, (role, uri) in sorted(objects.items()))
    (HERE / f"{project}.inv").write_bytes(header.encode() + zlib.compress(body.encode(), 9))


if __name__ == "__main__":
    for project, (version, objects) in INVENTORIES.items():
        write(project, version, objects)
