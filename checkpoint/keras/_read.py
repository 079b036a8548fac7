"""Reading Keras weights for `checkpoint.keras`: `load_weights`, its HDF5 and TF-checkpoint readers, the result type.

See `checkpoint.keras`'s docstring for the formats.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import varstate
from checkpoint import _dtypes, _keys, _storage
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint.keras import _hdf5, _order

_KERAS_ARCHIVE_WEIGHTS = "model.weights.h5"  # the weights file inside a .keras zip archive
_VARS = "vars"  # Keras 3: the group holding one object's own weights, named "0", "1", ...
_OPTIMIZER = "optimizer"
# A dataset may declare more bytes than the file stores (compression, fill values); past this size the
# ratio is bounded, so a crafted file cannot make a read allocate gigabytes from a few stored bytes.
_BOMB_FLOOR_BYTES = 64 << 20
_BOMB_MAX_RATIO = 1024
# Datasets each under that bound still add up: the whole file may declare at most the floor plus the ratio times
# the HDF5 file's size (an honest uncompressed file declares less than its size; gzip expands at most ~1032x).
_MAX_DEPTH = 100  # groups (HDF5) or object-graph levels; a real Keras model nests a handful

_KERNEL_BIAS = {1: ("kernel",), 2: ("kernel", "bias")}
_SEPARABLE = {2: ("depthwise_kernel", "pointwise_kernel"), 3: ("depthwise_kernel", "pointwise_kernel", "bias")}
_RNN_CELL = {2: ("kernel", "recurrent_kernel"), 3: ("kernel", "recurrent_kernel", "bias")}
#: The weight names of Keras 3's built-in layers, which a ``.weights.h5`` stores by position only:
#: ``{layer name without its _N suffix: {number of weights stored: their names in order}}``, trainable
#: weights first in creation order, then non-trainable ones (``BUILTIN_WEIGHT_NAMES["dense"][2]`` is
#: ``("kernel", "bias")``). `load_weights` names a layer's weights from it; a layer not listed, or a count
#: with two meanings (BatchNormalization with center or scale off stores 3), keeps positional names
#: (``"0"``, ``"1"``...) unless ``load_weights(weight_names=...)`` names them.
BUILTIN_WEIGHT_NAMES: dict[str, dict[int, tuple[str, ...]]] = {
    **{
        k: _KERNEL_BIAS
        for k in (
            "dense", "einsum_dense", "conv1d", "conv2d", "conv3d", "conv1d_transpose", "conv2d_transpose",
            "conv3d_transpose", "depthwise_conv1d", "depthwise_conv2d",
            # MultiHeadAttention's projections (EinsumDense): recent Keras 3 saves them under their property
            # names (query_dense), earlier ones under the attributes (_query_dense).
            *(f"{u}{p}_dense" for u in ("", "_") for p in ("query", "key", "gate", "value", "output")),
        )
    },
    **{k: _SEPARABLE for k in ("separable_conv1d", "separable_conv2d")},
    "embedding": {1: ("embeddings",)},
    "batch_normalization": {
        2: ("moving_mean", "moving_variance"),
        4: ("gamma", "beta", "moving_mean", "moving_variance"),
    },
    "layer_normalization": {2: ("gamma", "beta")},
    "group_normalization": {2: ("gamma", "beta")},
    "rms_normalization": {1: ("scale",)},
    **{k: _RNN_CELL for k in ("lstm_cell", "gru_cell", "simple_rnn_cell", "conv_lstm_cell")},
    "prelu": {1: ("alpha",)},
    "normalization": {3: ("mean", "variance", "count")},
}
# Weights Keras keeps out of training; their Variables are made non-trainable.
_NON_TRAINABLE = frozenset({"moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev"})


class LayerLayout(NamedTuple):
    """Where one layer's weights sit in Keras's files: what `save_weights` needs to write them back.

    Args:
        path: the layer's key path in the `KerasWeights` dict (``()`` for the
            model itself).
        name: Keras's layer name.
        group: its HDF5 group in a Keras 3 ``.weights.h5`` (``""`` for the
            model; None when the source was not one).
        weights: its weight names in the order Keras stores them.
        shapes: their shapes as read (``()`` when not given).
        dtypes: their dtype names as read (``()`` when not given).

    >>> from checkpoint.keras import LayerLayout
    >>> LayerLayout(("dense",), "dense", "layers/dense", ("kernel", "bias")).weights
    ('kernel', 'bias')
    """

    path: tuple[str, ...]
    name: str
    group: str | None
    weights: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()


class KerasWeights(dict):
    """A dict of Keras weights (see the module docstring) that remembers Keras's layout of them.

    It is a JAX pytree: ``jax.tree.map`` over it gives a `KerasWeights` with
    the same layout, so `save_weights` can write transformed weights back
    for Keras without being told the layout again.

    Args:
        items: the weights, as for ``dict(items)``: layer name -> {weight name
            -> Variable or array, sublayer name -> {...}}.
        layout: one `LayerLayout` per layer, in Keras's order; ``()`` when
            unknown (then `save_weights` needs ``like=``).
        source: the file the weights were read from (for messages); ``""``.

    >>> import jax, numpy as np, varstate
    >>> from checkpoint.keras import KerasWeights, LayerLayout
    >>> w = KerasWeights({"out": {"bias": varstate.Variable(np.ones(2, np.float32), name="out/bias")}},
    ...                  layout=(LayerLayout(("out",), "out", "layers/dense", ("bias",)),))
    >>> doubled = jax.tree.map(lambda x: x * 2, w)
    >>> type(doubled).__name__, doubled.layout == w.layout, doubled["out"]["bias"].value.tolist()
    ('KerasWeights', True, [2.0, 2.0])
    """

    def __init__(self, items: Any = (), *, layout: tuple[LayerLayout, ...] = (), source: str = "") -> None:
        super().__init__(items)
        self.layout = tuple(layout)
        self.source = source

    def __repr__(self) -> str:
        return f"KerasWeights({dict.__repr__(self)}, source={self.source!r})"


def _flatten_with_keys(w: KerasWeights):
    return tuple((jax.tree_util.DictKey(k), v) for k, v in w.items()), (tuple(w), w.layout, w.source)


def _unflatten(aux, children) -> KerasWeights:
    keys, layout, source = aux
    return KerasWeights(zip(keys, children, strict=True), layout=layout, source=source)


jax.tree_util.register_pytree_with_keys(KerasWeights, _flatten_with_keys, _unflatten)


@contextlib.contextmanager
def _damaged(where: str) -> Iterator[None]:
    """h5py's and zipfile's own exceptions for a damaged file, raised as the library's, naming `where`."""
    try:
        yield
    except (DataLossError, FileNotFoundError, PermissionError):
        raise  # already the library's, or about the path rather than the file's bytes
    except zipfile.BadZipFile as e:
        # zipfile and libhdf5 report a failed checksum only through their messages.
        error = DataLossError if "CRC" in str(e) else CheckpointFormatError
        raise error(f"{where}: a damaged zip archive ({e}); save the model again") from e
    except (OSError, RuntimeError, KeyError, NotImplementedError, EOFError, zlib.error) as e:
        error = DataLossError if "checksum" in str(e) else CheckpointFormatError
        raise error(f"{where}: a damaged or unsupported file ({type(e).__name__}: {e}); save the weights again") from e
    except (ValueError, TypeError) as e:
        if not _hdf5.raised_by_h5py(e):
            raise  # the library's own (weight_names, int64 out of range)
        raise CheckpointFormatError(
            f"{where}: a damaged or unsupported file ({type(e).__name__}: {e}); save the weights again") from e


