"""The harness every equality test shares: a naive per-example loop, the SPEC §2 statistics of
what it materializes (numpy), one closeness check, and the check that runs every implementation
against them. The naive loop and its statistics never touch pegrad.

`naive_unit_grads` runs `jax.grad` on one example at a time. For granularity="token" it takes a
`tokenwise` loss in which every parameter carries a leading axis T and position t uses copy t:
the gradient with respect to copy t is position t's contribution, by construction.
"""

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

import pegrad

# (impl, chunk_size, choose): the factorized path runs with every route it can prove ("first")
# and with the default plan ("cheapest": mean-loss for the mean alone, formed gradients kept
# for clipping).
IMPLS = [
    ("vmap", None, "cheapest"),
    ("vmap", 2, "cheapest"),
    ("factorized", None, "first"),
    ("factorized", 2, "first"),
    ("factorized", None, "cheapest"),
]


def example_at(batch: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], batch)


def naive_unit_grads(
    loss: Callable, params: Any, batch: Any, tokenwise: Callable | None = None
) -> tuple[np.ndarray, Any]:
    """(losses [B], per-unit gradients with leaves [units, *param shape]) in numpy."""
    n = jax.tree.leaves(batch)[0].shape[0]
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    losses, units = [], []
    for i in range(n):
        example = example_at(batch, i)
        value, grads = value_and_grad(params, example)
        losses.append(float(value))
        if tokenwise is None:
            units.append(jax.tree.map(lambda g: np.asarray(g)[None], grads))
        else:
            t = jax.tree.leaves(example)[0].shape[0]
            copies = jax.tree.map(lambda p, t=t: jnp.broadcast_to(p, (t, *p.shape)), params)
            units.append(jax.tree.map(np.asarray, jax.grad(tokenwise)(copies, example)))
    return np.asarray(losses), jax.tree.map(lambda *g: np.concatenate(g), *units)


def probe_like(params: Any) -> Any:
    """A fixed v for "dot", shaped like the parameters (no entry 0, no two alike); None at a
    model's leaves that are not floating arrays, as in its statistics."""

    def probe(p: Any) -> Any:
        if not jnp.issubdtype(getattr(p, "dtype", np.dtype(object)), jnp.floating):
            return None
        return np.sin(np.arange(np.size(p)) + 1.0).reshape(np.shape(p))

    return jax.tree.map(probe, params)


def naive_stats(grads: Any, clip_norm: float) -> dict[str, Any]:
    """The SPEC §2 definitions, in numpy, from materialized per-unit gradients ("dot" with
    `probe_like` of the parameters)."""
    leaves = jax.tree.leaves(grads)
    n = leaves[0].shape[0]
    flat = [g.reshape(n, -1) for g in leaves]
    probe = [
        x.reshape(-1) for x in jax.tree.leaves(probe_like(jax.tree.map(lambda g: g[0], grads)))
    ]
    sq_norms = sum(np.sum(g.reshape(n, -1) ** 2, axis=1) for g in leaves)
    with np.errstate(divide="ignore"):
        factors = np.minimum(1.0, clip_norm / np.sqrt(sq_norms))
    out = {
        "mean": jax.tree.map(lambda g: g.mean(0), grads),
        "sq_mean": jax.tree.map(lambda g: (g**2).mean(0), grads),
        "sign_mean": jax.tree.map(lambda g: np.sign(g).mean(0), grads),
        "sq_norms": sq_norms,
        "gram": sum(g @ g.T for g in flat),
        "dot": sum(g @ v for g, v in zip(flat, probe, strict=True)),
        "clipped_mean": jax.tree.map(lambda g: np.tensordot(factors, g, axes=1) / n, grads),
    }
    if n > 1:
        out["var"] = jax.tree.map(lambda g: g.var(0, ddof=1), grads)
    return out


