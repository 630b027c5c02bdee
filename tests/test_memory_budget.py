"""memory_budget (SPEC §3): per-unit gradients formed at once — by the reference, the rewrite's
chunk loop, or a contraction's per-example φ — hold at most that many bytes (or one example's).
The statistics do not depend on it (every implementation equals the naive loop at float64 under
any budget), `explain` reports each leaf's chunk and bytes under it, and the compiled program
holds less with a small budget where per-unit gradients dominate its memory."""

from typing import Any, cast

import jax
import numpy as np
import pytest
from helpers import check_every_implementation, compiled_temp_bytes
from pieces import PIECES, Piece, piece_unit_grads

import pegrad

# the whole batch at once, two examples' gradients, one example's (a budget below it)
BUDGETS = {"ample": 10**9, "two examples": 2, "below one example": 1}
# a route's match formed per example in the head (attention's contraction), the chunk loop
# (the conv's fallback, the tied table), none (the MLP's rank-one layers: only the reference)
NAMES = ["attention", "conv_scan", "tied_embedding_head", "mlp3"]
IMPLS = [
    ("vmap", None, "cheapest"),
    ("factorized", None, "first"),
    ("factorized", None, "cheapest"),
]


def _piece(name: str) -> Piece:
    return next(p for p in PIECES if p.name == name)


def _setup(name: str, n: int) -> tuple[Piece, Any, Any, Any]:
    piece = _piece(name)
    params = piece.init(jax.random.key(0))
    batch = piece.example(jax.random.key(1), n)
    return piece, params, batch, lambda p, ex: piece.loss(p, ex, False)


def _example_bytes(params: Any, per_example: int = 1) -> int:
    """One example's per-unit gradients of every leaf (float64 here)."""
    return per_example * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize(
    "name,granularity",
    [(n, g) for n in NAMES for g in ["example", "token"] if g == "example" or _piece(n).sequence],
)
def test_statistics_under_a_memory_budget_equal_the_naive_loop(
    name: str, granularity: str, budget: str
):
    piece, params, batch, loss = _setup(name, 5)
    per_example = jax.tree.leaves(batch)[0].shape[1] if granularity == "token" else 1
    size = BUDGETS[budget] * (1 if budget == "ample" else _example_bytes(params, per_example))
    expected = piece_unit_grads(piece, params, batch, granularity)
    check_every_implementation(
        loss,
        params,
        batch,
        expected,
        f"{name}/budget={budget}",
        granularity=granularity,
        impls=IMPLS,
        memory_budget=size,
    )


def _evened(n: int, bound: int) -> int:
    """As many chunks as `bound` examples a chunk needs, the n examples spread evenly on them."""
    chunks = -(-n // bound)
    return -(-n // chunks)


@pytest.mark.parametrize("n", [1, 2, 5, 31, 32, 33, 100])
@pytest.mark.parametrize("bound", [1, 3, 8, 10, 16, 32, 200])
def test_chunks_are_as_few_as_the_bound_allows_and_evened_out(n: int, bound: int):
    """32 examples at most 10 at a time: 4 chunks of 8 (not 10, 10, 10 and 2, or padding)."""
    c = pegrad._examples_per_chunk(n, 1, bound, None, n)
    chunks = -(-n // c)
    assert 1 <= c <= min(n, bound)
    assert chunks == -(-n // min(n, bound))  # no more chunks than the bound needs
    assert chunks * c - n < chunks  # less than one example of padding per chunk
    assert pegrad._examples_per_chunk(n, 4, None, 4 * bound, n) == c  # the budget alike


@pytest.mark.parametrize("stats", [("mean", "sq_mean"), ("var",)], ids="+".join)
@pytest.mark.parametrize("examples", [1, 2, 3])
@pytest.mark.parametrize("name", ["attention", "conv_scan", "tied_embedding_head"])
def test_explain_shows_each_leaf_formed_within_the_budget(name: str, examples: int, stats: tuple):
    """The chunk loop's leaves share one chunk: their bytes together fit the budget; a
    contraction's per-example φ in the head fits it on its own (each at least one example)."""
    _, params, batch, loss = _setup(name, 5)
    unbounded = pegrad.explain(loss, params, batch, stats, choose="first")
    units = {(p.leaf, w): size // c for p in unbounded for w, c, size in p.formed}
    assert units  # the piece forms per-unit gradients somewhere
    loop_unit = sum(u for (_, where), u in units.items() if where == "chunk loop")
    budget = examples * (loop_unit or max(units.values()))
    plans = pegrad.explain(loss, params, batch, stats, choose="first", memory_budget=budget)
    assert [(p.leaf, w) for p in plans for w, _, _ in p.formed] == list(units)
    in_loop = 0
    for p in plans:
        for where, c, size in p.formed:
            assert size == c * units[p.leaf, where]
            if where == "chunk loop":
                assert c == min(examples, 5), (p.leaf, c)
                in_loop += size
            else:
                assert c == _evened(5, max(1, min(5, budget // units[p.leaf, where]))), (p.leaf, c)
                assert size <= max(budget, units[p.leaf, where])
    assert in_loop <= budget
    assert " ".join(str(plans).split()).count("examples at a time") == len(units)


@pytest.mark.parametrize(
    "name,impl", [("mlp3", "vmap"), ("conv_scan", "vmap"), ("conv_scan", "factorized")]
)
@pytest.mark.parametrize("stats", [("mean", "sq_mean"), ("var",)], ids="+".join)
def test_a_small_budget_holds_less_in_the_compiled_program(name: str, impl: str, stats: tuple):
    _, params, batch, loss = _setup(name, 16)

    def temp_bytes(budget: int | None) -> int:
        fn = pegrad.value_and_grad_stats(
            loss, stats, impl=cast(pegrad.Impl, impl), memory_budget=budget
        )
        return compiled_temp_bytes(fn, params, batch)

    whole, one = temp_bytes(None), temp_bytes(1)
    assert one < whole, (one, whole)


@pytest.mark.parametrize("bad", [0, -4096, True, 1.5e6, "1MB"])
def test_a_budget_that_is_not_a_positive_int_is_refused(bad: Any):
    """A non-int is refused by the annotation's runtime check under pytest, by pegrad's own
    check (the same message as for 0) without it."""
    kind = ValueError if isinstance(bad, int) else (TypeError, ValueError)
    match = "memory_budget must be a positive int" if isinstance(bad, int) else "memory_budget"
    with pytest.raises(kind, match=match):
        pegrad.value_and_grad_stats(lambda p, ex: (p * ex).sum(), memory_budget=bad)
    with pytest.raises(kind, match=match):
        pegrad.explain(lambda p, ex: (p * ex).sum(), np.ones(3), np.ones((2, 3)), memory_budget=bad)
