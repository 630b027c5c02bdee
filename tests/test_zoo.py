"""pegrad on models written the way other libraries write them (tests/zoo.py): every statistic
× implementation × batch size (1, 2, odd) equals the naive per-example loop at float64, and
at granularity="token" the rewrite equals the untied reference (tests/test_pegrad.py proves the
untied reference against per-position copies written by hand)."""

import jax
import pytest
from helpers import check_every_implementation, check_token_statistics, naive_unit_grads
from zoo import MODELS, Model


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
