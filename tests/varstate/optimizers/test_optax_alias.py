"""optax's own generic optimizer tests (`AliasTest` of ``optax/_src/alias_test.py``) on varstate through `to_optax`.

The test bodies are optax's, run as they ship: each case calls an `AliasTest`
method's undecorated function with a row of optax's table
(``_OPTIMIZERS_UNDER_TEST``: name and keyword arguments) and the method's
other parameters, while ``alias_test._get_opt``, the one place the bodies
look an optimizer up by name, returns our factory: ``make(**kwargs).to_optax()``
with the signature optax's ``inject_hyperparams`` reads.

Cases: 16 of our optimizer classes (`OURS`) implement 24 rows of optax's
table. Every row over every grid point of every method (``OPTAX_ALIAS_ALL=1``)
takes about two and a half minutes on 2 cores, so the suite runs each method
once per class (16 cases a method; 15 for inject_hyperparams, where Keras's
SGD has no applicable row), taking the rows and the dtypes or targets in turn,
so that across the methods every row and dtype comes up: about 12 s with the
suite's compilation cache warm, 40 s cold. `NOT_APPLICABLE` says which cases
are left out, and why.
"""

import functools
import importlib.util
import itertools
import os
import sys
import types

import jax.numpy as jnp
import pytest

from varstate.optimizers import Adadelta, Adagrad, Adam, Momentum, RMSProp, keras

if importlib.util.find_spec("sklearn") is None:
    # alias_test imports sklearn at module level for its LBFGS and other tests; AliasTest uses none of it.
    for _name in ("sklearn", "sklearn.datasets", "sklearn.linear_model"):
        sys.modules[_name] = types.ModuleType(_name)
    sys.modules["sklearn"].datasets = sys.modules["sklearn.datasets"]  # type: ignore[attr-defined]
    sys.modules["sklearn"].linear_model = sys.modules["sklearn.linear_model"]  # type: ignore[attr-defined]

from optax._src import alias_test


