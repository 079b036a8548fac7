"""Records TensorFlow's `tf.custom_gradient` and Keras dynamic loss scaling results.

Run by hand with tensorflow-cpu (TF + numpy only; no jax):

    /work/tfvenv/bin/python tests/data/make_tf_custom_gradient_fixtures.py

Writes tests/data/tf_custom_gradient.json: inputs, outputs and gradients of
several custom-gradient functions (each computed in eager mode AND under
tf.function, which must agree), the exception types TF raises for misuse,
and the (scale, good_steps, applied) trace of Keras's dynamic loss scale.
"""

import json
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.keras.mixed_precision import loss_scale_optimizer as keras_lso

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_custom_gradient.json")


def both_modes(fn, *args):
    """fn(*args) eagerly and under tf.function; asserts they agree; returns numpy."""
    eager = tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
    graph = tf.nest.map_structure(lambda t: t.numpy(), tf.function(fn)(*args))
    tf.nest.map_structure(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), eager, graph)
    return tf.nest.map_structure(lambda a: np.asarray(a, np.float64).tolist(), eager)


cases = {}

# 1. Numerically stable log(1 + exp(x)) (the TF documentation's example).
@tf.custom_gradient
def log1pexp(x):
    e = tf.exp(x)
    return tf.math.log(1 + e), lambda dy: dy * (1 - 1 / (1 + e))


x1 = tf.constant([-3.0, 0.0, 2.5, 10.0, 100.0])