@contextlib.contextmanager
def _open_archive(path: str) -> Iterator[Any]:
    """The weights HDF5 inside a .keras archive, opened from memory (nothing is extracted to disk)."""
    with zipfile.ZipFile(path) as z:
        if _KERAS_ARCHIVE_WEIGHTS not in z.namelist():
            raise CheckpointFormatError(
                f"{path}: a zip archive without {_KERAS_ARCHIVE_WEIGHTS}; a .keras file written by "
                f"model.save holds its weights there (found: {sorted(z.namelist())[:10]})"
            )
        info = z.getinfo(_KERAS_ARCHIVE_WEIGHTS)
        if info.file_size > _BOMB_FLOOR_BYTES and info.file_size > _BOMB_MAX_RATIO * info.compress_size:
            raise CheckpointFormatError(
                f"{path}: {_KERAS_ARCHIVE_WEIGHTS} expands from {info.compress_size} to {info.file_size} "
                "bytes; refusing to expand it (a damaged or crafted archive)"
            )
        data = z.read(_KERAS_ARCHIVE_WEIGHTS)
    with _hdf5.open_bytes(data, path) as f:
        yield f


class _SizeBudget:
    """The bytes one HDF5 file's datasets may still declare (see `_BOMB_FLOOR_BYTES`), taken as they are read."""

    def __init__(self, f) -> None:
        self.total = self.left = _BOMB_FLOOR_BYTES + _BOMB_MAX_RATIO * f.id.get_filesize()

    def take(self, declared: int, where: str) -> None:
        self.left -= declared
        if self.left < 0:
            raise CheckpointFormatError(
                f"{where} takes what the file's datasets declare past {self.total} bytes in all ({_BOMB_MAX_RATIO}x "
                f"the file's size plus {_BOMB_FLOOR_BYTES}); refusing to expand them (a damaged or crafted file)"
            )


