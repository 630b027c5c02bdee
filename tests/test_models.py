"""Tests for models.py: shapes and dtypes, causality, the paper-size parameter count, scanned
blocks against the list of blocks, the routes pegrad.explain reports, and per-example gradient
statistics through pegrad (both implementations) against a naive loop.

Float64 and strict dtype promotion come from tests/conftest.py.
"""

import dataclasses
import functools
import re
from typing import TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IMPLS, check_every_implementation, naive_unit_grads

import pegrad
from models import (
    MLP,
    Block,
    TransformerConfig,
    TransformerLM,
    count_params,
    lm_loss,
    make_loss_fn,
    mlp_loss,
    mlp_mse_loss,
)

B, T = 3, 5  # examples per batch, positions per sequence
LM_VARIANTS = [("learned", False), ("learned", True), ("rotary", False), ("rotary", True)]


M = TypeVar("M", bound=eqx.Module)


def _jitter(model: M, key: jax.Array, scale: float = 0.1) -> M:
    """Add noise to every floating leaf, so no bias, norm scale or shift sits at 0 or 1."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return cast(M, eqx.combine(jax.tree.unflatten(treedef, noisy), static))


@functools.cache
def _tiny_lm(
    position: str,
    tied: bool,
    dtype: str = "float64",
    n_kv_heads: int | None = None,
    scan_layers: bool = False,
) -> TransformerLM:
    # Built eagerly: the compiled small ops are shared by all variants (a jit per variant is
    # slower), and cached so each variant is built once.
    config = TransformerConfig.tiny(
        position=position,
        tied_head=tied,
        dtype=dtype,
        n_kv_heads=n_kv_heads,
        scan_layers=scan_layers,
    )
    k_init, k_jitter = jax.random.split(jax.random.key(0))
    model = TransformerLM(config, key=k_init)
    return _jitter(model, k_jitter) if dtype == "float64" else model


def _lm_batch(vocab: int, seed: int = 2) -> tuple[jax.Array, jax.Array]:
    k_tokens, k_targets = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tokens, (B, T), 0, vocab)
    targets = jax.random.randint(k_targets, (B, T), 0, vocab)
    return tokens, targets


@functools.cache
def _tiny_mlp() -> MLP:
    k_init, k_jitter = jax.random.split(jax.random.key(0))
    model = MLP(4, 3, 6, 2, activation="tanh", dtype="float64", key=k_init)
    return _jitter(model, k_jitter)


# ------------------------------------------------------------------------------------------
# Shapes and dtypes


@pytest.mark.parametrize(
    "position,tied,dtype,n_kv_heads,scan",
    [(p, t, "float64", None, False) for p, t in LM_VARIANTS]
    + [("learned", False, "float32", None, False), ("rotary", True, "bfloat16", 1, True)],
)
def test_lm_shapes_dtypes_and_loss(
    position: str, tied: bool, dtype: str, n_kv_heads: int | None, scan: bool
):
    model = _tiny_lm(position, tied, dtype, n_kv_heads, scan)
    vocab, context = model.config.vocab_size, model.config.context_length
    tokens, targets = _lm_batch(vocab)
    full = jnp.zeros((context,), dtype=tokens.dtype)

    @eqx.filter_jit
    def run(model: TransformerLM) -> tuple[jax.Array, jax.Array, jax.Array]:
        losses = jax.vmap(lm_loss, in_axes=(None, 0))(model, (tokens, targets))
        return jax.vmap(model)(tokens), losses, model(full)

    logits, losses, full_logits = run(model)  # vmap calls the model on one example at a time
    assert logits.shape == (B, T, vocab) and logits.dtype == jnp.dtype(dtype)
    assert losses.shape == (B,)
    assert losses.dtype == (jnp.float32 if dtype == "bfloat16" else jnp.dtype(dtype))
    assert full_logits.shape == (context, vocab)
    assert (model.pos_emb is None) == (position == "rotary")
    assert (model.head is None) == tied
    with pytest.raises(ValueError, match="exceeds context_length"):
        model(jnp.zeros((context + 1,), dtype=tokens.dtype))
    # lm_loss is the mean over positions of -log softmax(logits)[target].
    log_probs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float64), axis=-1))
    expected = [-np.mean([log_probs[i, t, targets[i, t]] for t in range(T)]) for i in range(B)]
    rtol = {"float64": 1e-13, "float32": 1e-5, "bfloat16": 1e-5}[dtype]
    np.testing.assert_allclose(losses.astype(jnp.float64), expected, rtol=rtol)


def test_mlp_shapes_losses_and_errors():
    model = _tiny_mlp()
    k_x, k_y = jax.random.split(jax.random.key(3))
    x = jax.random.normal(k_x, (B, 4), jnp.float64)
    label = jnp.asarray(2)
    target = jax.random.normal(k_y, (3,), jnp.float64)

    @eqx.filter_jit
    def run(model: MLP) -> tuple[jax.Array, ...]:
        out = model(x[0])
        return (
            out,
            jax.vmap(model)(x),
            mlp_loss(model, (x[0], label)),
            mlp_mse_loss(model, (x[0], target)),
        )

    out, batched, xent, mse = run(model)
    assert out.shape == (3,) and out.dtype == jnp.float64
    assert batched.shape == (B, 3)
    np.testing.assert_allclose(xent, -jax.nn.log_softmax(out)[2], rtol=1e-13)
    np.testing.assert_allclose(mse, jnp.mean((out - target) ** 2), rtol=1e-13)
    linear = MLP(4, 2, 6, 0, dtype="float64", key=jax.random.key(0))
    assert len(linear.layers) == 1
    assert linear.layers[0].weight.shape == (2, 4)  # eqx.nn.Linear: [out, in]
    assert linear.layers[0].bias is not None and not jnp.any(linear.layers[0].bias)
    custom = MLP(4, 2, 6, 1, activation=jnp.sin, dtype="float64", key=jax.random.key(0))
    assert custom(x[0]).shape == (2,)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        MLP(4, 2, 6, 1, activation="swish", key=jax.random.key(0))
    with pytest.raises(ValueError, match="depth"):
        MLP(4, 2, 6, -1, key=jax.random.key(0))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(n_heads=3), "must divide d_model"),
        (dict(position="sinusoidal"), "sinusoidal"),
        (dict(position="rotary", d_model=6, n_heads=2), "even head dimension"),
        (dict(vocab_size=0), "vocab_size must be >= 1"),
        (dict(dtype="int32"), "floating dtype"),
        (dict(n_kv_heads=0), "n_kv_heads must be >= 1"),
        (dict(d_model=16, n_heads=4, n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
    ],
)
def test_config_errors(overrides: dict, match: str):
    # TypeError: under the test suite's runtime type checker, a bad Literal fails before
    # __post_init__ gets to raise its ValueError.
    with pytest.raises((ValueError, TypeError), match=match):
        TransformerConfig.tiny(**overrides)


# ------------------------------------------------------------------------------------------
# Causality


# Equality to rounding: XLA may sum in another order under vmap than without it (seen: logits
# of size 0.56 differing by 4e-16 in float64), so earlier logits are compared with a tolerance of
# 2^10 float64 epsilons (2e-13) of their size; changing a later token moves later logits by
# ~0.1 to 0.8 here, and a leak moves earlier ones by as much (test_causality_check_catches_leaks).
CAUSAL_RTOL = 2.0**10 * float(jnp.finfo(jnp.float64).eps)
CAUSAL_VARIANTS = [("learned", False, None, False), ("rotary", True, 1, True)]


def _causality(model: TransformerLM) -> dict[str, float]:
    """How far `model` is from causal, relative to the size of what it computes:
    "jac_future": max |d logits[t] / d embeddings[s]| over s > t, over the same for s <= t;
    "earlier": max over t of the change of logits[: t + 1] when every token after t changes,
    over max |logits|; "later": the smallest change of logits[t + 1 :] in that case, over the
    same (what a change of the future does where it may)."""
    tokens = _lm_batch(model.config.vocab_size)[0][0]
    shifted = (tokens + 1) % model.config.vocab_size
    after = jnp.arange(T)[None, :] > jnp.arange(T - 1)[:, None]  # [T - 1, T]
    changed = jnp.where(after, shifted, tokens)  # changed[t]: every token after t replaced

    @eqx.filter_jit
    def run(model: TransformerLM) -> tuple[jax.Array, jax.Array, jax.Array]:
        jac = jax.jacrev(model.from_embeddings)(model.embed(tokens))  # [T, vocab, T, d_model]
        return jac, model(tokens), jax.vmap(model)(changed)

    jac, logits, changed_logits = run(model)
    per_pair = np.max(np.abs(np.asarray(jac)), axis=(1, 3))  # [t, s]
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    scale = float(np.max(np.abs(logits)))
    moved = np.abs(np.asarray(changed_logits - logits[None]))  # [t, position, vocab]
    return {
        "jac_future": float(per_pair[future].max() / per_pair[~future].min()),
        "earlier": max(float(moved[t, : t + 1].max()) for t in range(T - 1)) / scale,
        "later": min(float(moved[t, t + 1 :].max()) for t in range(T - 1)) / scale,
    }


@pytest.mark.parametrize("position,tied,n_kv_heads,scan", CAUSAL_VARIANTS)
def test_causality(position: str, tied: bool, n_kv_heads: int | None, scan: bool):
    """logits[t] depends on no token after t (to rounding: CAUSAL_RTOL), and on every one up to
    t: changing later tokens moves later logits by over a million times the tolerance."""
    leak = _causality(_tiny_lm(position, tied, n_kv_heads=n_kv_heads, scan_layers=scan))
    assert leak["jac_future"] <= CAUSAL_RTOL, leak
    assert leak["earlier"] <= CAUSAL_RTOL, leak
    assert leak["later"] > 1e6 * CAUSAL_RTOL, leak


@pytest.mark.parametrize("position,tied,n_kv_heads,scan", CAUSAL_VARIANTS)
@pytest.mark.parametrize("leak", ["mask one position late", "mask e^-20 instead of 0"])
def test_causality_check_catches_leaks(
    monkeypatch: pytest.MonkeyPatch,
    leak: str,
    position: str,
    tied: bool,
    n_kv_heads: int | None,
    scan: bool,
):
    """The same model made non-causal (models.py's attention mask patched while it is traced)
    fails both halves of test_causality's check by orders of magnitude, even when the future
    gets attention weights of e^-20 ≈ 2e-9."""
    if leak == "mask one position late":
        tril = jnp.tril
        monkeypatch.setattr(jnp, "tril", lambda x, k=0: tril(x, k + 1))
    else:
        softmax = jax.nn.softmax
        monkeypatch.setattr(
            jax.nn, "softmax", lambda x, axis=-1: softmax(jnp.where(x == -jnp.inf, -20.0, x), axis)
        )
    found = _causality(_tiny_lm(position, tied, n_kv_heads=n_kv_heads, scan_layers=scan))
    assert found["jac_future"] > 1e3 * CAUSAL_RTOL, found
    assert found["earlier"] > 1e3 * CAUSAL_RTOL, found


# ------------------------------------------------------------------------------------------
# Grouped-query attention and scanned blocks


def test_grouped_query_attention_shares_each_key_value_head_with_a_group_of_query_heads():
    """A model with n_kv_heads K/V heads is the n_heads model whose K/V head j is copied to
    query heads j * group .. (j + 1) * group - 1."""
    config = TransformerConfig.tiny(d_model=16, n_heads=4, n_kv_heads=2, dtype="float64")
    grouped = _jitter(TransformerLM(config, key=jax.random.key(0)), jax.random.key(1))
    full = TransformerLM(dataclasses.replace(config, n_kv_heads=None), key=jax.random.key(0))
    group, head_dim = config.n_heads // config.kv_heads, config.head_dim

    def copy_heads(x: jax.Array) -> jax.Array:  # [kv_heads * head_dim, ...] -> [d_model, ...]
        heads = x.reshape(config.kv_heads, head_dim, *x.shape[1:])
        return jnp.repeat(heads, group, axis=0).reshape(config.d_model, *x.shape[1:])

    full_params, static = eqx.partition(full, eqx.is_array)
    full_leaves, treedef = jax.tree.flatten(full_params)
    grouped_leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(grouped, eqx.is_array))
    leaves = []
    for (path, x), like in zip(grouped_leaves, full_leaves, strict=True):
        if x.shape != like.shape:
            assert re.search(r"\.(k|v)_proj\.", jax.tree_util.keystr(path)), path
            x = copy_heads(x)
        leaves.append(x)
    copied = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
    tokens = _lm_batch(config.vocab_size)[0]
    logits = eqx.filter_jit(lambda model: jax.vmap(model)(tokens))
    np.testing.assert_allclose(logits(grouped), logits(copied), rtol=1e-12)


def _stack_blocks(model: TransformerLM) -> TransformerLM:
    """The same weights in the scan_layers layout: the blocks' arrays stacked [layer, ...]."""
    assert isinstance(model.blocks, tuple)
    config = dataclasses.replace(model.config, scan_layers=True)
    layout = TransformerLM(config, key=jax.random.key(0))  # only its structure is kept
    blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *model.blocks)
    return eqx.tree_at(
        lambda m: (m.tok_emb, m.pos_emb, m.blocks, m.final_norm, m.head),
        layout,
        (model.tok_emb, model.pos_emb, blocks, model.final_norm, model.head),
        is_leaf=lambda x: x is None,
    )


