"""Models for pegrad: an MLP and a decoder-only transformer language model, in Equinox.

Every `__call__` here sees ONE example: the MLP maps a vector `[d_in]` to `[d_out]`, the
transformer maps tokens `[seq]` to logits `[seq, vocab]`. The batch axis is added by the
caller's `jax.vmap` (pegrad does this itself), exactly as in the loss contract of SPEC §1.

The losses `mlp_loss`, `mlp_mse_loss` and `lm_loss` take `(model, example)`. pegrad
differentiates `loss_fn(params, example)` with respect to `params`, the floating leaves, so
split the model once and recombine inside the loss (`make_loss_fn`):

    model = TransformerLM(TransformerConfig.tiny(), key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    loss_fn = make_loss_fn(static, lm_loss)          # loss_fn(params, (tokens, targets))
    stats_fn = pegrad.value_and_grad_stats(loss_fn, stats=("mean", "sq_mean"))
    loss, stats = stats_fn(params, (tokens, targets))   # tokens, targets: [B, seq]

The layers are Equinox's own, written the ordinary Equinox way: `eqx.nn.Linear`,
`eqx.nn.LayerNorm` and `eqx.nn.Embedding` each see one position, and `jax.vmap` applies them
along the sequence. Nothing here is shaped for pegrad: its rewrite finds the per-position
structure in the traced computation (`pegrad.explain` reports the route each leaf takes).
Attention is written out, with `eqx.nn.Linear` projections (`CausalSelfAttention` says why).
`TransformerConfig` offers learned or rotary positions, a tied or separate output head,
grouped-query attention (`n_kv_heads`) and blocks stacked and run by `jax.lax.scan`
(`scan_layers`).

Checked by tests/test_models.py: output shapes and dtypes, causality (logits at position t do
not depend on anything after t), the paper-size configuration's parameter count (built
abstractly with `eqx.filter_eval_shape`), scanned blocks equal to the list of blocks, the routes
`pegrad.explain` reports, and per-example gradient statistics through pegrad (both
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
    """The parameter dtype named `name`; a clear error for anything not floating point."""
    dtype = jnp.dtype(name)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype such as 'float32', got {name!r}")
    return dtype


def _at_least_float32(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Losses are computed in float32 or wider, even for bf16 logits."""
    return x if jnp.finfo(x.dtype).bits >= 32 else x.astype(jnp.float32)


def _linear(
    d_in: int, d_out: int, *, std: float, bias: bool, dtype: str, key: PRNGKeyArray
) -> eqx.nn.Linear:
    """`eqx.nn.Linear` (weight `[d_out, d_in]`) with weights drawn from N(0, std²) and zero
    biases: GPT-2's and LeCun's initialisations, where Equinox's default is uniform."""
    k_layer, k_weight = jax.random.split(key)
    layer = eqx.nn.Linear(d_in, d_out, use_bias=bias, dtype=_float_dtype(dtype), key=k_layer)
    weight = std * jax.random.normal(k_weight, layer.weight.shape, layer.weight.dtype)
    layer = eqx.tree_at(lambda m: m.weight, layer, weight)
    if layer.bias is not None:
        layer = eqx.tree_at(lambda m: m.bias, layer, jnp.zeros_like(layer.bias))
    return layer


# ------------------------------------------------------------------------------------------
# MLP (classification and regression)

_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
}


