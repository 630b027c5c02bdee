"""A zoo of models written the way other libraries write them (Flax linen and NNX, Equinox's own
`eqx.nn` layers, scans, gathers, stacked weights), each as ONE example's loss. The zoo is ours:
small, float64, built to exercise the patterns pegrad's rewrite meets in the wild. `FAMILIES`
beside `MODELS` is families.py's registry — the models bench.py's cost table measures — at
`families.TINY` (float64), and the scale fit's ResNet-18 at width 4, so that
tests/test_zoo.py proves each benchmarked model exact.

`Model.build(key)` returns (params, loss_fn) with `loss_fn(params, example) -> scalar` and
params a pytree of float64 arrays; `Model.batch(key, B)` returns a batch. `sequence` models have
batch leaves [B, T, ...] and use every parameter position-wise (granularity="token" applies).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import families

T, D = 4, 6  # positions, width
F64 = jnp.float64


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[jax.Array], tuple[Any, Callable]]
    batch: Callable[[jax.Array, int], Any]
    sequence: bool = False

    def __str__(self) -> str:
        return self.name


def _normal(key: jax.Array, *shape: int) -> jax.Array:
    return jax.random.normal(key, shape, F64)


def _vectors(key: jax.Array, b: int, d_in: int = D, d_out: int = 3) -> Any:
    kx, ky = jax.random.split(key)
    return _normal(kx, b, d_in), _normal(ky, b, d_out)


def _sequences(key: jax.Array, b: int, d_in: int = D, d_out: int = D) -> Any:
    kx, ky = jax.random.split(key)
    return _normal(kx, b, T, d_in), _normal(ky, b, T, d_out)


def _standard_promotion(loss: Callable) -> Callable:
    """Flax is not written for strict dtype promotion (the tests' setting): trace it under
    JAX's standard rules, as its users do."""

    def traced(p: Any, ex: Any) -> jax.Array:
        with jax.numpy_dtype_promotion("standard"):
            return loss(p, ex)

    return traced


def _equinox(model: Any, loss: Callable) -> tuple[Any, Callable]:
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return params, lambda p, ex: loss(eqx.combine(p, static), ex)


# -- Flax ------------------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(8, dtype=F64, param_dtype=F64)(x))
        h = nn.LayerNorm(dtype=F64, param_dtype=F64)(h)
        return nn.Dense(3, dtype=F64, param_dtype=F64)(h)


def linen_mlp(key: jax.Array) -> tuple[Any, Callable]:
    module = LinenMLP()
    with jax.numpy_dtype_promotion("standard"):
        params = module.init(key, jnp.zeros(D, F64))

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        return jnp.sum((module.apply(p, x) - y) ** 2)

    return params, _standard_promotion(loss)


class LinenBlock(nn.Module):
    """Pre-norm causal self-attention and an MLP on one sequence [T, D]. (No attention biases:
    softmax ignores a key bias, whose gradient is then round-off, with no well-posed sign.)"""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[0]))
        h = nn.LayerNorm(dtype=F64, param_dtype=F64)(x)
        x = x + nn.MultiHeadDotProductAttention(2, dtype=F64, param_dtype=F64, use_bias=False)(
            h, h, mask=mask
        )
        h = nn.LayerNorm(dtype=F64, param_dtype=F64)(x)
        return x + nn.Dense(D, dtype=F64, param_dtype=F64)(
            jnp.tanh(nn.Dense(8, dtype=F64, param_dtype=F64)(h))
        )


def linen_block(key: jax.Array) -> tuple[Any, Callable]:
    module = LinenBlock()
    with jax.numpy_dtype_promotion("standard"):
        params = module.init(key, jnp.zeros((T, D), F64))

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        return jnp.mean((module.apply(p, x) - y) ** 2)

    return params, _standard_promotion(loss)


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(D, 8, rngs=rngs, param_dtype=F64, dtype=F64)
        self.norm = nnx.LayerNorm(8, rngs=rngs, param_dtype=F64, dtype=F64)
        self.out = nnx.Linear(8, 3, rngs=rngs, param_dtype=F64, dtype=F64)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.norm(jax.nn.silu(self.hidden(x))))


