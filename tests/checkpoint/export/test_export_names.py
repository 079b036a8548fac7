"""checkpoint.export keeps Variable names exactly: two Variables with one name are refused at export."""

import re

import jax.numpy as jnp
import pytest

import checkpoint
import varstate


def test_two_variables_named_alike_in_different_registries_are_refused(tmp_path):
    a = varstate.Variable(jnp.ones(2), name="w", registry=varstate.Registry())
    b = varstate.Variable(jnp.zeros(2), name="w", registry=varstate.Registry())
    with pytest.raises(ValueError, match=re.escape(
            "export: 'a' and 'b' are Variables both named 'w' (made in different registries); expected each "
            "exported Variable's name once, found it twice, and load would have to rename the second 'w_1'. Give "
            "one of them another name (Variable(..., name=...)) or make both in one registry, which names the "
            "second itself.")):
        checkpoint.export(tmp_path / "out", {"a": a, "b": b})
    assert not (tmp_path / "out").exists()


def test_names_come_back_exactly(tmp_path):
    registry = varstate.Registry()
    a = varstate.Variable(jnp.ones(2), name="w", registry=registry)
    b = varstate.Variable(jnp.zeros(2), name="w", registry=registry)
    tied = {"a": a, "b": b, "again": a}
    loaded = checkpoint.load(checkpoint.export(tmp_path / "out", tied))
    assert (loaded.a.name, loaded.b.name) == ("w", "w_1")