def _decode(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _variable(value: np.ndarray, path: tuple[str, ...], registry, where: str) -> varstate.Variable:
    name = "/".join(path)
    if _dtypes.is_real(value.dtype) or value.dtype.kind == "c":
        value = _dtypes.narrow_to_held(value, name, where)
    return varstate.Variable(value, name=name, trainable=path[-1] not in _NON_TRAINABLE,
                             registry=registry)


def _insert(tree: dict, path: tuple[str, ...], value: Any, where: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise CheckpointFormatError(
                f"{where}: {'/'.join(path[: i + 1])!r} is both a weight and a layer holding {'/'.join(path)!r}"
            )
        node = child
    if path[-1] in node:
        raise CheckpointFormatError(
            f"{where}: two weights (or a weight and a layer) share the name {'/'.join(path)!r}; name them apart "
            "with load_weights(weight_names=...)"
        )
    node[path[-1]] = value


# --- the public reader: the format is found from the file itself -------------------------------
def load_weights(
    path: str | os.PathLike,
    *,
    weight_names: Mapping[str, Sequence[str]] | None = None,
    node: str | None = None,
    registry: varstate.Registry | None = None,
) -> KerasWeights:
    """Reads a Keras model's weights (any format in the module docstring) as `varstate.Variable` objects.

    A Variable is named by its Keras path relative to the model
    (``"lstm/lstm_cell/kernel"``). 64-bit values are narrowed as JAX holds
    them unless JAX's 64-bit types are on.

    Args:
        path: a ``.weights.h5``, ``.keras`` or legacy ``.h5`` file, or a TF
            checkpoint (its prefix or directory); the format is found from
            the file itself, not its name.
        weight_names: names for the weights of layers a Keras 3
            ``.weights.h5`` stores by position only: ``{"my_layer": ["w",
            "b"]}``, keyed by layer name or by the layer's key path
            (``"block/my_layer"``); layers of `BUILTIN_WEIGHT_NAMES` need none.
        node: the model's object path in a TF checkpoint holding more than
            one candidate; None is the root, or its only child that is a
            Keras model, or ``"model"``.
        registry: the `varstate.Registry` the Variables are made in; None is
            a new one, so that the names are exactly the Keras paths.

    Returns:
        A `KerasWeights`, layer name -> {weight name -> Variable, sublayer
        name -> {...}} in Keras's layer order, values bit-exact. A
        ``.weights.h5`` does not record the order across layer classes: it is
        found from the optimizer's variables when the file holds them and
        only one order fits, else only each class's layers keep Keras's order
        among themselves; a ``.keras`` gives it from its config.

    Raises:
        TypeError: `path` is not a string or path.
        FileNotFoundError: nothing readable at `path`.
        CheckpointFormatError: a file that is not Keras weights, or is corrupt
            or hostile (naming the file and the group or key); an HDF5 file
            whose datasets declare more than 64 MiB plus 1024 times the file's
            size in all (values it does not store); a dataset wider than 64
            bits (``float128``) or with a null dataspace. Big-endian datasets
            are read as their values, in native byte order.
        ValueError: an int64 value out of int32's range while JAX's 64-bit
            types are off; a TF checkpoint with no Keras model at `node`.

    >>> import os, tempfile, numpy as np, varstate
    >>> from checkpoint import keras
    >>> w = keras.KerasWeights({"dense": {"kernel": varstate.Variable(np.ones((2, 3), np.float32)),
    ...                                   "bias": varstate.Variable(np.zeros(3, np.float32))}},
    ...     layout=(keras.LayerLayout((), "model", ""),
    ...             keras.LayerLayout(("dense",), "dense", "layers/dense", ("kernel", "bias"))))
    >>> path = keras.save_weights(os.path.join(tempfile.mkdtemp(), "m.weights.h5"), w)
    >>> back = keras.load_weights(path)
    >>> back["dense"]["kernel"].name, back["dense"]["kernel"].shape, list(back["dense"])
    ('dense/kernel', (2, 3), ['kernel', 'bias'])
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Keras weights path must be a string, got {type(path).__name__} {path!r}.")
    path = os.fspath(path)
    registry = varstate.Registry() if registry is None else registry
    names = {k: tuple(v) for k, v in (weight_names or {}).items()}
    if os.path.isfile(path) and zipfile.is_zipfile(path):
        with _damaged(path), _open_archive(path) as f:
            return _Keras3Reader(f, path, names, registry, _order.archive_config(path)).read()
    if os.path.isfile(path) and _hdf5.is_hdf5(path):
        with _damaged(path), _hdf5.open_file(path) as f:
            if (root := _legacy_root(f)) is not None:
                return _read_legacy(root, path, registry)
            return _Keras3Reader(f, path, names, registry).read()
    if os.path.isfile(path) and not path.endswith(".index"):
        raise CheckpointFormatError(
            f"{path}: not a Keras weights file: expected an HDF5 file (.weights.h5, .h5), a .keras archive, "
            "or a TF checkpoint prefix (the path before '.index')"
        )
    missing_file(path, "load_weights")
    # open_reader's FileNotFoundError says what it expected.
    return _read_tf_checkpoint(_storage.open_reader(path), path, node, registry)


KERAS_SUFFIXES = (".weights.h5", ".h5", ".hdf5", ".keras")


def missing_file(path: str, who: str) -> None:
    """Raises FileNotFoundError when nothing is at `path`: no file, directory, nor TF checkpoint prefix."""
    if os.path.lexists(path) or os.path.lexists(path + ".index"):
        return  # a file, a checkpoint directory or a prefix: the reader that takes it says what is wrong
    # A name Keras gives its files cannot be a checkpoint prefix: the file alone is missing.
    prefix = "" if path.endswith(KERAS_SUFFIXES) else f", and it is no TF checkpoint prefix (no {path}.index)"
    parent = os.path.dirname(os.path.abspath(path))
    where = "" if os.path.isdir(parent) else f" (its directory {parent} does not exist either)"
    raise FileNotFoundError(f"{who}: {path} does not exist: no such file or directory{where}{prefix}. Check the path "
                            "(a Keras model writes it with model.save_weights('name.weights.h5') or model.save("
                            "'name.keras')).")


# --- Keras 3 .weights.h5 ----------------------------------------------------------------------
class _Keras3Reader:
    def __init__(self, f, where: str, names: dict[str, tuple[str, ...]], registry, config: Any = None) -> None:
        self.h5py = _hdf5.h5py_module()
        self.f, self.where, self.names, self.registry = f, where, names, registry
        self.config = config  # a .keras archive's model config: Keras's order of the layers
        self.tree: dict = {}
        self.layout: list[LayerLayout] = []
        self.groups: dict[tuple[str, ...], str] = {}  # each layer's path -> its group, to find twins in linear time
        self.budget = _SizeBudget(f)

    def read(self) -> KerasWeights:
        root_vars = self._child(self.f, _VARS, "")
        if root_vars is None and "layers" not in self.f:
            raise CheckpointFormatError(
                f"{self.where}: an HDF5 file without Keras's 'vars' or 'layers' groups, nor the 'layer_names' "
                "attribute of Keras 2's format: not a Keras weights file"
            )
        model_name = "" if root_vars is None else _decode(_hdf5.attribute(root_vars, "name", "", f"{self.where}: vars"))
        self._own(root_vars, (), model_name, "")
        for name, child in self._groups(self.f, ""):
            if name not in (_VARS, _OPTIMIZER):  # the optimizer's state is not a weight of the model
                self._walk(child, name, ())
        weights = KerasWeights(self.tree, layout=tuple(self.layout), source=self.where)
        return _order.in_keras_order(weights, self.config, self._optimizer_shapes())

    def _optimizer_shapes(self) -> list[tuple[int, ...]] | None:
        """The shapes of ``optimizer/vars/N`` in order (they follow Keras's trainable variables), or None."""
        group = self._child(self.f, _OPTIMIZER, "")
        group = self._child(group, _VARS, _OPTIMIZER) if isinstance(group, self.h5py.Group) else None
        if not isinstance(group, self.h5py.Group):
            return None
        datasets = [self._child(group, str(i), f"{_OPTIMIZER}/{_VARS}") for i in range(len(group))]
        if not all(isinstance(ds, self.h5py.Dataset) and ds.shape is not None for ds in datasets):
            return None  # irregular: load_optimizer_state says what is wrong
        return [tuple(ds.shape) for ds in datasets]

    def _child(self, group, name: str, group_path: str):
        if name not in group:
            return None
        link = group.get(name, getlink=True)
        if not isinstance(link, self.h5py.HardLink):
            raise CheckpointFormatError(
                f"{self.where}: {group_path + '/' if group_path else ''}{name} is a {type(link).__name__}; a "
                "Keras weights file holds plain groups and datasets, and links to other files are not followed"
            )
        return group[name]

    def _groups(self, group, group_path: str) -> list[tuple[str, Any]]:
        """Subgroups in the order they were written (HDF5 lists names sorted; object addresses grow as written)."""
        children = [(name, self._child(group, name, group_path))
                    for name in _hdf5.names(group, f"{self.where}: {group_path or '/'}")]
        groups = [(name, child) for name, child in children if isinstance(child, self.h5py.Group)]
        return sorted(groups, key=lambda nc: self.h5py.h5o.get_info(nc[1].id).addr)

    def _walk(self, group, group_path: str, parent: tuple[str, ...]) -> None:
        if group_path.count("/") >= _MAX_DEPTH:
            raise CheckpointFormatError(
                f"{self.where}: groups nested more than {_MAX_DEPTH} deep ({group_path[:200]}...); Keras models "
                "nest far less: the file is damaged or crafted"
            )
        with _damaged(f"{self.where}: {group_path}"):  # names the deepest group whose metadata is damaged
            own = self._child(group, _VARS, group_path)
            path = parent
            if isinstance(own, self.h5py.Group):
                layer_name = _decode(_hdf5.attribute(own, "name", group_path.rsplit("/", 1)[-1],
                                                     f"{self.where}: {group_path}/vars"))
                path = (*parent, layer_name)
                if path in self.groups:
                    raise CheckpointFormatError(
                        f"{self.where}: two layers are both named {'/'.join(path)!r} (groups {group_path} and "
                        f"{self.groups[path]})"
                    )
                self.groups[path] = group_path
                self._own(own, path, layer_name, group_path)
            # A group without 'vars' is a container (a list or dict of layers): its layers belong to `parent`.
            for name, child in self._groups(group, group_path):
                if name != _VARS:
                    self._walk(child, f"{group_path}/{name}", path)

    def _own(self, vars_group, path: tuple[str, ...], layer_name: str, group_path: str) -> None:
        datasets = []
        if vars_group is not None:
            keys = _hdf5.names(vars_group, f"{self.where}: {group_path}/vars")
            if sorted(keys, key=lambda k: (len(k), k)) != [str(i) for i in range(len(keys))]:
                raise CheckpointFormatError(
                    f"{self.where}: {group_path}/vars holds {sorted(keys)}; Keras names a layer's weights "
                    "'0', '1', ... in order"
                )
            datasets = [self._dataset(vars_group, str(i), f"{group_path}/vars") for i in range(len(keys))]
        names = self._weight_names(path, layer_name, len(datasets), group_path)
        # A layer's dict is made by its first weight, so a layer without weights (InputLayer, pooling) leaves none;
        # layers still keep the order they were written in, as each layer's sublayers are read right after it.
        node: Any = self.tree
        for part in path:
            node = node.get(part, {})
            if not isinstance(node, dict):
                raise CheckpointFormatError(f"{self.where}: layer {'/'.join(path)!r} shares its name with a weight")
        key = f"{self.where}:{group_path}/vars"
        for name, value in zip(names, datasets, strict=True):
            _insert(self.tree, (*path, name), _variable(value, (*path, name), self.registry, key), self.where)
        self.layout.append(LayerLayout(path, layer_name, group_path, tuple(names),
                                       tuple(tuple(v.shape) for v in datasets), tuple(v.dtype.name for v in datasets)))

    def _weight_names(self, path, layer_name: str, count: int, group_path: str) -> tuple[str, ...]:
        for key in ("/".join(path), layer_name):
            if key in self.names:
                names = self.names[key]
                if len(names) != count or len(set(names)) != count:
                    raise ValueError(
                        f"weight_names[{key!r}] = {list(names)}, but layer {'/'.join(path)!r} ({group_path}) "
                        f"stores {count} weights: give {count} distinct names"
                    )
                return names
        # By the group's name, then the layer's. No table has a count of 0: a layer without weights gets ().
        for key in (group_path.rsplit("/", 1)[-1], layer_name):
            known = BUILTIN_WEIGHT_NAMES.get(re.sub(r"_\d+$", "", key), {}).get(count)
            if known:
                return known
        return tuple(str(i) for i in range(count))

    def _dataset(self, group, key: str, group_path: str) -> np.ndarray:
        ds = self._child(group, key, group_path)
        where = f"{self.where}: {group_path}/{key}"
        if not isinstance(ds, self.h5py.Dataset):
            raise CheckpointFormatError(f"{where} is a group; Keras stores each weight as a dataset")
        if ds.is_virtual or ds.external:
            raise CheckpointFormatError(f"{where} keeps its data outside this file, which is not read")
        return _read_dataset(ds, where, self.budget)


def _read_dataset(ds, where: str, budget: _SizeBudget) -> np.ndarray:
    """A dataset's value in native byte order; `budget` bounds what the file's datasets declare in all."""
    bf16 = _decode(_hdf5.attribute(ds, "dtype", "", where)) == "bfloat16"
    dtype = ds.dtype
    # float128 / complex256 (long doubles) have no JAX type.
    wide = dtype.itemsize > {"f": 8, "c": 16}.get(dtype.kind, 8)
    if not (dtype.kind in "biufc" or (bf16 and dtype.itemsize == 2)) or wide:
        raise CheckpointFormatError(f"{where} has dtype {dtype}; Keras weights are numbers of at most 64 bits")
    if ds.shape is None:
        raise CheckpointFormatError(f"{where} has a null dataspace (no value); Keras stores every weight with a shape")
    declared = math.prod(ds.shape) * dtype.itemsize
    stored = ds.id.get_storage_size()
    if declared > _BOMB_FLOOR_BYTES and declared > _BOMB_MAX_RATIO * stored:
        raise CheckpointFormatError(
            f"{where} declares {declared} bytes but stores {stored}; refusing to expand it (a damaged or crafted "
            "file). Rewrite the weights without compression."
        )
    budget.take(declared, where)
    with _damaged(where):  # names the layer whose data is damaged
        value = np.asarray(ds[()])
    value = value if value.dtype.isnative else value.astype(value.dtype.newbyteorder("="))  # big-endian files
    return value.view(jnp.bfloat16) if bf16 else value


# --- Keras 2 legacy HDF5 ------------------------------------------------------------------------
def _legacy_root(f):
    """The group holding Keras 2's `layer_names` attribute (the file, or 'model_weights' of a full model)."""
    if "layer_names" in f.attrs:
        return f
    if "model_weights" in f and "layer_names" in f["model_weights"].attrs:
        return f["model_weights"]
    return None


def _read_legacy(root, where: str, registry) -> KerasWeights:
    tree: dict = {}
    layout: dict[tuple[str, ...], list[str]] = {}
    budget = _SizeBudget(root.file)
    for layer_name in (_decode(n) for n in _hdf5.attribute(root, "layer_names", [], f"{where}: {root.name}")):
        if layer_name not in root:
            raise CheckpointFormatError(f"{where}: layer {layer_name!r} is listed in layer_names but has no group")
        group = root[layer_name]
        for weight in (_decode(n) for n in _hdf5.attribute(group, "weight_names", [], f"{where}: {layer_name}")):
            parts = weight.removesuffix(":0").split("/")
            # A Keras 2 weight name starts with its layer's name ("lstm/lstm_cell/kernel:0"), after any
            # enclosing scope; the rest are sublayers and the weight.
            rest = parts[parts.index(layer_name) + 1 :] if layer_name in parts[:-1] else parts[-1:]
            path = (layer_name, *rest)
            ds = _hdf5.stored_dataset(group, weight, f"{where}: {layer_name}/{weight}")
            value = _read_dataset(ds, f"{where}: {layer_name}/{weight}", budget)
            _insert(tree, path, _variable(value, path, registry, f"{where}:{layer_name}/{weight}"), where)
            layout.setdefault(path[:-1], []).append(path[-1])
    return _without_groups(tree, layout, where)


def _without_groups(tree: dict, layout: dict[tuple[str, ...], list[str]], where: str) -> KerasWeights:
    """Weights read from a file that is not a Keras 3 one: each layer's weight names in the order read, no group."""
    return KerasWeights(tree, layout=tuple(LayerLayout(p, p[-1], None, tuple(w)) for p, w in layout.items()),
                        source=where)


# --- TF checkpoints of Keras models ------------------------------------------------------------
_LAYER_WITH_WEIGHTS = re.compile(r"layer_with_weights-(\d+)")
_LAYER = re.compile(r"layer-(\d+)")
# Children of a subclassed model that are not its layers (training state, Keras/TF bookkeeping).
_NOT_LAYERS = frozenset({
    _OPTIMIZER, "save_counter", "root", "_tracked", "_compiled_trainable_state", "_loss_tracker", "_compile_metrics",
    "_compile_loss", "_metrics", "keras_api", "train_function", "train_tf_function", "_inbound_nodes",
    "_outbound_nodes", "_losses", "_losses_override", "call_signature_parameters", "_call_has_context_arg",
})


class _Graph:
    """A TF checkpoint's object graph, walked by local names; every child reference is checked on the way."""

    def __init__(self, reader, where: str) -> None:
        self.reader, self.nodes, self.where = reader, reader.object_graph.nodes, where

    def children(self, i: int) -> list[tuple[str, int]]:
        out = []
        for ref in self.nodes[i].children:
            if not 0 <= ref.node_id < len(self.nodes):
                raise CheckpointFormatError(
                    f"{self.where}: node {i}'s child {ref.local_name!r} refers to node {ref.node_id}, but the "
                    f"object graph has {len(self.nodes)} nodes"
                )
            out.append((ref.local_name, ref.node_id))
        return out

    def named(self, i: int) -> dict[str, int]:
        return dict(self.children(i))

    def find(self, path: str, missing: Callable[[str, list[str]], Exception]) -> int:
        """The node at `path` (local names joined by '/'); raises `missing(part, its siblings' names)` if absent."""
        i = 0
        for part in [p for p in path.split("/") if p]:
            kids = self.children(i)
            found = dict(kids).get(part)
            if found is None:
                raise missing(part, [n for n, _ in kids])
            i = found
        return i

    def value(self, i: int):
        return next((a for a in self.nodes[i].attributes if a.name == _keys.VARIABLE_VALUE), None)

    def read(self, i: int, path: str) -> tuple[np.ndarray, str]:
        """The value and full name of the variable at node `i` (`path` names it in the error if it is none)."""
        attr = self.value(i)
        if attr is None:
            raise CheckpointFormatError(f"{self.where}: {path} is not a variable (it has no VARIABLE_VALUE)")
        return self.reader.get(attr.checkpoint_key), attr.full_name

    def is_list(self, i: int) -> bool:
        kids = self.children(i)
        return bool(kids) and all(name.isdigit() for name, _ in kids)


def _is_model(g: _Graph, i: int) -> bool:
    names = {n for n, _ in g.children(i)}
    return bool(names & {"_operations", "_functional", "_layers"}) or any(
        _LAYER_WITH_WEIGHTS.fullmatch(n) or _LAYER.fullmatch(n) for n in names)


def _find_model(g: _Graph, node: str | None) -> tuple[int, str]:
    if node is not None:
        return g.find(node, lambda part, names: ValueError(
            f"{g.where}: no object {node!r} in the checkpoint (at {part!r}, the children are {sorted(names)})")), node
    if _is_model(g, 0):
        return 0, ""
    kids = [(n, j) for n, j in g.children(0) if n not in (_OPTIMIZER, _keys.SAVE_COUNTER) and _is_model(g, j)]
    if len(kids) == 1:
        return kids[0][1], kids[0][0]
    if kids and "model" not in dict(kids):
        raise ValueError(
            f"{g.where}: several Keras models in the checkpoint ({sorted(n for n, _ in kids)}); pick one with "
            "load_weights(node=...)"
        )
    # One of several models is 'model'; or no layer lists anywhere: a subclassed model (its layers are
    # attributes), at the root or under 'model'.
    model = g.named(0).get("model")
    return (0, "") if model is None else (model, "model")


def _numbered(kids: list[tuple[str, int]], pattern: re.Pattern) -> list[tuple[str, int]]:
    """The children whose name is `pattern` with a number, by that number."""
    numbered = sorted(((int(m[1]), n, j) for n, j in kids if (m := pattern.fullmatch(n))), key=lambda t: t[0])
    return [(n, j) for _, n, j in numbered]


def _layers(g: _Graph, model: int) -> tuple[list[tuple[str, int]], bool]:
    """The model's layers in Keras's order, and whether they came from a layer list (else: attributes)."""
    kids = g.children(model)
    by_name = dict(kids)
    if numbered := _numbered(kids, _LAYER_WITH_WEIGHTS):  # tf-keras Functional/Sequential: layers with weights
        return numbered, True
    if "_functional" in by_name:  # Keras 3 Sequential: the Functional it builds
        return _layers(g, by_name["_functional"])
    for listed in ("_operations", "_layers"):  # Keras 3 Functional
        if listed in by_name:
            return sorted(g.children(by_name[listed]), key=lambda nj: int(nj[0]) if nj[0].isdigit() else -1), True
    if numbered := _numbered(kids, _LAYER):
        return numbered, True
    layers: list[tuple[str, int]] = []
    for n, j in kids:
        if n in _NOT_LAYERS:
            continue
        if g.is_list(j):  # a list attribute of layers: each item is a layer, keyed "<attribute>/<index>"
            layers.extend((f"{n}/{item}", k) for item, k in g.children(j))
        else:
            layers.append((n, j))
    return layers, False


def _collect(g: _Graph, layer: int, seen: set[int]) -> list:
    """Variables under a layer node, depth first in children order: (node, name levels down, local names, attribute).

    A list of sublayers adds no name level of its own: its items are the next level. Iterative, so that a
    crafted deep graph cannot exhaust Python's stack.
    """
    out = []
    stack: list[tuple[Iterator[tuple[str, int]], int, tuple[str, ...]]] = [(iter(g.children(layer)), 0, ())]
    while stack:
        children, hops, local = stack[-1]
        step = next(children, None)
        if step is None:
            stack.pop()
            continue
        name, j = step
        if j in seen or name == _OPTIMIZER:
            continue
        seen.add(j)
        attr = g.value(j)
        if attr is not None:
            out.append((j, hops + 1, (*local, name), attr))
        elif len(stack) < _MAX_DEPTH:
            stack.append((iter(g.children(j)), hops if g.is_list(j) else hops + 1, (*local, name)))
        else:
            raise CheckpointFormatError(
                f"{g.where}: the object graph nests more than {_MAX_DEPTH} levels below a layer; Keras models nest "
                "far less: the checkpoint is damaged or crafted"
            )
    return out


def _read_tf_checkpoint(reader, where: str, node: str | None, registry,
                        ids: dict[int, tuple[str, ...]] | None = None) -> KerasWeights:
    """The Keras model's weights in a TF checkpoint; `ids`, when given, gets each weight's node id -> key path."""
    graph = reader.object_graph
    if graph is None or not len(graph.nodes):
        raise CheckpointFormatError(
            f"{where}: a name-based checkpoint (no object graph), not one Keras writes; read its values with "
            "checkpoint.read_checkpoint"
        )
    g = _Graph(reader, where)
    model, model_path = _find_model(g, node)
    layers, listed = _layers(g, model)
    seen = {model, *(j for _, j in layers)}
    tree: dict = {}
    layout: dict[tuple[str, ...], list[str]] = {}
    found: dict[int, tuple[str, ...]] = {} if ids is None else ids  # each weight's node id -> its key path
    for local_name, layer in layers:
        layer_key = None
        for j, hops, local, attr in _collect(g, layer, seen):
            parts = attr.full_name.removesuffix(":0").split("/") if attr.full_name else []
            weight = parts[-1] if parts else local[-1].lstrip("_")
            if listed and len(parts) > hops:
                # Keras names a variable by its layer scopes: the last hops+1 parts are the layer, its
                # sublayers and the weight (anything before is the model's own scope).
                path = tuple(parts[-(hops + 1) :])
                layer_key = layer_key or path[0]
                path = (layer_key, *path[1:])
            else:
                # Subclassed models: the checkpoint does not record layer names reliably; use attribute names.
                path = (*local_name.split("/"), *(p.lstrip("_") for p in local[:-1]), weight)
            _insert(tree, path, _variable(reader.get(attr.checkpoint_key), path, registry, attr.checkpoint_key), where)
            layout.setdefault(path[:-1], []).append(path[-1])
            found[j] = path
    _check_nothing_hidden(g, model, found, model_path)
    if not tree:
        raise CheckpointFormatError(
            f"{where}: no layer weights found under {model_path or 'the root'!r} of the object graph; it is not a "
            "checkpoint of a Keras model"
        )
    return _without_groups(tree, layout, where)


def _check_nothing_hidden(g: _Graph, model: int, found: Container[int], model_path: str) -> None:
    """Raises if the model's optimizer tracks trainable variables that no layer reached (they would be lost)."""
    opt = g.named(model).get(_OPTIMIZER)
    trainable = g.named(opt).get("_trainable_variables") if opt is not None else None
    if trainable is None:
        return
    missed = [j for _, j in g.children(trainable) if g.value(j) is not None and j not in found]
    if missed:
        name = g.value(missed[0]).full_name
        raise CheckpointFormatError(
            f"{g.where}: {len(missed)} trainable variables of model {model_path or 'at the root'!r} (first: "
            f"{name!r}) are reachable only through its optimizer, so their layers are unknown (a Keras 3 "
            "subclassed model keeping layers in a list); save the model with model.save_weights('m.weights.h5') "
            "and load that instead"
        )
