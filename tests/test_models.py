"""Tests for models.py: shapes and dtypes, causality, the paper-size parameter count, and
per-example gradient statistics through pegrad (both implementations) against a naive loop.

Float64 and strict dtype promotion come from tests/conftest.py.
"""

import functools
from typing import TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_every_implementation, naive_unit_grads

from models import (
    MLP,
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
def _tiny_lm(position: str, tied: bool, dtype: str = "float64") -> TransformerLM:
    # Built eagerly: the compiled small ops are shared by all variants (a jit per variant is
    # slower), and cached so each variant is built once.
    config = TransformerConfig.tiny(position=position, tied_head=tied, dtype=dtype)
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
    "position,tied,dtype",
    [(p, t, "float64") for p, t in LM_VARIANTS]
    + [("learned", False, "float32"), ("rotary", True, "bfloat16")],
)
def test_lm_shapes_dtypes_and_loss(position: str, tied: bool, dtype: str):
    model = _tiny_lm(position, tied, dtype)
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
    ],
)
def test_config_errors(overrides: dict, match: str):
    # TypeError: under the test suite's runtime type checker, a bad Literal fails before
    # __post_init__ gets to raise its ValueError.
    with pytest.raises((ValueError, TypeError), match=match):
        TransformerConfig.tiny(**overrides)


# ------------------------------------------------------------------------------------------
# Causality


@pytest.mark.parametrize("position,tied", [("learned", False), ("rotary", True)])
def test_causality(position: str, tied: bool):
    """d logits[t] / d embeddings[s] is exactly zero for every s > t (and not for s <= t), and
    changing the tokens after position t leaves logits[: t + 1] bit-identical."""
    model = _tiny_lm(position, tied)
    tokens = _lm_batch(model.config.vocab_size)[0][0]
    # changed[t] is `tokens` with every token after position t replaced.
    shifted = (tokens + 1) % model.config.vocab_size
    after = jnp.arange(T)[None, :] > jnp.arange(T - 1)[:, None]  # [T - 1, T]
    changed = jnp.where(after, shifted, tokens)

    @eqx.filter_jit
    def run(model: TransformerLM) -> tuple[jax.Array, jax.Array, jax.Array]:
        jac = jax.jacrev(model.from_embeddings)(model.embed(tokens))  # [T, vocab, T, d_model]
        return jac, model(tokens), jax.vmap(model)(changed)

    jac, logits, changed_logits = run(model)
    per_pair = jnp.max(jnp.abs(jac), axis=(1, 3))  # [t, s]
    future = jnp.triu(jnp.ones((T, T), dtype=bool), k=1)
    assert jnp.all(jnp.where(future, per_pair, 0.0) == 0.0)
    assert jnp.all(jnp.where(future, 1.0, per_pair) > 0.0)
    for t in range(T - 1):
        assert jnp.array_equal(changed_logits[t, : t + 1], logits[: t + 1])
        assert not jnp.array_equal(changed_logits[t, t + 1 :], logits[t + 1 :])


# ------------------------------------------------------------------------------------------
# Paper-size configuration


def _closed_form_count(config: TransformerConfig) -> int:
    d, f, v, n = config.d_model, config.d_ff, config.vocab_size, config.n_layers
    attention = 4 * d * d + 3 * d  # q, k, v, out weights; biases on q, v, out (none on keys)
    feed_forward = 2 * d * f + f + d
    block = attention + feed_forward + 2 * 2 * d  # two layer norms, scale and shift each
    embeddings = v * d + (config.context_length * d if config.position == "learned" else 0)
    head = 0 if config.tied_head else d * v
    return embeddings + n * block + 2 * d + head


@pytest.mark.parametrize("tied", [True, False])
def test_paper_config_parameter_count(tied: bool):
    config = TransformerConfig.paper(tied_head=tied)
    assert (config.vocab_size, config.context_length, config.d_model) == (50257, 1024, 768)
    assert (config.n_layers, config.n_heads, config.d_ff) == (12, 12, 3072)
    shapes = eqx.filter_eval_shape(TransformerLM, config, key=jax.random.key(0))
    n_params = count_params(shapes)
    print(f"paper config, tied_head={tied}: {n_params:,} parameters")
    assert n_params == _closed_form_count(config)
    assert 120e6 < n_params < 170e6
    assert isinstance(shapes.tok_emb, jax.ShapeDtypeStruct)  # nothing was allocated


def test_count_params_matches_leaves():
    model = _tiny_lm("rotary", False)
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


def _lm_case(position: str, tied: bool):
    model = _tiny_lm(position, tied)
    return model, lm_loss, _lm_batch(model.config.vocab_size)


CASES = {
    "mlp": _mlp_case,
    "lm-learned-untied": lambda: _lm_case("learned", False),
    "lm-rotary-tied": lambda: _lm_case("rotary", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pegrad_matches_naive_loop(case: str):
    model, loss, batch = CASES[case]()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    loss_fn = make_loss_fn(static, loss)
    first = jax.tree.map(lambda x: x[0], batch)
    assert jnp.array_equal(jax.jit(loss_fn)(params, first), eqx.filter_jit(loss)(model, first))
    expected = naive_unit_grads(loss_fn, params, batch)
    check_every_implementation(loss_fn, params, batch, expected, case)
