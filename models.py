"""Models for pegrad: an MLP and a decoder-only transformer language model, in Equinox.

Every ``__call__`` here sees ONE example: the MLP maps a vector ``[d_in]`` to ``[d_out]``, the
transformer maps tokens ``[seq]`` to logits ``[seq, vocab]``. The batch axis is added by the
caller's ``jax.vmap`` (pegrad does this itself), exactly as in the loss contract of SPEC §1.

The losses ``mlp_loss``, ``mlp_mse_loss`` and ``lm_loss`` take ``(model, example)``. pegrad
differentiates ``loss_fn(params, example)`` with respect to ``params``, the floating leaves, so
split the model once and recombine inside the loss::

    model = TransformerLM(TransformerConfig.tiny(), key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    loss_fn = make_loss_fn(static, lm_loss)          # loss_fn(params, (tokens, targets))
    stats_fn = pegrad.value_and_grad_stats(loss_fn, stats=("mean", "sq_mean"))
    loss, stats = stats_fn(params, (tokens, targets))   # tokens, targets: [B, seq]

How the layers are written matters to pegrad's factorized rewrite, which recognises a weight
used at every position from the shape of the computation alone (no per-layer registration):
embeddings are gathers (``tok_emb[tokens]``, ``pos_emb[jnp.arange(seq)]``), every dense layer
is one matmul ``x @ W`` over all positions (``x: [seq, d_in]``, ``W: [d_in, d_out]``), the tied
head is ``x @ tok_emb.T``, and layer norm is the explicit formula with ``scale`` and ``shift``.

Checked by tests/test_models.py: output shapes and dtypes (MLP; transformer with learned and
rotary positions, tied and untied heads), causality (logits at position t do not depend on
anything after t), the paper-size configuration's parameter count (built abstractly with
``eqx.filter_eval_shape``), and per-example gradient statistics through pegrad (both
implementations) against a plain per-example Python loop.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

Scalar = Float[Array, ""]

# ------------------------------------------------------------------------------------------
# Building blocks


def _float_dtype(name: str) -> jnp.dtype:
    """The parameter dtype named ``name``; a clear error for anything not floating point."""
    dtype = jnp.dtype(name)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype such as 'float32', got {name!r}")
    return dtype


def _at_least_float32(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Losses are computed in float32 or wider, even for bf16 logits."""
    return x if jnp.finfo(x.dtype).bits >= 32 else x.astype(jnp.float32)


class Linear(eqx.Module):
    """Dense layer ``y = x @ weight + bias``, applied to every leading position of ``x`` at once."""

    weight: Float[Array, "d_in d_out"]
    bias: Float[Array, " d_out"] | None

    def __init__(
        self, d_in: int, d_out: int, *, std: float, bias: bool, dtype: str, key: PRNGKeyArray
    ):
        self.weight = std * jax.random.normal(key, (d_in, d_out), _float_dtype(dtype))
        self.bias = jnp.zeros((d_out,), _float_dtype(dtype)) if bias else None

    def __call__(self, x: Float[Array, "*pos d_in"]) -> Float[Array, "*pos d_out"]:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class LayerNorm(eqx.Module):
    """Layer norm over the last axis, with a learnable ``scale`` and ``shift``."""

    scale: Float[Array, " d"]
    shift: Float[Array, " d"]
    eps: float = eqx.field(static=True)

    def __init__(self, d: int, *, eps: float, dtype: str):
        self.scale = jnp.ones((d,), _float_dtype(dtype))
        self.shift = jnp.zeros((d,), _float_dtype(dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "*pos d"]) -> Float[Array, "*pos d"]:
        centred = x - x.mean(axis=-1, keepdims=True)
        variance = (centred**2).mean(axis=-1, keepdims=True)
        return centred * jax.lax.rsqrt(variance + self.eps) * self.scale + self.shift


# ------------------------------------------------------------------------------------------
# MLP (classification and regression)

_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
}


class MLP(eqx.Module):
    """``depth`` hidden layers of ``width`` units, then a linear output layer (depth 0: linear).

    Weights start as LeCun normal (std 1/sqrt(d_in)), biases at zero. ``activation`` is a name
    in ``"relu" | "gelu" | "tanh" | "silu"`` or any elementwise function.
    """

    layers: tuple[Linear, ...]
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __init__(
        self,
        in_size: int,
        out_size: int,
        width: int,
        depth: int,
        *,
        activation: str | Callable[[Array], Array] = "relu",
        dtype: str = "float32",
        key: PRNGKeyArray,
    ):
        if min(in_size, out_size, width) < 1 or depth < 0:
            raise ValueError(
                f"MLP needs in_size, out_size, width >= 1 and depth >= 0; got in_size={in_size}, "
                f"out_size={out_size}, width={width}, depth={depth}"
            )
        if isinstance(activation, str):
            if activation not in _ACTIVATIONS:
                raise ValueError(
                    f"unknown activation {activation!r}; choose one of {sorted(_ACTIVATIONS)}"
                )
            activation = _ACTIVATIONS[activation]
        sizes = [in_size] + [width] * depth + [out_size]
        layer_keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(
            Linear(d_in, d_out, std=d_in**-0.5, bias=True, dtype=dtype, key=k)
            for d_in, d_out, k in zip(sizes[:-1], sizes[1:], layer_keys, strict=True)
        )
        self.activation = activation

    def __call__(self, x: Float[Array, " d_in"]) -> Float[Array, " d_out"]:
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)


