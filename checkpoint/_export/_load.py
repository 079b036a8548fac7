"""`load`: an export directory back as objects, with its signatures runnable.

Nothing loaded executes Python code from the files: objects are rebuilt from
the SavedObjectGraph (registered types through `register_revived_type`),
values come from the TensorBundle, functions through `jax.export.deserialize`
after their sha256 is checked against the ExportDef. A loaded signature does
run the compiled code in its file; before it can, `read_function` checks the
custom calls of the function and of its VJPs: a target outside jax.export's
own allow-list is refused (an unknown target can crash the process), and so
is a kernel on that list unless the caller trusts the file (a kernel takes
the buffer shapes the file declares on faith). Every file read is a regular
file of bounded size.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import struct
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from google.protobuf.message import DecodeError

from checkpoint import _dtypes, _graph, _keys
from checkpoint._errors import CheckpointFormatError
from checkpoint._export import _jax_private, _sandbox
from checkpoint._export._format import (
    FUNCTION_NAME,
    GENERIC,
    MAX_FILE_BYTES,
    REVIVED,
    SIGNATURE_MAP,
    SIGNATURES,
    VERSION,
    WRAPPERS,
    Asset,
    seal_problem,
)
from checkpoint._graph._build import PRNG_KEY_IMPL
from checkpoint._storage import EXPORT_FILE, SAVED_MODEL_FILE, VARIABLES_PREFIX, BundleReader
from checkpoint.protos import saved_object_graph_pb2 as pb
from varstate import Registry, Variable, VariableAggregation, VariableSynchronization, _seam

_log = logging.getLogger("checkpoint")
MAX_VJP_ORDER = 8  # VJPs of a loaded function checked and accepted; jax.export serializes as many as asked
# The targets on jax.export's stable list that run no kernel on buffers the file declares, so a lying type cannot
# make them write out of bounds: annotations for the partitioner, the symbolic-shape check, an allocation, and
# StableHLO ops spelled as custom calls until shape refinement turns them into ops whose types are verified
# (refinement refuses a dynamic_reduce_window whose result type lies; without refinement XLA has no implementation).
# Every other target, tpu_custom_call, mosaic_gpu_v2 and tf.call_tf_function included, needs trust_custom_calls.
NON_KERNEL_TARGETS = frozenset({
    "shape_assertion", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement",
    "AllocateBuffer", "stablehlo.dynamic_reduce_window", "stablehlo.dynamic_rng_bit_generator",
    "stablehlo.dynamic_top_k"})


class RevivedObject:
    """A loaded object of a type not registered here (TF's generic user object): its children as attributes."""

    _identifier: str  # in __dict__ with the children

    def __init__(self, identifier: str, children: Mapping[str, Any]) -> None:
        self.__dict__.update(children)
        self.__dict__["_identifier"] = identifier

    def __repr__(self) -> str:
        names = sorted(k for k in self.__dict__ if k != "_identifier")
        return f"RevivedObject({self._identifier!r}, attributes={names})"


def _fit(value: Any, aval: Any) -> Any:
    """A captured value in the dtype the function was traced with.

    They differ in width only when JAX's 64-bit types were set otherwise at
    export: an int64 global step, exported from int32 and loaded with x64 on,
    goes back to int32 (it was int32 when traced, so it fits).
    """
    dtype = getattr(value, "dtype", None)
    if not isinstance(aval.dtype, np.dtype):  # a PRNG key: rebuilt with its implementation, checked at load
        return value
    same_kind = dtype is not None and np.dtype(dtype).kind == np.dtype(aval.dtype).kind
    if same_kind and dtype != aval.dtype and jax.dtypes.canonicalize_dtype(aval.dtype) == aval.dtype:
        return jnp.asarray(value).astype(aval.dtype)
    return value


class Signature:
    """A loaded signature: checks the arguments, then runs the deserialized `jax.export.Exported` on them
    and on the restored variables and constants it reads."""

    def __init__(self, name: str, exported: jax.export.Exported, captured: list[Any], where: str) -> None:
        self.name, self.exported, self._where = name, exported, where
        self._arg_trees = exported.in_tree.children()[0].children()[1:]  # ((captured, *args), {})
        self._arg_avals = exported.in_avals[len(captured):]
        self._inputs = [_fit(c.value if isinstance(c, Variable) else c, aval)
                        for c, aval in zip(captured, exported.in_avals[:len(captured)], strict=True)]
        self._call = jax.jit(exported.call)  # compiled once per input shape, then a plain jit dispatch
        self._accepted: set[tuple] = set()  # argument structures, shapes and dtypes already checked

    def __repr__(self) -> str:
        args = ", ".join(str(a.str_short()) for a in self._arg_avals)
        return f"Signature({self.name!r}, ({args}) -> {self.exported.out_tree})"

    def __call__(self, *args: Any) -> Any:
        # The check costs a few microseconds in Python: done once per kind of arguments, as jit compiles once.
        leaves, treedef = jax.tree.flatten(args)
        try:
            key: tuple | None = (treedef, *[(x.shape, x.dtype) for x in leaves])
        except AttributeError:
            key = None  # a Python number among the arguments: checked on every call
        if key is None or key not in self._accepted:
            self._check(args)
            if key is not None:
                if len(self._accepted) >= 256:  # many batch sizes through a symbolic dimension: start over
                    self._accepted.clear()
                self._accepted.add(key)
        return self._call(self._inputs, *args)

    def _check(self, args: tuple) -> None:
        what = f"Signature {self.name!r} of {self._where}"
        if len(args) != len(self._arg_trees):
            raise TypeError(f"{what} takes {len(self._arg_trees)} positional argument(s), got {len(args)}.")
        for i, (arg, tree) in enumerate(zip(args, self._arg_trees, strict=True)):
            found = jax.tree.structure(arg)
            if found != tree:
                raise TypeError(f"{what}: argument {i} has structure {found}, expected {tree}.")
        for j, (x, aval) in enumerate(zip(jax.tree.leaves(args), self._arg_avals, strict=True)):
            shape, dtype = np.shape(x), x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
            fits = len(shape) == len(aval.shape) and all(
                jax.export.is_symbolic_dim(d) or d == n for d, n in zip(aval.shape, shape, strict=True))
            if dtype != aval.dtype or not fits:
                expected, got = aval.str_short(), f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"
                raise (TypeError if dtype != aval.dtype else ValueError)(
                    f"{what}: input {j} expects {expected}, got {got}. Pass arrays of that dtype and shape "
                    "(symbolic dimensions accept any size).")


def load(directory: str | os.PathLike, *, registry: Registry | None = None,
         trust_custom_calls: bool = False) -> RevivedObject:
    """Loads an export: an object whose attributes mirror the exported root, plus `signatures`.

    Variables come back as `varstate.Variable` objects with their names and
    flags, arrays and Python scalars as they were, dicts/lists/tuples as such,
    registered types through `register_revived_type`, other containers as
    generic objects (`RevivedObject`), and ``signatures[name](*args)`` runs
    the exported function. Needs none of the code that made the export.

    Args:
        directory: the export's directory (what `export` returned).
        registry: the `varstate.Registry` the Variables are made in; None is
            a new one, so that names are kept exactly.
        trust_custom_calls: allow kernel custom calls (lapack, cuSOLVER,
            Pallas's ``tpu_custom_call`` and ``mosaic_gpu_v2``,
            ``tf.call_tf_function``: the targets on jax.export's stable list
            that run a kernel). A kernel writes into buffers of the shapes
            the file declares, unchecked, so a file that lies about them can
            corrupt memory; pass True only for files whose author you trust.
            Without it such an export is refused before anything runs (jax's
            own non-kernel targets, such as ``shape_assertion`` for a
            symbolic batch, need no trust). Targets off that list are
            refused either way.

    Returns:
        The root as an object with its children as attributes (a
        `RevivedObject`, or the registered type of the root), whose
        ``signatures`` maps each signature's name to a callable.

    Raises:
        FileNotFoundError: `directory` is not an export (no ``export.pb``).
        CheckpointFormatError: a corrupt, incomplete or hostile export (a
            link, a file over its size bound, a function file whose hash
            does not match, a custom call refused as above), naming the file.
        ValueError: an export of a newer format version than this reader.
        TypeError: `trust_custom_calls` is not a bool.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> root = {"scale": varstate.Variable(jnp.float32(3.0), name="scale", trainable=False), "offset": jnp.ones(2)}
    >>> path = checkpoint.export(os.path.join(tempfile.mkdtemp(), "m"), root,
    ...                          {"apply": (lambda r, x: x * r["scale"].value + r["offset"], (jnp.zeros(2),))})
    >>> loaded = checkpoint.load(path)
    >>> loaded.scale.name, loaded.scale.trainable, loaded.signatures["apply"](jnp.array([1.0, 2.0])).tolist()
    ('scale', False, [4.0, 7.0])
    """
    if not isinstance(trust_custom_calls, bool):  # "no" would be true: a wrong guess here is memory corruption
        raise TypeError(f"load: trust_custom_calls must be a bool, got {trust_custom_calls!r}.")
    directory = os.path.abspath(os.fspath(directory))
    definition = read_definition(directory)
    with BundleReader(os.path.join(directory, VARIABLES_PREFIX)) as reader:
        return _Loader(directory, definition, reader, registry or Registry(), trust_custom_calls).root()


def read_definition(directory: str) -> pb.ExportDef:
    """The ExportDef of the export in `directory`, after its file, sha256 and format version are checked."""
    top = os.path.join(directory, EXPORT_FILE)
    if not os.path.lexists(top):
        hint = (" It is a TensorFlow SavedModel (saved_model.pb), which this does not load."
                if os.path.isfile(os.path.join(directory, SAVED_MODEL_FILE)) else "")
        raise FileNotFoundError(f"load: {directory!r} is not an export written by checkpoint.export "
                                f"(no {EXPORT_FILE}).{hint}")
    data = read_file(top, EXPORT_FILE)
    try:
        # The sha256 trailer is a field ExportDef does not declare: parsing skips it.
        definition = pb.ExportDef.FromString(data)
    except DecodeError:
        raise CheckpointFormatError(f"{top}: not a valid ExportDef (the file is corrupt).") from None
    v = definition.version
    if v.producer < 1 or not definition.object_graph.nodes:
        raise CheckpointFormatError(f"{top}: no format version or no objects (the file is corrupt).")
    problem = seal_problem(data) if v.producer >= 2 else None  # format version 1 had no sha256
    if problem:
        raise CheckpointFormatError(f"{top}: {problem}, as an export of format version {v.producer} must (it was "
                                    "modified, truncated or is corrupt); export the model again.")
    if v.min_consumer > VERSION or VERSION in v.bad_consumers:
        raise ValueError(f"load: {directory!r} has export format version {v.producer} for readers of version >= "
                         f"{v.min_consumer} except {list(v.bad_consumers)}; this reader is version {VERSION}. "
                         "Upgrade varstate to load it.")
    return definition


def read_file(path: str, what: str) -> bytes:
    """The bytes of `path`, which must be a regular file (not a link, device or pipe) of at most 2 GiB."""
    # O_NOFOLLOW: a link is refused, not followed; O_NONBLOCK: opening a FIFO does not wait for a writer.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise CheckpointFormatError(f"{path}: the export's {what} is a symbolic link, which load refuses "
                                        "(it could point anywhere); copy the file itself into the export.") from None
        if e.errno == errno.ENOENT:
            raise CheckpointFormatError(f"{path}: the export's {what} is missing (the export is incomplete); "
                                        "export the model again.") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{path}: the export's {what} is not a regular file (found a "
                                        f"{_file_kind(st.st_mode)}); an export holds only regular files.")
        if st.st_size > MAX_FILE_BYTES:
            raise CheckpointFormatError(f"{path}: the export's {what} is {st.st_size} bytes, over the "
                                        f"{MAX_FILE_BYTES}-byte limit of the format; it is not a file export wrote.")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise CheckpointFormatError(f"{path}: the export's {what} grew past {MAX_FILE_BYTES} bytes while read.")
    return data


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
             (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket")]
    return next((name for test, name in kinds if test(mode)), f"file of mode {oct(mode)}")


def read_function(directory: str, definition: pb.ExportDef, name: str, label: str, *,
                  trust_custom_calls: bool = False) -> jax.export.Exported:
    """Signature `label`'s function `name` deserialized, once its file, sha256 and custom calls are checked.

    The custom calls of every function the file carries are checked: the
    function and its VJPs (``Exported.vjp()``) to the last order serialized,
    which may be at most `MAX_VJP_ORDER`; a file with more is refused. Targets
    off jax.export's stable list are refused; those on it outside
    `NON_KERNEL_TARGETS` unless `trust_custom_calls`.
    """
    if not FUNCTION_NAME.fullmatch(name):  # a name from the file: it must stay one file name under functions/
        raise CheckpointFormatError(f"{os.path.join(directory, EXPORT_FILE)}: signature {label!r} names function "
                                    f"{name!r}, which is not a function file name ([A-Za-z0-9_]+); refusing it.")
    path = os.path.join(directory, "functions", name)
    data = read_file(path, f"function file of signature {label!r}")
    if hashlib.sha256(data).digest() != definition.function_sha256.get(name):
        raise CheckpointFormatError(f"{path}: the function file does not match its sha256 in {EXPORT_FILE} "
                                    "(it was modified or is corrupt); export the model again.")
    stable = _jax_private.stable_custom_call_targets()
    # The file carries the function and its VJPs to the order it was serialized with; jax runs a VJP when the
    # loaded signature is differentiated, so each is checked here, before anything runs.
    exported = function = _deserialize(path, lambda: jax.export.deserialize(bytearray(data)), "it")
    for order in range(MAX_VJP_ORDER + 1):
        what = f" (its VJP of order {order})" if order else ""
        # The file's own disabled_safety_checks are not honoured: the file is what is being checked.
        targets = set(custom_call_targets(function, path))
        unknown = sorted(targets - stable)
        if unknown:
            raise CheckpointFormatError(
                f"{path}: signature {label!r}{what} calls XLA custom call target(s) {unknown}, which jax.export does "
                f"not accept without a disabled safety check (JAX {jax.__version__} accepts {len(stable)} stable "
                "targets); load refuses it before anything runs, as calling an unknown target can crash the process. "
                "Export the function again without custom calls outside that list.")
        kernels = sorted(targets - NON_KERNEL_TARGETS)
        if kernels and not trust_custom_calls:
            raise CheckpointFormatError(
                f"{path}: signature {label!r}{what} calls kernel custom call target(s) {kernels}; load refuses them "
                "before anything runs unless the caller trusts the file: a kernel writes into buffers of the shapes "
                "the file declares, unchecked, so a file that lies about them can corrupt memory or crash the process. "
                "If you trust the file's author, load it with checkpoint.load(path, trust_custom_calls=True).")
        if not function.has_vjp():
            return exported
        function = _deserialize(path, function.vjp, f"the VJP of order {order + 1} of signature {label!r}")
    raise CheckpointFormatError(
        f"{path}: signature {label!r} carries VJPs past order {MAX_VJP_ORDER}, the most load accepts; export the "
        f"function again serialized with vjp_order at most {MAX_VJP_ORDER}.")


def _deserialize(path: str, deserialize: Callable[[], jax.export.Exported], what: str) -> jax.export.Exported:
    try:
        return deserialize()
    # jax reads the flatbuffer in Python without verifying it first: damage surfaces as whichever of these the
    # first bad offset or missing field leads to (found by tests/checkpoint/export/test_export_fuzz.py).
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, AssertionError, StopIteration,
            struct.error, RecursionError, OverflowError) as e:
        raise CheckpointFormatError(f"{path}: jax.export cannot deserialize {what} ({type(e).__name__}: {e}); "
                                    "the file is corrupt.") from e