def nnx_mlp(key: jax.Array) -> tuple[Any, Callable]:
    with jax.numpy_dtype_promotion("standard"):
        graphdef, params = nnx.split(NnxMLP(nnx.Rngs(params=key)), nnx.Param)

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        return jnp.sum((nnx.merge(graphdef, p)(x) - y) ** 2)

    return params, _standard_promotion(loss)


# -- Library models called on a batch of one: x[None] -----------------------------------------

V = 11  # vocabulary of the language models


class LinenGPT(nn.Module):
    """A GPT as Flax users write it: token and position `Embed`s, pre-norm blocks of attention
    and a Dense MLP with biases, a final LayerNorm, an untied head or the embedding's `attend`;
    called on a batch [1, T] of token ids."""

    tied: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        dense = dict(dtype=F64, param_dtype=F64)
        embed = nn.Embed(V, D, **dense)
        x = embed(tokens) + nn.Embed(T, D, **dense)(jnp.arange(tokens.shape[-1])[None])
        mask = nn.make_causal_mask(jnp.ones(tokens.shape))
        h = nn.LayerNorm(**dense)(x)
        x = x + nn.MultiHeadDotProductAttention(2, use_bias=False, **dense)(h, h, mask=mask)
        h = nn.LayerNorm(**dense)(x)
        x = x + nn.Dense(D, **dense)(nn.gelu(nn.Dense(8, **dense)(h)))
        x = nn.LayerNorm(**dense)(x)
        return embed.attend(x) if self.tied else nn.Dense(V, **dense)(x)


def _next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[1:, None], axis=-1))


def linen_gpt(key: jax.Array, tied: bool = False) -> tuple[Any, Callable]:
    module = LinenGPT(tied=tied)
    with jax.numpy_dtype_promotion("standard"):
        params = module.init(key, jnp.zeros((1, T), jnp.int32))

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        return _next_token_loss(module.apply(p, tokens[None, :-1])[0], tokens)

    return params, _standard_promotion(loss)


def _token_windows(key: jax.Array, b: int) -> jax.Array:
    """Token ids [B, T + 1] with repeats (a window predicts its own next tokens)."""
    return jax.random.randint(key, (b, T + 1), 0, 4)


