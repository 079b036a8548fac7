"""Restore defects found in review: 64-bit values into plain-array templates, untied values into a tied template,
an optimizer state restored before its Variables, warnings for restores that raised, and long root lists."""

import gc
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate.optimizers import Adam

KEY = "/.ATTRIBUTES/VARIABLE_VALUE"
FIX_X64 = re.escape("enable them with jax.config.update('jax_enable_x64', True)")


def restore_error(path, template):
    """The ValueError of restoring `template` as root `x`, as text."""
    with pytest.raises(ValueError) as e:
        checkpoint.Checkpoint(x=template).restore(path)
    return str(e.value)


@pytest.fixture
def no_x64():
    assert not jax.config.jax_enable_x64  # the suite's default, and the case these tests are about


# --- 1. 64-bit values into plain-array templates: checked as for a Variable ---------------------------------------

@pytest.mark.parametrize("fmt", ["orbax", "tf"])
@pytest.mark.parametrize(("stored", "template", "found"), [
    (np.array(2**40 + 5, np.int64), jnp.int32(0), "holds 1099511627781, out of range"),
    (np.array([1, 2**40 + 5], np.int64), np.zeros(2, np.int32), "holds 1099511627781, out of range"),
    (np.array([-2**31 - 1], np.int64), jnp.zeros(1, jnp.int32), "holds -2147483649, out of range"),
    (np.array([2**63], np.uint64), np.zeros(1, np.uint32), "holds 9223372036854775808, out of range"),
    (np.array([1e-300], np.float64), jnp.zeros(1, jnp.float32), "holds 1e-300, which float32 rounds to 0,"),
    (np.float64(1e300), np.float32(0), "holds 1e+300, out of range"),
])
def test_a_64_bit_value_a_plain_array_cannot_hold_is_refused_as_for_a_variable(no_x64, tmp_path, fmt, stored,
                                                                              template, found):
    path = checkpoint.Checkpoint(x=stored).write(str(tmp_path / "c"), format=fmt)
    message = restore_error(path, template)
    assert re.match(rf"Tensor 'x{re.escape(KEY)}' \({stored.dtype}\) {re.escape(found)} for variable '\(root\)\.x' "
                    rf"\({np.dtype(template.dtype)}; JAX's 64-bit types are disabled\): {FIX_X64}", message), message
    # The very error a Variable template of the same dtype gets.
    assert message == restore_error(path, varstate.Variable(jnp.asarray(template)))


def test_a_python_int_out_of_int32_range_into_a_jax_int32_template_is_refused(no_x64, tmp_path):
    path = checkpoint.Checkpoint(x=2**40).write(str(tmp_path / "c"))
    assert restore_error(path, jnp.int32(0)).startswith(
        "Tensor 'x/.ATTRIBUTES/py_state' (int64) holds 1099511627776, out of range for variable '(root).x'")


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_a_64_bit_value_in_range_comes_back_as_stored_and_jax_takes_it_unchanged(no_x64, tmp_path, fmt):
    stored = {"step": np.array(2**31 - 1, np.int64), "low": np.array([-2**31], np.int64),
              "f": np.array([1e-30, 3e38], np.float64)}
    path = checkpoint.Checkpoint(**stored).write(str(tmp_path / "c"), format=fmt)
    got = checkpoint.Checkpoint(step=jnp.int32(0), low=jnp.zeros(1, jnp.int32),
                                f=jnp.zeros(2, jnp.float32)).restore(path).assert_consumed()
    for name, value in stored.items():
        assert got.roots[name].dtype == value.dtype  # as stored, so that it saves back as stored
        np.testing.assert_array_equal(got.roots[name], value)
        # Checked on restore, so what JAX later makes of it is the value (floats to float32's nearest).
        np.testing.assert_array_equal(np.asarray(jnp.asarray(got.roots[name])), value.astype(np.float32)
                                      if value.dtype.kind == "f" else value)


# --- 2. Distinct saved Variables into a template that ties them ---------------------------------------------------

def untied_checkpoint(tmp_path):
    saved = {"a": varstate.Variable(jnp.ones(2)), "b": varstate.Variable(jnp.full(2, 2.0))}
    return checkpoint.Checkpoint(m=saved).write(str(tmp_path / "untied"))


TIED = (r"Cannot restore \(root\)\.m\.b: its template Variable is also the template's \(root\)\.m\.a \(one Variable "
        r"used at two paths, tied\), but the checkpoint holds two distinct Variables there: "
        r"'m/a/\.ATTRIBUTES/VARIABLE_VALUE' at \(root\)\.m\.a and 'm/b/\.ATTRIBUTES/VARIABLE_VALUE' at "
        r"\(root\)\.m\.b\. .*Untie the template \(a Variable of its own at each path\), or restore into separate "
        r"Variables and pick one of them to tie\.")