def custom_call_targets(exported: jax.export.Exported, where: str) -> list[str]:
    """The call targets of every `stablehlo.custom_call` in the exported module, in any function or region.

    The module is read in a child process first (`_sandbox`): a damaged one can crash or hang MLIR's reader.
    """
    return _sandbox.module_targets(exported.mlir_module_serialized, where)


class _Loader:
    def __init__(self, directory: str, definition: pb.ExportDef, reader: BundleReader, registry: Registry,
                 trust_custom_calls: bool) -> None:
        self.dir, self.definition, self.reader, self.registry = directory, definition, reader, registry
        self.trust_custom_calls = trust_custom_calls
        self.graph = definition.object_graph
        self.ckpt_graph = self.reader.object_graph
        self.names = _graph.node_names(self.graph)
        self.memo: dict[int, Any] = {}
        self.building: set[int] = set()

    def fail(self, node: int, message: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.dir}: node {node} ({self.names[node]}): {message}")

    def root(self) -> RevivedObject:
        try:
            kids = self.children(0)
        except RecursionError:
            raise CheckpointFormatError(f"{self.dir}: the object graph nests too deeply.") from None
        return RevivedObject(self.graph.nodes[0].user_object.identifier or GENERIC, kids)

    def children(self, node: int) -> dict[str, Any]:
        return {ref.local_name: self.node(ref.node_id, node) for ref in self.graph.nodes[node].children}

    def node(self, i: int, parent: int) -> Any:
        if not 0 < i < len(self.graph.nodes):
            raise self.fail(parent, f"refers to node {i}, outside the graph's {len(self.graph.nodes)} nodes")
        if i in self.memo:
            return self.memo[i]
        if i in self.building:
            raise self.fail(i, "is its own descendant (a cycle in the object graph)")
        self.building.add(i)
        proto = self.graph.nodes[i]
        kind = proto.WhichOneof("kind")
        if kind not in ("variable", "constant", "asset", "bare_concrete_function", "user_object"):
            raise self.fail(i, f"has kind {kind!r}, which load does not support")
        self.memo[i] = getattr(self, kind)(i, getattr(proto, kind))
        self.building.discard(i)
        return self.memo[i]

    def value(self, i: int, key: str) -> np.ndarray:
        if key not in self.reader:
            raise self.fail(i, f"its value {key!r} is missing from {self.reader.prefix}")
        return self.reader.get(key)

    def variable(self, i: int, sv: pb.SavedVariable) -> Variable:
        attrs = self.ckpt_graph.nodes[i].attributes if self.ckpt_graph and i < len(self.ckpt_graph.nodes) else []
        if not attrs:
            raise self.fail(i, "the variables' object graph has no value for this variable")
        value = self.value(i, attrs[0].checkpoint_key)
        shape, dtype = tuple(d.size for d in sv.shape.dim), _dtypes.BY_ENUM.get(sv.dtype)
        if value.shape != shape or value.dtype != dtype:
            raise self.fail(i, f"stored value is {value.dtype}{list(value.shape)}, the graph says {dtype}{list(shape)}")
        data = _dtypes.narrow_to_held(value, self.names[i], attrs[0].checkpoint_key)
        held = self.key_or_value(i, data)
        try:
            var = Variable(jnp.asarray(held), name=sv.name or None, trainable=sv.trainable,
                           synchronization=VariableSynchronization(sv.synchronization),
                           aggregation=VariableAggregation(sv.aggregation), registry=self.registry)
        except (ValueError, TypeError) as e:
            raise self.fail(i, str(e)) from None
        if data.dtype != value.dtype:  # saved again as it was (TF's int64 global step)
            var = _seam.record_saved_dtype(var, value.dtype)
        return var

    def constant(self, i: int, const: pb.SavedConstant) -> Any:
        key = const.operation
        value = self.value(i, key)
        if key.endswith(_keys.value_suffix(_keys.PY_STATE)):  # a Python scalar
            item = value.item()
            return item.decode() if isinstance(item, bytes) else item
        return self.key_or_value(i, jnp.asarray(_dtypes.narrow_to_held(value, self.names[i], key)))

    def key_or_value(self, i: int, data: Any) -> Any:
        """The PRNG key that node `i`'s key data `data` stands for, or `data` itself for a node that holds no key.

        `export` stores a key as `Checkpoint` does: its key data under VARIABLE_VALUE and, on the same node of the
        variables' object graph, the name of its implementation under PRNG_KEY_IMPL.
        """
        attrs = self.ckpt_graph.nodes[i].attributes if self.ckpt_graph and i < len(self.ckpt_graph.nodes) else []
        impl_key = next((a.checkpoint_key for a in attrs if a.name == PRNG_KEY_IMPL), None)
        if impl_key is None:
            return data
        names = np.asarray(self.value(i, impl_key)).reshape(-1)
        name = names[0] if names.size == 1 else None
        name = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
        if not isinstance(name, str):
            raise self.fail(i, f"its PRNG key implementation {impl_key!r} should be one string, found "
                               f"{names.size} value(s) of dtype {names.dtype} (the export is corrupt); export the "
                               "model again")
        try:
            return jax.random.wrap_key_data(jnp.asarray(data), impl=name)
        except (ValueError, TypeError, KeyError) as e:
            problem = (f"its key data ({data.dtype}{list(data.shape)}) is not a PRNG key of implementation {name!r} "
                       f"({type(e).__name__}: {e}); the export is corrupt or was made by a JAX with implementations "
                       "this one lacks: load it with that JAX, or export it again")
            raise self.fail(i, problem) from None

    def asset(self, i: int, asset: pb.SavedAsset) -> Asset:
        index = asset.asset_file_def_index
        files = self.definition.asset_file_def
        if not 0 <= index < len(files):
            raise self.fail(i, f"asset index {index} is outside the {len(files)} asset files")
        name = files[index].filename
        if not name or os.path.basename(name) != name or name in (".", "..") or "\0" in name:
            raise self.fail(i, f"asset file name {name!r} leads outside {self.dir}/assets; refusing it")
        # Links are refused, not resolved: a linked assets/ or asset would hand the caller any file on this
        # machine as if it came with the export.
        assets = os.path.join(os.path.realpath(self.dir), "assets")
        for path, what in ((assets, "the assets directory"), (os.path.join(assets, name), f"asset {name!r}")):
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                raise self.fail(i, f"{what} is missing from the export ({path})") from None
            if stat.S_ISLNK(mode):
                raise self.fail(i, f"{what} is a symbolic link ({path}), which load refuses: it could point "
                                   "anywhere. Copy the file itself into the export.")
            if not (stat.S_ISDIR if path == assets else stat.S_ISREG)(mode):
                raise self.fail(i, f"{what} ({path}) is a {_file_kind(mode)}, expected a "
                                   f"{'directory' if path == assets else 'regular file'}")
        return Asset(os.path.join(assets, name))

    def user_object(self, i: int, uo: pb.SavedUserObject) -> Any:
        kids = self.children(i)
        if uo.identifier in (SIGNATURE_MAP, WRAPPERS[dict]):
            return kids
        if uo.identifier in (WRAPPERS[list], WRAPPERS[tuple]):
            items = [kids[k] for k in sorted(kids, key=lambda k: int(k) if k.isdigit() else -1)]
            return items if uo.identifier == WRAPPERS[list] else tuple(items)
        regs = REVIVED.get(uo.identifier, [])  # read at load time: registrations may change
        for reg in regs:
            if reg.accepts(uo.version):
                try:
                    return reg.from_children(kids)
                except (TypeError, ValueError) as e:
                    e.add_note(f"while reviving {self.names[i]} as {uo.identifier!r} version {reg.version}")
                    raise
        if uo.identifier != GENERIC:
            why = (f"no registered version accepts version {uo.version.producer} (min_consumer "
                   f"{uo.version.min_consumer}, bad_consumers {list(uo.version.bad_consumers)}; registered: "
                   f"{[r.version for r in regs]})" if regs else "the type is not registered here")
            _log.warning("load: %s (%s, identifier %r) is loaded as a generic object: %s.", self.names[i],
                         uo.metadata, uo.identifier, why)
        return RevivedObject(uo.identifier, kids)

    def bare_concrete_function(self, i: int, bare: pb.SavedBareConcreteFunction) -> Signature:
        name = bare.concrete_function_name
        if name not in self.graph.concrete_functions or not FUNCTION_NAME.fullmatch(name):
            raise self.fail(i, f"names concrete function {name!r}, which the export does not have")
        label = self.names[i].replace("(root).", "").replace(f"{SIGNATURES}.", "", 1)
        exported = read_function(self.dir, self.definition, name, label, trust_custom_calls=self.trust_custom_calls)
        captured = [self.node(n, i) for n in self.graph.concrete_functions[name].bound_inputs]
        if exported.in_tree.children()[0].children()[0].num_leaves != len(captured):  # ((captured, *args), {})
            raise self.fail(i, f"function {name!r} takes a different number of captured inputs than its "
                               f"{len(captured)} bound_inputs")
        for n, c, aval in zip(self.graph.concrete_functions[name].bound_inputs, captured,
                              exported.in_avals[:len(captured)], strict=True):
            found = getattr(c.value if isinstance(c, Variable) else c, "dtype", None)
            # A PRNG key's dtype names its implementation: one of another (or a key where numbers were traced, or
            # numbers where a key was) would fail inside the call, with nothing naming the value.
            keys = [d for d in (found, aval.dtype) if d is not None and not isinstance(d, np.dtype)]
            if keys and found != aval.dtype:
                raise self.fail(i, f"function {name!r} reads {self.names[n]} as {aval.dtype}, but the export holds "
                                   f"it as {found} (the export is inconsistent); export the model again")
        return Signature(label, exported, captured, self.dir)