def _given(**kwargs):
    """The keyword arguments that are not None: None stands for our optimizer's default, as in optax's signatures."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _adadelta(cls):
    # Adadelta's first steps are sqrt(epsilon) times the learning rate: with TF's and Keras's epsilon (1e-8, 1e-7)
    # it is still far from optax's target after 10,000 steps. optax's rho and epsilon make the same rule as
    # optax.adadelta's.
    return lambda learning_rate=None: cls(**_given(learning_rate=learning_rate), rho=0.9, epsilon=1e-6)


def _keras_adafactor(learning_rate=None, min_dim_size_to_factor=1):
    # optax's test names min_dim_size_to_factor as a static argument. Keras factors every variable of rank 2 or
    # more: optax's rule with min_dim_size_to_factor=1.
    if min_dim_size_to_factor != 1:
        raise ValueError(f"Keras's Adafactor factors every matrix (min_dim_size_to_factor=1), got "
                         f"{min_dim_size_to_factor}")
    return keras.Adafactor(**_given(learning_rate=learning_rate))


# Our optimizer -> {optax's name: a function of the keyword arguments optax's table gives under that name
# (learning_rate, momentum, weight_decay; None: our default)}. optax's decoupled-weight-decay variants (adamw,
# adamaxw, nadamw) are Keras's weight_decay with optax's default decay, 1e-4.
OURS = {
    "Adadelta": {"adadelta": _adadelta(Adadelta)},
    "Adagrad": {"adagrad": lambda learning_rate: Adagrad(learning_rate)},
    "Adam": {"adam": lambda learning_rate: Adam(learning_rate)},
    "Momentum": {"sgd": lambda learning_rate, momentum: Momentum(learning_rate, momentum)},
    "RMSProp": {"rmsprop": lambda learning_rate, momentum=None: RMSProp(learning_rate, **_given(momentum=momentum))},
    "keras.Adadelta": {"adadelta": _adadelta(keras.Adadelta)},
    "keras.Adafactor": {"adafactor": _keras_adafactor},
    "keras.Adagrad": {"adagrad": lambda learning_rate: keras.Adagrad(learning_rate)},
    "keras.Adam": {
        "adam": lambda learning_rate: keras.Adam(learning_rate),
        "amsgrad": lambda learning_rate: keras.Adam(learning_rate, amsgrad=True),
    },
    "keras.AdamW": {"adamw": lambda learning_rate: keras.AdamW(learning_rate, weight_decay=1e-4)},
    "keras.Adamax": {
        "adamax": lambda learning_rate: keras.Adamax(learning_rate),
        "adamaxw": lambda learning_rate: keras.Adamax(learning_rate, weight_decay=1e-4),
    },
    "keras.Lamb": {"lamb": lambda learning_rate: keras.Lamb(learning_rate)},
    "keras.Lion": {"lion": lambda learning_rate, weight_decay: keras.Lion(learning_rate, weight_decay=weight_decay)},
    "keras.Nadam": {
        "nadam": lambda learning_rate: keras.Nadam(learning_rate),
        "nadamw": lambda learning_rate: keras.Nadam(learning_rate, weight_decay=1e-4),
    },
    "keras.RMSprop": {
        "rmsprop": lambda learning_rate, momentum=None: keras.RMSprop(learning_rate, **_given(momentum=momentum)),
    },
    "keras.SGD": {"sgd": lambda learning_rate, momentum: keras.SGD(learning_rate, momentum=momentum)},
}

# optax's complex-aware rules square a gradient's magnitude (optax's abs_sq); TF's and Keras's square the
# gradient itself (g * g). These use g linearly or through its magnitude only, as optax does:
COMPLEX_AWARE = {"Momentum", "keras.SGD", "keras.Adamax"}
# optax skips these itself on complex params ("does not support complex parameters").
OPTAX_REAL_ONLY = {"adadelta", "lion"}

NOT_APPLICABLE = {
    "test_explicit_dtype": "TF's and Keras's slots take the param's dtype (no accumulator dtype option) and TF's "
                           "names (m, momentum), where the test sets mu_dtype= and reads optax's mu or trace",
    "complex descent": "TF's and Keras's rules square the gradient (g * g) where optax's complex-aware ones take "
                       "|g|^2: no rule for complex params (23 of these 28 cases miss optax's target)",
    "optax skips": "optax skips the case for its own optimizer of that name (complex params; or no learning "
                   "rate given to adadelta or adafactor, which then needs one)",
    "Keras Nadam bfloat16": "Keras rounds beta_2=0.999 to 1.0 in bfloat16 and divides by 1 - beta_2**t = 0: the "
                            "update is NaN, as keras.optimizers.Nadam's with TF (MultiSteps' 0 * NaN is NaN)",
    "Keras momentum traced": "Keras's SGD and RMSprop keep a momentum slot only when momentum != 0, a decision "
                             "on the value: momentum stays a Python float (inject_hyperparams traces it)",
}

def _factory(make):
    """A factory with `make`'s signature (inject_hyperparams reads it) that returns ``make(...).to_optax()``."""

    @functools.wraps(make)
    def factory(*args, **kwargs):
        return make(*args, **kwargs).to_optax()

    return factory


_TARGETS = (alias_test._setup_parabola, alias_test._setup_rosenbrock)
_FLOATS = ("bfloat16", "float32")
GRIDS = {  # each AliasTest method's parameters besides the table row, as its decorator lists them
    "test_optimization": [{"target": t, "dtype": d} for t in _TARGETS for d in (jnp.float32, jnp.complex64)],
    "test_optimizers_accept_extra_args": [{}],
    "test_optimizers_can_be_wrapped_in_inject_hyperparams": [{}],
    "test_preserve_dtype": [{"dtype": d} for d in _FLOATS],
    "test_state_shape_dtype_shard_stability": [
        {"dtype": d} for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.complex64, jnp.complex128)],
    "test_gradient_accumulation": [{"dtype": d} for d in _FLOATS],
}


def _not_applicable(method, ours, opt_name, opt_kwargs, extra):
    complex_params = jnp.issubdtype(extra.get("dtype", jnp.float32), jnp.complexfloating)
    if complex_params and opt_name in OPTAX_REAL_ONLY and method in (
            "test_optimization", "test_state_shape_dtype_shard_stability"):
        return "optax skips"
    if method == "test_optimization" and opt_name in ("adadelta", "adafactor") and "learning_rate" not in opt_kwargs:
        return "optax skips"
    if method == "test_optimization" and complex_params and ours not in COMPLEX_AWARE:
        return "complex descent"
    if method == "test_gradient_accumulation" and ours == "keras.Nadam" and extra["dtype"] == "bfloat16":
        return "Keras Nadam bfloat16"
    if method == "test_optimizers_can_be_wrapped_in_inject_hyperparams" and ours in (
            "keras.SGD", "keras.RMSprop") and "momentum" in opt_kwargs:
        return "Keras momentum traced"
    return None


