"""A model the reference computes never crashes the rewrite: parameters sliced, split,
unstacked, stacked and concatenated in any pattern give the naive loop's statistics (float64,
1e-10 relative) with the factorized path, every leaf taking a route it proves or the exact
fallback — and no route's proof raises (the planner would turn that into a refusal that
`explain` shows as "a pegrad bug").
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from helpers import check_every_implementation, naive_unit_grads
from hypothesis import given, settings
from hypothesis import strategies as st

import pegrad

ROWS, COLS = 6, 3
FACTORIZED = [
    ("factorized", None, "first"),
    ("factorized", 2, "first"),
    ("factorized", None, "cheapest"),
]


def _read(w: jax.Array, how: tuple) -> jax.Array:
    """One way a user reads part of a stacked weight [ROWS, COLS]."""
    kind, *args = how
    if kind == "split":
        return jnp.split(w, args[0])[args[1]]
    if kind == "split_at":
        return jnp.split(w, [2, 4])[args[0]]
    if kind == "unstack":
        return jnp.unstack(w)[args[0]]
    if kind == "row":
        return w[args[0]]
    if kind == "slice":
        return w[args[0] : args[1]]
    if kind == "stack":
        return jnp.stack([w[args[0]], w[args[1]]])
    assert kind == "concat"
    return jnp.concatenate([w[args[0] : args[0] + 1], w[args[1] : args[1] + 2]])


def _use(part: jax.Array, x: jax.Array, how: str) -> jax.Array:
    """A dense use (one matmul: an outer-product gradient) or an elementwise one."""
    return jnp.sum(jnp.tanh(part @ x if how == "dense" else part * x))


row = st.integers(0, ROWS - 1)
reads = st.one_of(
    st.tuples(st.just("split"), st.sampled_from([2, 3])).flatmap(
        lambda t: st.tuples(st.just(t[0]), st.just(t[1]), st.integers(0, t[1] - 1))
    ),
    st.tuples(st.just("split_at"), st.integers(0, 2)),
    st.tuples(st.just("unstack"), row),
    st.tuples(st.just("row"), row),
    st.tuples(st.just("slice"), st.integers(0, ROWS - 1)).flatmap(
        lambda t: st.tuples(st.just("slice"), st.just(t[1]), st.integers(t[1] + 1, ROWS))
    ),
    st.tuples(st.just("stack"), row, row),
    st.tuples(st.just("concat"), row, st.integers(0, ROWS - 2)),
)
patterns = st.lists(
    st.tuples(reads, st.sampled_from(["dense", "elementwise"])), min_size=1, max_size=3
)


def _model(pattern: list) -> Callable:
    def loss(params, x):
        x = x + params["b"]
        return sum(_use(_read(params["w"], how), x, use) for how, use in pattern)

    return loss


def _check(pattern: list) -> None:
    loss = _model(pattern)
    key = jax.random.key(len(pattern))
    params = {
        "w": jax.random.normal(key, (ROWS, COLS)),
        "b": 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (COLS,)),
    }
    batch = jax.random.normal(jax.random.fold_in(key, 2), (3, COLS))
    for choice in ("first", "cheapest"):
        for p in pegrad.explain(loss, params, batch, ("mean", "sq_mean"), choose=choice):
            assert not any("pegrad bug" in why for _, why in p.refused), p.refused
    expected = naive_unit_grads(loss, params, batch)
    check_every_implementation(loss, params, batch, expected, str(pattern), impls=FACTORIZED)


@pytest.mark.parametrize(
    "pattern",
    [
        [(("split", 2, 1), "dense"), (("row", 0), "dense")],  # issue 16's reproductions
        [(("unstack", 1), "dense"), (("row", 3), "dense")],
        [(("split_at", 1), "dense"), (("slice", 4, 5), "dense")],
        [(("stack", 0, 4), "dense"), (("split", 3, 1), "dense")],
    ],
    ids=["split-and-row", "unstack-and-row", "split-middle-and-slice", "stack-and-split"],
)
def test_split_and_indexed_parameters_equal_the_naive_loop(pattern: list):
    _check(pattern)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(pattern=patterns)
def test_any_slicing_pattern_equals_the_naive_loop(pattern: list):
    _check(pattern)