def assert_tree_close(actual: Any, expected: Any, what: str, rtol: float = 1e-10) -> None:
    """Equal trees, every leaf within `rtol` of the largest entry of the expected leaf (or of
    1e-12 where that is 0). A leaf whose entries are all below 1e-4 of the tree's largest is
    held within `rtol` of 1e-4 × the tree's largest entry: a gradient 0 by symmetry, such as a
    softmax's key bias (the families' Flax GPTs), holds only round-off, up to a few float64 ulps
    of the tree's scale, and 1e-14 of it is ~50 ulps (float32 anywhere: ~1e6 × that)."""
    flat_a, tree_a = jax.tree.flatten(actual)
    flat_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e, f"{what}: tree structure differs"
    top = max((float(np.max(np.abs(np.asarray(e)))) for e in flat_e if np.size(e)), default=0.0)
    for a, e in zip(flat_a, flat_e, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
        if not e.size:
            continue
        scale = max(float(np.max(np.abs(e))), 1e-4 * top, 1e-12)  # 1e-12: var of a constant
        err = float(np.max(np.abs(a - e))) / scale
        assert err <= rtol, f"{what}: relative error {err:.2e}"


def check_every_implementation(
    loss: Callable,
    params: Any,
    batch: Any,
    expected: tuple[np.ndarray, Any],
    what: str,
    *,
    granularity: str = "example",
    clip_norm: float = 0.5,
    impls: Sequence[tuple[str, int | None, str]] = IMPLS,
    rtol: float = 1e-10,
    **options: Any,
) -> None:
    """Every statistic from every implementation (with `options` to value_and_grad_stats)
    equals the naive loop's; so does the mean asked for alone (plain grad where proven)."""
    losses, unit_grads = expected
    n_units = jax.tree.leaves(unit_grads)[0].shape[0]
    stats = tuple(s for s in pegrad.STATISTICS if n_units > 1 or s != "var")
    want = naive_stats(unit_grads, clip_norm)
    for impl, chunk, choice in _distinct(impls, loss, params, batch, granularity, stats):
        fn = pegrad.value_and_grad_stats(
            loss,
            stats,
            impl=cast(pegrad.Impl, impl),
            chunk_size=chunk,
            granularity=cast(pegrad.Granularity, granularity),
            clip_norm=clip_norm,
            choose=cast(pegrad.Choose, choice),
            **options,
        )
        loss_value, got = jax.jit(fn)(params, batch, dot_with=probe_like(params))
        where = f"{what}/{granularity}/{impl}/chunk={chunk}/{choice}/{options}"
        np.testing.assert_allclose(loss_value, losses.mean(), rtol=1e-12, err_msg=where)
        assert int(got["batch_size"]) == n_units, where
        for name in stats:
            if name == "sign_mean":  # a sign decided by round-off is no test of anything
                top = max(
                    float(np.max(np.abs(g), initial=0.0)) for g in jax.tree.leaves(unit_grads)
                )
                mask = jax.tree.map(lambda g, top=top: _well_posed_signs(g, top), unit_grads)
                got[name] = jax.tree.map(lambda x, m: np.where(m, x, 0.0), got[name], mask)
                want[name] = jax.tree.map(lambda x, m: np.where(m, x, 0.0), want[name], mask)
            assert_tree_close(got[name], want[name], f"{where}/{name}", rtol)
    if granularity == "example":  # the mean alone, as most callers ask: "mean-loss" if proven
        fn = pegrad.value_and_grad_stats(loss, "mean", **options)
        loss_value, got = jax.jit(fn)(params, batch)
        where = f"{what}/mean alone/{options}"
        np.testing.assert_allclose(loss_value, losses.mean(), rtol=1e-12, err_msg=where)
        assert_tree_close(got["mean"], want["mean"], where, rtol)


def _well_posed_signs(g: np.ndarray, top: float = 0.0) -> np.ndarray:
    """Entries whose sign no unit leaves to round-off: exactly 0 or well above it — above 1e-9
    of the leaf's largest entry, and of 1e-4 × `top` (the tree's largest). A leaf below that
    but not all 0 is 0 by symmetry, round-off alone (as assert_tree_close says): an exact 0 in
    it is round-off too."""
    largest = float(np.max(np.abs(g), initial=0.0))
    scale = max(largest, 1e-4 * top)
    noise = 0 < largest < 1e-4 * top  # a leaf of round-off: no sign in it is decided
    tiny = ((g != 0) | noise) & (np.abs(g) < 1e-9 * scale)
    return ~np.any(tiny, axis=0)


def _distinct(
    impls: Sequence[tuple[str, int | None, str]],
    loss: Callable,
    params: Any,
    batch: Any,
    granularity: str,
    stats: Sequence[str],
) -> list[tuple[str, int | None, str]]:
    """The variants that run different programs: a chunk no smaller than the batch is no
    chunking, and the default plan may be the one the routes give anyway."""
    n = jax.tree.leaves(batch)[0].shape[0]
    plans = {}
    for choice in ("first", "cheapest"):
        found = pegrad.explain(
            loss,
            params,
            batch,
            stats,
            granularity=cast(pegrad.Granularity, granularity),
            clip_norm=0.5,
            choose=choice,
        )
        plans[choice] = [p.route for p in found]
    kept = []
    for impl, chunk, choice in impls:
        if chunk is not None and chunk >= n:
            continue
        if impl == "factorized" and choice == "cheapest" and plans["cheapest"] == plans["first"]:
            continue
        kept.append((impl, chunk, choice))
    return kept


def check_token_statistics(
    loss: Callable, params: Any, batch: Any, what: str, clip_norm: float = 0.5
) -> None:
    """Per-token statistics of every factorized variant equal the untied reference's."""
    stats = pegrad.STATISTICS

    def run(impl: str, chunk: int | None, choice: str) -> tuple[Any, Any]:
        fn = pegrad.value_and_grad_stats(
            loss,
            stats,
            impl=cast(pegrad.Impl, impl),
            chunk_size=chunk,
            granularity="token",
            clip_norm=clip_norm,
            choose=cast(pegrad.Choose, choice),
        )
        return jax.jit(fn)(params, batch, dot_with=probe_like(params))

    reference_loss, reference = run("vmap", None, "cheapest")
    for impl, chunk, choice in _distinct(IMPLS, loss, params, batch, "token", stats):
        if impl == "factorized":
            value, got = run(impl, chunk, choice)
            where = f"{what}/token/{impl}/chunk={chunk}/{choice}"
            np.testing.assert_allclose(value, reference_loss, rtol=1e-12, err_msg=where)
            for name in stats:
                assert_tree_close(got[name], reference[name], f"{where}/{name}")


def compiled_temp_bytes(fn: Callable, *args: Any) -> int:
    """Temporary memory of `fn` compiled for `args` (XLA's buffer assignment; works on CPU)."""
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert analysis is not None, "this backend reports no compiled memory analysis"
    return int(analysis.temp_size_in_bytes)