def test_distinct_saved_variables_into_one_tied_template_variable_are_refused(tmp_path, caplog):
    path = untied_checkpoint(tmp_path)
    t = varstate.Variable(jnp.zeros(2))
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        with pytest.raises(ValueError, match=TIED):
            checkpoint.Checkpoint(m={"a": t, "b": t}).restore(path)
        gc.collect()
    assert caplog.text == ""  # the error said it all: no warning for a status never returned
    # The fix the message gives: separate Variables, then pick one.
    got = checkpoint.Checkpoint(m={"a": varstate.Variable(jnp.zeros(2)), "b": varstate.Variable(jnp.zeros(2))})
    got = got.restore(path).assert_consumed().m
    assert got["a"].value.tolist() == [1.0, 1.0] and got["b"].value.tolist() == [2.0, 2.0]


def test_a_tied_variable_given_again_in_a_deferred_restore_is_refused_and_the_status_kept(tmp_path):
    path = checkpoint.Checkpoint(m={"a": varstate.Variable(jnp.ones(2))}, n=varstate.Variable(jnp.full(2, 2.0))).write(
        str(tmp_path / "c"))
    t = varstate.Variable(jnp.zeros(2))
    status = checkpoint.Checkpoint(m={"a": t}).restore(path)
    with pytest.raises(ValueError, match=r"Cannot restore \(root\)\.n: its template Variable is also the template's "
                                         r"\(root\)\.m\.a .*'m/a/\.ATTRIBUTES/VARIABLE_VALUE' at \(root\)\.m\.a and "
                                         r"'n/\.ATTRIBUTES/VARIABLE_VALUE' at \(root\)\.n\."):
        status.restore(n=t)
    # Nothing of the refused restore was recorded: (root).n is still left over, and takes a Variable of its own.
    with pytest.raises(AssertionError, match=r"Unresolved object in checkpoint \(root\)\.n:"):
        status.assert_consumed()
    assert status.restore(n=varstate.Variable(jnp.zeros(2))).n.value.tolist() == [2.0, 2.0]
    status.assert_consumed()


def test_tied_into_tied_and_tied_into_untied_still_restore(tmp_path):
    v = varstate.Variable(jnp.full(2, 3.0))
    path = checkpoint.Checkpoint(m={"a": v, "b": v}).write(str(tmp_path / "tied"))
    t = varstate.Variable(jnp.zeros(2))
    got = checkpoint.Checkpoint(m={"a": t, "b": t}).restore(path).assert_consumed().m
    assert got["a"].resource_id == got["b"].resource_id == t.resource_id and got["b"].value.tolist() == [3.0, 3.0]
    got = checkpoint.Checkpoint(m={"a": varstate.Variable(jnp.zeros(2)), "b": varstate.Variable(jnp.zeros(2))})
    got = got.restore(path).assert_consumed().m
    assert got["a"].value.tolist() == got["b"].value.tolist() == [3.0, 3.0]


# --- 3. An optimizer state restored before its Variables --------------------------------------------------------

def adam_checkpoint(tmp_path, optimizer="optimizer"):
    opt = Adam(0.1)
    model = {"w": varstate.Variable(jnp.array([1.0, -2.0, 3.0]))}
    state = opt.init(model)
    for g in ([0.5, -1.0, 0.25], [1.0, 2.0, -3.0]):
        model, state = opt.apply_gradients({"w": jnp.array(g)}, model, state)
    path = checkpoint.Checkpoint(model=model, **{optimizer: state}).write(str(tmp_path / "ckpt"))
    return path, opt, model, state


def fresh():
    return {"w": varstate.Variable(jnp.zeros(3))}


def assert_same_state(opt, model, state, ref_model, ref_state):
    """Slots, non-slots and one more step equal to the saved run's, bit for bit."""
    for name in ("m", "v"):
        np.testing.assert_array_equal(state.get_slot(model["w"], name).value,
                                      ref_state.get_slot(ref_model["w"], name).value)
    for name in ("beta1_power", "beta2_power"):
        np.testing.assert_array_equal(state.non_slot(name).value, ref_state.non_slot(name).value)
    g = {"w": jnp.array([0.1, 0.2, 0.3])}
    np.testing.assert_array_equal(opt.apply_gradients(g, model, state)[0]["w"].value,
                                  opt.apply_gradients(g, ref_model, ref_state)[0]["w"].value)


def test_an_optimizer_root_named_before_the_model_root_gets_its_slots(tmp_path):
    path, opt, model, state = adam_checkpoint(tmp_path, optimizer="adam")  # "adam" < "model": matched first
    t = fresh()
    got = checkpoint.Checkpoint(model=t, adam=opt.init(t)).restore(path, strict=True)
    assert_same_state(opt, got.model, got.adam, model, state)


ORDER = (r"Cannot restore \(root\)\.model\.w after the optimizer state \(root\)\.optimizer: an earlier restore "
         r"returned that state before its Variables were restored, without their slots \('m' for \(root\)\.model\.w, "
         r"'v' for \(root\)\.model\.w\), and it cannot change now\. Restore the Variables first and the optimizer "
         r"state after them \(status\.restore\(optimizer=opt\.init\(status\.model\)\)\), or both in one restore "
         r"\(Checkpoint\(model=\.\.\., optimizer=\.\.\.\)\.restore\(path\), or give the optimizer state again beside "
         r"them: status\.restore\(model=\.\.\., optimizer=\.\.\.\)\)\.")


