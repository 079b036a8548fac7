"""custom_gradient end to end: TF-style rules, including one for variables the function reads.

Run: python examples/custom_gradient.py
"""

import jax
import jax.numpy as jnp

import varstate


@varstate.custom_gradient
def log1pexp(x):
    """log(1 + e^x) with a gradient that stays finite for large x (TF's documentation example)."""
    e = jnp.exp(x)
    return jnp.log1p(e), lambda dy: dy * (1 - 1 / (1 + e))


def loss(params, x, y):
    """A dense layer whose kernel gradient is clipped elementwise by a custom rule."""
    kernel, bias = params["kernel"], params["bias"]

    @varstate.custom_gradient
    def dense(x):
        out = x @ kernel.value + bias.value  # reads two variables that are not arguments

        def grad_fn(dy, variables):
            rules = {"kernel": jnp.clip(x.T @ dy, -0.1, 0.1), "bias": dy.sum(0)}
            return dy @ kernel.value.T, [rules[v.name] for v in variables]

        return out, grad_fn

    return jnp.mean((log1pexp(dense(x)) - y) ** 2)


def main():
    print("d/dx log1pexp at x=100:", jax.grad(lambda x: log1pexp(x))(100.0).item())
    reg = varstate.Registry()
    params = {
        "kernel": varstate.Variable(jax.random.normal(jax.random.key(0), (4, 2)), name="kernel", registry=reg),
        "bias": varstate.Variable(jnp.zeros(2), name="bias", registry=reg),
    }
    x = jax.random.normal(jax.random.key(1), (32, 4))
    y = jnp.ones((32, 2))
    opt = varstate.optimizers.GradientDescent(0.5)
    state = opt.init(params)
    step = jax.jit(jax.value_and_grad(loss))
    for i in range(5):
        value, grads = step(params, x, y)
        print(f"step {i}: loss {value.item():.4f}, max |kernel grad| {jnp.abs(grads['kernel'].value).max().item():.2f}")
        params, state = opt.apply_gradients(grads, params, state)


if __name__ == "__main__":
    main()