class NnxTagger(nnx.Module):
    """NNX layers on a batch [1, T]: an untied token table, a Linear with bias, a LayerNorm."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs, param_dtype=F64, dtype=F64)
        self.hidden = nnx.Linear(D, 8, rngs=rngs, param_dtype=F64, dtype=F64)
        self.norm = nnx.LayerNorm(8, rngs=rngs, param_dtype=F64, dtype=F64)
        self.out = nnx.Linear(8, V, rngs=rngs, param_dtype=F64, dtype=F64)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.out(self.norm(jax.nn.silu(self.hidden(self.embed(tokens)))))


def nnx_tagger(key: jax.Array) -> tuple[Any, Callable]:
    with jax.numpy_dtype_promotion("standard"):
        graphdef, params = nnx.split(NnxTagger(nnx.Rngs(params=key)), nnx.Param)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        return _next_token_loss(nnx.merge(graphdef, p)(tokens[None, :-1])[0], tokens)

    return params, _standard_promotion(loss)


def unit_batch_mlp(key: jax.Array) -> tuple[Any, Callable]:
    """A dense layer and its bias written for batches, called on x[None]."""
    k1, k2 = jax.random.split(key)
    params = {"w": _normal(k1, D, 8) / 3, "b": 0.1 * _normal(k2, 8), "v": _normal(k2, 8, 3) / 3}

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        h = jnp.tanh(x[None] @ p["w"] + p["b"])  # [1, 8]
        return jnp.sum((h @ p["v"] - y[None]) ** 2)

    return params, loss


# -- Equinox's own layers ------------------------------------------------------------------------


class PositionwiseMLP(eqx.Module):
    """eqx.nn.Linear and LayerNorm see one position; jax.vmap applies them to all."""

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(D, dtype=F64)
        self.up = eqx.nn.Linear(D, 8, key=k1, dtype=F64)
        self.down = eqx.nn.Linear(8, D, key=k2, dtype=F64)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(lambda h: self.down(jax.nn.gelu(self.up(self.norm(h)))))(x)


def eqx_positionwise(key: jax.Array) -> tuple[Any, Callable]:
    model = PositionwiseMLP(key)
    model = eqx.tree_at(lambda m: m.norm.weight, model, 1.0 + 0.1 * _normal(key, D))
    return _equinox(model, lambda m, ex: jnp.mean((m(ex[0]) - ex[1]) ** 2))


def eqx_attention(key: jax.Array) -> tuple[Any, Callable]:
    model = eqx.nn.MultiheadAttention(
        2, D, use_query_bias=True, use_output_bias=True, key=key, dtype=F64
    )
    causal = jnp.tril(jnp.ones((T, T), bool))
    return _equinox(
        model, lambda m, ex: jnp.mean((m(ex[0], ex[0], ex[0], mask=causal) - ex[1]) ** 2)
    )


class ConvNet(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1, dtype=F64)
        self.conv2 = eqx.nn.Conv2d(4, 4, 3, padding=1, key=k2, dtype=F64)
        self.head = eqx.nn.Linear(4, 3, key=k3, dtype=F64)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv2(jnp.tanh(self.conv1(x))))
        return self.head(jnp.mean(h, axis=(1, 2)))


def eqx_conv(key: jax.Array) -> tuple[Any, Callable]:
    return _equinox(ConvNet(key), lambda m, ex: jnp.sum((m(ex[0]) - ex[1]) ** 2))


def _images(key: jax.Array, b: int) -> Any:
    kx, ky = jax.random.split(key)
    return _normal(kx, b, 2, 5, 5), _normal(ky, b, 3)


class GRUReader(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(D, 5, key=k1, dtype=F64)
        self.head = eqx.nn.Linear(5, D, key=k2, dtype=F64)

    def __call__(self, xs: jax.Array) -> jax.Array:
        def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = self.cell(x, h)
            return h, h

        _, hs = jax.lax.scan(step, jnp.zeros(5, F64), xs)
        return jax.vmap(self.head)(hs)


def eqx_gru(key: jax.Array) -> tuple[Any, Callable]:
    return _equinox(GRUReader(key), lambda m, ex: jnp.mean((m(ex[0]) - ex[1]) ** 2))


# -- plain JAX patterns ---------------------------------------------------------------------------


@jax.custom_jvp
def soft_relu(x: jax.Array) -> jax.Array:
    return jnp.logaddexp(x, 0.0)


@soft_relu.defjvp
def _soft_relu_jvp(primals: tuple, tangents: tuple) -> tuple:
    (x,), (dx,) = primals, tangents
    return soft_relu(x), jax.nn.sigmoid(x) * dx


def custom_jvp_mlp(key: jax.Array) -> tuple[Any, Callable]:
    k1, k2 = jax.random.split(key)
    params = {"w1": _normal(k1, 8, D) / 3, "w2": _normal(k2, 3, 8) / 3}

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        return jnp.sum((p["w2"] @ soft_relu(p["w1"] @ x) - y) ** 2)

    return params, loss


def moe_top1(key: jax.Array) -> tuple[Any, Callable]:
    """A router picks one of three experts per example; the expert is read by a gather."""
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "router": _normal(k1, 3, D),
        "experts": _normal(k2, 3, 3, D) / 3,
        "bias": _normal(k3, 3),
    }

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        choice = jnp.argmax(p["router"] @ x)
        gate = jax.nn.softmax(p["router"] @ x)[choice]
        return jnp.sum((gate * jnp.tanh(p["experts"][choice] @ x) + p["bias"] - y) ** 2)

    return params, loss


def residual_layer(h: jax.Array, weights: tuple) -> tuple[jax.Array, None]:
    """One gated residual layer as a lax.scan body over stacked (weight, gain)."""
    w, g = weights
    return h + g * jnp.tanh(h @ w), None


def scanned_stack(key: jax.Array) -> tuple[Any, Callable]:
    """Stacked layers [L, D, D] applied by lax.scan, as nn.scan / filter_vmap stacks do."""
    k1, k2 = jax.random.split(key)
    params = {"layers": _normal(k1, 3, D, D) / 3, "gains": 1.0 + 0.1 * _normal(k2, 3, D)}

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        h, _ = jax.lax.scan(residual_layer, x, (p["layers"], p["gains"]))
        return jnp.mean((h - y) ** 2)

    return params, loss


def looped_stack(key: jax.Array) -> tuple[Any, Callable]:
    """The same stacked weights read as w[l] in a Python loop: disjoint slices of one leaf."""
    params = {"layers": _normal(key, 3, D, D) / 3}

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        h = x
        for layer in range(3):
            h = h + jnp.tanh(h @ p["layers"][layer])
        return jnp.mean((h - y) ** 2)

    return params, loss


def relative_position_attention(key: jax.Array) -> tuple[Any, Callable]:
    """Scores get a learned bias rel[T − 1 − t + s]: row t reads the window starting at
    T − 1 − t of one table, and the windows overlap."""
    k1, k2 = jax.random.split(key)
    params = {"qk": _normal(k1, D, D) / 3, "rel": 0.1 * _normal(k2, 2 * T - 1)}

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        window = lambda t: jax.lax.dynamic_slice(p["rel"], (T - 1 - t,), (T,))  # noqa: E731
        scores = (x @ p["qk"]) @ x.T + jax.vmap(window)(jnp.arange(T))
        return jnp.mean((jax.nn.softmax(scores, axis=-1) @ x - y) ** 2)

    return params, loss


def _family(family: families.Family) -> Model:
    """A family of families.py's registry at its tiny float64 size."""
    return Model(
        family.name,
        lambda key: family.build(families.TINY, key),
        lambda key, b: family.batch(families.TINY, key, b),
    )