def test_scanned_blocks_equal_the_list_of_blocks():
    """scan_layers changes the layout, not the model: the same key gives the same weights, and
    the same weights give the same logits and per-example gradients."""
    config = TransformerConfig.tiny(position="rotary", n_kv_heads=1, dtype="float64")
    stacked = _stack_blocks(TransformerLM(config, key=jax.random.key(0)))
    scanned = TransformerLM(dataclasses.replace(config, scan_layers=True), key=jax.random.key(0))
    assert isinstance(scanned.blocks, Block)
    assert jax.tree.structure(stacked) == jax.tree.structure(scanned)
    assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, stacked, scanned)))

    unrolled = _tiny_lm("rotary", True, n_kv_heads=1)
    scanned = _stack_blocks(unrolled)
    tokens, targets = _lm_batch(config.vocab_size)

    @eqx.filter_jit
    def run(model: TransformerLM) -> tuple[jax.Array, TransformerLM]:
        per_example_grads = jax.vmap(eqx.filter_grad(lm_loss), in_axes=(None, 0))
        return jax.vmap(model)(tokens), per_example_grads(model, (tokens, targets))

    logits, grads = run(unrolled)
    scanned_logits, scanned_grads = run(scanned)
    np.testing.assert_allclose(scanned_logits, logits, rtol=1e-12)
    # The per-example gradients, stacked the same way (axis 0 is the example, 1 the layer).
    assert isinstance(grads.blocks, tuple)
    want = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *grads.blocks)
    for got, expected in zip(
        jax.tree.leaves((scanned_grads.blocks, scanned_grads.tok_emb, scanned_grads.final_norm)),
        jax.tree.leaves((want, grads.tok_emb, grads.final_norm)),
        strict=True,
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-14)


