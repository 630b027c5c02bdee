"""pegrad on models written the way other libraries write them (tests/zoo.py): every statistic
× implementation × batch size (1, 2, odd) equals the naive per-example loop at float64, and
at granularity="token" the rewrite equals the untied reference (tests/test_pegrad.py proves the
untied reference against per-position copies written by hand)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    check_every_implementation,
    check_token_statistics,
    naive_stats,
    naive_unit_grads,
)
from zoo import MODELS, Model

import pegrad


@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("model", MODELS, ids=str)
def test_every_statistic_equals_the_naive_loop(model: Model, batch_size: int):
    params, loss = model.build(jax.random.key(0))
    batch = model.batch(jax.random.key(batch_size), batch_size)
    expected = naive_unit_grads(loss, params, batch)
    check_every_implementation(loss, params, batch, expected, model.name)


@pytest.mark.parametrize("model", [m for m in MODELS if m.sequence], ids=str)
def test_per_token_statistics_equal_the_untied_reference(model: Model):
    params, loss = model.build(jax.random.key(0))
    check_token_statistics(loss, params, model.batch(jax.random.key(1), 2), model.name)


# Models whose norms take the Gram identity (sq_norms alone) or the formed gradients (beside the
# mean), with floating inputs a NaN can be put in.
GRAM = ["eqx_positionwise", "eqx_attention", "linen_block", "relative_position"]


@pytest.mark.parametrize("stats", [("sq_norms",), ("mean", "sq_norms")], ids="+".join)
@pytest.mark.parametrize("name", GRAM)
def test_a_nan_example_reaches_no_other_examples_norm(name: str, stats: tuple):
    """nonfinite="propagate": example 0 holds NaN inputs, so its norm is NaN; every other
    example's norm is still the naive loop's (XLA's scheduling ties may not couple examples)."""
    model = next(m for m in MODELS if m.name == name)
    params, loss = model.build(jax.random.key(0))
    x, y = model.batch(jax.random.key(3), 3)
    _, grads = naive_unit_grads(loss, params, (x, y))
    want = naive_stats(grads, 1.0)["sq_norms"]
    spoiled = (x.at[0].set(jnp.nan), y)
    fn = pegrad.value_and_grad_stats(loss, stats, impl="factorized")
    _, got = eqx.filter_jit(fn)(params, spoiled)
    norms = np.asarray(got["sq_norms"])
    assert np.isnan(norms[0]), name
    np.testing.assert_allclose(norms[1:], want[1:], rtol=1e-10, err_msg=name)
