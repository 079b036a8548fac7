"""The packages' annotations catch a user's typed mistakes, and let correct code through (mypy, as `make test`).

One mypy run checks two user scripts: `user_ok.py`, correct code that must get no error, and
`user_mistakes.py`, one mistake per line in `MISTAKES`, each reported on its line with its message. The run
shares `make test`'s cache (`.mypy_cache`, the pyproject's options), so it checks little besides the scripts.
"""

import pathlib
import re
import textwrap

import pytest
from mypy import api

ROOT = pathlib.Path(__file__).resolve().parent.parent

OK = """
    import jax.numpy as jnp

    import checkpoint
    import varstate
    from checkpoint import latest_checkpoint
    from varstate.optimizers import Adam, GradientDescent

    w = varstate.Variable(jnp.zeros(3), name="w")
    w = w.assign(jnp.ones(3)).assign_add(1.0).assign_sub([1.0, 1.0, 1.0]).assign(w)
    y = (w * 2 + 1) @ w - w[0] + abs(-w) + (2.0 ** w)[1]
    opt = Adam(learning_rate=0.01)
    state = opt.init([w])
    params, state = opt.apply_gradients([jnp.ones(3)], [w], state)
    path: str = checkpoint.Checkpoint(model=params, optimizer=state).save("/tmp/ckpt")
    found = latest_checkpoint("/tmp")
    if found is not None:
        checkpoint.Checkpoint(model=params).restore(found).assert_consumed()
    GradientDescent(0.5)
"""

# (source line, what mypy says of it)
MISTAKES = [
    ('varstate.Variable(jnp.zeros(2)).assign("x")',
     'Argument 1 to "assign" of "Variable" has incompatible type "str"'),
    ("checkpoint.Checkpoint(model=varstate.Variable(1.0)).save(3)",
     'Argument 1 to "save" of "Checkpoint" has incompatible type "int"; expected "str"'),
    ("latest_checkpoint(5)", 'Argument 1 to "latest_checkpoint" has incompatible type "int"; expected "str"'),
    # Keras's argument name given to the TF v1 optimizer (whose is beta1).
    ("Adam(beta_1=0.9)", 'Unexpected keyword argument "beta_1" for "Adam"'),
]
HEADER = """\
import jax.numpy as jnp

import checkpoint
import varstate
from checkpoint import latest_checkpoint
from varstate.optimizers import Adam
"""


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> dict[str, dict[int, list[str]]]:
    """{script name: {line: [messages]}} from one mypy run over both scripts."""
    where = tmp_path_factory.mktemp("typing")
    (where / "user_ok.py").write_text(textwrap.dedent(OK).lstrip())
    (where / "user_mistakes.py").write_text(HEADER + "".join(source + "\n" for source, _ in MISTAKES))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # mypy finds the packages (and reads pyproject.toml, the cache) from the checkout
        stdout, stderr, _ = api.run([str(where / "user_ok.py"), str(where / "user_mistakes.py")])
    assert not stderr, stderr
    out: dict[str, dict[int, list[str]]] = {"user_ok.py": {}, "user_mistakes.py": {}}
    # Only the scripts' lines: the packages' own errors are `make test`'s mypy step to report.
    for m in re.finditer(r"^(?:.*[/\\])?(user_ok\.py|user_mistakes\.py):(\d+): error: (.*)$", stdout, re.M):
        out[m[1]].setdefault(int(m[2]), []).append(m[3])
    return out


def test_correct_code_gets_no_errors(reported):
    assert reported["user_ok.py"] == {}


@pytest.mark.parametrize("index", range(len(MISTAKES)), ids=[source for source, _ in MISTAKES])
def test_a_mistake_is_reported_on_its_line(reported, index):
    source, message = MISTAKES[index]
    line = HEADER.count("\n") + index + 1
    got = reported["user_mistakes.py"].get(line, [])
    assert any(message in m for m in got), f"line {line} ({source}): expected {message!r}, mypy said {got}"


def test_nothing_else_is_reported(reported):
    lines = set(range(HEADER.count("\n") + 1, HEADER.count("\n") + len(MISTAKES) + 1))
    assert set(reported["user_mistakes.py"]) <= lines