class MLP(eqx.Module):
    """`depth` hidden layers of `width` units, then a linear output layer (depth 0: linear).

    Weights start as LeCun normal (std 1/sqrt(d_in)), biases at zero. Called on ONE input
    vector `[in_size]`, it returns `[out_size]` (the logits, for `mlp_loss`).

    Args:
        in_size: length of the input vector.
        out_size: length of the output vector.
        width: units in each hidden layer.
        depth: number of hidden layers (0: the model is one linear layer).
        activation: applied after each hidden layer: "relu", "gelu", "tanh", "silu", or any
            elementwise function.
        dtype: the parameters' dtype, by name ("float32", "float64", "bfloat16", ...).
        key: the PRNG key the weights are drawn from.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from pegrad import models
        >>> mlp = models.MLP(4, 3, width=16, depth=2, key=jax.random.key(0))
        >>> mlp(jnp.ones(4, jnp.float32)).shape
        (3,)
        >>> [layer.weight.shape for layer in mlp.layers]
        [(16, 4), (16, 16), (3, 16)]
    """

    layers: tuple[eqx.nn.Linear, ...]
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
            _linear(d_in, d_out, std=d_in**-0.5, bias=True, dtype=dtype, key=k)
            for d_in, d_out, k in zip(sizes[:-1], sizes[1:], layer_keys, strict=True)
        )
        self.activation = activation

    def __call__(self, x: Float[Array, " d_in"]) -> Float[Array, " d_out"]:
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)


def mlp_loss(model: MLP, example: tuple[Float[Array, " d_in"], Int[Array, ""]]) -> Scalar:
    """Cross-entropy of one `(input, class label)` example; the model's outputs are the logits.

    Args:
        model: an `MLP` with one output per class.
        example: `(x, label)`: an input vector `[d_in]` and an integer class label.

    Returns:
        logsumexp(logits) − logits[label], a scalar in float32 or wider.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from pegrad import models
        >>> mlp = models.MLP(4, 3, width=8, depth=1, key=jax.random.key(0))
        >>> models.mlp_loss(mlp, (jnp.ones(4, jnp.float32), jnp.array(2))).shape
        ()
    """
    x, label = example
    logits = _at_least_float32(model(x))
    return jax.nn.logsumexp(logits) - logits[label]


def mlp_mse_loss(
    model: MLP, example: tuple[Float[Array, " d_in"], Float[Array, " d_out"]]
) -> Scalar:
    """Squared error of one `(input, target)` example, averaged over the output units.

    Args:
        model: an `MLP`.
        example: `(x, target)`: an input vector `[d_in]` and a target vector `[d_out]`.

    Returns:
        mean((model(x) − target)²), a scalar.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from pegrad import models
        >>> mlp = models.MLP(4, 2, width=8, depth=0, key=jax.random.key(0))  # linear
        >>> target = mlp(jnp.ones(4, jnp.float32)) + 1.0
        >>> print(models.mlp_mse_loss(mlp, (jnp.ones(4, jnp.float32), target)))
        1.0
    """
    x, target = example
    return jnp.mean((model(x) - target) ** 2)


