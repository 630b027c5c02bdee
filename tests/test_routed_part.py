"""The routed-part route (pegrad.RoutedPart): one outer product per example written into a zero
table at a place the example picks — a mixture of experts reading one expert's matrix per
example, experts[choice] @ x.

The specification, in order: every statistic of such models (top-1 experts weighted by their
router score; a window of rows whose start the example picks, windows of different examples
overlapping, starts clamped as XLA clamps them; a scaling after the placement) equals the naive
per-example loop at float64 for B = 1, 2, 5, the table proven by the route; and each
precondition, broken, sends the leaf to another exact route with the reason in `explain`.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers import check_every_implementation, naive_unit_grads

import pegrad

F64 = jnp.float64
D = 4


def top1_experts(n_experts: int) -> Callable[[jax.Array], tuple[Any, Callable]]:
    """A router picks one expert per example; its matrix is read by a traced index."""

    def build(key: jax.Array) -> tuple[Any, Callable]:
        k1, k2, k3 = jax.random.split(key, 3)
        params = {
            "router": jax.random.normal(k1, (n_experts, D), F64),
            "experts": jax.random.normal(k2, (n_experts, D, D), F64) / 2,
            "head": jax.random.normal(k3, (2, D), F64),
        }

        def loss(p: Any, ex: Any) -> jax.Array:
            x = ex[0][:D]
            scores = p["router"] @ x
            choice = jnp.argmax(scores)
            h = jax.nn.softmax(scores)[choice] * jnp.tanh(p["experts"][choice] @ x)
            return jnp.sum((p["head"] @ h - ex[1]) ** 2)

        return params, loss

    return build


def picked_window(key: jax.Array) -> tuple[Any, Callable]:
    """The example picks the start of a 2-row window of a 5-row table (2 + argmax over 5
    values: starts 4 to 6 clamp to 3, as XLA clamps them); different examples' windows
    overlap. The gradient is scaled by 3 after the placement."""
    params = {"table": jax.random.normal(key, (5, D), F64)}

    def loss(p: Any, ex: Any) -> jax.Array:
        start = 2 + jnp.argmax(ex[0])
        rows = jax.lax.dynamic_slice(3.0 * p["table"], (start, 0), (2, D))
        return jnp.sum((jnp.sin(rows @ ex[0][:D]) - ex[1]) ** 2)

    return params, loss


MODELS = {
    "top1_of_3_experts": top1_experts(3),
    "top1_of_1_expert": top1_experts(1),
    "picked_window": picked_window,
}


def _batch(key: jax.Array, b: int) -> Any:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (b, 5), F64), jax.random.normal(ky, (b, 2), F64)


def _plan(loss: Callable, params: Any, batch: Any) -> dict[str, Any]:
    plans = pegrad.explain(loss, params, batch, ("mean", "sq_mean"), choose="first")
    return {p.leaf: p for p in plans}


@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_statistic_of_a_routed_part_equals_the_naive_loop(name: str, batch_size: int):
    params, loss = MODELS[name](jax.random.key(0))
    batch = _batch(jax.random.key(batch_size), batch_size)
    routed = "['table']" if name == "picked_window" else "['experts']"
    assert _plan(loss, params, batch)[routed].route == "routed-part"
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), name)


# -- Each precondition, broken: another exact route takes the leaf, and explain says why. ----


def _also_summed(key: jax.Array) -> tuple[Any, Callable]:
    """The expert table is also used whole: its gradient is a sum, not one part."""
    params, loss = top1_experts(3)(key)
    return params, lambda p, ex: loss(p, ex) + 0.1 * jnp.sum(jnp.sin(p["experts"]))


def _at_every_position(key: jax.Array) -> tuple[Any, Callable]:
    """The chosen expert is applied at two positions: the part sums them (not rank one)."""
    params, _ = top1_experts(3)(key)

    def loss(p: Any, ex: Any) -> jax.Array:
        choice = jnp.argmax(p["router"] @ ex[0][:D])
        xs = jnp.stack([ex[0][:D], ex[0][1 : D + 1]])
        h = jnp.tanh(xs @ p["experts"][choice].T)
        return jnp.sum((h @ p["head"].T - ex[1]) ** 2)

    return params, loss


def _many_experts(key: jax.Array) -> tuple[Any, Callable]:
    """65 places: more contractions than the route allows."""
    params, loss = top1_experts(65)(key)
    return params, loss


@pytest.mark.parametrize(
    "build, refusal",
    [
        (_also_summed, "not one part written into the leaf"),
        (_at_every_position, "the part: the dot_general sums 1 axes per example (not rank one)"),
        (_many_experts, "the part may take 65 places (> 64)"),
    ],
    ids=["table_used_whole_too", "part_not_rank_one", "too_many_places"],
)
def test_a_broken_precondition_takes_another_exact_route(build: Callable, refusal: str):
    params, loss = build(jax.random.key(0))
    batch = _batch(jax.random.key(1), 3)
    plan = _plan(loss, params, batch)["['experts']"]
    assert plan.route != "routed-part"
    assert ("routed-part", refusal) in plan.refused
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "")


def test_a_place_the_parameters_pick_is_one_place_for_every_example():
    """A traced index that depends on the parameters only (not static, not the example's):
    read once, broadcast over the examples."""
    params, _ = top1_experts(3)(jax.random.key(0))

    def loss(p: Any, ex: Any) -> jax.Array:
        choice = jnp.argmax(p["router"][:, 0])
        h = jnp.tanh(p["experts"][choice] @ ex[0][:D])
        return jnp.sum((p["head"] @ h - ex[1]) ** 2)

    batch = _batch(jax.random.key(1), 3)
    assert _plan(loss, params, batch)["['experts']"].route == "routed-part"
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "")