# ------------------------------------------------------------------------------------------
# Paper-size configuration


def _closed_form_count(config: TransformerConfig) -> int:
    d, f, v, n = config.d_model, config.d_ff, config.vocab_size, config.n_layers
    kv = config.kv_heads * config.head_dim  # keys and values: d unless grouped-query
    attention = 2 * d * d + 2 * d * kv + 2 * d + kv  # biases on q, v, out (none on keys)
    feed_forward = 2 * d * f + f + d
    block = attention + feed_forward + 2 * 2 * d  # two layer norms, scale and shift each
    embeddings = v * d + (config.context_length * d if config.position == "learned" else 0)
    head = 0 if config.tied_head else d * v
    return embeddings + n * block + 2 * d + head


@pytest.mark.parametrize("tied,scan", [(True, False), (False, False), (True, True)])
def test_paper_config_parameter_count(tied: bool, scan: bool):
    config = TransformerConfig.paper(tied_head=tied, scan_layers=scan)
    assert (config.vocab_size, config.context_length, config.d_model) == (50257, 1024, 768)
    assert (config.n_layers, config.n_heads, config.d_ff) == (12, 12, 3072)
    shapes = eqx.filter_eval_shape(TransformerLM, config, key=jax.random.key(0))
    n_params = count_params(shapes)
    print(f"paper config, tied_head={tied}, scan_layers={scan}: {n_params:,} parameters")
    assert n_params == _closed_form_count(config)
    assert 120e6 < n_params < 170e6
    assert isinstance(shapes.tok_emb.weight, jax.ShapeDtypeStruct)  # nothing was allocated
    if scan:
        assert isinstance(shapes.blocks, Block)
        assert shapes.blocks.mlp.up.weight.shape == (12, 3072, 768)  # [layer, out, in]


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_count_params_matches_leaves(n_kv_heads: int | None):
    model = _tiny_lm("rotary", False, n_kv_heads=n_kv_heads)
    params, _ = eqx.partition(model, eqx.is_inexact_array)
    assert count_params(model) == sum(x.size for x in jax.tree.leaves(params))
    assert count_params(model) == _closed_form_count(model.config)