# ------------------------------------------------------------------------------------------
# Decoder-only transformer language model


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape of a `TransformerLM`, one field per knob (each commented below). Presets: `tiny()`
    (tests), `small()` (CPU training), `paper()` (GPT-2-small class, the paper's
    overhead/memory model); each takes overrides. A bad combination (a head count that does not
    divide `d_model`, an odd rotary head dimension, a dtype that is not floating) is a
    `ValueError` naming it, raised when the config is made.

    Example:
        >>> from pegrad import models
        >>> config = models.TransformerConfig.small(n_kv_heads=2, position="rotary")
        >>> config.d_model, config.head_dim, config.kv_heads
        (128, 32, 2)
    """

    vocab_size: int = 256  # number of token ids (256: raw bytes)
    context_length: int = 128  # longest input sequence; rows of the learned position table
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # number of transformer blocks
    n_heads: int = 4  # query heads per block; must divide d_model
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: n_heads
    d_ff: int = 512  # hidden width of each block's MLP (GPT-2: 4 * d_model)
    position: Literal["learned", "rotary"] = "learned"  # learned table or rotary (RoPE) on q, k
    tied_head: bool = True  # logits = x @ tok_emb.T (True) or x @ a separate head matrix
    bias: bool = True  # biases in the dense layers (never on keys: softmax ignores a key bias)
    norm_eps: float = 1e-5  # layer norm epsilon
    rotary_base: float = 10_000.0  # RoPE frequency base
    init_std: float = 0.02  # std of weights and embeddings; residual outputs get /sqrt(2 n_layers)
    scan_layers: bool = False  # blocks stacked into one Block, run by jax.lax.scan
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
        if self.n_kv_heads is not None and self.n_kv_heads < 1:
            raise ValueError(
                f"TransformerConfig.n_kv_heads must be >= 1 (or None: one key/value head per "
                f"query head), got {self.n_kv_heads}"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"TransformerConfig.n_kv_heads={self.n_kv_heads} must divide "
                f"n_heads={self.n_heads}: each key/value head serves n_heads / n_kv_heads "
                "query heads"
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

    @property
    def kv_heads(self) -> int:
        """Key/value heads per block: `n_kv_heads`, or `n_heads` when that is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @classmethod
    def tiny(cls, **overrides: Any) -> "TransformerConfig":
        """About 2,000 parameters, for tests.

        Args:
            **overrides: fields to set instead of the preset's (e.g. `d_model=16`).

        Returns:
            The config: vocabulary 17, context 8, d_model 8, 2 layers of 2 heads, d_ff 32.
        """
        base = dict(vocab_size=17, context_length=8, d_model=8, n_layers=2, n_heads=2, d_ff=32)
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> "TransformerConfig":
        """Byte-level, ~0.8M parameters: trains on a CPU in minutes.

        Args:
            **overrides: fields to set instead of the preset's.

        Returns:
            The config: vocabulary 256, context 128, d_model 128, 4 layers of 4 heads, d_ff 512.
        """
        base = dict(vocab_size=256, context_length=128, d_model=128, n_layers=4, n_heads=4)
        return cls(**{**base, "d_ff": 512, **overrides})

    @classmethod
    def paper(cls, **overrides: Any) -> "TransformerConfig":
        """GPT-2-small shape: 12 layers, d_model 768, 12 heads, GPT-2 vocabulary, 1024 context.

        Args:
            **overrides: fields to set instead of the preset's.

        Returns:
            The config: vocabulary 50257, context 1024, d_model 768, 12 layers of 12 heads,
            d_ff 3072.
        """
        base = dict(vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12)
        return cls(**{**base, "d_ff": 3072, **overrides})