def case_log1pexp(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = log1pexp(x)
        loss = tf.reduce_sum(tf.where(tf.math.is_finite(y), y, 0.0))
    return y, tape.gradient(loss, x)


y, g = both_modes(case_log1pexp, x1)
cases["log1pexp"] = {"x": x1.numpy().tolist(), "y": y, "dx": g}

# 2. Identity forward, gradient clipped by norm.
@tf.custom_gradient
def clip_by_norm_grad(x):
    return tf.identity(x), lambda dy: tf.clip_by_norm(dy, 0.5)


x2 = tf.constant([1.0, -2.0, 3.0, 0.5])


def case_clip(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(3.0 * clip_by_norm_grad(x))
    return tape.gradient(loss, x)


cases["clip_by_norm"] = {"x": x2.numpy().tolist(), "scale": 3.0, "clip_norm": 0.5, "dx": both_modes(case_clip, x2)}

# 3. Two arguments, two outputs; the rule for y is deliberately not the true gradient.
@tf.custom_gradient
def two_outputs(x, y):
    return (x * y, x + y), lambda d1, d2: (d1 * y + d2, d1 * x + 2.0 * d2)


x3, y3 = tf.constant([1.0, 2.0, -1.0]), tf.constant([0.5, -3.0, 4.0])


def case_two(x, y):
    with tf.GradientTape() as tape:
        tape.watch([x, y])
        a, b = two_outputs(x, y)
        loss = tf.reduce_sum(2.0 * a + 3.0 * b)
    return tape.gradient(loss, [x, y])


dx, dy = both_modes(case_two, x3, y3)
cases["two_outputs"] = {"x": x3.numpy().tolist(), "y": y3.numpy().tolist(), "dx": dx, "dy": dy}

# 4. A function reading two variables it does not take as arguments; the
#    custom rule for w deliberately differs from the true gradient (x**2).
w = tf.Variable([0.5, -1.5, 2.0], name="w")
b = tf.Variable(0.25, name="b")
x4 = tf.constant([1.0, 2.0, -3.0])


@tf.custom_gradient
def uses_variables(x):
    out = tf.reduce_sum(w * x**2) + b

    def grad_fn(dy, variables):
        rules = {"w": dy * 3.0 * x, "b": dy * 5.0}
        return dy * 2.0 * x * w, [rules[v.name.split(":")[0]] for v in variables]

    return out, grad_fn


def case_vars(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = 2.0 * uses_variables(x)
    return tape.gradient(loss, [x, w, b])


def case_vars_true(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = 2.0 * (tf.reduce_sum(w * x**2) + b)
    return tape.gradient(loss, [x, w, b])


custom, true = both_modes(case_vars, x4), both_modes(case_vars_true, x4)
assert not np.allclose(custom[1], true[1]), "the rule for w must differ from the true gradient"
cases["variables"] = {
    "x": x4.numpy().tolist(), "w": w.numpy().tolist(), "b": float(b.numpy()), "loss_scale": 2.0,
    "dx": custom[0], "dw": custom[1], "db": custom[2], "true_dw": true[1], "true_db": true[2],
}

# 5. Second derivative: grad_fn is itself differentiated (rule 3x^2 + x, so d2 = 6x + 1).
@tf.custom_gradient
def cube(x):
    return x**3, lambda dy: dy * (3.0 * x**2 + x)


x5 = tf.constant([0.5, 2.0, -1.0])


def case_second(x):
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(cube(x))
        g = inner.gradient(y, x)
    return g, outer.gradient(g, x)


g1, g2 = both_modes(case_second, x5)
cases["second_order"] = {"x": x5.numpy().tolist(), "d1": g1, "d2": g2}

# 6. None as an input gradient: zero (TF reports None; recorded with unconnected=ZERO).
@tf.custom_gradient
def half_none(x, y):
    return x * y, lambda dy: (None, dy * x)


x6, y6 = tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])


def case_none(x, y):
    with tf.GradientTape() as tape:
        tape.watch([x, y])
        loss = tf.reduce_sum(half_none(x, y))
    return tape.gradient(loss, [x, y], unconnected_gradients=tf.UnconnectedGradients.ZERO)


dx, dy = both_modes(case_none, x6, y6)
cases["none_gradient"] = {"x": x6.numpy().tolist(), "y": y6.numpy().tolist(), "dx": dx, "dy": dy}

# --- misuse: the exception types TF raises -------------------------------------
errors = {}
v = tf.Variable(2.0, name="v")


def expect(name, fn):
    for mode, run in (("eager", fn), ("graph", tf.function(fn))):
        try:
            run()
        except Exception as e:  # recording whatever TF raises
            last_line = [ln for ln in str(e).splitlines() if ln.strip()][-1].strip()
            errors[f"{name}/{mode}"] = {"type": type(e).__name__, "message": last_line[:300]}
        else:
            errors[f"{name}/{mode}"] = None


@tf.custom_gradient
def no_variables_kw(x):
    return x * v, lambda dy: dy * v


@tf.custom_gradient
def too_many_variable_grads(x):
    return x * v, lambda dy, variables: (dy * v, [dy * x, dy])


@tf.custom_gradient
def too_many_input_grads(x):
    return 2.0 * x, lambda dy: (dy, dy)


@tf.custom_gradient
def takes_kwargs(x, scale=1.0):
    return x * scale, lambda dy: dy * scale


def grad_of(f, **kw):
    def run():
        x = tf.constant(3.0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x, **kw)
        return tape.gradient(y, x)
    return run


expect("missing_variables_keyword", grad_of(no_variables_kw))
expect("wrong_number_of_variable_grads", grad_of(too_many_variable_grads))
expect("wrong_number_of_input_grads", grad_of(too_many_input_grads))
expect("keyword_arguments", grad_of(takes_kwargs, scale=tf.constant(2.0)))

# --- Keras dynamic loss scaling (TF2 Keras `_DynamicLossScaleState`) -----------
BAD = {"finite": 2.0, "inf": np.inf, "nan": np.nan}


def loss_scale_trace(initial, growth_steps, kinds):
    state = keras_lso._DynamicLossScaleState(initial, growth_steps, multiplier=2)
    trace = []
    for kind in kinds:
        g = tf.constant([1.0, BAD[kind]])
        _, applied = state.update([g])
        trace.append([float(state.current_loss_scale.numpy()), int(state.counter.numpy()), bool(applied)])
    return trace


basic = ["finite"] * 4 + ["inf", "nan"] + ["finite"] * 4
loss_scale = {
    "names": [state_var.name.split(":")[0] for state_var in
              (keras_lso._DynamicLossScaleState(8.0, 3, 2).current_loss_scale,
               keras_lso._DynamicLossScaleState(8.0, 3, 2).counter)],
    "defaults": {"initial_scale": keras_lso._DEFAULT_INITIAL_SCALE, "growth_steps": keras_lso._DEFAULT_GROWTH_STEPS},
    "basic": {"initial": 8.0, "growth_steps": 3, "grads": basic, "trace": loss_scale_trace(8.0, 3, basic)},
    "floor_at_one": {"initial": 2.0, "growth_steps": 5, "grads": ["inf", "nan", "inf"],
                     "trace": loss_scale_trace(2.0, 5, ["inf", "nan", "inf"])},
    "no_growth_to_inf": {"initial": 2.0**127, "growth_steps": 1, "grads": ["finite", "finite"],
                         "trace": loss_scale_trace(2.0**127, 1, ["finite", "finite"])},
}

with open(OUT, "w") as fh:
    json.dump({"tensorflow": tf.__version__, "cases": cases, "errors": errors, "loss_scale": loss_scale},
              fh, indent=1, sort_keys=True)
print("wrote", OUT)
print(json.dumps(errors, indent=1))
