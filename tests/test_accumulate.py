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
    fn = pegrad.Accumulator.value_and_grad_stats(  # a micro-batch of 1 has M2 0, no variance
        lambda p, ex: piece.loss(p, ex, False), STATS, impl=impl, clip_norm=CLIP
    )

    @jax.jit
    def accumulate(params, batch):
        acc = pegrad.Accumulator.init(params, STATS)
        start = 0
        for size in sizes:
            micro = jax.tree.map(lambda x, a=start, b=start + size: x[a:b], batch)
            acc = acc.update(*fn(params, micro))
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


# Micro-batches as (size, kept): a mask keeping `kept` of `size` examples, or None: no mask.
MICRO = {
    "1": [(2, 1)],
    "0": [(2, 0)],
    "0+1+u1": [(2, 0), (2, 1), (1, None)],
    "2+0+1": [(2, 2), (2, 0), (2, 1)],
    "m1+m0+2": [(1, 1), (1, 0), (2, None)],  # a masked micro-batch of one example
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("micro", list(MICRO.values()), ids=list(MICRO))
def test_micro_batches_keeping_one_or_no_example_merge_exactly(micro, jit: bool):
    """A micro-batch keeping one example has no variance of its own, but it adds its mean to the
    union's (Chan: N_k·(ḡ_k − ḡ)²), and one keeping none adds nothing: in and out of jit,
    `Accumulator.value_and_grad_stats` refuses no micro-batch for its count, and the merged
    statistics equal those of the union of the kept examples. Only a union of fewer than 2
    units has no variance: `finalize` refuses it out of jit, gives NaN under jit (SPEC §6)."""
    piece = _piece("dense_bias")
    params = piece.init(jax.random.key(0))
    stats = (*STATS, "sign_mean")
    batch = piece.example(jax.random.key(1), sum(size for size, _ in micro))
    masks = [None if kept is None else np.arange(size) < kept for size, kept in micro]
    keep = np.concatenate(
        [np.arange(size) < (size if kept is None else kept) for size, kept in micro]
    )
    fn = pegrad.Accumulator.value_and_grad_stats(
        lambda p, ex: piece.loss(p, ex, False), stats, impl="vmap", clip_norm=CLIP
    )

    def accumulate(params, batch):
        acc, start = pegrad.Accumulator.init(params, stats), 0
        for (size, _), mask in zip(micro, masks, strict=True):
            part = jax.tree.map(lambda x, a=start, b=start + size: x[a:b], batch)
            acc = acc.update(*fn(params, part, None if mask is None else jnp.asarray(mask)))
            start += size
        return acc.finalize()

    n = int(keep.sum())
    if n < 2 and not jit:
        with pytest.raises(ValueError, match=f"'var' is undefined for {n} unit"):
            accumulate(params, batch)
        return
    loss, got = (jax.jit(accumulate) if jit else accumulate)(params, batch)
    assert int(got["batch_size"]) == n
    if n == 0:  # an empty union: every statistic is undefined, as value_and_grad_stats says
        del got["batch_size"]
        assert np.isnan(loss) and all(np.isnan(x).all() for x in jax.tree.leaves(got))
        return
    want_loss, want, _ = _expected(piece, params, batch, keep)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    for s in STATS:
        if s == "var" and n < 2:
            assert all(np.isnan(x).all() for x in jax.tree.leaves(got["var"])), "var of 1 unit"
        else:
            assert_tree_close(got[s], want[s], s)
    union = jax.tree.map(lambda x: x[keep], batch)
    _, big = jax.jit(_fn(piece, "vmap", ("mean", "sign_mean")))(params, union)
    assert_tree_close(got["sign_mean"], big["sign_mean"], "sign_mean", rtol=1e-12)


@pytest.mark.parametrize("sizes", [(1,), (4,)], ids=["one-unit", "four"])
def test_the_micro_batch_function_takes_dot_with_and_gives_each_micro_batchs_dot(sizes):
    piece = _piece("mlp3")
    params = piece.init(jax.random.key(0))
    batch = piece.example(jax.random.key(1), sizes[0])
    v = jax.tree.map(jnp.ones_like, params)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    micro = pegrad.Accumulator.value_and_grad_stats(loss, ("mean", "var", "dot"))
    _, got = micro(params, batch, dot_with=v)
    _, want = pegrad.value_and_grad_stats(loss, ("mean", "dot"))(params, batch, dot_with=v)
    assert_tree_close(got["dot"], want["dot"], "dot")
    assert_tree_close(got["mean"], want["mean"], "mean")