def mlp_loss(model: MLP, example: tuple[Float[Array, " d_in"], Int[Array, ""]]) -> Scalar:
    """Cross-entropy of one ``(input, class label)`` example; the outputs are the logits."""
    x, label = example
    logits = _at_least_float32(model(x))
    return jax.nn.logsumexp(logits) - logits[label]


def mlp_mse_loss(
    model: MLP, example: tuple[Float[Array, " d_in"], Float[Array, " d_out"]]
) -> Scalar:
    """Squared error of one ``(input, target)`` example, averaged over the output units."""
    x, target = example
    return jnp.mean((model(x) - target) ** 2)


# ------------------------------------------------------------------------------------------
# Decoder-only transformer language model


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape of a ``TransformerLM``. Presets: ``tiny()`` (tests), ``small()`` (CPU training),
    ``paper()`` (GPT-2-small class, the paper's overhead/memory model); each takes overrides."""

    vocab_size: int = 256  # number of token ids (256: raw bytes)
    context_length: int = 128  # longest input sequence; rows of the learned position table
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # number of transformer blocks
    n_heads: int = 4  # attention heads per block; must divide d_model
    d_ff: int = 512  # hidden width of each block's MLP (GPT-2: 4 * d_model)
    position: Literal["learned", "rotary"] = "learned"  # learned table or rotary (RoPE) on q, k
    tied_head: bool = True  # logits = x @ tok_emb.T (True) or x @ a separate head matrix
    bias: bool = True  # biases in the dense layers (never on keys: softmax ignores a key bias)
    norm_eps: float = 1e-5  # layer norm epsilon
    rotary_base: float = 10_000.0  # RoPE frequency base
    init_std: float = 0.02  # std of weights and embeddings; residual outputs get /sqrt(2 n_layers)
    dtype: str = "float32"  # parameter dtype (tests use "float64")

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}"
                )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TransformerConfig.n_heads={self.n_heads} must divide d_model={self.d_model}"
            )
        if self.position not in ("learned", "rotary"):
            raise ValueError(
                f"TransformerConfig.position must be 'learned' or 'rotary', got {self.position!r}"
            )
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"rotary positions need an even head dimension, got d_model/n_heads={self.head_dim}"
            )
        _float_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def tiny(cls, **overrides: Any) -> "TransformerConfig":
        """A few hundred parameters, for tests."""
        base = dict(vocab_size=17, context_length=8, d_model=8, n_layers=2, n_heads=2, d_ff=32)
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> "TransformerConfig":
        """Byte-level, ~0.8M parameters: trains on a CPU in minutes."""
        base = dict(vocab_size=256, context_length=128, d_model=128, n_layers=4, n_heads=4)
        return cls(**{**base, "d_ff": 512, **overrides})

    @classmethod
    def paper(cls, **overrides: Any) -> "TransformerConfig":
        """GPT-2-small shape: 12 layers, d_model 768, 12 heads, GPT-2 vocabulary, 1024 context."""
        base = dict(vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12)
        return cls(**{**base, "d_ff": 3072, **overrides})


