"""Models written the way library users write them reach proven routes (SPEC §3): a model
called on x[None], per-position biases and norm scales, token and position tables in the index
layouts Flax and NNX produce. Each route here is taken only where its precondition holds: each
test breaks one and sees the leaf refused (and the numbers still equal the naive loop, which
tests/test_zoo.py checks for the library models themselves)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import check_every_implementation, naive_unit_grads
from zoo import FAMILIES, MODELS

import pegrad

F64 = jnp.float64


def _routes(loss, params, batch, stats=("mean", "sq_mean")) -> dict[str, str]:
    return {p.leaf: p.route for p in pegrad.explain(loss, params, batch, stats)}


def _check(loss, params, batch) -> None:
    expected = naive_unit_grads(loss, params, batch)
    check_every_implementation(loss, params, batch, expected, "case")


def _model(name: str):
    (model,) = [m for m in MODELS + FAMILIES if m.name == name]
    params, loss = model.build(jax.random.key(0))
    return params, loss, model.batch(jax.random.key(1), 3)


@pytest.mark.parametrize("stats", [("mean",), ("mean", "sq_mean"), tuple(pegrad.STATISTICS)])
@pytest.mark.parametrize("name", ["linen_gpt", "nnx_tagger"])
def test_a_library_transformer_has_no_leaf_on_the_fallback(name: str, stats: tuple[str, ...]):
    params, loss, batch = _model(name)
    plans = pegrad.explain(
        loss,
        params,
        batch,
        stats,
        clip_norm=1.0 if "clipped_mean" in stats else None,
        choose="first",
    )
    assert not [p.leaf for p in plans if p.route == "fallback"], str(plans)


def test_a_tied_embedding_falls_back_and_explain_says_why():
    """The tied table's gradient adds a lookup's rows and the decoder's dense V × d product
    before φ: no identity splits φ over the sum, so the leaf is materialized per example."""
    params, loss, batch = _model("linen_gpt_tied")
    plans = {p.leaf: p for p in pegrad.explain(loss, params, batch, ("mean", "sq_mean"))}
    table = plans["['params']['Embed_0']['embedding']"]
    assert table.route == "fallback"
    assert "contributions added before φ" in str(table)
    others = [p.route for leaf, p in plans.items() if leaf != table.leaf]
    assert "fallback" not in others


def test_a_named_axis_norm_scale_takes_the_contraction_route():
    """Haliax-style einsums (families.py's `named-axis`, at tests/zoo.py's size): a norm scale
    is a contraction over positions with the feature axis batched, Σ_t δ_t ⊙ x_t per example,
    proven by `contraction`, which precedes the fallback; beside the mean it forms each example's
    gradient once for the sum and the mean of squares. The scanned scales are a value of the
    backward pass (head-value)."""
    params, loss, batch = _model("named-axis")
    for stats in [("mean", "sq_mean"), ("mean", "var"), ("mean", "sq_norms")]:
        routes = _routes(loss, params, batch, stats)
        assert routes["['final']"] == "contraction", (stats, routes)
        assert routes["['scales']"] == "head-value", (stats, routes)
        assert routes["['qkv']"] == "contraction", (stats, routes)


def _unit_axis(width: int):
    """A weight applied to x reshaped [width, D / width]: width 1 is a batch of one."""
    params = {
        "w": jax.random.normal(jax.random.key(0), (6 // width, 4), F64) / 3,
        "b": 0.1 * jax.random.normal(jax.random.key(1), (4,), F64),
    }

    def loss(p, ex):
        x, y = ex
        h = jnp.tanh(x.reshape(width, -1) @ p["w"] + p["b"])
        return jnp.sum((jnp.sum(h, 0) - y) ** 2)

    batch = (
        jax.random.normal(jax.random.key(2), (3, 6), F64),
        jax.random.normal(jax.random.key(3), (3, 4), F64),
    )
    return loss, params, batch


@pytest.mark.parametrize(
    "width,weight,bias", [(1, "outer-product", "head-value"), (2, "contraction", "unit-sum")]
)
def test_an_axis_of_size_one_is_not_a_position(width: int, weight: str, bias: str):
    loss, params, batch = _unit_axis(width)
    _check(loss, params, batch)
    routes = _routes(loss, params, batch)
    assert (routes["['w']"], routes["['b']"]) == (weight, bias)


def test_a_sum_over_positions_of_a_batched_value_is_one_reduction():
    """A bias and a gain at every position: g_i = Σ_t δ_t (∘ x_t): unit-sum, never the tail."""
    params = {
        "gain": 1.0 + 0.1 * jax.random.normal(jax.random.key(0), (5,), F64),
        "bias": 0.1 * jax.random.normal(jax.random.key(1), (5,), F64),
    }

    def loss(p, ex):
        x, y = ex  # [T, 5]
        return jnp.mean((jnp.tanh(x * p["gain"] + p["bias"]) - y) ** 2)

    batch = (
        jax.random.normal(jax.random.key(2), (3, 4, 5), F64),
        jax.random.normal(jax.random.key(3), (3, 4, 5), F64),
    )
    _check(loss, params, batch)
    assert set(_routes(loss, params, batch).values()) == {"unit-sum"}


def test_a_sum_scaled_by_an_example_dependent_value_after_it_is_not_a_unit_sum():
    """g_i = s_i · Σ_t δ_t with s_i from the example: the core is then the product, and the
    leaf is not read as a sum over positions."""
    params = {"bias": 0.1 * jax.random.normal(jax.random.key(1), (5,), F64)}

    def loss(p, ex):
        x, y = ex
        scale = jax.lax.stop_gradient(jnp.sum(x))
        return jnp.mean((jnp.tanh(x + scale * p["bias"]) - y) ** 2)

    batch = (
        jax.random.normal(jax.random.key(2), (3, 4, 5), F64),
        jax.random.normal(jax.random.key(3), (3, 4, 5), F64),
    )
    _check(loss, params, batch)
    assert _routes(loss, params, batch)["['bias']"] != "unit-sum"


LOOKUPS = {
    "index": lambda table, ids: table[ids],
    "index-batched": lambda table, ids: table[ids[None]][0],  # Flax's Embed on x[None]
    "take-fill": lambda table, ids: jnp.take(table, ids, axis=0),
    "take-clip": lambda table, ids: jnp.take(table, ids, axis=0, mode="clip"),
    # a window over the whole row, its column start indexed too (clamped to 0)
    "eqx-embedding": lambda table, ids: jax.vmap(eqx.nn.Embedding(weight=table))(ids),
}


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_repeated_rows_of_a_token_table_are_summed_per_example(lookup: str):
    """Rows that repeat within an example add up before φ (segment sums); out-of-range ids
    count as the scatter's mode says (dropped or clamped, then summed with the row they land
    on)."""
    params = {"emb": jax.random.normal(jax.random.key(0), (5, 3), F64)}
    take = LOOKUPS[lookup]

    def loss(p, ex):
        tokens, y = ex
        return jnp.mean((jnp.tanh(take(p["emb"], tokens)) - y) ** 2)

    tokens = jnp.asarray([[0, 1, 0, 7], [4, 9, 3, 3], [1, 1, 1, 4]])  # 7, 9 out of range
    batch = (tokens, jax.random.normal(jax.random.key(1), (3, 4, 3), F64))
    if lookup in ("index", "eqx-embedding"):  # they promise in-range ids: keep them in range
        batch = (jnp.minimum(tokens, 4), batch[1])
    _check(loss, params, batch)
    assert _routes(loss, params, batch)["['emb']"] == "segment-rows"


def test_windows_spanning_several_rows_are_not_segments():
    """A lookup of two rows at once: windows at starts 0 and 1 overlap in one row, so rows
    are not identical-or-disjoint and the per-example sums are not segments."""
    params = {"emb": jax.random.normal(jax.random.key(0), (6, 3), F64)}

    def loss(p, ex):
        starts, y = ex
        rows = jax.vmap(lambda s: jax.lax.dynamic_slice(p["emb"], (s, 0), (2, 3)))(starts)
        return jnp.mean((jnp.tanh(rows) - y) ** 2)

    starts = jnp.asarray([[0, 1, 3], [2, 2, 4], [4, 0, 1]])
    batch = (starts, jax.random.normal(jax.random.key(1), (3, 3, 2, 3), F64))
    _check(loss, params, batch)
    plan = {p.leaf: p for p in pegrad.explain(loss, params, batch, ("mean", "sq_mean"))}["['emb']"]
    assert plan.route != "segment-rows"
    assert (
        "segment-rows",
        "a window spans several rows: windows may partly overlap",
    ) in plan.refused