# ------------------------------------------------------------------------------------------
# Per-example gradient statistics through pegrad, against a naive per-example loop


def _mlp_case():
    k_x, k_y = jax.random.split(jax.random.key(3))
    x = jax.random.normal(k_x, (B, 4), jnp.float64)
    labels = jax.random.randint(k_y, (B,), 0, 3)
    return _tiny_mlp(), mlp_loss, (x, labels)


def _lm_case(position: str, tied: bool, n_kv_heads: int | None = None, scan: bool = False):
    model = _tiny_lm(position, tied, n_kv_heads=n_kv_heads, scan_layers=scan)
    return model, lm_loss, _lm_batch(model.config.vocab_size)


CASES = {
    "mlp": _mlp_case,
    "lm-learned-untied": lambda: _lm_case("learned", False),
    "lm-rotary-tied-gqa": lambda: _lm_case("rotary", True, n_kv_heads=1),
    "lm-learned-untied-scan": lambda: _lm_case("learned", False, scan=True),
}
# The vmap reference is jax.vmap(jax.grad) whatever the blocks' layout, and the scanned model
# equals the unrolled one (test above): only the rewrite has something new to see through.
CASE_IMPLS = {"lm-learned-untied-scan": [impl for impl in IMPLS if impl[0] == "factorized"]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pegrad_matches_naive_loop(case: str):
    model, loss, batch = CASES[case]()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    loss_fn = make_loss_fn(static, loss)
    first = jax.tree.map(lambda x: x[0], batch)
    assert jnp.array_equal(jax.jit(loss_fn)(params, first), eqx.filter_jit(loss)(model, first))
    expected = naive_unit_grads(loss_fn, params, batch)
    impls = CASE_IMPLS.get(case, IMPLS)
    check_every_implementation(loss_fn, params, batch, expected, case, impls=impls)


# ------------------------------------------------------------------------------------------
# The routes pegrad.explain reports: eqx.nn layers applied per position with jax.vmap take the
# same routes the hand-written layers (x @ W over all positions) did before them.


def _kind(leaf: str) -> str:
    """What a parameter leaf is, by its key path."""
    if re.search(r"\.(q|k)_proj\.", leaf):  # rotated by RoPE when positions are rotary
        return "q bias" if leaf.endswith(".bias") else "q/k weight"  # keys have no bias
    for kind in ("tok_emb", "pos_emb", "final_norm", "norm"):
        if kind in leaf:
            return kind
    return "bias" if leaf.endswith(".bias") else "weight"


_EXAMPLE = {  # a weight reads every position of the example: sum of rank-one terms
    "weight": "contraction",
    "q/k weight": "contraction",
    "pos_emb": "row-scatter",  # each position reads its own row
    "tok_emb": "segment-rows",  # a token may recur in a sequence: rows summed per example
    "norm": "unit-sum",  # a sum over positions: one reduction of a head value per example
    "final_norm": "unit-sum",
    "bias": "unit-sum",
    "q bias": "unit-sum",
}
_TOKEN = {  # each position is a unit: every weight gradient is rank one
    "weight": "outer-product",
    "q/k weight": "outer-product",
    "pos_emb": "row-scatter",
    "tok_emb": "row-scatter",
    "norm": "unit-sum",
    "final_norm": "unit-sum",
    "bias": "unit-sum",
    "q bias": "unit-sum",
}
_ROTARY_EXAMPLE = {kind: route for kind, route in _EXAMPLE.items() if kind != "pos_emb"}
_ROTARY_TOKEN = {kind: route for kind, route in _TOKEN.items() if kind != "pos_emb"}
# The first route that matches each leaf, by (case, granularity) and leaf kind.
ROUTES = {
    ("mlp", "example"): {"weight": "outer-product", "bias": "head-value"},
    ("lm-learned-untied", "example"): _EXAMPLE,
    ("lm-learned-untied", "token"): _TOKEN,
    # The tied table's rows and the head's dense product add up before φ: per example.
    ("lm-rotary-tied-gqa", "example"): {**_ROTARY_EXAMPLE, "tok_emb": "fallback"},
    ("lm-rotary-tied-gqa", "token"): {
        **_ROTARY_TOKEN,
        "tok_emb": "terms",  # gathered rows plus the tied head's rank-one terms
        # pegrad does not trace the position axis through the rotation ("the contracted axes
        # are not both traced to the example's positions"): the per-leaf fallback, exact.
        "q/k weight": "fallback",
        "q bias": "fallback",
    },
    # Per layer as the unrolled model, but the backward scan sums a bias's (or a norm's)
    # gradient over positions inside its body: the per-example gradient leaves it complete.
    ("lm-learned-untied-scan", "example"): {
        **_EXAMPLE,
        **{kind: "head-value" for kind in ("bias", "q bias", "norm")},
    },
}


@pytest.mark.parametrize("case,granularity", sorted(ROUTES))
def test_explain_routes(case: str, granularity: str):
    model, loss, batch = CASES[case]()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    plans = pegrad.explain(
        make_loss_fn(static, loss),
        params,
        batch,
        ("mean", "sq_mean"),
        granularity=cast(pegrad.Granularity, granularity),
        choose="first",
    )
    expected = ROUTES[case, granularity]
    got = {p.leaf: p.route for p in plans}
    assert got == {leaf: expected[_kind(leaf)] for leaf in got}
    assert {_kind(leaf) for leaf in got} == set(expected)  # every kind was seen


def test_token_statistics_of_scanned_blocks_are_refused_clearly():
    """pegrad's per-token untying does not enter a scan yet: a scan_layers model gets
    per-example statistics only, and says so."""
    model, loss, batch = CASES["lm-learned-untied-scan"]()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    with pytest.raises(ValueError, match=r"granularity='token'.*\.blocks\..*'scan'"):
        pegrad.explain(make_loss_fn(static, loss), params, batch, granularity="token")


@pytest.mark.parametrize("granularity", ["example", "token"])
def test_the_cheapest_plan_takes_the_routes_on_a_wider_model(granularity: str):
    """On d_model 64 with 16 positions every route beats materializing, so the default
    planner's choice is the routes' (on the tiny models above it may materialize instead)."""
    config = TransformerConfig.tiny(d_model=64, n_heads=4, d_ff=256, context_length=16)
    model = eqx.filter_eval_shape(TransformerLM, config, key=jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    explain = functools.partial(
        pegrad.explain,
        make_loss_fn(static, lm_loss),
        params,
        (tokens, tokens),
        ("mean", "sq_mean"),
        granularity=cast(pegrad.Granularity, granularity),
    )
    cheapest = explain()
    routes = explain(choose="first")
    assert [p.route for p in cheapest] == [p.route for p in routes]
    # The head is tied: at token granularity the table's rows are gathered and read by it.
    expected = (
        {**_EXAMPLE, "tok_emb": "fallback"}
        if granularity == "example"
        else {**_TOKEN, "tok_emb": "terms"}
    )
    assert [p.route for p in cheapest] == [expected[_kind(p.leaf)] for p in cheapest]
