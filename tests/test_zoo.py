"""pegrad on models written the way other libraries write them (tests/zoo.py): every statistic
× implementation × batch size (1, 2, odd) equals the naive per-example loop at float64, and
at granularity="token" the rewrite equals the untied reference (tests/test_pegrad.py proves the
untied reference against per-position copies written by hand). Every family bench.py measures
(families.py's registry) is one of them: the same code, at a tiny size in float64."""

import dataclasses

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
from zoo import FAMILIES, MODELS, Model

import bench
import families
import pegrad


@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("model", MODELS, ids=str)
def test_every_statistic_equals_the_naive_loop(model: Model, batch_size: int):
    params, loss = model.build(jax.random.key(0))
    batch = model.batch(jax.random.key(batch_size), batch_size)
    expected = naive_unit_grads(loss, params, batch)
    check_every_implementation(loss, params, batch, expected, model.name)


# What bench.py runs (vmap; the factorized rewrite's default plan) and every route a
# leaf proves (choose="first"); chunking is proven on the pieces and the zoo above.
BENCHED = [("vmap", None, "cheapest"), ("factorized", None, "first")]
BENCHED += [("factorized", None, "cheapest")]


@pytest.mark.parametrize("batch_size", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_every_benchmarked_family_equals_the_naive_loop(family: Model, batch_size: int):
    params, loss = family.build(jax.random.key(0))
    batch = family.batch(jax.random.key(batch_size), batch_size)
    expected = naive_unit_grads(loss, params, batch)
    check_every_implementation(loss, params, batch, expected, family.name, impls=BENCHED)


def test_bench_measures_the_registrys_families_and_no_other():
    """bench.py offers exactly the registry's families, each proven above (tests/zoo.py's
    FAMILIES), and builds each from the registry: the same parameters and batch, to the bit."""
    assert tuple(families.FAMILIES) == bench.FAMILIES
    assert set(bench.FAMILIES) <= {m.name for m in FAMILIES}  # and the scale fit's ResNet
    size = families.Size(width=8, seq=4, layers=2)  # bench.Config has no dtype: float32
    config = dataclasses.replace(
        bench.Config(),
        family_width=size.width,
        family_seq=size.seq,
        family_layers=size.layers,
        family_batch=3,
        seed=7,
    )
    workloads = bench.family_workloads(config)
    assert len(workloads) == len(families.FAMILIES)
    for make, family in zip(workloads, families.FAMILIES.values(), strict=True):
        workload = make()
        params, _ = family.build(size, jax.random.key(7))
        assert workload.model.startswith(family.describe(size) + " ("), family.name
        for got, want in [
            (workload.params, params),
            (workload.batch, family.batch(size, jax.random.key(7), 3)),
        ]:
            assert jax.tree.structure(got) == jax.tree.structure(want), family.name
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert a.dtype == b.dtype and np.array_equal(a, b), family.name


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
