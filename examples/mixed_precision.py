"""Mixed precision end to end: one MLP trained in float32, mixed_bfloat16, and mixed_float16 with loss scaling.

Variables stay float32 (AutoCastVariable), the forward pass runs in the
policy's compute dtype, and in float16 a LossScaleOptimizer keeps small
gradients from flushing to zero.

Run: python examples/mixed_precision.py
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import varstate
from varstate import mixed_precision
from varstate.optimizers import Adam


def make_params(sizes=(16, 64, 64, 1)):
    key, params = jax.random.key(0), []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        key, k = jax.random.split(key)
        params.append({"kernel": varstate.Variable(jax.random.normal(k, (a, b)) / np.sqrt(a), name=f"dense{i}/kernel"),
                       "bias": varstate.Variable(jnp.zeros(b), name=f"dense{i}/bias")})
    return params


def train(policy_name, steps=150):
    policy = mixed_precision.Policy(policy_name)
    params = make_params()
    if policy.compute_dtype != policy.variable_dtype:
        params = mixed_precision.autocast_variables(params)
    opt = Adam(3e-3)
    if policy.compute_dtype == "float16":
        opt = mixed_precision.LossScaleOptimizer(opt)
    state = opt.init(params)
    x = jax.random.normal(jax.random.key(1), (256, 16))
    y = jnp.sin(2.0 * x[:, :1]) * jnp.cos(x[:, 1:2])

    def loss_fn(params):
        with varstate.autocast(policy.compute_dtype):
            h = x.astype(policy.compute_dtype)
            for i, layer in enumerate(params):
                h = h @ layer["kernel"].value + layer["bias"].value
                h = jnp.tanh(h) if i < len(params) - 1 else h
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(params, state):
        if isinstance(opt, mixed_precision.LossScaleOptimizer):
            loss, grads = jax.value_and_grad(lambda p: opt.get_scaled_loss(loss_fn(p), state))(params)
            loss, grads = loss / opt.loss_scale(state), opt.get_unscaled_gradients(grads, state)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params)
        params, state = opt.update(grads, params, state)
        return params, state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return losses, params, state


def main():
    runs = {}
    for name in ("float32", "mixed_bfloat16", "mixed_float16"):
        losses, _, state = runs[name] = train(name)
        scale = state.non_slots.get("current_loss_scale")
        extra = f", loss scale {scale.value.item():g}" if scale is not None else ""
        print(f"{name:>15}: loss {losses[0]:.4f} -> {losses[-1]:.2e}{extra}")
    return runs


if __name__ == "__main__":
    main()
