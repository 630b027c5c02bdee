"""`pegrad.Accumulator`: the statistics of k micro-batches (of any sizes, masked or not)
combined equal the statistics of the one big batch — the naive per-example loop over all of
its examples — at float64, with both implementations, in a Python loop under jit and as a
`lax.scan` carry. What cannot be combined is refused.
"""

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, naive_stats
from pieces import PIECES, Piece, piece_unit_grads

import pegrad

CLIP = 0.5
STATS = ("mean", "sq_mean", "var", "clipped_mean")  # sign_mean: tested on well-posed signs below


def _piece(name: str) -> Piece:
    return next(p for p in PIECES if p.name == name)


def _fn(piece: Piece, impl: str, stats=STATS):
    return pegrad.value_and_grad_stats(
        lambda p, ex: piece.loss(p, ex, False),
        stats,
        impl=cast(pegrad.Impl, impl),
        clip_norm=CLIP if "clipped_mean" in stats else None,
    )


def _expected(piece: Piece, params, batch, keep: np.ndarray | None = None):
    if keep is not None:
        batch = jax.tree.map(lambda x: x[keep], batch)
    losses, grads = piece_unit_grads(piece, params, batch, "example")
    return losses.mean(), naive_stats(grads, CLIP), len(losses)


def _check(loss, stats, want_loss, want, n, where):
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12, err_msg=where)
    assert int(stats["batch_size"]) == n, where
    for s in STATS:
        assert_tree_close(stats[s], want[s], f"{where}/{s}")


@pytest.mark.parametrize("name", ["mlp3", "conv_scan", "embedding"])
@pytest.mark.parametrize("impl", ["vmap", "factorized"])
@pytest.mark.parametrize("sizes", [(7,), (3, 4), (2, 1, 4)], ids=["k1", "k2", "k3"])
def test_micro_batches_of_any_sizes_combine_into_the_big_batch(name, impl, sizes):
    piece = _piece(name)
    params = piece.init(jax.random.key(0))
    batch = piece.example(jax.random.key(1), sum(sizes))
    want_loss, want, n = _expected(piece, params, batch)
    fn = jax.jit(_fn(piece, impl))
    per_var = tuple(s for s in STATS if s != "var")  # a micro-batch of 1 has no variance
    fn_one = jax.jit(_fn(piece, impl, per_var))

    @jax.jit
    def accumulate(params, batch):
        acc = pegrad.Accumulator.init(params, STATS)
        start = 0
        for size in sizes:
            micro = jax.tree.map(lambda x, a=start, b=start + size: x[a:b], batch)
            loss, stats = (fn if size > 1 else fn_one)(params, micro)
            if size == 1:  # M2 of one unit is 0: what the accumulator takes for N_k = 1
                stats = {**stats, "var": jax.tree.map(jnp.zeros_like, stats["mean"])}
            acc = acc.update(loss, stats)
            start += size
        return acc.finalize()

    loss, stats = accumulate(params, batch)
    _check(loss, stats, want_loss, want, n, f"{name}/{impl}/{sizes}")


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_accumulation_as_a_scan_carry(impl: str):
    piece = _piece("mlp3")
    params = piece.init(jax.random.key(0))
    batch = piece.example(jax.random.key(1), 6)
    want_loss, want, n = _expected(piece, params, batch)
    fn = _fn(piece, impl, (*STATS, "sign_mean"))
    micro = jax.tree.map(lambda x: x.reshape(3, 2, *x.shape[1:]), batch)

    @jax.jit
    def accumulate(params, micro):
        def step(acc, one):
            return acc.update(*fn(params, one)), None

        init = pegrad.Accumulator.init(params, (*STATS, "sign_mean"))
        acc, _ = jax.lax.scan(step, init, micro)
        return acc.finalize()

    loss, stats = accumulate(params, micro)
    _check(loss, stats, want_loss, want, n, f"scan/{impl}")
    _, big = jax.jit(fn)(params, batch)
    assert_tree_close(stats["sign_mean"], big["sign_mean"], "sign_mean", rtol=1e-12)


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_masked_micro_batches_combine_into_the_masked_big_batch(impl: str):
    """Kept counts 2, 1 and 0: a micro-batch keeping one unit adds its mean (M2 = 0), one
    keeping none changes nothing, whatever NaN its statistics hold."""
    piece = _piece("mlp3")
    params = piece.init(jax.random.key(0))
    batch = piece.example(jax.random.key(1), 7)
    keep = np.array([True, False, True, False, True, False, False])
    want_loss, want, n = _expected(piece, params, batch, keep)
    fn = _fn(piece, impl)

    @jax.jit
    def accumulate(params, batch, mask):
        acc = pegrad.Accumulator.init(params, STATS)
        for a, b in [(0, 3), (3, 5), (5, 7)]:
            micro = jax.tree.map(lambda x, a=a, b=b: x[a:b], batch)
            acc = acc.update(*fn(params, micro, mask=mask[a:b]))
        return acc.finalize()

    loss, stats = accumulate(params, batch, jnp.asarray(keep))
    _check(loss, stats, want_loss, want, n, f"masked/{impl}")


def test_what_cannot_be_combined_is_refused():
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="'sq_norms' has one entry per unit"):
        pegrad.Accumulator.init(params, ("mean", "sq_norms"))
    with pytest.raises(ValueError, match="accumulate 'mean' too"):
        pegrad.Accumulator.init(params, "var")
    acc = pegrad.Accumulator.init(params, ("mean", "sq_mean"))
    with pytest.raises(ValueError, match=r"lack \['sq_mean'\]"):
        acc.update(jnp.zeros(()), {"mean": params, "batch_size": jnp.asarray(2)})
