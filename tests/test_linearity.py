"""The transposition of a gradient tail (the fallback's sum over examples moved inside its
operations) is taken only where the tail is proven LINEAR in its cotangent: per primitive and
per parameter. Each backward below is affine or constant in its cotangent, written the way a
user's `jax.custom_vjp` can write it; each must take the exact per-example path, say why in
`explain`, and equal the naive per-example loop at float64. Linear backwards stay transposed.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from helpers import check_every_implementation, naive_unit_grads

import pegrad

_ROWS = jax.lax.GatherDimensionNumbers(
    offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,)
)


def _gather_rows(ct: jax.Array, fill: float) -> jax.Array:
    """ct[[0, 1, ..., n-2, n+3]]: the last index is out of bounds and gets `fill`."""
    n = ct.shape[0]
    idx = jnp.concatenate([jnp.arange(n - 1), jnp.array([n + 3])])[:, None]
    return jax.lax.gather(ct, idx, _ROWS, (1,), mode="fill", fill_value=fill)


# name -> (backward of the identity as a function of (forward input z, cotangent ct), why)
AFFINE: dict[str, tuple[Callable, str]] = {
    "ignores-cotangent": (lambda z, ct: jnp.full_like(ct, 0.3), "does not depend on the cot"),
    "gather-fill-0.25": (lambda z, ct: _gather_rows(ct, 0.25), "fills out-of-bounds"),
    "adds-a-constant": (lambda z, ct: ct + 0.3, "'add' is not linear"),
    "pads-with-0.3": (
        lambda z, ct: jax.lax.pad(ct[1:], jnp.asarray(0.3, ct.dtype), [(1, 0, 0)]),
        "'pad' is not linear",
    ),
    "select-constant-branch": (
        lambda z, ct: jnp.where(z > 0, ct, 0.3),
        "'select_n' is not linear",
    ),
    "update-nonzero-operand": (
        lambda z, ct: jax.lax.dynamic_update_slice(jnp.full_like(ct, 0.3), ct[:2], (0,)),
        "'dynamic_update_slice' is not linear",
    ),
    "residual-not-cotangent": (lambda z, ct: 2.0 * z, "does not depend on the cot"),
}
LINEAR: dict[str, Callable] = {
    "scales": lambda z, ct: 2.0 * ct,
    "gather-fill-0": lambda z, ct: _gather_rows(ct, 0.0),
    "pads-with-0": lambda z, ct: jax.lax.pad(ct[1:], jnp.asarray(0.0, ct.dtype), [(1, 0, 0)]),
    "select-zero-branch": lambda z, ct: jnp.where(z > 0, ct, 0.0),
    "times-residual": lambda z, ct: z * ct,
}


def _identity_with_backward(backward: Callable) -> Callable:
    @jax.custom_vjp
    def f(z):
        return z

    f.defvjp(lambda z: (z, z), lambda z, ct: (backward(z, ct),))
    return f


def _model(backward: Callable) -> tuple[Callable, dict, jax.Array]:
    """A weight used elementwise, through the custom backward: its gradient tail is the
    backward followed by a product with the example."""
    f = _identity_with_backward(backward)

    def loss(params, x):
        return jnp.sum(jnp.sin(f(params["w"] * x)))

    params = {"w": jax.random.normal(jax.random.key(0), (4,))}
    batch = jax.random.normal(jax.random.key(1), (3, 4))
    return loss, params, batch


def _fallback_reason(loss: Callable, params: dict, batch: jax.Array, stats: tuple) -> str:
    clip = 0.5 if "clipped_mean" in stats else None
    (plan,) = pegrad.explain(loss, params, batch, stats, clip_norm=clip, choose="first")
    assert plan.route == "fallback", plan
    return plan.reason


@pytest.mark.parametrize("name", list(AFFINE))
def test_a_backward_affine_in_its_cotangent_is_not_transposed(name: str):
    backward, why = AFFINE[name]
    loss, params, batch = _model(backward)
    for stats in [("mean",), ("mean", "clipped_mean")]:
        reason = _fallback_reason(loss, params, batch, stats)
        assert "transposed" not in reason and why in reason, reason
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), name)


@pytest.mark.parametrize("name", list(LINEAR))
def test_a_backward_linear_in_its_cotangent_is_transposed(name: str):
    loss, params, batch = _model(LINEAR[name])
    assert "transposed" in _fallback_reason(loss, params, batch, ("mean",))
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), name)


def test_a_gather_filling_with_nan_is_not_linear():
    """fill_value=None means NaN for floats: not a zero fill, whatever else is proven."""
    eqn = jax.make_jaxpr(lambda x: x.at[jnp.array([0, 5])].get(mode="fill"))(jnp.ones(3))
    (gather,) = [e for e in eqn.jaxpr.eqns if e.primitive.name == "gather"]
    assert "nan" in pegrad._gather_affine(gather)
