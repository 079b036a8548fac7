"""Fuzzing read_saved_model: a damaged saved_model.pb or variables file gives CheckpointFormatError or DataLossError
naming the SavedModel, or the values it holds; never another exception, and never a wrong value from damaged data.

Seeded: each run tries the same inputs, so a failure reproduces (the message names the seed, input and mutations).
Short by default; for a long run by hand:

    SAVED_MODEL_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/checkpoint/tf/test_saved_model_fuzz.py -q
"""

import os
import random
import shutil

import numpy as np
import pytest

import checkpoint
from checkpoint import CheckpointFormatError, DataLossError

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_saved_model")
EXAMPLES = int(os.environ.get("SAVED_MODEL_FUZZ_EXAMPLES", "300"))
FILES = ("saved_model.pb", "variables/variables.index", "variables/variables.data-00000-of-00001")


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, list]:
    """`data` with one to four flips, byte overwrites, truncations or insertions, and what was done."""
    out, done = bytearray(data), []
    for _ in range(rng.choice((1, 1, 2, 4))):
        kind, at = rng.choice(("flip", "byte", "truncate", "overwrite", "insert")), rng.randrange(max(len(out), 1))
        if kind == "flip" and out:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == "byte" and out:
            out[at] = rng.randrange(256)
        elif kind == "truncate":
            del out[at:]
        elif kind == "overwrite":
            out[at:at + 4] = rng.randbytes(4)
        elif kind == "insert":
            out[at:at] = rng.randbytes(rng.randrange(1, 5))
        done.append((kind, at))
    return bytes(out), done


@pytest.mark.parametrize("model", ["module", "keras_export"])
def test_damaged_saved_models_raise_the_librarys_errors_naming_them(model, tmp_path):
    path = str(tmp_path / model)
    shutil.copytree(os.path.join(DATA, model), path)
    original = checkpoint.read_saved_model(path).variables
    assert original  # the fixture has values for the damaged data to be compared with
    rng = random.Random(f"saved_model {model}")
    outcomes = {"raised": 0, "read": 0}
    for i in range(EXAMPLES):
        name = rng.choice(FILES)
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            intact = f.read()
        damaged, mutations = mutate(intact, rng)
        with open(file, "wb") as f:
            f.write(damaged)
        where = f"input {i}: {name} {mutations}"
        try:
            values = checkpoint.read_saved_model(path).variables
        except (CheckpointFormatError, DataLossError) as e:
            assert path in str(e), f"{where}: the message does not name the SavedModel: {e}"
            outcomes["raised"] += 1
        except Exception as e:  # any other exception is the finding
            pytest.fail(f"{where}: {type(e).__name__}: {e}")
        else:
            outcomes["read"] += 1
            if name.endswith("data-00000-of-00001"):  # every value's bytes are checksummed
                assert values.keys() == original.keys(), where
                for key, value in values.items():
                    np.testing.assert_array_equal(value, original[key], err_msg=f"{where}: {key}")
                    assert value.dtype == original[key].dtype, where
        finally:
            with open(file, "wb") as f:
                f.write(intact)
    assert outcomes["raised"] > EXAMPLES // 2, outcomes  # the mutations reach the checks
