"""Small model pieces, each a pattern pegrad's rewrite must get right, written for ONE example.

Every piece takes `tokenwise`: with tokenwise=True each parameter that a position uses carries a
leading axis T and position t uses its own copy, so `jax.grad` with respect to copy t is exactly
the per-token contribution δ_t ⊗ x_t — an independent reference for granularity="token" that
shares no code with pegrad (helpers.naive_unit_grads).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import naive_unit_grads

T, D_IN, D_HID, D_OUT, VOCAB = 4, 3, 5, 2, 7


def _at(p: jax.Array, t: int | None) -> jax.Array:
    return p if t is None else p[t]


def _per_position(fn: Callable[[int | None, Any], jax.Array], xs: Any, tokenwise: bool) -> Any:
    """Apply fn(t, x_t) at every position; fn receives t only when parameters are per-token."""
    if tokenwise:
        n = jax.tree.leaves(xs)[0].shape[0]
        outs = [fn(t, jax.tree.map(lambda x, t=t: x[t], xs)) for t in range(n)]
        return jax.tree.map(lambda *o: jnp.stack(o), *outs)
    return jax.vmap(lambda x: fn(None, x))(xs)


@dataclasses.dataclass(frozen=True)
class Piece:
    name: str
    init: Callable[[jax.Array], Any]  # key -> params
    loss: Callable[..., jax.Array]  # (params, example, tokenwise=False) -> scalar
    example: Callable[[jax.Array, int], Any]  # (key, B) -> batch
    sequence: bool  # per-token statistics are defined for every parameter

    def __str__(self) -> str:
        return self.name


def _normal(key: jax.Array, *shape: int) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float64)


def _regression_batch(key: jax.Array, b: int, x_shape: tuple, y_shape: tuple) -> Any:
    kx, ky = jax.random.split(key)
    return _normal(kx, b, *x_shape), _normal(ky, b, *y_shape)


# -- single-vector pieces: rank-one gradients ----------------------------------------------


def dense_bias_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    x, y = ex
    return jnp.sum((jnp.tanh(p["w"] @ x + p["b"]) - y) ** 2)


def dense_nobias_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    x, y = ex
    return jnp.sum(jnp.sin(p["w"] @ x) * y)


def mlp_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    x, y = ex
    h = x
    for layer in p[:-1]:
        h = jax.nn.gelu(layer["w"] @ h + layer["b"])
    return jnp.sum((p[-1]["w"] @ h - y) ** 2) / 2.0


def tied_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    """The same matrix used twice: an autoencoder with decoder = encoderᵀ."""
    x, _ = ex
    h = jnp.tanh(p["w"] @ x)
    return jnp.sum((p["w"].T @ h - x) ** 2)


def broadcast_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    """A scalar temperature and a vector gain broadcast against a matrix product."""
    x, y = ex
    z = p["scale"] * (p["gain"][:, None] * p["w"]) @ x
    return jnp.sum(jnp.cos(z) * y)


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.layers = [
            eqx.nn.Linear(D_IN, D_HID, key=k1, dtype=jnp.float64),
            eqx.nn.Linear(D_HID, D_OUT, key=k2, dtype=jnp.float64),
        ]

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.checkpoint(lambda z: jax.nn.relu(self.layers[0](z)))(x)
        return eqx.filter_jit(self.layers[1])(h)


def eqx_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    x, y = ex
    return jnp.sum((p(x) - y) ** 2)


def control_flow_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    """cond, a fori loop (scan), a data-independent regularizer and an unused parameter."""
    x, y = ex
    h = jax.lax.cond(
        jnp.sum(x) > 0, lambda z: jnp.sin(p["w"] @ z), lambda z: jnp.cos(p["w"] @ z), x
    )
    h = jax.lax.fori_loop(0, 2, lambda i, z: z * p["decay"], h)
    penalty = jnp.sum(p["reg"] ** 2) + 0.0 * jnp.sum(p["unused"])
    return jnp.sum((h - y) ** 2) + penalty


def conv_scan_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    """A 1-d convolution, then stacked layers applied with lax.scan."""
    x, y = ex
    h = jax.lax.conv_general_dilated(x.T[None], p["kernel"], (1,), "SAME")[0]
    h, _ = jax.lax.scan(lambda z, w: (jnp.tanh(w @ z), None), h.sum(1), p["stack"])
    return jnp.sum((h[:D_OUT] - y) ** 2)


# -- sequence pieces: weights applied at every position --------------------------------------


def dense_seq_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    xs, ys = ex
    out = _per_position(lambda t, x: jnp.tanh(_at(p["w"], t) @ x + _at(p["b"], t)), xs, tokenwise)
    return jnp.mean((out - ys) ** 2)


def embedding_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    tokens, ys = ex
    positions = jnp.arange(tokens.shape[0])

    def at(t: int | None, inputs: Any) -> jax.Array:
        tok, pos = inputs
        h = _at(p["emb"], t)[tok] + _at(p["pos"], t)[pos]
        return _at(p["w"], t) @ jnp.tanh(h)

    out = _per_position(at, (tokens, positions), tokenwise)
    return jnp.sum((out - ys) ** 2)


def tied_lm_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    """Token embedding tied with the output head: each position uses the table twice."""
    tokens, targets = ex

    def at(t: int | None, inputs: Any) -> jax.Array:
        tok, target = inputs
        table = _at(p["emb"], t)
        h = jnp.tanh(_at(p["w"], t) @ table[tok])
        return jax.nn.logsumexp(table @ h) - (table @ h)[target]

    return jnp.mean(_per_position(at, (tokens, targets), tokenwise))


def layer_norm_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    xs, ys = ex

    def at(t: int | None, x: jax.Array) -> jax.Array:
        z = (x - x.mean()) / jnp.sqrt(x.var() + 1e-5)
        return jnp.tanh(_at(p["scale"], t) * z + _at(p["shift"], t))

    out = _per_position(at, xs, tokenwise)
    return jnp.mean((out - ys) ** 2)


def attention_loss(p: Any, ex: Any, tokenwise: bool = False) -> jax.Array:
    """Two-head causal self-attention with query/key/value/output projections."""
    xs, ys = ex
    n_heads = 2
    q = _per_position(lambda t, x: _at(p["wq"], t) @ x, xs, tokenwise)
    k = _per_position(lambda t, x: _at(p["wk"], t) @ x, xs, tokenwise)
    v = _per_position(lambda t, x: _at(p["wv"], t) @ x, xs, tokenwise)
    n = xs.shape[0]
    q, k, v = (a.reshape(n, n_heads, -1) for a in (q, k, v))
    scores = jnp.einsum("shd,thd->hst", q, k) / jnp.sqrt(float(q.shape[-1]))
    scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
    mixed = jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, axis=-1), v).reshape(n, -1)
    out = _per_position(lambda t, m: _at(p["wo"], t) @ m, mixed, tokenwise)
    return jnp.mean((out - ys) ** 2)


def _dense(key: jax.Array, n_out: int, n_in: int, bias: bool = True) -> dict:
    kw, kb = jax.random.split(key)
    layer = {"w": _normal(kw, n_out, n_in) / np.sqrt(n_in)}
    if bias:
        layer["b"] = 0.1 * _normal(kb, n_out)
    return layer


def _tokens_batch(key: jax.Array, b: int) -> Any:
    kt, ky = jax.random.split(key)
    return jax.random.randint(kt, (b, T), 0, VOCAB), _normal(ky, b, T, D_OUT)


PIECES = [
    Piece(
        "dense_bias",
        lambda k: _dense(k, D_OUT, D_IN),
        dense_bias_loss,
        lambda k, b: _regression_batch(k, b, (D_IN,), (D_OUT,)),
        False,
    ),
    Piece(
        "dense_nobias",
        lambda k: _dense(k, D_OUT, D_IN, bias=False),
        dense_nobias_loss,
        lambda k, b: _regression_batch(k, b, (D_IN,), (D_OUT,)),
        False,
    ),
    Piece(
        "mlp3",
        lambda k: [
            _dense(kk, o, i)
            for kk, (o, i) in zip(
                jax.random.split(k, 3), [(D_HID, D_IN), (D_HID, D_HID), (D_OUT, D_HID)], strict=True
            )
        ],
        mlp_loss,
        lambda k, b: _regression_batch(k, b, (D_IN,), (D_OUT,)),
        False,
    ),
    Piece(
        "tied",
        lambda k: _dense(k, D_HID, D_IN, bias=False),
        tied_loss,
        lambda k, b: _regression_batch(k, b, (D_IN,), (D_OUT,)),
        False,
    ),
    Piece(
        "broadcast",
        lambda k: {
            **_dense(k, D_OUT, D_IN, bias=False),
            "scale": jnp.asarray(0.7),
            "gain": 1.0 + 0.1 * _normal(jax.random.fold_in(k, 1), D_OUT),
        },
        broadcast_loss,
        lambda k, b: _regression_batch(k, b, (D_IN,), (D_OUT,)),
        False,
    ),
    Piece(
        "equinox_jit_remat",
        lambda k: EqxMLP(k),
        eqx_loss,
        lambda k, b: _regression_batch(k, b, (D_IN,), (D_OUT,)),
        False,
    ),
    Piece(
        "control_flow",
        lambda k: {
            **_dense(k, D_OUT, D_IN, bias=False),
            "decay": jnp.asarray(0.9),
            "reg": _normal(jax.random.fold_in(k, 1), 2),
            "unused": jnp.ones(3),
        },
        control_flow_loss,
        lambda k, b: _regression_batch(k, b, (D_IN,), (D_OUT,)),
        False,
    ),
    Piece(
        "conv_scan",
        lambda k: {
            "kernel": _normal(k, D_HID, D_IN, 3) / 3.0,
            "stack": _normal(jax.random.fold_in(k, 1), 2, D_HID, D_HID) / np.sqrt(D_HID),
        },
        conv_scan_loss,
        lambda k, b: _regression_batch(k, b, (T, D_IN), (D_OUT,)),
        False,
    ),
    Piece(
        "dense_over_sequence",
        lambda k: _dense(k, D_OUT, D_IN),
        dense_seq_loss,
        lambda k, b: _regression_batch(k, b, (T, D_IN), (T, D_OUT)),
        True,
    ),
    Piece(
        "embedding",
        lambda k: {
            "emb": _normal(k, VOCAB, D_IN),
            "pos": 0.1 * _normal(jax.random.fold_in(k, 1), T, D_IN),
            "w": _dense(jax.random.fold_in(k, 2), D_OUT, D_IN, bias=False)["w"],
        },
        embedding_loss,
        _tokens_batch,
        True,
    ),
    Piece(
        "tied_embedding_head",
        lambda k: {
            "emb": _normal(k, VOCAB, D_IN),
            "w": _dense(jax.random.fold_in(k, 1), D_IN, D_IN, bias=False)["w"],
        },
        tied_lm_loss,
        lambda k, b: (
            jax.random.randint(k, (b, T), 0, VOCAB),
            jax.random.randint(jax.random.fold_in(k, 1), (b, T), 0, VOCAB),
        ),
        True,
    ),
    Piece(
        "layer_norm",
        lambda k: {
            "scale": 1.0 + 0.1 * _normal(k, D_IN),
            "shift": 0.1 * _normal(jax.random.fold_in(k, 1), D_IN),
        },
        layer_norm_loss,
        lambda k, b: _regression_batch(k, b, (T, D_IN), (T, D_IN)),
        True,
    ),
    Piece(
        "attention",
        lambda k: {
            name: _dense(kk, 4, D_IN if name != "wo" else 4, bias=False)["w"]
            for name, kk in zip(["wq", "wk", "wv", "wo"], jax.random.split(k, 4), strict=True)
        },
        attention_loss,
        lambda k, b: _regression_batch(k, b, (T, D_IN), (T, 4)),
        True,
    ),
]


# -- the naive loop, per piece ---------------------------------------------------------------


def piece_unit_grads(piece: Piece, params: Any, batch: Any, granularity: str) -> Any:
    """Per-unit gradients of a piece, one `jax.grad` per example (per-token: untied copies)."""
    tokenwise = None
    if granularity == "token":
        tokenwise = lambda copies, example: piece.loss(copies, example, True)  # noqa: E731
    return naive_unit_grads(lambda p, ex: piece.loss(p, ex, False), params, batch, tokenwise)