def _candidates(method, ours):
    rows = [r for r in alias_test._OPTIMIZERS_UNDER_TEST if r["opt_name"] in OURS[ours]]
    return [(r["opt_name"], r["opt_kwargs"], extra) for r, extra in itertools.product(rows, GRIDS[method])
            if _not_applicable(method, ours, r["opt_name"], r["opt_kwargs"], extra) is None]


def _cases(method):
    """Every candidate with OPTAX_ALIAS_ALL=1; else one per optimizer, taken in turn (see the module docstring)."""
    turn = list(GRIDS).index(method)
    out = []
    for i, ours in enumerate(OURS):
        candidates = _candidates(method, ours)
        if candidates and not os.environ.get("OPTAX_ALIAS_ALL"):  # none: every case is not applicable
            candidates = [candidates[(i + turn) % len(candidates)]]
        for opt_name, opt_kwargs, extra in candidates:
            row = ",".join(f"{k}={v}" for k, v in opt_kwargs.items())
            grid = ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in extra.items())
            out.append(pytest.param(ours, opt_name, opt_kwargs, extra,
                                    id=f"{ours}-{opt_name}({row})" + (f"-{grid}" if grid else "")))
    return out


def _run(monkeypatch, method, ours, opt_name, opt_kwargs, extra):
    factory = _factory(OURS[ours][opt_name])
    monkeypatch.setattr(alias_test, "_get_opt", lambda self, name: factory)
    body = next(f.__wrapped__ for f in vars(alias_test.AliasTest).values()  # absl's generated methods wrap it
                if getattr(f, "__wrapped__", None) is not None and f.__wrapped__.__name__ == method)
    instance = alias_test.AliasTest(next(n for n in vars(alias_test.AliasTest) if n.startswith("test_")))
    body(instance, opt_name=opt_name, opt_kwargs=opt_kwargs, **extra)


_ARGS = ("ours", "opt_name", "opt_kwargs", "extra")


@pytest.mark.parametrize(_ARGS, _cases("test_optimization"))
def test_optimization(monkeypatch, ours, opt_name, opt_kwargs, extra):
    _run(monkeypatch, "test_optimization", ours, opt_name, opt_kwargs, extra)


@pytest.mark.parametrize(_ARGS, _cases("test_optimizers_accept_extra_args"))
def test_optimizers_accept_extra_args(monkeypatch, ours, opt_name, opt_kwargs, extra):
    _run(monkeypatch, "test_optimizers_accept_extra_args", ours, opt_name, opt_kwargs, extra)


@pytest.mark.parametrize(_ARGS, _cases("test_optimizers_can_be_wrapped_in_inject_hyperparams"))
def test_optimizers_can_be_wrapped_in_inject_hyperparams(monkeypatch, ours, opt_name, opt_kwargs, extra):
    _run(monkeypatch, "test_optimizers_can_be_wrapped_in_inject_hyperparams", ours, opt_name, opt_kwargs, extra)


@pytest.mark.parametrize(_ARGS, _cases("test_preserve_dtype"))
def test_preserve_dtype(monkeypatch, ours, opt_name, opt_kwargs, extra):
    _run(monkeypatch, "test_preserve_dtype", ours, opt_name, opt_kwargs, extra)


@pytest.mark.parametrize(_ARGS, _cases("test_state_shape_dtype_shard_stability"))
def test_state_shape_dtype_shard_stability(monkeypatch, ours, opt_name, opt_kwargs, extra):
    _run(monkeypatch, "test_state_shape_dtype_shard_stability", ours, opt_name, opt_kwargs, extra)


@pytest.mark.parametrize(_ARGS, _cases("test_gradient_accumulation"))
def test_gradient_accumulation(monkeypatch, ours, opt_name, opt_kwargs, extra):
    _run(monkeypatch, "test_gradient_accumulation", ours, opt_name, opt_kwargs, extra)


def test_every_aliastest_method_is_run_or_named_not_applicable():
    # A method optax adds to AliasTest fails here until it joins GRIDS or NOT_APPLICABLE.
    methods = {f.__wrapped__.__name__ for f in vars(alias_test.AliasTest).values()
               if getattr(f, "__wrapped__", None) is not None}
    assert methods == set(GRIDS) | {"test_explicit_dtype"}
