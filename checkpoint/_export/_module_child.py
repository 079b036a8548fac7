"""Run as a script, in a child process: the custom-call targets of StableHLO modules read from stdin.

Input: for each module, its length (8 bytes, little-endian) and its bytes
(jax.export's portable artifact). Output: one JSON line per module, a list of
target names or ``{"error": message}``. A module that crashes or hangs
MLIR's bytecode reader ends this process, not the caller (`_sandbox`).

Imports jaxlib only (about 0.2 s), not jax: it is started once per module
load. The module is read as jax's `Exported.mlir_module` reads it
(``jaxlib._jax.mlir.deserialize_portable_artifact`` in a context with jax's
dialects), so a module that passes here is parsed the same way in the
caller.
"""

import json
import struct
import sys

# jaxlib's private parts, read here alone (tests/test_layout.py): how jax itself reads a module.
from jaxlib._jax import mlir as jax_mlir  # type: ignore[import-not-found]  # a compiled module without stubs
from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs._jax_mlir_ext import register_dialects
from jaxlib.mlir.dialects import chlo, mhlo, sdy, stablehlo


def targets(module: ir.Module) -> list[str]:
    found = []
    stack = [module.operation]  # a stack, not recursion: nesting depth is the file's to choose
    while stack:
        op = stack.pop()
        if op.name == "stablehlo.custom_call":
            attr = op.attributes["call_target_name"] if "call_target_name" in op.attributes else None
            # Bytes, not str: a name that is not UTF-8 is refused as unknown, not a nanobind RuntimeError.
            found.append(ir.StringAttr(attr).value_bytes.decode("utf-8", "backslashreplace")
                         if isinstance(attr, ir.StringAttr) else "<no call_target_name>")
        stack.extend(inner.operation for region in op.regions for block in region for inner in block)
    return found


def main() -> None:
    data = sys.stdin.buffer.read()
    registry = ir.DialectRegistry()
    register_dialects(registry)
    at = 0
    while at < len(data):
        (size,) = struct.unpack_from("<Q", data, at)
        blob, at = data[at + 8:at + 8 + size], at + 8 + size
        context = ir.Context()
        context.append_dialect_registry(registry)
        context.load_all_available_dialects()
        for dialect in (sdy, chlo, stablehlo):
            dialect.register_dialect(context)
        mhlo.register_mhlo_dialect(context)
        with context:
            try:
                result: object = targets(jax_mlir.deserialize_portable_artifact(blob))
            except (ValueError, RuntimeError) as e:  # jaxlib reports a bad artifact as either
                result = {"error": str(e)}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
