"""Messages for the usual mistakes: Keras's argument spellings, optax objects where varstate ones belong."""

import dataclasses

import jax.numpy as jnp
import optax
import pytest

from varstate.optimizers import Adam, GradientDescent, LossScaleOptimizer, Momentum, RMSProp, from_optax
from varstate.optimizers._core._messages import checked_new, unexpected_keyword


@pytest.mark.parametrize(("cls", "keyword", "meant"), [
    (Adam, "beta_1", "beta1"),  # Keras's spelling
    (Adam, "beta_2", "beta2"),
    (Adam, "epsilom", "epsilon"),  # a typo
    (Adam, "lr", "learning_rate"),  # Keras 2's alias
    (Momentum, "nesterov", "use_nesterov"),  # Keras's SGD
    (RMSProp, "rho", "decay"),  # Keras's RMSprop
])
def test_unexpected_keyword_names_the_closest_field(cls, keyword, meant):
    fields = ", ".join(f.name for f in dataclasses.fields(cls))
    err = unexpected_keyword(cls, keyword)
    assert isinstance(err, TypeError)
    assert str(err) == (f"{cls.__name__}() got an unexpected keyword argument {keyword!r}: did you mean {meant}? "
                        f"{cls.__name__}'s arguments are {fields}.")


def test_unexpected_keyword_with_ties_and_without_a_close_name():
    assert "did you mean beta1 or beta2?" in str(unexpected_keyword(Adam, "beta"))
    assert str(unexpected_keyword(Adam, "amsgrad")) == (
        "Adam() got an unexpected keyword argument 'amsgrad'. "
        "Adam's arguments are learning_rate, beta1, beta2, epsilon, lazy.")


@dataclasses.dataclass(frozen=True)
class _HookedAdam(Adam):
    # What Optimizer.__new__ = checked_new does for every optimizer, installed on a test subclass.
    __new__ = checked_new


def test_the_hook_raises_before_the_dataclass_init():
    with pytest.raises(TypeError, match=r"^_HookedAdam\(\) got an unexpected keyword argument 'beta_1': did you "
                                        r"mean beta1\? _HookedAdam's arguments are learning_rate, beta1,"):
        _HookedAdam(1e-3, beta_1=0.9)
    # Valid keywords and positional arguments construct as before, and the configs stay equal and hashable.
    opt = _HookedAdam(1e-3, beta1=0.8)
    assert (opt.learning_rate, opt.beta1) == (1e-3, 0.8) and opt == _HookedAdam(1e-3, beta1=0.8)
    assert hash(opt) == hash(_HookedAdam(1e-3, beta1=0.8))
    assert dataclasses.replace(opt, beta2=0.9).beta2 == 0.9
    # A step still works on the hooked class.
    p = [jnp.ones(2)]
    new, _ = opt.update([jnp.ones(2)], p, opt.init(p))
    assert new[0].shape == (2,)


def test_without_the_hook_the_dataclass_message_is_bare():
    # Why the hook: the generated __init__ names neither the class nor the right spelling.
    with pytest.raises(TypeError, match=r"__init__\(\) got an unexpected keyword argument 'beta_1'$"):
        dataclasses.make_dataclass("Plain", [("beta1", float)], frozen=True)(beta_1=0.9)


def test_loss_scale_optimizer_of_an_optax_transformation_says_from_optax():
    with pytest.raises(TypeError, match=r"LossScaleOptimizer: inner_optimizer is an optax transformation "
                                        r"\(GradientTransformationExtraArgs\), not a varstate Optimizer: wrap it "
                                        r"with from_optax first, e\.g\. LossScaleOptimizer\(varstate\.optimizers\."
                                        r"from_optax\(optax\.adam\(1e-3\)\)\)"):
        LossScaleOptimizer(optax.adam(1e-3))
    # The fix the message gives works.
    assert LossScaleOptimizer(from_optax(optax.adam(1e-3))).inner_optimizer.tx is not None


def test_from_optax_of_a_factory_says_call_it():
    with pytest.raises(TypeError, match=r"from_optax: got optax\.adam, a function that makes a transformation, "
                                        r"not a transformation: call it with its hyperparameters, e\.g\. "
                                        r"from_optax\(optax\.adam\(1e-3\)\)"):
        from_optax(optax.adam)

    def my_factory():
        return optax.sgd(0.1)

    with pytest.raises(TypeError, match=r"from_optax: got my_factory, a function .* "
                                        r"from_optax\(my_factory\(1e-3\)\)"):
        from_optax(my_factory)
    with pytest.raises(TypeError, match=r"from_optax: got GradientDescent, a varstate Optimizer already: use it as "
                                        r"it is \(from_optax hosts optax transformations; to_optax goes the other"):
        from_optax(GradientDescent(0.1))
    with pytest.raises(TypeError, match=r"from_optax: expected an optax GradientTransformation \(with init and "
                                        r"update\), got int"):
        from_optax(3)


def test_from_optax_init_refuses_stepped_and_says_why():
    with pytest.raises(TypeError, match=r"^from_optax\(\.\.\.\)\.init: stepped= leaves the slots of unstepped params "
                                        r"out, as TF does; an optax transformation's init makes its state for every "
                                        r"param\. Call init\(params\) without stepped=\.$"):
        from_optax(optax.sgd(0.1)).init([jnp.zeros(2)], stepped=[False])