MODELS = [
    Model("linen_mlp", linen_mlp, _vectors),
    Model("linen_block", linen_block, _sequences, sequence=True),
    Model("nnx_mlp", nnx_mlp, _vectors),
    Model("eqx_positionwise", eqx_positionwise, _sequences, sequence=True),
    Model("eqx_attention", eqx_attention, _sequences, sequence=True),
    Model("eqx_conv", eqx_conv, _images),
    Model("eqx_gru_scan", eqx_gru, _sequences),
    Model("custom_jvp", custom_jvp_mlp, _vectors),
    Model("moe_top1_gather", moe_top1, _vectors),
    Model("scanned_stack", scanned_stack, lambda k, b: _vectors(k, b, D, D)),
    Model("looped_stack", looped_stack, lambda k, b: _vectors(k, b, D, D)),
    Model("relative_position", relative_position_attention, _sequences),
    Model("linen_gpt", linen_gpt, _token_windows),
    Model("linen_gpt_tied", lambda key: linen_gpt(key, tied=True), _token_windows),
    Model("nnx_tagger", nnx_tagger, _token_windows),
    Model("unit_batch_mlp", unit_batch_mlp, _vectors),
]


def resnet18(key: jax.Array) -> tuple[Any, Callable]:
    """results/bench/scale_fit.py's ResNet-18 (families.ResNet18: GroupNorm, a group per channel
    below 32) at width 4 (stages 4-8-16-32), 10 classes, on 128×128 images: its last stage is
    4×4. (On 64×64, 2×2, some entries of the last convolution's gradient are exactly 0 in the
    loop and round-off in vmap: signs that no implementation decides.)"""
    model = families.ResNet18(10, "group", 4, dtype=F64, key=key)
    return _equinox(model, families._classify_loss)


def _photos(key: jax.Array, b: int) -> Any:
    kx, ky = jax.random.split(key)
    return _normal(kx, b, 3, 128, 128), jax.random.randint(ky, (b,), 0, 10)


FAMILIES = [_family(family) for family in families.FAMILIES.values()]
FAMILIES += [Model("resnet18", resnet18, _photos)]  # the scale fit's; GPT-2: tests/test_models
