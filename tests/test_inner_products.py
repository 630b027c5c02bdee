"""The per-example inner products "dot" (⟨g_i, v⟩) and "gram" (⟨g_i, g_j⟩), SPEC §2.

Their values equal the naive loop's on every model of tests/zoo.py (tests/test_zoo.py, through
helpers.check_every_implementation, which asks for every statistic) and under masks, dropped
examples and has_aux (tests/test_api.py); their invariants (symmetry, the diagonal is sq_norms,
dot's mean is ⟨ḡ, v⟩) are a property test in tests/test_pegrad.py. Here: what is refused, and
that the identities are the routes taken (no per-unit gradient formed for a dense weight)."""

import re
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, naive_stats, naive_unit_grads, probe_like
from pieces import PIECES

import pegrad


def _mlp():
    piece = next(p for p in PIECES if p.name == "mlp3")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 4)
    return params, batch, lambda p, ex: piece.loss(p, ex, False)


def test_dot_without_dot_with_is_refused_with_the_fix():
    params, batch, loss = _mlp()
    with pytest.raises(ValueError, match=r"'dot' needs dot_with=v.*fn\(params, batch, dot_with"):
        pegrad.value_and_grad_stats(loss, ("mean", "dot"))(params, batch)


def test_dot_with_without_dot_is_refused():
    params, batch, loss = _mlp()
    with pytest.raises(ValueError, match="dot_with was given but 'dot' is not among"):
        pegrad.value_and_grad_stats(loss, "gram")(params, batch, dot_with=params)


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_a_dot_with_of_another_shape_or_structure_names_it(impl: pegrad.Impl):
    params, batch, loss = _mlp()
    fn = pegrad.value_and_grad_stats(loss, "dot", impl=impl)
    leaf, path = jax.tree_util.tree_leaves_with_path(params)[0][::-1]
    wrong = jax.tree.map(lambda x: x if x is not leaf else jnp.zeros((*x.shape, 2)), params)
    name = re.escape(f"dot_with{jax.tree_util.keystr(path)}")
    with pytest.raises(ValueError, match=f"{name} must be a floating array of the parameter's"):
        fn(params, batch, dot_with=wrong)
    with pytest.raises(ValueError, match="dot_with must have the parameters' structure"):
        fn(params, batch, dot_with=jax.tree.leaves(params))
    ints = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.int32), params)
    with pytest.raises(ValueError, match="must be a floating array"):
        fn(params, batch, dot_with=ints)


@pytest.mark.parametrize("stat", ["dot", "gram"])
def test_the_accumulator_refuses_the_inner_products(stat: str):
    params, _, _ = _mlp()
    with pytest.raises(ValueError, match=f"'{stat}' has one entry per unit"):
        pegrad.Accumulator.init(params, ("mean", stat))


def test_a_dense_weight_gives_gram_and_dot_by_its_identities():
    """The MLP's weights take outer-product with gram and dot factorized: (XXᵀ)∘(ΔΔᵀ) and
    δ_iᵀVx_i; no leaf forms per-unit gradients, and the values equal the naive loop's."""
    params, batch, loss = _mlp()
    plans = pegrad.explain(loss, params, batch, ("gram", "dot"))
    assert all(p.methods == {"gram": "factorized", "dot": "factorized"} for p in plans), plans
    assert not any(p.formed for p in plans), plans
    _, grads = naive_unit_grads(loss, params, batch)
    want = naive_stats(grads, 1.0)
    for impl in ("vmap", "factorized"):
        fn = pegrad.value_and_grad_stats(loss, ("gram", "dot"), impl=cast(pegrad.Impl, impl))
        _, got = jax.jit(fn)(params, batch, dot_with=probe_like(params))
        for stat in ("gram", "dot"):
            assert_tree_close(got[stat], want[stat], f"{impl}/{stat}")


def test_gram_of_a_contraction_is_formed_in_blocks_of_two_chunks():
    """A weight at every position (a contraction) has no factorized Gram: its per-example
    gradients are formed in the head, the whole batch at once where they hold no more than the
    step's batched values, else two chunks at a time (`_pairs`), equal to the loop for any
    chunk size."""
    piece = next(p for p in PIECES if p.name == "dense_over_sequence")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 5)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    _, grads = naive_unit_grads(loss, params, batch)
    want = naive_stats(grads, 1.0)["gram"]
    for chunk, formed in ((1, 1), (2, 2), (None, 5)):
        plans = pegrad.explain(loss, params, batch, "gram", chunk_size=chunk, choose="first")
        (weight,) = [p for p in plans if p.route == "contraction"]
        assert weight.methods == {"gram": "factorized"}, plans
        assert [c for where, c, _ in weight.formed if where == "head"] == [formed], plans
        fn = pegrad.value_and_grad_stats(loss, "gram", chunk_size=chunk, choose="first")
        np.testing.assert_allclose(jax.jit(fn)(params, batch)[1]["gram"], want, rtol=1e-10)


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_dot_alone_on_a_contraction_is_one_contraction_per_example(impl: pegrad.Impl, n: int):
    """A weight at every position asked for ⟨g_i, v⟩ alone forms no per-example gradient:
    Σ_k a_kᵀ V b_k, one contraction of the head's operands with V = postᵀ v
    (`Contraction.compute`); equal to the naive loop's for any batch size."""
    piece = next(p for p in PIECES if p.name == "dense_over_sequence")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), n)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    (weight,) = [p for p in pegrad.explain(loss, params, batch, "dot") if p.route == "contraction"]
    assert weight.methods == {"dot": "factorized"} and not weight.formed, weight
    _, grads = naive_unit_grads(loss, params, batch)
    fn = pegrad.value_and_grad_stats(loss, "dot", impl=impl)
    _, got = jax.jit(fn)(params, batch, dot_with=probe_like(params))
    assert_tree_close(got["dot"], naive_stats(grads, 1.0)["dot"], f"{impl}/dot")