def rotary_embedding(
    x: Float[Array, "seq *heads head_dim"], base: float
) -> Float[Array, "seq *heads head_dim"]:
    """Rotate the two halves of each head's features by position-dependent angles (RoPE).

    Args:
        x: queries or keys of one sequence, `[seq, *heads, head_dim]`, `head_dim` even.
        base: the frequency base (`TransformerConfig.rotary_base`).

    Returns:
        x with features j and j + head_dim/2 of position t rotated by the angle
        t·base^(−j/(head_dim/2)); same shape and dtype (angles in float32 or wider).

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import models
        >>> x = jnp.ones((3, 4))  # 3 positions, one head of dimension 4
        >>> y = models.rotary_embedding(x, base=10_000.0)
        >>> bool(jnp.allclose(y[0], x[0])), y.shape  # position 0 is not rotated
        (True, (3, 4))
    """
    seq, *heads, head_dim = x.shape
    half = head_dim // 2
    angle_dtype = x.dtype if jnp.finfo(x.dtype).bits >= 32 else jnp.float32
    inv_freq = base ** (-jnp.arange(half, dtype=angle_dtype) / half)
    angles = jnp.arange(seq, dtype=angle_dtype)[:, None] * inv_freq[None, :]  # [seq, half]
    angles = angles.reshape(seq, *(1 for _ in heads), half)  # broadcast over the head axes
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class CausalSelfAttention(eqx.Module):
    """Multi-head attention in which position t attends to positions 0..t only; with
    `n_kv_heads < n_heads`, query heads `j * group .. (j + 1) * group - 1` share key/value
    head `j` (`group = n_heads / n_kv_heads`). Called on `[seq, d_model]`, returns the same.

    Written out rather than `eqx.nn.MultiheadAttention`, which gives keys and values as many
    heads as queries (no grouped-query attention). RoPE is `rotary_embedding` above because
    `eqx.nn.RotaryPositionalEmbedding` caches its angle table by size and dtype, not by base,
    so two `rotary_base` values in one process would share a table. And not
    `jax.nn.dot_product_attention`, whose softmax runs in float32 even for float64 inputs,
    which the float64 tests cannot afford.

    Args:
        config: `d_model`, `n_heads`, `kv_heads`, `position`, `rotary_base`, `bias`,
            `init_std` (the output projection's divided by sqrt(2·n_layers)) and `dtype`.
        key: the PRNG key the projections are drawn from.
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    out_proj: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    rotary_base: float | None = eqx.field(static=True)  # None: no rotary embedding

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        d, std, dtype, bias = config.d_model, config.init_std, config.dtype, config.bias
        d_kv = config.kv_heads * config.head_dim
        k_q, k_k, k_v, k_out = jax.random.split(key, 4)
        self.q_proj = _linear(d, d, std=std, bias=bias, dtype=dtype, key=k_q)
        self.k_proj = _linear(d, d_kv, std=std, bias=False, dtype=dtype, key=k_k)
        self.v_proj = _linear(d, d_kv, std=std, bias=bias, dtype=dtype, key=k_v)
        out_std = std / math.sqrt(2 * config.n_layers)
        self.out_proj = _linear(d, d, std=out_std, bias=bias, dtype=dtype, key=k_out)
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.rotary_base = config.rotary_base if config.position == "rotary" else None

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        seq, d_model = x.shape
        kv, head_dim = self.n_kv_heads, d_model // self.n_heads
        # Queries grouped by the key/value head they read: the reshape shares K and V without
        # copying them per query head.
        q = jax.vmap(self.q_proj)(x).reshape(seq, kv, self.n_heads // kv, head_dim)
        k = jax.vmap(self.k_proj)(x).reshape(seq, kv, head_dim)
        v = jax.vmap(self.v_proj)(x).reshape(seq, kv, head_dim)
        if self.rotary_base is not None:
            q = rotary_embedding(q, self.rotary_base)
            k = rotary_embedding(k, self.rotary_base)
        scores = jnp.einsum("tkgd,skd->kgts", q, k) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        mixed = jnp.einsum("kgts,skd->tkgd", weights, v).reshape(seq, d_model)
        return jax.vmap(self.out_proj)(mixed)


class FeedForward(eqx.Module):
    """The MLP of a block, for one position: d_model -> d_ff -> GELU -> d_model.

    Args:
        config: `d_model`, `d_ff`, `bias`, `init_std` (the down projection's divided by
            sqrt(2·n_layers)) and `dtype`.
        key: the PRNG key the projections are drawn from.
    """

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k_up, k_down = jax.random.split(key)
        d, f, std, dtype = config.d_model, config.d_ff, config.init_std, config.dtype
        self.up = _linear(d, f, std=std, bias=config.bias, dtype=dtype, key=k_up)
        down_std = std / math.sqrt(2 * config.n_layers)
        self.down = _linear(f, d, std=down_std, bias=config.bias, dtype=dtype, key=k_down)

    def __call__(self, x: Float[Array, " d_model"]) -> Float[Array, " d_model"]:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(eqx.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)); the norms
    and the MLP see one position at a time, attention the whole sequence.

    Args:
        config: the model's `TransformerConfig`.
        key: the PRNG key the block's weights are drawn from.
    """

    attn_norm: eqx.nn.LayerNorm
    attn: CausalSelfAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp: FeedForward

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k_attn, k_mlp = jax.random.split(key)
        dtype = _float_dtype(config.dtype)
        self.attn_norm = eqx.nn.LayerNorm(config.d_model, eps=config.norm_eps, dtype=dtype)
        self.attn = CausalSelfAttention(config, key=k_attn)
        self.mlp_norm = eqx.nn.LayerNorm(config.d_model, eps=config.norm_eps, dtype=dtype)
        self.mlp = FeedForward(config, key=k_mlp)

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        x = x + self.attn(jax.vmap(self.attn_norm)(x))
        return x + jax.vmap(self.mlp)(jax.vmap(self.mlp_norm)(x))