def rotary_embedding(
    x: Float[Array, "seq heads head_dim"], base: float
) -> Float[Array, "seq heads head_dim"]:
    """Rotate the two halves of each head's features by position-dependent angles (RoPE)."""
    seq, _, head_dim = x.shape
    half = head_dim // 2
    angle_dtype = x.dtype if jnp.finfo(x.dtype).bits >= 32 else jnp.float32
    inv_freq = base ** (-jnp.arange(half, dtype=angle_dtype) / half)
    angles = jnp.arange(seq, dtype=angle_dtype)[:, None] * inv_freq[None, :]  # [seq, half]
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class CausalSelfAttention(eqx.Module):
    """Multi-head attention in which position t attends to positions 0..t only."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    out_proj: Linear
    n_heads: int = eqx.field(static=True)
    rotary_base: float | None = eqx.field(static=True)  # None: no rotary embedding

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        d, std, dtype = config.d_model, config.init_std, config.dtype
        k_q, k_k, k_v, k_out = jax.random.split(key, 4)
        self.q_proj = Linear(d, d, std=std, bias=config.bias, dtype=dtype, key=k_q)
        self.k_proj = Linear(d, d, std=std, bias=False, dtype=dtype, key=k_k)
        self.v_proj = Linear(d, d, std=std, bias=config.bias, dtype=dtype, key=k_v)
        out_std = std / math.sqrt(2 * config.n_layers)
        self.out_proj = Linear(d, d, std=out_std, bias=config.bias, dtype=dtype, key=k_out)
        self.n_heads = config.n_heads
        self.rotary_base = config.rotary_base if config.position == "rotary" else None

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        seq, d_model = x.shape
        heads = (seq, self.n_heads, d_model // self.n_heads)
        q = self.q_proj(x).reshape(heads)
        k = self.k_proj(x).reshape(heads)
        v = self.v_proj(x).reshape(heads)
        if self.rotary_base is not None:
            q = rotary_embedding(q, self.rotary_base)
            k = rotary_embedding(k, self.rotary_base)
        scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(heads[2])
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        mixed = jnp.einsum("hts,shd->thd", weights, v).reshape(seq, d_model)
        return self.out_proj(mixed)


class FeedForward(eqx.Module):
    """Position-wise MLP: d_model -> d_ff -> GELU -> d_model."""

    up: Linear
    down: Linear

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k_up, k_down = jax.random.split(key)
        std, dtype, bias = config.init_std, config.dtype, config.bias
        self.up = Linear(config.d_model, config.d_ff, std=std, bias=bias, dtype=dtype, key=k_up)
        down_std = std / math.sqrt(2 * config.n_layers)
        self.down = Linear(
            config.d_ff, config.d_model, std=down_std, bias=bias, dtype=dtype, key=k_down
        )

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(eqx.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    attn_norm: LayerNorm
    attn: CausalSelfAttention
    mlp_norm: LayerNorm
    mlp: FeedForward

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k_attn, k_mlp = jax.random.split(key)
        self.attn_norm = LayerNorm(config.d_model, eps=config.norm_eps, dtype=config.dtype)
        self.attn = CausalSelfAttention(config, key=k_attn)
        self.mlp_norm = LayerNorm(config.d_model, eps=config.norm_eps, dtype=config.dtype)
        self.mlp = FeedForward(config, key=k_mlp)

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(eqx.Module):
    """Decoder-only language model: tokens ``[seq]`` -> next-token logits ``[seq, vocab]``.

    ``seq`` may be anything up to ``config.context_length``. Token ids must lie in
    ``[0, vocab_size)``: like all JAX indexing, the embedding gather clamps out-of-range ids
    instead of raising, so the data pipeline is where they are checked.
    """

    tok_emb: Float[Array, "vocab d_model"]
    pos_emb: Float[Array, "context d_model"] | None  # None with rotary positions
    blocks: tuple[Block, ...]
    final_norm: LayerNorm
    head: Float[Array, "d_model vocab"] | None  # None with a tied head
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k_tok, k_pos, k_head, k_blocks = jax.random.split(key, 4)
        dtype, std = _float_dtype(config.dtype), config.init_std
        self.tok_emb = std * jax.random.normal(k_tok, (config.vocab_size, config.d_model), dtype)
        self.pos_emb = (
            std * jax.random.normal(k_pos, (config.context_length, config.d_model), dtype)
            if config.position == "learned"
            else None
        )
        block_keys = jax.random.split(k_blocks, config.n_layers)
        self.blocks = tuple(Block(config, key=k) for k in block_keys)
        self.final_norm = LayerNorm(config.d_model, eps=config.norm_eps, dtype=config.dtype)
        self.head = (
            None
            if config.tied_head
            else std * jax.random.normal(k_head, (config.d_model, config.vocab_size), dtype)
        )
        self.config = config

    def embed(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq d_model"]:
        """Token embeddings, plus learned position embeddings when configured."""
        (seq,) = tokens.shape
        if seq > self.config.context_length:
            raise ValueError(
                f"sequence of length {seq} exceeds context_length={self.config.context_length}"
            )
        x = self.tok_emb[tokens]
        if self.pos_emb is not None:
            positions = jnp.arange(seq)
            x = x + self.pos_emb[positions]
        return x

    def from_embeddings(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq vocab"]:
        """Everything after ``embed``: the blocks, the final norm and the output head."""
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        return x @ (self.tok_emb.T if self.head is None else self.head)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        return self.from_embeddings(self.embed(tokens))


def lm_loss(model: TransformerLM, example: tuple[Int[Array, " seq"], Int[Array, " seq"]]) -> Scalar:
    """Mean next-token cross-entropy of one ``(tokens, targets)`` sequence over its positions
    (computed in float32 or wider)."""
    tokens, targets = example
    logits = _at_least_float32(model(tokens))
    target_logits = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)


# ------------------------------------------------------------------------------------------
# Helpers


def make_loss_fn(
    static: PyTree, loss: Callable[[Any, Any], Scalar]
) -> Callable[[PyTree, Any], Scalar]:
    """Turn ``loss(model, example)`` into pegrad's ``loss_fn(params, example)``.

    ``static`` is the second half of ``eqx.partition(model, eqx.is_inexact_array)``; the
    returned function rebuilds the model from ``params`` and ``static`` on every call.
    """

    def loss_fn(params: PyTree, example: Any) -> Scalar:
        return loss(eqx.combine(params, static), example)

    return loss_fn


def count_params(model: PyTree) -> int:
    """Number of floating-point parameters; also works on ``eqx.filter_eval_shape`` output."""
    return sum(
        math.prod(leaf.shape)
        for leaf in jax.tree.leaves(model)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )
