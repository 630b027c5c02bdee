"""The model families pegrad is benchmarked on, written the way people write them: one registry.

`FAMILIES` maps a name to a `Family`: `build(size, key) -> (params, loss_fn)`, where
`loss_fn(params, example)` is ONE example's loss and `params` a pytree of floating arrays, and
`batch(size, key, B)`, a batch of B examples. A `Size` sets width, sequence length, blocks and
dtype. bench.py's cost table (its "families" section) builds every family at `BENCH` (d 256,
T 64, 4 blocks, float32); tests/zoo.py builds every family at `TINY` in float64, where
tests/test_zoo.py proves every statistic under vmap and under the rewrite (every route a leaf
proves, and the default plan) equal to the naive per-example loop (tests/helpers.py) at
B 1, 2, 3 — so every model the cost table measures is one proven exact. A new family goes
here, and nowhere else; tests/test_zoo.py fails if bench.py offers a family the zoo does not
prove.

The families: an MLP; transformers (`models.TransformerLM`) as a list of blocks, as stacked
blocks in `lax.scan` or read as W[l] in a Python loop, and with grouped-query attention + RoPE;
a GPT written with flax.linen layers (Dense, LayerNorm, Embed, MultiHeadDotProductAttention)
called on x[None], as a list of blocks and in nn.scan (needs flax, from the test extra); a GPT
as a named-axis library lowers it (einsums, a one-hot embedding tied to the head); a CNN
(`eqx.nn.Conv2d`) on 16×16 images (positions above the channels) and on 8×8 (below), and as
stacked kernels run by `lax.scan`; a GRU (`eqx.nn.GRUCell` in `lax.scan`); a top-1 mixture of
experts reading its expert by a gather. Beside them, `ResNet18` (GroupNorm), which
results/bench/scale_fit.py compiles at 224×224 and tests/zoo.py proves exact at width 4.

Each family draws its parameters and data from `jax.random.split(key, 8)` at the indices
bench.py has always used (the model keys[0], or keys[5] for the language models; inputs keys[1],
tokens keys[6], labels keys[7]), so the cost table's models and data are those of its records.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

import models

LossFn = Callable[[PyTree, PyTree], Float[Array, ""]]


@dataclasses.dataclass(frozen=True)
class Size:
    """How big a family is built: transformer d_model, GRU state, MLP width (CNN channels are
    width/4, width/2, width/8); sequence length (the GRU reads half of it); blocks; dtype."""

    width: int = 256
    seq: int = 64
    layers: int = 4
    dtype: str = "float32"  # parameters and floating inputs ("float64": the tests)

    @property
    def shape(self) -> str:
        return f"d{self.width} L{self.layers} T{self.seq}"


BENCH = Size()  # bench.py's cost table (--family-width, --family-seq, --family-layers)
TINY = Size(width=8, seq=4, layers=2, dtype="float64")  # tests/zoo.py: the exactness tests


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # bench.py's --families name
    describe: Callable[[Size], str]  # the cost table's label, e.g. "mlp 256x3"
    build: Callable[[Size, PRNGKeyArray], tuple[PyTree, LossFn]]  # (params, one example's loss)
    batch: Callable[[Size, PRNGKeyArray, int], PyTree]  # (size, key, B) -> B examples

    def __str__(self) -> str:
        return self.name


def _keys(key: PRNGKeyArray) -> Array:
    return jax.random.split(key, 8)


def _dtype(size: Size) -> Any:
    return jnp.dtype(size.dtype)


def _equinox(model: eqx.Module, loss: Callable[[Any, Any], Array]) -> tuple[PyTree, LossFn]:
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return params, models.make_loss_fn(static, loss)


def _cross_entropy(logits: Array, label: Array) -> Array:
    return jax.nn.logsumexp(logits) - logits[label]


def _classify_loss(model: Callable[[Array], Array], example: tuple[Array, Array]) -> Array:
    return _cross_entropy(model(example[0]), example[1])


def _classified(
    key: PRNGKeyArray, size: Size, shape: tuple[int, ...]
) -> tuple[Float[Array, "batch ..."], Int[Array, " batch"]]:
    """Inputs of `shape` (B first) and labels of 10 classes."""
    keys = _keys(key)
    x = jax.random.normal(keys[1], shape, _dtype(size))
    return x, jax.random.randint(keys[7], shape[:1], 0, 10, jnp.int32)


# -- Equinox models ------------------------------------------------------------------------------


class ConvNet(eqx.Module):
    """Two 3×3 convolutions (3 → width → width channels), global average pooling, 10 classes."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, width: int, *, dtype: Any = None, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, width, 3, padding=1, dtype=dtype, key=k1)
        self.conv2 = eqx.nn.Conv2d(width, width, 3, padding=1, dtype=dtype, key=k2)
        self.head = eqx.nn.Linear(width, 10, dtype=dtype, key=k3)

    def __call__(self, image: Float[Array, "3 h w"]) -> Float[Array, "10"]:
        h = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(image))))
        return self.head(jnp.mean(h, axis=(1, 2)))


class ScannedConvs(eqx.Module):
    """A stem convolution, then `depth` same-shape convolutions stacked and run by lax.scan."""

    stem: eqx.nn.Conv2d
    kernels: Array
    head: eqx.nn.Linear

    def __init__(self, width: int, depth: int, *, dtype: Any = None, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.stem = eqx.nn.Conv2d(3, width, 3, padding=1, dtype=dtype, key=k1)
        scale = 1.0 / math.sqrt(9 * width)
        self.kernels = scale * jax.random.normal(k2, (depth, width, width, 3, 3), dtype)
        self.head = eqx.nn.Linear(width, 10, dtype=dtype, key=k3)

    def __call__(self, image: Float[Array, "3 h w"]) -> Float[Array, "10"]:
        def layer(h: Array, kernel: Array) -> tuple[Array, None]:
            return h + jax.nn.relu(jax.lax.conv(h[None], kernel, (1, 1), "SAME")[0]), None

        h, _ = jax.lax.scan(layer, jax.nn.relu(self.stem(image)), self.kernels)
        return self.head(jnp.mean(h, axis=(1, 2)))


class GRU(eqx.Module):
    """`eqx.nn.GRUCell` run over a sequence by lax.scan; a linear read-out at every step."""

    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, d_in: int, width: int, *, dtype: Any = None, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(d_in, width, dtype=dtype, key=k1)
        self.head = eqx.nn.Linear(width, d_in, dtype=dtype, key=k2)

    def __call__(self, xs: Float[Array, "t d"]) -> Float[Array, "t d"]:
        def step(h: Array, x: Array) -> tuple[Array, Array]:
            h = self.cell(x, h)
            return h, h

        h0 = jnp.zeros(self.cell.hidden_size, self.cell.weight_hh.dtype)
        _, hs = jax.lax.scan(step, h0, xs)
        return jax.vmap(self.head)(hs)


class MoE(eqx.Module):
    """A router picks one expert per example; the expert's matrix is read by a gather."""

    router: eqx.nn.Linear
    experts: Array
    head: eqx.nn.Linear

    def __init__(self, width: int, n_experts: int, *, dtype: Any = None, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.router = eqx.nn.Linear(width, n_experts, dtype=dtype, key=k1)
        experts = jax.random.normal(k2, (n_experts, width, width), dtype)
        self.experts = experts / math.sqrt(width)
        self.head = eqx.nn.Linear(width, 10, dtype=dtype, key=k3)

    def __call__(self, x: Float[Array, " d"]) -> Float[Array, "10"]:
        scores = self.router(x)
        choice = jnp.argmax(scores)
        h = jax.nn.softmax(scores)[choice] * jax.nn.gelu(self.experts[choice] @ x)
        return self.head(h)


class _BasicBlock(eqx.Module):
    """ResNet's basic block: two 3×3 convolutions, each normalized, and a (projected) skip."""

    conv1: eqx.nn.Conv2d
    norm1: Callable[[Array], Array]
    conv2: eqx.nn.Conv2d
    norm2: Callable[[Array], Array]
    project: eqx.nn.Conv2d | None
    norm_project: Callable[[Array], Array]

    def __init__(
        self, c_in: int, c_out: int, stride: int, norm: Callable, *, dtype: Any, key: PRNGKeyArray
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        conv = functools.partial(eqx.nn.Conv2d, use_bias=False, dtype=dtype)
        self.conv1 = conv(c_in, c_out, 3, stride, padding=1, key=k1)
        self.norm1 = norm(c_out)
        self.conv2 = conv(c_out, c_out, 3, padding=1, key=k2)
        self.norm2 = norm(c_out)
        down = stride != 1 or c_in != c_out
        self.project = conv(c_in, c_out, 1, stride, key=k3) if down else None
        self.norm_project = norm(c_out)

    def __call__(self, x: Float[Array, "c h w"]) -> Float[Array, "d h2 w2"]:
        h = self.norm2(self.conv2(jax.nn.relu(self.norm1(self.conv1(x)))))
        skip = x if self.project is None else self.norm_project(self.project(x))
        return jax.nn.relu(h + skip)


class ResNet18(eqx.Module):
    """ResNet-18 (He et al. 2016, ImageNet layout: 7×7/2 stem, 3×3/2 max pool, four stages of
    two basic blocks at 64-128-256-512 channels, global average pool, linear head) on one
    image `[3, H, W]`, with GroupNorm (32 groups, or one per channel below 32 channels) where
    the original has BatchNorm (pegrad refuses layers that couple the examples), or no
    normalization (`norm="none"`). `width` scales the stages (width-2w-4w-8w; 64: ResNet-18's).
    results/bench/scale_fit.py compiles it at 224×224; tests/zoo.py proves it exact at width 4.
    """

    stem: eqx.nn.Conv2d
    stem_norm: Callable[[Array], Array]
    blocks: list[_BasicBlock]
    head: eqx.nn.Linear

    def __init__(
        self,
        classes: int = 1000,
        norm: str = "group",
        width: int = 64,
        *,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        if norm not in ("group", "none"):
            raise ValueError(f"norm must be 'group' or 'none', got {norm!r}")

        def make_norm(c: int) -> Callable[[Array], Array]:
            if norm == "none":
                return eqx.nn.Identity()
            return eqx.nn.GroupNorm(min(32, c), c, dtype=dtype)

        keys = jax.random.split(key, 10)
        self.stem = eqx.nn.Conv2d(
            3, width, 7, 2, padding=3, use_bias=False, dtype=dtype, key=keys[0]
        )
        self.stem_norm = make_norm(width)
        self.blocks, c_in = [], width
        for stage in range(4):
            c_out = width * 2**stage
            for i in range(2):
                stride = 2 if stage and not i else 1
                block_key = keys[1 + 2 * stage + i]
                block = _BasicBlock(c_in, c_out, stride, make_norm, dtype=dtype, key=block_key)
                self.blocks.append(block)
                c_in = c_out
        self.head = eqx.nn.Linear(c_in, classes, dtype=dtype, key=keys[9])

    def __call__(self, image: Float[Array, "3 h w"]) -> Float[Array, " classes"]:
        x = jax.nn.relu(self.stem_norm(self.stem(image)))
        x = eqx.nn.MaxPool2d(3, 2, padding=1)(x)
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def _mlp(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
    model = models.MLP(size.width, 10, size.width, 3, dtype=size.dtype, key=_keys(key)[0])
    return _equinox(model, models.mlp_loss)


def _cnn(width: Callable[[int], int]) -> Callable[[Size, PRNGKeyArray], tuple[PyTree, LossFn]]:
    def build(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
        model = ConvNet(width(size.width), dtype=_dtype(size), key=_keys(key)[0])
        return _equinox(model, _classify_loss)

    return build


def _cnn_scan(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
    model = ScannedConvs(size.width // 8, size.layers, dtype=_dtype(size), key=_keys(key)[0])
    return _equinox(model, _classify_loss)


def _gru(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
    model = GRU(32, size.width, dtype=_dtype(size), key=_keys(key)[0])
    return _equinox(model, lambda m, ex: jnp.mean((m(ex[0]) - ex[1]) ** 2))


def _gru_batch(size: Size, key: PRNGKeyArray, b: int) -> tuple[Array, Array]:
    """Sequences of 32 features, T/2 steps; the target is the next step."""
    xs = jax.random.normal(_keys(key)[1], (b, size.seq // 2, 32), _dtype(size))
    return xs, jnp.roll(xs, -1, 1)


def _moe(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
    return _equinox(MoE(size.width, 4, dtype=_dtype(size), key=_keys(key)[0]), _classify_loss)


# -- Transformers: models.TransformerLM ----------------------------------------------------------


def stacked_blocks_in_a_loop(
    model: models.TransformerLM, example: tuple[Array, Array]
) -> Float[Array, ""]:
    """`models.lm_loss` of a model whose blocks are stacked (scan_layers) but read as W[l] in a
    Python loop, as a hand-written model indexes its stacked weights."""
    arrays, rest = eqx.partition(model.blocks, eqx.is_array)
    layers = jax.tree.leaves(arrays)[0].shape[0]
    blocks = tuple(
        eqx.combine(jax.tree.map(lambda a, k=k: a[k], arrays), rest) for k in range(layers)
    )
    return models.lm_loss(eqx.tree_at(lambda m: m.blocks, model, blocks), example)


def _lm_config(size: Size, **options: Any) -> models.TransformerConfig:
    return models.TransformerConfig.small(
        d_model=size.width,
        n_layers=size.layers,
        n_heads=4,
        d_ff=4 * size.width,
        context_length=size.seq,
        dtype=size.dtype,
        **options,
    )


def _lm(
    loss: Callable[[Any, Any], Array] = models.lm_loss, **options: Any
) -> Callable[[Size, PRNGKeyArray], tuple[PyTree, LossFn]]:
    def build(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
        model = models.TransformerLM(_lm_config(size, **options), key=_keys(key)[5])
        return _equinox(model, loss)

    return build


def _lm_batch(size: Size, key: PRNGKeyArray, b: int) -> tuple[Array, Array]:
    """Byte windows: inputs [B, T] and their next tokens."""
    tokens = jax.random.randint(_keys(key)[6], (b, size.seq + 1), 0, 256, jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _token_windows(size: Size, key: PRNGKeyArray, b: int) -> Int[Array, "batch t1"]:
    """Token windows [B, T + 1] of a 256-token vocabulary: each predicts its next tokens."""
    return jax.random.randint(_keys(key)[6], (b, size.seq + 1), 0, 256, jnp.int32)


def _next_token_loss(logits: Array, example: Array) -> Float[Array, ""]:
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), example[1:, None], -1)
    return -jnp.mean(picked)


def _flax_gpt(scan: bool) -> Callable[[Size, PRNGKeyArray], tuple[PyTree, LossFn]]:
    """A GPT written as a flax.linen user writes it, not for pegrad: batched layers called on
    x[None], biases everywhere, LayerNorms, token and position `Embed`s (vocabulary 256)."""

    def build(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
        try:
            import flax.linen as nn
        except ImportError as error:
            raise ValueError("the flax-gpt families need flax: pip install -e '.[test]'") from error
        d, heads, vocab, dtype = size.width, 4, 256, _dtype(size)
        kinds = dict(dtype=dtype, param_dtype=dtype)

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x: Array, _: None = None) -> tuple[Array, None]:
                h = nn.LayerNorm(**kinds)(x)
                mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
                x = x + nn.MultiHeadDotProductAttention(num_heads=heads, **kinds)(h, h, mask=mask)
                h = nn.LayerNorm(**kinds)(x)
                return x + nn.Dense(d, **kinds)(nn.gelu(nn.Dense(4 * d, **kinds)(h))), None

        class GPT(nn.Module):
            @nn.compact
            def __call__(self, tokens: Array) -> Array:
                x = nn.Embed(vocab, d, **kinds)(tokens)
                x = x + nn.Embed(size.seq, d, **kinds)(jnp.arange(tokens.shape[-1]))
                if scan:
                    stack = nn.scan(
                        Block,
                        variable_axes={"params": 0},
                        split_rngs={"params": True},
                        length=size.layers,
                    )
                    x, _ = stack()(x, None)
                else:
                    for _ in range(size.layers):
                        x, _ = Block()(x)
                return nn.Dense(vocab, **kinds)(nn.LayerNorm(**kinds)(x))

        model = GPT()
        keys = _keys(key)
        with jax.numpy_dtype_promotion("standard"):  # Flax is not written for strict promotion
            params = model.init(keys[5], jnp.zeros((1, size.seq), jnp.int32))

        def loss(p: PyTree, example: Array) -> Float[Array, ""]:
            with jax.numpy_dtype_promotion("standard"):
                logits = model.apply(p, example[None, :-1])[0]  # type: ignore[index]
                return _next_token_loss(logits, example)

        return params, loss

    return build


def named_axis_lm(
    key: PRNGKeyArray, vocab: int, d: int, layers: int, heads: int, dtype: Any = None
) -> tuple[PyTree, LossFn]:
    """A GPT as a named-axis library (Haliax) lowers it: every product an einsum, the embedding a
    contraction with one-hot tokens and tied to the head, RMS-norm scales a contraction with the
    feature axis batched ("d,td->td"), the blocks' arrays stacked over layers in lax.scan."""
    k = jax.random.split(key, 5)
    hd = d // heads

    def w(key: PRNGKeyArray, *shape: int) -> Array:
        return jax.random.normal(key, (layers, *shape), dtype) / math.sqrt(shape[0])

    params = {
        "embed": 0.02 * jax.random.normal(k[0], (vocab, d), dtype),
        "scales": jnp.ones((layers, 2, d), dtype),
        "final": jnp.ones((d,), dtype),
        "qkv": w(k[1], d, 3, heads, hd),
        "out": w(k[2], heads, hd, d),
        "up": w(k[3], d, 4 * d),
        "down": w(k[4], 4 * d, d),
    }

    def norm(g: Array, x: Array) -> Array:
        return jnp.einsum(
            "d,td->td", g, x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        )

    def block(x: Array, p: PyTree) -> tuple[Array, None]:
        q, k_, v = jnp.einsum("td,dchk->cthk", norm(p["scales"][0], x), p["qkv"])  # [t, h, k] each
        scores = jnp.einsum("thk,shk->hts", q, k_) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones(scores.shape[1:], bool))
        mixed = jnp.einsum("hts,shk->thk", jax.nn.softmax(jnp.where(causal, scores, -1e9)), v)
        x = x + jnp.einsum("thk,hkd->td", mixed, p["out"])
        up = jax.nn.gelu(jnp.einsum("td,df->tf", norm(p["scales"][1], x), p["up"]))
        return x + jnp.einsum("tf,fd->td", up, p["down"]), None

    def loss(p: PyTree, example: Array) -> Float[Array, ""]:
        one_hot = jax.nn.one_hot(example[:-1], vocab, dtype=p["embed"].dtype)
        x = jnp.einsum("tv,vd->td", one_hot, p["embed"])
        stack = {n: p[n] for n in ("scales", "qkv", "out", "up", "down")}
        x, _ = jax.lax.scan(block, x, stack)
        logits = jnp.einsum("td,vd->tv", norm(p["final"], x), p["embed"])
        return _next_token_loss(logits, example)

    return params, loss


def _named_axis(size: Size, key: PRNGKeyArray) -> tuple[PyTree, LossFn]:
    return named_axis_lm(_keys(key)[5], 256, size.width, size.layers, 4, _dtype(size))


# -- The registry ----------------------------------------------------------------------------------


def _images(side: int) -> Callable[[Size, PRNGKeyArray, int], tuple[Array, Array]]:
    return lambda size, key, b: _classified(key, size, (b, 3, side, side))


def _vectors(size: Size, key: PRNGKeyArray, b: int) -> tuple[Array, Array]:
    return _classified(key, size, (b, size.width))


_REGISTRY = (
    Family("mlp", lambda s: f"mlp {s.width}x3", _mlp, _vectors),
    Family("transformer", lambda s: f"transformer {s.shape}, list of blocks", _lm(), _lm_batch),
    Family(
        "transformer-scan",
        lambda s: f"transformer {s.shape}, blocks in lax.scan",
        _lm(scan_layers=True),
        _lm_batch,
    ),
    Family(
        "transformer-stacked",
        lambda s: f"transformer {s.shape}, stacked blocks read as W[l] in a loop",
        _lm(stacked_blocks_in_a_loop, scan_layers=True),
        _lm_batch,
    ),
    Family(
        "gqa-rope",
        lambda s: f"transformer {s.shape}, GQA + RoPE",
        _lm(position="rotary", n_kv_heads=1),
        _lm_batch,
    ),
    Family(
        "flax-gpt",
        lambda s: f"flax.linen GPT {s.shape}, list of blocks, on x[None]",
        _flax_gpt(scan=False),
        _token_windows,
    ),
    Family(
        "flax-gpt-scan",
        lambda s: f"flax.linen GPT {s.shape}, blocks in nn.scan, on x[None]",
        _flax_gpt(scan=True),
        _token_windows,
    ),
    Family(
        "named-axis",
        lambda s: f"named-axis GPT {s.shape}, einsums, tied one-hot embedding, lax.scan",
        _named_axis,
        _token_windows,
    ),
    Family(
        "cnn",
        lambda s: f"cnn 3-{s.width // 4}-{s.width // 4} 16x16",
        _cnn(lambda d: d // 4),
        _images(16),
    ),
    Family(
        "cnn-8x8",
        lambda s: f"cnn 3-{s.width // 2}-{s.width // 2} 8x8",
        _cnn(lambda d: d // 2),
        _images(8),
    ),
    Family(
        "cnn-scan",
        lambda s: f"cnn 3-{s.width // 8}, {s.layers} convs in lax.scan, 16x16",
        _cnn_scan,
        _images(16),
    ),
    Family("gru", lambda s: f"gru H{s.width} T{s.seq // 2} (lax.scan)", _gru, _gru_batch),
    Family("moe", lambda s: f"moe top-1 gather 4x{s.width}", _moe, _vectors),
)
FAMILIES: dict[str, Family] = {family.name: family for family in _REGISTRY}