class TransformerLM(eqx.Module):
    """Decoder-only language model: tokens `[seq]` -> next-token logits `[seq, vocab]`.

    `seq` may be anything up to `config.context_length`. Token ids must lie in
    `[0, vocab_size)`: like all JAX indexing, the embedding gather clamps out-of-range ids
    instead of raising, so the data pipeline is where they are checked.

    `blocks` is a tuple of `Block`s, or with `config.scan_layers` one `Block` whose arrays
    carry a leading `n_layers` axis (built by `eqx.filter_vmap`), run by `jax.lax.scan`: one
    block is traced and compiled instead of `n_layers`. The same key gives the same weights
    either way.

    Args:
        config: the model's shape (`TransformerConfig`).
        key: the PRNG key every weight is drawn from.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from pegrad import models
        >>> model = models.TransformerLM(models.TransformerConfig.tiny(), key=jax.random.key(0))
        >>> model(jnp.array([1, 2, 3])).shape  # 3 tokens -> logits over 17 ids at each
        (3, 17)
        >>> models.count_params(model)
        1944
    """

    tok_emb: eqx.nn.Embedding
    pos_emb: eqx.nn.Embedding | None  # None with rotary positions
    blocks: tuple[Block, ...] | Block  # a Block of stacked arrays with scan_layers
    final_norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear | None  # None with a tied head (the logits read tok_emb.weight)
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        k_tok, k_pos, k_head, k_blocks = jax.random.split(key, 4)
        dtype, std, d = _float_dtype(config.dtype), config.init_std, config.d_model
        self.tok_emb = eqx.nn.Embedding(
            weight=std * jax.random.normal(k_tok, (config.vocab_size, d), dtype)
        )
        self.pos_emb = (
            eqx.nn.Embedding(
                weight=std * jax.random.normal(k_pos, (config.context_length, d), dtype)
            )
            if config.position == "learned"
            else None
        )
        block_keys = jax.random.split(k_blocks, config.n_layers)
        if config.scan_layers:
            self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(block_keys)
        else:
            self.blocks = tuple(Block(config, key=k) for k in block_keys)
        self.final_norm = eqx.nn.LayerNorm(d, eps=config.norm_eps, dtype=dtype)
        self.head = (
            None
            if config.tied_head
            else _linear(d, config.vocab_size, std=std, bias=False, dtype=config.dtype, key=k_head)
        )
        self.config = config

    def embed(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq d_model"]:
        """Token embeddings, plus learned position embeddings when configured.

        Args:
            tokens: token ids `[seq]`, `seq` at most `config.context_length`.

        Returns:
            The residual stream's input, `[seq, d_model]`.
        """
        (seq,) = tokens.shape
        if seq > self.config.context_length:
            raise ValueError(
                f"sequence of length {seq} exceeds context_length={self.config.context_length}"
            )
        x = jax.vmap(self.tok_emb)(tokens)
        if self.pos_emb is not None:
            x = x + jax.vmap(self.pos_emb)(jnp.arange(seq))
        return x

    def from_embeddings(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq vocab"]:
        """Everything after `embed`: the blocks, the final norm and the output head.

        Args:
            x: the residual stream's input, `[seq, d_model]` (`embed`'s output).

        Returns:
            Next-token logits, `[seq, vocab_size]`.
        """
        if isinstance(self.blocks, Block):
            arrays, rest = eqx.partition(self.blocks, eqx.is_array)

            def layer(x: Float[Array, "seq d_model"], block_arrays: PyTree) -> tuple[Array, None]:
                return eqx.combine(block_arrays, rest)(x), None

            x, _ = jax.lax.scan(layer, x, arrays)
        else:
            for block in self.blocks:
                x = block(x)
        x = jax.vmap(self.final_norm)(x)
        if self.head is None:
            return x @ self.tok_emb.weight.T
        return jax.vmap(self.head)(x)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        return self.from_embeddings(self.embed(tokens))


def lm_loss(model: TransformerLM, example: tuple[Int[Array, " seq"], Int[Array, " seq"]]) -> Scalar:
    """Mean next-token cross-entropy of one `(tokens, targets)` sequence over its positions
    (computed in float32 or wider).

    Args:
        model: a `TransformerLM`.
        example: `(tokens, targets)`, two `[seq]` arrays of token ids; `targets[t]` is the id
            that should follow `tokens[: t + 1]`.

    Returns:
        (1/seq) Σ_t (logsumexp(logits[t]) − logits[t, targets[t]]), a scalar.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from pegrad import models
        >>> model = models.TransformerLM(models.TransformerConfig.tiny(), key=jax.random.key(0))
        >>> text = jnp.array([3, 1, 4, 1, 5, 9])
        >>> loss = models.lm_loss(model, (text[:-1], text[1:]))
        >>> bool(abs(loss - jnp.log(17)) < 0.1)  # near log(vocab) at initialisation
        True
    """
    tokens, targets = example
    logits = _at_least_float32(model(tokens))
    target_logits = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)


# ------------------------------------------------------------------------------------------
# Helpers


def make_loss_fn(
    static: PyTree, loss: Callable[[Any, Any], Scalar]
) -> Callable[[PyTree, Any], Scalar]:
    """Turn `loss(model, example)` into pegrad's `loss_fn(params, example)`.

    Args:
        static: the second half of `eqx.partition(model, eqx.is_inexact_array)`.
        loss: a loss of `(model, example)`, such as `mlp_loss` or `lm_loss`.

    Returns:
        `loss_fn(params, example)`, which rebuilds the model from `params` (the first half of
        the partition) and `static` on every call.

    Example:
        >>> import equinox as eqx
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import pegrad
        >>> from pegrad import models
        >>> mlp = models.MLP(4, 3, width=8, depth=1, key=jax.random.key(0))
        >>> params, static = eqx.partition(mlp, eqx.is_inexact_array)
        >>> loss_fn = models.make_loss_fn(static, models.mlp_loss)
        >>> batch = (jnp.ones((5, 4), jnp.float32), jnp.arange(5) % 3)  # B = 5 examples
        >>> loss, stats = pegrad.value_and_grad_stats(loss_fn, ("mean", "sq_norms"))(params, batch)
        >>> stats["sq_norms"].shape
        (5,)
    """

    def loss_fn(params: PyTree, example: Any) -> Scalar:
        return loss(eqx.combine(params, static), example)

    return loss_fn


def count_params(model: PyTree) -> int:
    """Number of floating-point parameters; also works on `eqx.filter_eval_shape` output.

    Args:
        model: any pytree (a model, or its abstract shape from `eqx.filter_eval_shape`).

    Returns:
        The total size of its floating-point leaves (integer and static leaves not counted).

    Example:
        >>> import equinox as eqx
        >>> import jax
        >>> from pegrad import models
        >>> config = models.TransformerConfig.paper()
        >>> shape = eqx.filter_eval_shape(models.TransformerLM, config, key=jax.random.key(0))
        >>> models.count_params(shape)  # GPT-2 small's shape (no key biases: 9,216 fewer)
        124430592
    """
    return sum(
        math.prod(leaf.shape)
        for leaf in jax.tree.leaves(model)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )
