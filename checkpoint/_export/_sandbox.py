"""StableHLO modules from a file are first read in a child process, with a time limit.

MLIR's bytecode reader trusts its input: two changed bytes in a module can
make it crash the process (SIGSEGV) or loop forever (found by fuzzing a
function file's module). No check in the caller's process can bound that,
so `module_targets` reads each module in a child (`_module_child.py`, jaxlib
only, about 0.3 s to start) and returns the custom-call targets it found;
only a module the child read is then read in the caller, by jax, when the
function runs. The child's answer is kept by the module's sha256, so a
module is read in a child once per process.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

from checkpoint._errors import CheckpointFormatError

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_module_child.py")
# Seconds for the child to start and read a module: jaxlib's import, plus reading at a pessimistic 10 MB/s.
TIME_LIMIT_S = 30.0
_BYTES_PER_S = 10e6
_known: dict[bytes, list[str]] = {}  # sha256 of a module -> its custom-call targets


def module_targets(module: bytes, where: str) -> list[str]:
    """The custom-call targets of a serialized StableHLO module, read in a child process first.

    Raises:
        CheckpointFormatError: the module cannot be read, or reading it
            crashed or outlasted the time limit (the file is damaged or
            crafted), naming `where`.
    """
    key = hashlib.sha256(module).digest()
    if key not in _known:
        limit = TIME_LIMIT_S + len(module) / _BYTES_PER_S
        try:
            done = subprocess.run([sys.executable, "-I", CHILD], input=struct.pack("<Q", len(module)) + module,
                                  capture_output=True, timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            raise CheckpointFormatError(
                f"{where}: reading its StableHLO module did not finish in {limit:.0f} s (MLIR's reader loops on "
                "some damaged modules); the file is damaged or crafted: export the model again.") from None
        if done.returncode != 0:
            raise CheckpointFormatError(
                f"{where}: reading its StableHLO module ended the process that read it (exit status "
                f"{done.returncode}; MLIR's reader crashes on some damaged modules, so load reads a module in a "
                "separate process first); the file is damaged or crafted: export the model again. "
                f"Its last output: {done.stderr.decode(errors='replace')[-300:]!r}")
        result = json.loads(done.stdout)
        if isinstance(result, dict):
            raise CheckpointFormatError(f"{where}: its StableHLO module cannot be read ({result['error']}).")
        if len(_known) >= 1024:  # a bound on what a long-lived process keeps
            _known.clear()
        _known[key] = result
    return list(_known[key])