def test_variables_restored_after_their_optimizer_state_are_refused_then_restored_with_it(tmp_path):
    path, opt, model, state = adam_checkpoint(tmp_path)
    t = fresh()
    status = checkpoint.Checkpoint(optimizer=opt.init(t)).restore(path)
    with pytest.raises(ValueError, match=ORDER):
        status.restore(model=t)
    # Refused before anything was recorded: the first status still says the slots wait for their Variable.
    with pytest.raises(AssertionError, match=re.escape(
            "Unresolved slot restorations: 2 slots were not restored, showing 2: (root).model.w's state 'm' for "
            "(root).optimizer (its Variable (root).model.w was not restored); (root).model.w's state 'v' for "
            "(root).optimizer (its Variable (root).model.w was not restored). Give each slot's Variable to a "
            "restore, before or with its optimizer state, and make that state from the restored Variables "
            "(opt.init(status.model)); or call expect_partial() and use assert_existing_objects_matched().")):
        status.assert_consumed()
    both = status.restore(model=t, optimizer=opt.init(t))  # the fix: the optimizer state given again beside them
    status.assert_consumed()
    assert_same_state(opt, both.model, both.optimizer, model, state)


def test_slots_of_an_optimizer_state_made_from_other_variables_are_named_as_such(tmp_path):
    path, opt, *_ = adam_checkpoint(tmp_path)
    status = checkpoint.Checkpoint(model=fresh()).restore(path)
    status.restore(optimizer=opt.init(fresh()))  # not from status.model: no slot is linked to (root).model.w
    with pytest.raises(AssertionError, match=re.escape(
            "(root).model.w's state 'm' for (root).optimizer (the optimizer state restored at (root).optimizer has "
            "no slot 'm' for the Variable restored at (root).model.w)")):
        status.assert_consumed()
    # Nothing it could have taken: restoring its Variables after it is not refused.
    later = checkpoint.Checkpoint(optimizer=opt.init(fresh())).restore(path).restore(model=fresh())
    with pytest.raises(AssertionError, match=r"has no slot 'v' for the Variable restored at \(root\)\.model\.w"):
        later.assert_consumed()


# --- 5. No warning for a restore that raised ------------------------------------------------------------------

def warnings_after(caplog, fn):
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        fn()
        gc.collect()
    return [r.getMessage() for r in caplog.records if r.name == "checkpoint"]


def test_a_restore_that_raised_logs_nothing_later(no_x64, tmp_path, caplog):
    w = varstate.Variable(jnp.ones(3))
    path = checkpoint.Checkpoint(model={"w": w}, step=np.int64(2**40), other=jnp.ones(1)).write(str(tmp_path / "c"))
    cases = [
        (ValueError, r"has shape \(3,\), the object has shape \(4,\)",
         {"model": {"w": varstate.Variable(jnp.zeros(4))}}),
        (TypeError, r"has dtype float32, the object has dtype int32",
         {"model": {"w": varstate.Variable(jnp.zeros(3, jnp.int32))}}),
        (ValueError, r"Root 'modle' matched no value", {"modle": {"w": w}, "other": jnp.zeros(1)}),
        (ValueError, r"out of range for variable '\(root\)\.step'", {"step": jnp.int32(0)}),
    ]
    for error, match, roots in cases:
        def restore(error=error, match=match, roots=roots):
            with pytest.raises(error, match=match):
                checkpoint.Checkpoint(**roots).restore(path)
        assert warnings_after(caplog, restore) == [], match


def test_a_deferred_restore_that_raised_leaves_the_earlier_status_warning(tmp_path, caplog):
    path = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.ones(3))}, step=jnp.int32(1)).write(
        str(tmp_path / "c"))

    def restore():
        status = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(3))}).restore(path)
        with pytest.raises(ValueError, match=r"Root 'stpe' matched no value"):
            status.restore(stpe=jnp.int32(0))

    # The caller held that status and left (root).step unrestored: its warning stands, without the refused root.
    assert warnings_after(caplog, restore) == [
        "Some values in the checkpoint were not restored: (root).step (under (root).step). Call expect_partial() "
        "on the status (CheckpointManager.restore: expect_partial=True) if this is intended."]


# --- 7. Long lists of roots are cut at 10 -------------------------------------------------------------------------

def test_the_warning_and_the_dead_root_message_list_at_most_10_roots(tmp_path, caplog):
    roots = {f"x{i:02d}": jnp.full(1, float(i)) for i in range(40)}
    path = checkpoint.Checkpoint(**roots).write(str(tmp_path / "c"))
    first10 = [f"x{i:02d}" for i in range(10)]

    def restore():
        checkpoint.Checkpoint(w=jnp.zeros(1)).restore(path)

    [message] = warnings_after(caplog, restore)
    under = ", ".join(f"(root).{r}" for r in first10)
    assert f"(under {under} and 30 more roots)." in message, message
    assert f"its roots are [{', '.join(repr(r) for r in first10)} and 30 more roots]." in message, message
