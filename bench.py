"""What per-example gradient statistics cost: pegrad's implementations against the plain gradient.

For every model × statistic set × implementation this prints, and with `--json PATH` saves, one
row with

* time_ratio: the median over timed rounds of (step time) / (step time of the plain baseline
  timed right next to it). The baseline is `jax.value_and_grad` of the mean loss on the same
  model and batch. Each round visits a model's programs in a fresh random order and times each
  one back to back with the baseline (in random order), so a change of machine load hits both
  sides of a ratio alike; one timing repeats a call until `min_time_s` has passed. The first
  call of every program is a warm-up and is not timed; programs slower than `max_program_s`
  per round get fewer rounds (at least one), and those whose warm-up call alone took longer
  report that call (the table says so). compile_s (trace, lower and compile) is separate.
* memory_ratio: temporary memory of the compiled program over the baseline's, read from
  `jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes` (XLA's buffer
  assignment: intermediates only, not arguments or outputs; it works on CPU).
* footprint_ratio: the program's footprint — its arguments, outputs and temporary allocation
  (argument + output + temp − alias bytes of the same analysis; XLA:CPU's own
  `peak_memory_in_bytes` leaves the temporaries out) — over the baseline's: what the device
  holds while it runs. The arguments are the same for every program; the outputs are not (two
  statistics are two parameter-sized trees), so this ratio shows what the temp ratio hides.

Implementations: "plain" (the baseline, mean only), "vmap" (pegrad's exact reference: all B
per-example gradients), "vmap-chunked" (the same, `chunk_size` examples at a time),
"factorized" (pegrad's graph rewrite) at granularity "example", and for the transformer also at
granularity "token" (statistics over the B·T positions: a different quantity).

Sections:

* mlp: an MLP where the sequence length (1) is below the width, cross-entropy on 10 classes;
  every statistic set, every implementation.
* mlp-scaling: the same MLP, mean+sq_mean, B in `mlp_batch_sizes`: how each cost grows with B.
* lm: a byte-level transformer LM with sequence length >= width (`models.TransformerLM`).
* paper: `TransformerConfig.paper()` (GPT-2-small shape) compiled but never run, for its
  memory profile; inputs are `jax.ShapeDtypeStruct`s, so nothing model-sized is allocated.
* families: the model families people train, B = `family_batch`, mean and mean+sq_mean:
  an MLP; transformers as a list of blocks, as stacked blocks in `lax.scan` or read as W[l] in
  a Python loop, and with
  grouped-query attention + RoPE; a GPT written with flax.linen layers (Dense, LayerNorm,
  Embed, MultiHeadDotProductAttention) called on x[None], as a list of blocks and in nn.scan
  (needs flax, from the test extra); a CNN (`eqx.nn.Conv2d`) on 16×16 images (positions above
  the channels) and on 8×8 (below), and as stacked kernels run by `lax.scan`; a GRU
  (`eqx.nn.GRUCell` in `lax.scan`); a top-1 mixture of experts reading its expert by a gather.
  Beside pegrad's implementations, "micro_grad" is optax's
  `optax.microbatching.micro_grad` (per-example gradients one microbatch at a time, transformed
  to (g, g²) and averaged): the JAX peer.
* scale: GPT-2 small (12 blocks, d 768, T 1024, vocabulary 50257, tied head: 124M) and a
  ResNet-18 (`ResNet18`: GroupNorm in place of BatchNorm) on 224×224×3 images, compiled never
  run: plain grad, each of `scale_stat_sets` under pegrad's factorized, vmap and vmap-chunked,
  optax's micro_grad and jax-privacy's `clipped_grad` (where installed) at the microbatch with
  the smallest footprint; the footprint fitted affine in B at `scale_batches`, the largest B
  under each of `scale_budgets_gib` predicted and compiled there to check it. Writes
  `scale_out`.md/.json (command, commit) after every program; one model per command merges
  into the same files:

      python bench.py --sections scale --scale-models gpt2 --scale-batches 4 8
      python bench.py --sections scale --scale-models resnet18 --scale-batches 8 32

Programs whose compiled temporary memory exceeds `max_run_gib` are compiled (their memory is
reported) but not timed; the table says so. A statistic set that `pegrad` refuses for a model
is listed with the reason.

Run (CPU, float32):

    python bench.py                       # everything: ~8 minutes on 2 busy CPU cores
    python bench.py --quick               # small sizes, few rounds: a smoke test (< 1 minute)
    python bench.py --sections mlp lm --reps 11 --json runs/bench.json
    python bench.py --help                # every option, from `Config` below
"""

import argparse
import dataclasses
import functools
import gc
import inspect
import json
import math
import os
import random
import re
import statistics
import sys
import time
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

import hlo_cost
import models
import pegrad
from hlo_cost import H200

IMPLS = ("vmap", "vmap-chunked", "factorized", "factorized-token", "micro_grad")
SECTIONS = ("mlp", "mlp-scaling", "lm", "paper", "families", "scale")
SCALE_MODELS = ("gpt2", "resnet18")
SCALE_IMPLS = ("plain", "factorized", "micro_grad", "jax-privacy", "vmap-chunked", "vmap")
FAMILIES = (
    "mlp",
    "transformer",
    "transformer-scan",
    "transformer-stacked",
    "gqa-rope",
    "flax-gpt",
    "flax-gpt-scan",
    "named-axis",
    "cnn",
    "cnn-8x8",
    "cnn-scan",
    "gru",
    "moe",
)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the benchmark measures. Each field is a flag: `mlp_width` is --mlp-width."""

    quick: bool = False  # smoke-test sizes (QUICK below); flags given explicitly still win
    accelerator: bool = False  # the GPU/TPU run (ACCELERATOR below); explicit flags still win
    sections: tuple[str, ...] = SECTIONS  # which parts to run
    stat_sets: tuple[str, ...] = (  # statistic sets, names joined by "+"
        "mean",
        "mean+sq_mean",
        "sign_mean",
        "var",
        "mean+sq_norms",
        "clipped_mean",
    )
    impls: tuple[str, ...] = IMPLS[:4]  # implementations compared with plain grad (not families)
    clip_norm: float = 1.0  # C of "clipped_mean"
    chunk_size: int = 0  # examples per chunk for vmap-chunked; 0: a quarter of the batch
    reps: int = 7  # timed rounds per model; ratios are medians over rounds
    min_time_s: float = 0.1  # one timing repeats a program until at least this long
    max_run_gib: float = 1.0  # compile but do not run programs needing more temporary memory
    max_program_s: float = 10.0  # timing budget per program: slow ones get fewer rounds (>= 1)
    seed: int = 0  # parameters, data and the order of programs within a round
    mlp_in: int = 1024  # MLP input size
    mlp_width: int = 1024  # MLP hidden width
    mlp_depth: int = 3  # MLP hidden layers
    mlp_classes: int = 10  # MLP output classes (cross-entropy)
    mlp_batch: int = 128  # MLP batch size of the "mlp" section
    mlp_batch_sizes: tuple[int, ...] = (8, 32, 128, 512)  # batch sizes of "mlp-scaling"
    lm_d_model: int = 64  # transformer width
    lm_layers: int = 2  # transformer blocks
    lm_heads: int = 4  # attention heads
    lm_seq: int = 256  # sequence length (>= lm_d_model: the regime where vmap is viable)
    lm_batch: int = 16  # transformer batch size
    lm_tied_head: bool = False  # tied embedding/head (per token, pegrad materializes it in chunks)
    paper_layers: int = 12  # blocks of the paper-size model (12: TransformerConfig.paper())
    paper_seq: int = 1024  # its sequence length
    paper_batch: int = 8  # its batch size (compile only)
    paper_tied_head: bool = False  # tied embedding/head (False: 163M parameters, True: 124M)
    paper_run: bool = False  # also run (time) it: real parameters and tokens (an accelerator's)
    paper_stat_sets: tuple[str, ...] = (  # statistic sets of the "paper" memory profile
        "mean+sq_mean",
        "sign_mean",
        "clipped_mean",
    )
    families: tuple[str, ...] = FAMILIES  # which model families the "families" section runs
    family_batch: int = 32  # batch size of the "families" section
    family_width: int = 256  # width of the family models (transformer d_model, GRU state, ...)
    family_seq: int = 64  # sequence length of the transformers (GRU: half of it)
    family_layers: int = 4  # transformer blocks
    family_stat_sets: tuple[str, ...] = ("mean", "mean+sq_mean")  # statistic sets of "families"
    family_impls: tuple[str, ...] = ("vmap", "factorized", "micro_grad")  # their implementations
    scale_models: tuple[str, ...] = SCALE_MODELS  # models of the "scale" section
    scale_stat_sets: tuple[str, ...] = (  # statistic sets of "scale"
        "mean+sq_mean",
        "mean+var",
        "mean+sq_norms",
        "clipped_mean+sq_norms",
    )
    scale_impls: tuple[str, ...] = SCALE_IMPLS  # programs of "scale" ("plain": plain grad)
    scale_batches: tuple[int, ...] = (2, 4)  # batch sizes the footprint's affine fit reads
    scale_budgets_gib: tuple[float, ...] = (16.0, 40.0, 80.0)  # the largest B that fits each
    scale_verify: bool = True  # compile at each predicted largest B (no: the prediction only)
    scale_unverified: tuple[str, ...] = ()  # implementations whose largest B is predicted only
    scale_chunk_size: int = 1  # examples per chunk of "vmap-chunked" in "scale" (fixed in B)
    scale_microbatches: tuple[int, ...] = (1, 2)  # micro_grad / jax-privacy: the best is kept
    scale_layers: int = 12  # gpt2 blocks (12: GPT-2 small)
    scale_seq: int = 1024  # gpt2 sequence length
    scale_image: int = 224  # resnet18 image side (3 channels)
    scale_norm: str = "group"  # resnet18 normalization: "group" (GroupNorm, 32 groups) or "none"
    scale_out: str = "results/bench/scale"  # "scale" writes PATH.md and PATH.json ("": do not)
    json: str = ""  # write the records here as a JSON list ("": do not)


# --quick: small enough for CI (under a minute on 2 CPU cores).
QUICK: dict[str, Any] = dict(
    sections=("mlp", "mlp-scaling", "lm"),  # add "paper" for a one-layer memory profile
    stat_sets=("mean+sq_mean",),
    reps=3,
    min_time_s=0.01,
    max_program_s=1.0,
    mlp_in=256,
    mlp_width=256,
    mlp_batch=32,
    mlp_batch_sizes=(8, 32),
    lm_d_model=32,
    lm_layers=1,
    lm_heads=2,
    lm_seq=64,
    lm_batch=8,
    paper_layers=1,
    paper_seq=128,
    paper_batch=2,
    paper_stat_sets=("mean+sq_mean",),
    family_batch=8,
    family_width=32,
    family_seq=16,
    family_layers=2,
)

# --accelerator: the README's cost table (mean+sq_mean, every family) on a GPU or TPU in one
# command. XLA:GPU compiles slower than XLA:CPU (on an H200 with jax 0.11.2 about 10 s per
# program of the d 256 transformers, 30-45 s per factorized GPT-2 small), so the other
# statistics and GPT-2 small (tied head, T 1024, run and timed) are separate commands; --json is
# written after each program, so a run cut short keeps what it measured:
#     python bench.py --accelerator --json runs/gpu-families.json                  # ~5 min
#     python bench.py --accelerator --families transformer gqa-rope mlp \
#         --family-stat-sets mean+var mean+sq_norms clipped_mean+sq_norms --json runs/gpu-stats.json
#     python bench.py --accelerator --sections paper --json runs/gpu-paper.json    # ~2 min
ACCELERATOR: dict[str, Any] = dict(
    sections=("families",),
    impls=("vmap", "factorized"),
    reps=5,
    min_time_s=0.05,
    max_program_s=5.0,
    max_run_gib=60.0,
    paper_tied_head=True,
    paper_run=True,
    paper_stat_sets=("mean+sq_mean",),
    families=(
        "transformer",
        "gqa-rope",
        "mlp",
        "transformer-stacked",
        "flax-gpt",
        "transformer-scan",
        "named-axis",
        "flax-gpt-scan",
        "cnn",
        "cnn-8x8",
        "cnn-scan",
        "gru",
        "moe",
    ),
    family_stat_sets=("mean+sq_mean",),
    family_impls=("vmap", "factorized"),
)

PLAIN = "plain"
Record = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Programs: one statistic set under one implementation.


@dataclasses.dataclass(frozen=True)
class Program:
    stats: str  # statistic names joined by "+"; the plain baseline computes "mean"
    impl: str  # "plain" | "vmap" | "vmap-chunked" | "factorized" | "hand-written"
    granularity: str = "example"
    chunk_size: int | None = None
    written: Callable | None = None  # "hand-written": the program itself
    microbatch: int | None = None  # "micro_grad", "jax-privacy": examples per microbatch

    def build(self, loss_fn: Callable, clip_norm: float) -> Callable:
        """`fn(params, batch) -> (loss, gradient or statistics)`."""
        if self.written is not None:
            return self.written
        if self.impl == PLAIN:
            return plain_value_and_grad(loss_fn)
        names = tuple(self.stats.split("+"))
        if self.impl == "micro_grad":
            return optax_micro_grad(loss_fn, names, self.microbatch, clip_norm)
        if self.impl == "jax-privacy":
            return jax_privacy_clipped_grad(loss_fn, names, self.microbatch, clip_norm)
        fn = pegrad.value_and_grad_stats(
            loss_fn,
            names,
            impl="vmap" if self.impl.startswith("vmap") else "factorized",
            chunk_size=self.chunk_size,
            granularity="token" if self.granularity == "token" else "example",
            clip_norm=clip_norm if "clipped_mean" in names else None,
        )
        if "dot" not in names:
            return fn
        return lambda params, batch: fn(params, batch, dot_with=params)  # v: a tree like them


def plain_value_and_grad(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
) -> Callable[[PyTree, PyTree], tuple[Float[Array, ""], PyTree]]:
    """The baseline: `jax.value_and_grad` of the mean loss over the batch."""

    def mean_loss(params: PyTree, batch: PyTree) -> Float[Array, ""]:
        return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0))(params, batch))

    return jax.value_and_grad(mean_loss)


def hand_written_mlp(static: PyTree) -> Callable:
    """The floor of mean + sq_mean on `models.MLP` with `models.mlp_loss`: the backward pass
    written out by hand, each layer's (1/B) Σ_i δ_i² ⊗ x_i² formed beside its gradient
    (1/B) Σ_i δ_i ⊗ x_i from the same δ and x — the one extra matmul per weight the statistic
    costs, and nothing else. Returns (loss, {"mean", "sq_mean"}) as pegrad does; tests/test_bench
    proves its numbers equal to pegrad's."""

    def fn(params: PyTree, batch: PyTree) -> tuple[Float[Array, ""], dict[str, PyTree]]:
        model = eqx.combine(params, static)
        x, labels = batch
        n = x.shape[0]
        inputs, pullbacks = [], []
        for layer in model.layers[:-1]:
            inputs.append(x)
            x, pullback = jax.vjp(model.activation, x @ layer.weight.T + layer.bias)
            pullbacks.append(pullback)
        inputs.append(x)
        logits = x @ model.layers[-1].weight.T + model.layers[-1].bias
        loss = jnp.mean(
            jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]
        )
        delta = jax.nn.softmax(logits) - jax.nn.one_hot(
            labels, logits.shape[-1], dtype=logits.dtype
        )
        mean, sq = [], []  # per layer, last first: (weight, bias)
        for k in reversed(range(len(model.layers))):
            h, d2 = inputs[k], delta * delta
            mean.append(((delta.T @ h) / n, jnp.sum(delta, 0) / n))
            sq.append(((d2.T @ (h * h)) / n, jnp.sum(d2, 0) / n))
            if k:
                (delta,) = pullbacks[k - 1](delta @ model.layers[k].weight)

        def tree(values: list) -> PyTree:
            leaves = [leaf for pair in reversed(values) for leaf in pair]
            where = lambda m: [x for layer in m.layers for x in (layer.weight, layer.bias)]  # noqa: E731
            return eqx.tree_at(where, params, leaves)

        return loss, {"mean": tree(mean), "sq_mean": tree(sq)}

    return fn


def optax_micro_grad(
    loss_fn: Callable,
    names: tuple[str, ...],
    microbatch: int | None = None,
    clip_norm: float = 1.0,
) -> Callable:
    """optax's per-example gradients (the paper's first author's tool), `microbatch` examples at
    a time (None: the whole batch in one vmap): each example's gradient g transformed to what
    `names` needs — g for "mean", g² for "sq_mean", both for "var" (N/(N−1)(q − ḡ²) afterwards),
    g·min(1, C/‖g‖) for "clipped_mean" — and averaged; ‖g‖² per example (optax's `metrics_fn`)
    for "sq_norms". Returns (mean loss, {name: statistic}) as pegrad does."""
    if unknown := set(names) - {"mean", "sq_mean", "var", "sq_norms", "clipped_mean"}:
        raise ValueError(f"micro_grad is not benchmarked on {sorted(unknown)}")
    moments = [n for n in ("mean", "sq_mean") if n in names or "var" in names]

    def sq_norm(g: PyTree) -> Array:
        return jnp.sum(jnp.stack([jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)]))

    def transform(g: PyTree) -> dict[str, PyTree]:
        out = {n: g if n == "mean" else jax.tree.map(jnp.square, g) for n in moments}
        if "clipped_mean" in names:
            factor = jnp.minimum(1.0, clip_norm / jnp.sqrt(sq_norm(g)))
            out["clipped_mean"] = jax.tree.map(lambda x: x * factor.astype(x.dtype), g)
        return out

    grad_fn = optax.microbatching.micro_grad(
        loss_fn,
        batch_argnums=1,
        keep_batch_dim=False,
        microbatch_size=microbatch,
        accumulator=optax.microbatching.AccumulationType.MEAN,
        transform_fn=transform,
        metrics_fn=sq_norm if "sq_norms" in names else lambda g: (),
    )

    def fn(params: PyTree, batch: PyTree) -> tuple[Array, dict[str, PyTree]]:
        out, aux = grad_fn(params, batch)
        stats = {n: out[n] for n in out if n in names}
        if "var" in names:
            n = jax.tree.leaves(batch)[0].shape[0]
            centred = lambda q, m: n / (n - 1) * (q - m * m)  # noqa: E731
            stats["var"] = jax.tree.map(centred, out["sq_mean"], out["mean"])
        if "sq_norms" in names:
            stats["sq_norms"] = aux.metrics
        return jnp.mean(aux.values), stats

    return fn


def jax_privacy_clipped_grad(
    loss_fn: Callable, names: tuple[str, ...], microbatch: int | None, clip_norm: float
) -> Callable:
    """jax-privacy's `clipped_grad` (the DP library's per-example clipped sum, `microbatch`
    examples at a time), divided by N: the clipped mean, and ‖g_i‖² from its grad norms.
    Needs jax-privacy (not a dependency of this project: a separate environment)."""
    if not {"clipped_mean"} <= set(names) <= {"clipped_mean", "sq_norms"}:
        raise ValueError(f"jax-privacy's clipped_grad gives clipped_mean (+ sq_norms), not {names}")
    try:
        from jax_privacy import clipping  # type: ignore[import-not-found]
    except ImportError as error:
        raise ValueError("jax-privacy is not installed in this environment") from error
    grad_fn = clipping.clipped_grad(
        loss_fn,
        l2_clip_norm=clip_norm,
        batch_argnums=1,
        keep_batch_dim=False,
        return_values=True,
        return_grad_norms="sq_norms" in names,
        microbatch_size=microbatch,
    )

    def fn(params: PyTree, batch: PyTree) -> tuple[Array, dict[str, PyTree]]:
        n = jax.tree.leaves(batch)[0].shape[0]
        total, aux = grad_fn(params, batch)
        stats = {"clipped_mean": jax.tree.map(lambda x: x / n, total)}
        if "sq_norms" in names:
            stats["sq_norms"] = jnp.square(aux.grad_norms)
        return jnp.mean(aux.values), stats

    return fn


def programs_for(
    stat_sets: Sequence[str], batch_size: int, config: Config, *, token: bool
) -> list[Program]:
    """The baseline, then every statistic set under every implementation in `config.impls`
    ("factorized-token" only where `token`: models with a sequence axis)."""
    return _programs(stat_sets, batch_size, config, config.impls, token=token)


def _programs(
    stat_sets: Sequence[str], batch_size: int, config: Config, impls: Sequence[str], *, token: bool
) -> list[Program]:
    chunk = config.chunk_size or max(1, batch_size // 4)
    variants = {
        "vmap": Program("", "vmap"),
        "vmap-chunked": Program("", "vmap-chunked", chunk_size=chunk),
        "factorized": Program("", "factorized"),
        "factorized-token": Program("", "factorized", granularity="token"),
        "micro_grad": Program("", "micro_grad"),
    }
    impls = [i for i in IMPLS if i in impls and (token or i != "factorized-token")]
    out = [Program("mean", PLAIN)]
    for stats in stat_sets:
        out += [dataclasses.replace(variants[i], stats=stats) for i in impls]
    return out


# --------------------------------------------------------------------------------------------
# Models: a loss for one example, parameters, and a batch (arrays, or shapes only).


@dataclasses.dataclass(frozen=True)
class Workload:
    section: str
    model: str  # a short description, e.g. "mlp 1024-1024x3-10 (3.2M)"
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]]
    params: PyTree  # arrays, or jax.ShapeDtypeStruct for compile-only workloads
    batch: PyTree
    programs: tuple[Program, ...]
    run: bool  # time the programs (False: memory analysis only)

    @property
    def batch_size(self) -> int:
        return jax.tree.leaves(self.batch)[0].shape[0]


def _is_float_leaf(x: Any) -> bool:
    """Floating arrays, or their abstract shapes (from eqx.filter_eval_shape)."""
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)


def mlp_workload(
    config: Config, batch_size: int, section: str, stat_sets: Sequence[str]
) -> Workload:
    key_model, key_x, key_y = jax.random.split(jax.random.key(config.seed), 3)
    model = models.MLP(
        config.mlp_in, config.mlp_classes, config.mlp_width, config.mlp_depth, key=key_model
    )
    params, static = eqx.partition(model, _is_float_leaf)
    x = jax.random.normal(key_x, (batch_size, config.mlp_in), jnp.float32)
    labels = jax.random.randint(key_y, (batch_size,), 0, config.mlp_classes, jnp.int32)
    n = models.count_params(model)
    name = (
        f"mlp {config.mlp_in}-{config.mlp_width}x{config.mlp_depth}-{config.mlp_classes}"
        f" ({n / 1e6:.1f}M)"
    )
    programs = programs_for(stat_sets, batch_size, config, token=False)
    if "mean+sq_mean" in stat_sets:
        programs.append(Program("mean+sq_mean", "hand-written", written=hand_written_mlp(static)))
    return Workload(
        section,
        name,
        models.make_loss_fn(static, models.mlp_loss),
        params,
        (x, labels),
        tuple(programs),
        run=True,
    )


def lm_workload(config: Config) -> Workload:
    key_model, key_data = jax.random.split(jax.random.key(config.seed))
    lm = models.TransformerConfig.small(
        d_model=config.lm_d_model,
        n_layers=config.lm_layers,
        n_heads=config.lm_heads,
        d_ff=4 * config.lm_d_model,
        context_length=config.lm_seq,
        tied_head=config.lm_tied_head,
    )
    model = models.TransformerLM(lm, key=key_model)
    params, static = eqx.partition(model, _is_float_leaf)
    shape = (config.lm_batch, config.lm_seq + 1)
    tokens = jax.random.randint(key_data, shape, 0, lm.vocab_size, jnp.int32)
    n = models.count_params(model)
    name = f"lm d{lm.d_model} L{lm.n_layers} T{config.lm_seq} ({n / 1e6:.2f}M)"
    return Workload(
        "lm",
        name,
        models.make_loss_fn(static, models.lm_loss),
        params,
        (tokens[:, :-1], tokens[:, 1:]),
        tuple(programs_for(config.stat_sets, config.lm_batch, config, token=True)),
        run=True,
    )


def paper_workload(config: Config) -> Workload:
    lm = models.TransformerConfig.paper(
        n_layers=config.paper_layers, tied_head=config.paper_tied_head
    )
    key_model, key_data = jax.random.split(jax.random.key(config.seed))
    if config.paper_run:  # real parameters and tokens, to be timed
        model = models.TransformerLM(lm, key=key_model)
        shape = (config.paper_batch, config.paper_seq + 1)
        tokens = jax.random.randint(key_data, shape, 0, lm.vocab_size, jnp.int32)
        batch = (tokens[:, :-1], tokens[:, 1:])
    else:  # shapes only: compiled, never run, nothing model-sized allocated
        model = eqx.filter_eval_shape(models.TransformerLM, lm, key=key_model)
        shape = (config.paper_batch, config.paper_seq)
        batch = (jax.ShapeDtypeStruct(shape, jnp.int32),) * 2
    params, static = eqx.partition(model, _is_float_leaf)
    n = models.count_params(model)
    name = f"paper d{lm.d_model} L{lm.n_layers} T{config.paper_seq} ({n / 1e6:.0f}M)"
    return Workload(
        "paper",
        name,
        models.make_loss_fn(static, models.lm_loss),
        params,
        batch,
        tuple(programs_for(config.paper_stat_sets, config.paper_batch, config, token=True)),
        run=config.paper_run,
    )


# -- the families: models written the way people write them ------------------------------------


def _cross_entropy(logits: Array, label: Array) -> Array:
    return jax.nn.logsumexp(logits) - logits[label]


class _ConvNet(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, width: int, *, key: Any):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, width, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(width, width, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(width, 10, key=k3)

    def __call__(self, image: Array) -> Array:
        h = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(image))))
        return self.head(jnp.mean(h, axis=(1, 2)))


class _ScannedConvs(eqx.Module):
    """A stem convolution, then `depth` same-shape convolutions stacked and run by lax.scan."""

    stem: eqx.nn.Conv2d
    kernels: Array
    head: eqx.nn.Linear

    def __init__(self, width: int, depth: int, *, key: Any):
        k1, k2, k3 = jax.random.split(key, 3)
        self.stem = eqx.nn.Conv2d(3, width, 3, padding=1, key=k1)
        scale = 1.0 / math.sqrt(9 * width)
        self.kernels = scale * jax.random.normal(k2, (depth, width, width, 3, 3))
        self.head = eqx.nn.Linear(width, 10, key=k3)

    def __call__(self, image: Array) -> Array:
        def layer(h: Array, kernel: Array) -> tuple[Array, None]:
            return h + jax.nn.relu(jax.lax.conv(h[None], kernel, (1, 1), "SAME")[0]), None

        h, _ = jax.lax.scan(layer, jax.nn.relu(self.stem(image)), self.kernels)
        return self.head(jnp.mean(h, axis=(1, 2)))


class _GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, d_in: int, width: int, *, key: Any):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(d_in, width, key=k1)
        self.head = eqx.nn.Linear(width, d_in, key=k2)

    def __call__(self, xs: Array) -> Array:
        def step(h: Array, x: Array) -> tuple[Array, Array]:
            h = self.cell(x, h)
            return h, h

        _, hs = jax.lax.scan(step, jnp.zeros(self.cell.hidden_size), xs)
        return jax.vmap(self.head)(hs)


class _MoE(eqx.Module):
    """A router picks one expert per example; the expert's matrix is read by a gather."""

    router: eqx.nn.Linear
    experts: Array
    head: eqx.nn.Linear

    def __init__(self, width: int, n_experts: int, *, key: Any):
        k1, k2, k3 = jax.random.split(key, 3)
        self.router = eqx.nn.Linear(width, n_experts, key=k1)
        self.experts = jax.random.normal(k2, (n_experts, width, width)) / math.sqrt(width)
        self.head = eqx.nn.Linear(width, 10, key=k3)

    def __call__(self, x: Array) -> Array:
        scores = self.router(x)
        choice = jnp.argmax(scores)
        h = jax.nn.softmax(scores)[choice] * jax.nn.gelu(self.experts[choice] @ x)
        return self.head(h)


def _stacked_blocks_in_a_loop(model: models.TransformerLM, example: tuple[Array, Array]) -> Array:
    """`models.lm_loss` of a model whose blocks are stacked (scan_layers) but read as W[l] in a
    Python loop, as a hand-written model indexes its stacked weights."""
    arrays, rest = eqx.partition(model.blocks, eqx.is_array)
    layers = jax.tree.leaves(arrays)[0].shape[0]
    blocks = tuple(
        eqx.combine(jax.tree.map(lambda a, k=k: a[k], arrays), rest) for k in range(layers)
    )
    return models.lm_loss(eqx.tree_at(lambda m: m.blocks, model, blocks), example)


def _named_axis_lm(
    key: PRNGKeyArray, vocab: int, d: int, layers: int, heads: int
) -> tuple[PyTree, Callable[[PyTree, Array], Float[Array, ""]]]:
    """A GPT as a named-axis library (Haliax) lowers it: every product an einsum, the embedding a
    contraction with one-hot tokens and tied to the head, RMS-norm scales a contraction with the
    feature axis batched ("d,td->td"), the blocks' arrays stacked over layers in lax.scan."""
    k = jax.random.split(key, 5)
    hd = d // heads

    def w(key: PRNGKeyArray, *shape: int) -> Array:
        return jax.random.normal(key, (layers, *shape)) / math.sqrt(shape[0])

    params = {
        "embed": 0.02 * jax.random.normal(k[0], (vocab, d)),
        "scales": jnp.ones((layers, 2, d)),
        "final": jnp.ones((d,)),
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
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), example[1:, None], -1)
        return -jnp.mean(picked)

    return params, loss


def family_workloads(config: Config) -> list[Callable[[], Workload]]:
    """The "families" section: one workload per model family (built when measured)."""
    b, d, seq = config.family_batch, config.family_width, config.family_seq
    keys = jax.random.split(jax.random.key(config.seed), 8)

    def workload(name: str, model: Any, loss: Callable, batch: PyTree) -> Workload:
        params, static = eqx.partition(model, _is_float_leaf)
        n = models.count_params(model)
        programs = _programs(config.family_stat_sets, b, config, config.family_impls, token=False)
        label = f"{name} ({n / 1e6:.2f}M)"
        return Workload(
            "families",
            label,
            models.make_loss_fn(static, loss),
            params,
            batch,
            tuple(programs),
            True,
        )

    def classify(x: Array) -> tuple[Array, Array]:
        return x, jax.random.randint(keys[7], (b,), 0, 10, jnp.int32)

    def lm(name: str, loss: Callable = models.lm_loss, **options: Any) -> Workload:
        fields = {f.name for f in dataclasses.fields(models.TransformerConfig)}
        missing = sorted(set(options) - fields)
        if missing:  # an option this models.py does not offer
            raise ValueError(f"models.TransformerConfig has no {missing}")
        config_lm = models.TransformerConfig.small(
            d_model=d,
            n_layers=config.family_layers,
            n_heads=4,
            d_ff=4 * d,
            context_length=seq,
            **options,
        )
        tokens = jax.random.randint(keys[6], (b, seq + 1), 0, config_lm.vocab_size, jnp.int32)
        model = models.TransformerLM(config_lm, key=keys[5])
        return workload(name, model, loss, (tokens[:, :-1], tokens[:, 1:]))

    def mlp() -> Workload:
        model = models.MLP(d, 10, d, 3, key=keys[0])
        return workload(
            f"mlp {d}x3", model, models.mlp_loss, classify(jax.random.normal(keys[1], (b, d)))
        )

    def cnn(width: int, side: int) -> Workload:
        """Positions (side²) above the channels, or below them."""
        images = jax.random.normal(keys[1], (b, 3, side, side))
        return workload(
            f"cnn 3-{width}-{width} {side}x{side}",
            _ConvNet(width, key=keys[0]),
            lambda m, ex: _cross_entropy(m(ex[0]), ex[1]),
            classify(images),
        )

    def cnn_scan() -> Workload:
        images = jax.random.normal(keys[1], (b, 3, 16, 16))
        width, depth = d // 8, config.family_layers
        return workload(
            f"cnn 3-{width}, {depth} convs in lax.scan, 16x16",
            _ScannedConvs(width, depth, key=keys[0]),
            lambda m, ex: _cross_entropy(m(ex[0]), ex[1]),
            classify(images),
        )

    def gru() -> Workload:
        xs = jax.random.normal(keys[1], (b, seq // 2, 32))
        loss = lambda m, ex: jnp.mean((m(ex[0]) - ex[1]) ** 2)  # noqa: E731
        return workload(
            f"gru H{d} T{seq // 2} (lax.scan)",
            _GRU(32, d, key=keys[0]),
            loss,
            (xs, jnp.roll(xs, -1, 1)),
        )

    def moe() -> Workload:
        model = _MoE(d, 4, key=keys[0])
        return workload(
            f"moe top-1 gather 4x{d}",
            model,
            lambda m, ex: _cross_entropy(m(ex[0]), ex[1]),
            classify(jax.random.normal(keys[1], (b, d))),
        )

    def flax_gpt(scan: bool) -> Workload:
        # Written as a flax.linen user writes it, not for pegrad: batched layers called on
        # x[None], biases everywhere, LayerNorms, token and position `Embed`s.
        try:
            import flax.linen as nn
        except ImportError as error:
            raise SystemExit("the flax-gpt families need flax: pip install -e '.[test]'") from error
        vocab, heads, layers = 256, 4, config.family_layers

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x: Array, _: None = None) -> tuple[Array, None]:
                h = nn.LayerNorm()(x)
                mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
                x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(h, h, mask=mask)
                h = nn.LayerNorm()(x)
                return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(h))), None

        class GPT(nn.Module):
            @nn.compact
            def __call__(self, tokens: Array) -> Array:
                x = nn.Embed(vocab, d)(tokens) + nn.Embed(seq, d)(jnp.arange(tokens.shape[-1]))
                if scan:
                    stack = nn.scan(
                        Block,
                        variable_axes={"params": 0},
                        split_rngs={"params": True},
                        length=layers,
                    )
                    x, _ = stack()(x, None)
                else:
                    for _ in range(layers):
                        x, _ = Block()(x)
                return nn.Dense(vocab)(nn.LayerNorm()(x))

        model = GPT()
        tokens = jax.random.randint(keys[6], (b, seq + 1), 0, vocab, jnp.int32)
        params = model.init(keys[5], tokens[:1, :-1])

        def loss(p: PyTree, example: Array) -> Float[Array, ""]:
            logits = model.apply(p, example[None, :-1])[0]  # type: ignore[index]
            picked = jnp.take_along_axis(jax.nn.log_softmax(logits), example[1:, None], -1)
            return -jnp.mean(picked)

        n = sum(x.size for x in jax.tree.leaves(params))
        programs = _programs(config.family_stat_sets, b, config, config.family_impls, token=False)
        where = "blocks in nn.scan" if scan else "list of blocks"
        label = f"flax.linen GPT {shape}, {where}, on x[None] ({n / 1e6:.2f}M)"
        return Workload("families", label, loss, params, tokens, tuple(programs), True)

    def named_axis() -> Workload:
        params, loss = _named_axis_lm(keys[5], 256, d, config.family_layers, 4)
        tokens = jax.random.randint(keys[6], (b, seq + 1), 0, 256, jnp.int32)
        n = sum(x.size for x in jax.tree.leaves(params))
        programs = _programs(config.family_stat_sets, b, config, config.family_impls, token=False)
        label = (
            f"named-axis GPT {shape}, einsums, tied one-hot embedding, lax.scan ({n / 1e6:.2f}M)"
        )
        return Workload("families", label, loss, params, tokens, tuple(programs), True)

    shape = f"d{d} L{config.family_layers} T{seq}"
    builders = {
        "mlp": mlp,
        "transformer": lambda: lm(f"transformer {shape}, list of blocks"),
        "transformer-scan": lambda: lm(
            f"transformer {shape}, blocks in lax.scan", scan_layers=True
        ),
        "transformer-stacked": lambda: lm(
            f"transformer {shape}, stacked blocks read as W[l] in a loop",
            _stacked_blocks_in_a_loop,
            scan_layers=True,
        ),
        "gqa-rope": lambda: lm(f"transformer {shape}, GQA + RoPE", position="rotary", n_kv_heads=1),
        "flax-gpt": lambda: flax_gpt(scan=False),
        "flax-gpt-scan": lambda: flax_gpt(scan=True),
        "named-axis": named_axis,
        "cnn": lambda: cnn(d // 4, 16),
        "cnn-8x8": lambda: cnn(d // 2, 8),
        "cnn-scan": cnn_scan,
        "gru": gru,
        "moe": moe,
    }
    return [builders[name] for name in config.families]


# --------------------------------------------------------------------------------------------
# Measuring one workload: compile everything, then interleaved timing rounds.


def explain_paths(workload: Workload, program: Program, clip_norm: float) -> str:
    """How many parameter leaves each route of the factorized rewrite took, and how, e.g.
    "6 outer-product (factorized), 2 fallback"."""
    names = tuple(program.stats.split("+"))
    plans = pegrad.explain(
        workload.loss_fn,
        workload.params,
        workload.batch,
        names,
        granularity="token" if program.granularity == "token" else "example",
        clip_norm=clip_norm if "clipped_mean" in names else None,
    )
    counts = Counter(
        p.route if p.status == "fallback" else f"{p.route} ({p.status})" for p in plans
    )
    return ", ".join(f"{n} {route}" for route, n in sorted(counts.items()))


def _seconds_per_call(exe: Any, args: tuple[PyTree, PyTree], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(exe(*args))
    return (time.perf_counter() - start) / n


def time_paired(
    executables: dict[Program, Any],
    baseline: Program,
    args: tuple[PyTree, PyTree],
    config: Config,
) -> tuple[dict[Program, tuple[list[float], list[float]]], dict[Program, float]]:
    """Per program: its seconds per call and the baseline's, timed back to back; and the
    programs too slow to time (their warm-up call took over `max_program_s`), with that time.

    Each round visits the programs in a fresh random order and times every program right next
    to the baseline (which of the two goes first is random too), so a change of machine load
    hits both sides of a ratio alike. A program's first call is a warm-up, not timed; it sets
    how many calls make one timing (`min_time_s`) and in how many rounds the program is timed
    (all `reps` unless that would take longer than `max_program_s`; at least one).
    """
    repeats: dict[Program, int] = {}
    rounds: dict[Program, int] = {}
    too_slow: dict[Program, float] = {}
    for program, exe in executables.items():
        warm = _seconds_per_call(exe, args, 1)
        if warm > config.max_program_s and program != baseline:
            too_slow[program] = warm
            continue
        repeats[program] = max(1, math.ceil(config.min_time_s / warm))
        per_round = warm * repeats[program]
        rounds[program] = max(1, min(config.reps, int(config.max_program_s / per_round)))
    pairs: dict[Program, tuple[list[float], list[float]]] = {
        p: ([], []) for p in rounds if p != baseline
    }
    rng = random.Random(config.seed)
    for r in range(config.reps):
        order = [p for p in pairs if r < rounds[p]]
        rng.shuffle(order)
        for program in order:
            sides = [(program, 0), (baseline, 1)]
            rng.shuffle(sides)
            for side, slot in sides:
                seconds = _seconds_per_call(executables[side], args, repeats[side])
                pairs[program][slot].append(seconds)
    return pairs, too_slow


def measure(
    workload: Workload, config: Config, save: Callable[[list[Record]], None] | None = None
) -> list[Record]:
    """Compile every program of `workload` (memory), then time those that may run; `save`
    is given the records so far after each compilation."""
    baseline = workload.programs[0]
    records: dict[Program, Record] = {}
    executables: dict[Program, Any] = {}
    args = (workload.params, workload.batch)
    for program in workload.programs:
        record = records[program] = {
            "section": workload.section,
            "model": workload.model,
            "stats": program.stats,
            "impl": program.impl,
            "granularity": program.granularity,
            "batch_size": workload.batch_size,
            "chunk_size": program.chunk_size,
            "time_ratio": None,
            "memory_ratio": None,
            "footprint_ratio": None,
            "compile_s": None,
            "time_s": None,
            "temp_bytes": None,
            "footprint_bytes": None,
            "kernels": None,
            "h200_estimate_s": None,
            "paths": "",
            "note": "",
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
        }
        start = time.perf_counter()
        try:
            exe = jax.jit(program.build(workload.loss_fn, config.clip_norm)).lower(*args).compile()
        except ValueError as error:  # pegrad refuses this statistic set for this model
            record["note"] = f"not available: {str(error).splitlines()[0]}"
            print(f"  {_label(program):45s} not available", file=sys.stderr)
            continue
        except Exception as error:  # a failure (a new JAX, say): recorded, the run goes on
            record["note"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0]}"
            print(f"  {_label(program):45s} {record['note']}", file=sys.stderr)
            continue
        record["compile_s"] = time.perf_counter() - start
        kernels = hlo_cost.read_hlo(exe.as_text() or "")  # the card's estimate beside its time
        record["kernels"], record["h200_estimate_s"] = kernels.launches, kernels.time_s(H200)
        memory = exe.memory_analysis()
        record["temp_bytes"] = temp = None if memory is None else int(memory.temp_size_in_bytes)
        record["footprint_bytes"] = None if memory is None else _footprint(memory)
        if program.impl == "factorized":
            record["paths"] = explain_paths(workload, program, config.clip_norm)
        print(f"  {_label(program):45s} compiled in {record['compile_s']:5.1f} s", file=sys.stderr)
        if save is not None:
            save(list(records.values()))
        if not workload.run:
            record["note"] = "compiled only"
        elif temp is not None and temp > config.max_run_gib * 2**30:
            record["note"] = f"not run: temp {temp / 2**30:.1f} GiB > --max-run-gib"
        else:
            executables[program] = exe

    base_temp = records[baseline]["temp_bytes"]
    base_footprint = records[baseline]["footprint_bytes"]
    for record in records.values():
        if record["temp_bytes"] is not None and base_temp:
            record["memory_ratio"] = record["temp_bytes"] / base_temp
        if record["footprint_bytes"] and base_footprint:
            record["footprint_ratio"] = record["footprint_bytes"] / base_footprint
    if baseline not in executables:
        return list(records.values())
    print(f"  timing {len(executables)} programs", file=sys.stderr)
    pairs, too_slow = time_paired(executables, baseline, args, config)
    baseline_times = [t for _, base in pairs.values() for t in base]
    if not baseline_times:  # nothing else could be timed: time the baseline alone
        baseline_times = [_seconds_per_call(executables[baseline], args, 1)]
    base_median = records[baseline]["time_s"] = statistics.median(baseline_times)
    records[baseline]["time_ratio"] = 1.0
    for program, (times, base) in pairs.items():
        records[program]["time_s"] = statistics.median(times)
        records[program]["time_ratio"] = statistics.median(
            t / t0 for t, t0 in zip(times, base, strict=True)
        )
        if len(times) < config.reps:
            records[program]["note"] = f"slow: {len(times)} round(s)"
    for program, seconds in too_slow.items():
        records[program]["time_s"] = seconds
        records[program]["time_ratio"] = seconds / base_median
        records[program]["note"] = "slow: warm-up call only (> --max-program-s)"
    return list(records.values())


def _footprint(memory: Any) -> int:
    """Arguments, outputs and temporaries of a compiled program, aliased bytes counted once."""
    sizes = (memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.temp_size_in_bytes)
    return int(sum(sizes) - memory.alias_size_in_bytes)


def _label(program: Program) -> str:
    token = " token" if program.granularity == "token" else ""
    return f"{program.stats} / {program.impl}{token}"


# --------------------------------------------------------------------------------------------
# Report.

COLUMNS = (
    "model",
    "B",
    "stats",
    "impl",
    "granularity",
    "time ratio",
    "memory ratio",
    "footprint ratio",
    "time ms",
    "temp MiB",
    "footprint MiB",
    "compile s",
    "factorized paths / note",
)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(records: Sequence[Record]) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        impl = r["impl"] + (f" ({r['chunk_size']})" if r["chunk_size"] else "")
        notes = "; ".join(s for s in (r["paths"], r["note"]) if s)
        time_ms = None if r["time_s"] is None else 1e3 * r["time_s"]
        temp = None if r["temp_bytes"] is None else r["temp_bytes"] / 2**20
        footprint = r.get("footprint_bytes")
        footprint = None if footprint is None else footprint / 2**20
        cells = (
            r["model"],
            str(r["batch_size"]),
            r["stats"],
            impl,
            r["granularity"],
            _fmt(r["time_ratio"], ".2f"),
            _fmt(r["memory_ratio"], ".2f"),
            _fmt(r.get("footprint_ratio"), ".2f"),
            _fmt(time_ms, ".1f"),
            _fmt(temp, ".1f"),
            _fmt(footprint, ".1f"),
            _fmt(r["compile_s"], ".1f"),
            notes,
        )
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------
# Scale: GPT-2 small and a ResNet-18 compiled, never run; the largest batch that fits.


class _BasicBlock(eqx.Module):
    """ResNet's basic block: two 3×3 convolutions, each normalized, and a (projected) skip."""

    conv1: eqx.nn.Conv2d
    norm1: Callable[[Array], Array]
    conv2: eqx.nn.Conv2d
    norm2: Callable[[Array], Array]
    project: eqx.nn.Conv2d | None
    norm_project: Callable[[Array], Array]

    def __init__(self, c_in: int, c_out: int, stride: int, norm: Callable, *, key: Any):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(c_in, c_out, 3, stride, padding=1, use_bias=False, key=k1)
        self.norm1 = norm(c_out)
        self.conv2 = eqx.nn.Conv2d(c_out, c_out, 3, padding=1, use_bias=False, key=k2)
        self.norm2 = norm(c_out)
        down = stride != 1 or c_in != c_out
        self.project = (
            eqx.nn.Conv2d(c_in, c_out, 1, stride, use_bias=False, key=k3) if down else None
        )
        self.norm_project = norm(c_out)

    def __call__(self, x: Array) -> Array:
        h = self.norm2(self.conv2(jax.nn.relu(self.norm1(self.conv1(x)))))
        skip = x if self.project is None else self.norm_project(self.project(x))
        return jax.nn.relu(h + skip)


class ResNet18(eqx.Module):
    """ResNet-18 (He et al. 2016, ImageNet layout: 7×7/2 stem, 3×3/2 max pool, four stages of
    two basic blocks at 64-128-256-512 channels, global average pool, linear head) on one
    image `[3, H, W]`, with GroupNorm (32 groups) where the original has BatchNorm (pegrad
    refuses layers that couple the examples), or no normalization (`norm="none"`)."""

    stem: eqx.nn.Conv2d
    stem_norm: Callable[[Array], Array]
    blocks: list[_BasicBlock]
    head: eqx.nn.Linear

    def __init__(self, classes: int = 1000, norm: str = "group", *, key: Any):
        if norm not in ("group", "none"):
            raise ValueError(f"norm must be 'group' or 'none', got {norm!r}")

        def make_norm(c: int) -> Callable[[Array], Array]:
            return eqx.nn.GroupNorm(32, c) if norm == "group" else eqx.nn.Identity()

        keys = jax.random.split(key, 10)
        self.stem = eqx.nn.Conv2d(3, 64, 7, 2, padding=3, use_bias=False, key=keys[0])
        self.stem_norm = make_norm(64)
        self.blocks, c_in = [], 64
        for stage, c_out in enumerate((64, 128, 256, 512)):
            for i in range(2):
                stride = 2 if stage and not i else 1
                block_key = keys[1 + 2 * stage + i]
                self.blocks.append(_BasicBlock(c_in, c_out, stride, make_norm, key=block_key))
                c_in = c_out
        self.head = eqx.nn.Linear(512, classes, key=keys[9])

    def __call__(self, image: Array) -> Array:
        x = jax.nn.relu(self.stem_norm(self.stem(image)))
        x = eqx.nn.MaxPool2d(3, 2, padding=1)(x)
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def _classify_loss(model: Any, example: tuple[Array, Array]) -> Array:
    return _cross_entropy(model(example[0]), example[1])


@dataclasses.dataclass(frozen=True)
class ScaleModel:
    name: str  # e.g. "gpt2-small d768 L12 T1024 V50257, tied head (124M)"
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]]
    params: PyTree  # jax.ShapeDtypeStruct leaves: nothing model-sized is allocated
    batch: Callable[[int], PyTree]  # B -> the batch's shapes


def scale_model(config: Config, name: str) -> ScaleModel:
    """A model of the "scale" section, as shapes only (`eqx.filter_eval_shape`)."""
    key = jax.random.key(config.seed)
    if name == "gpt2":
        lm = models.TransformerConfig.paper(
            n_layers=config.scale_layers, context_length=config.scale_seq
        )
        model = eqx.filter_eval_shape(models.TransformerLM, lm, key=key)
        loss: Callable = models.lm_loss
        seq = config.scale_seq

        def batch(b: int) -> PyTree:
            tokens = jax.ShapeDtypeStruct((b, seq), jnp.int32)
            return (tokens, tokens)

        head = "tied head" if lm.tied_head else "separate head"
        label = f"gpt2-small d{lm.d_model} L{lm.n_layers} T{seq} V{lm.vocab_size}, {head}"
    elif name == "resnet18":
        model = eqx.filter_eval_shape(ResNet18, 1000, config.scale_norm, key=key)
        side = config.scale_image

        loss = _classify_loss

        def batch(b: int) -> PyTree:
            images = jax.ShapeDtypeStruct((b, 3, side, side), jnp.float32)
            return (images, jax.ShapeDtypeStruct((b,), jnp.int32))

        norm = "GroupNorm(32)" if config.scale_norm == "group" else "no normalization"
        label = f"resnet18 {side}x{side}x3, 1000 classes, {norm}"
    else:
        raise ValueError(f"unknown scale model {name!r}; choose from {SCALE_MODELS}")
    params, static = eqx.partition(model, _is_float_leaf)
    n = models.count_params(model)
    return ScaleModel(f"{label} ({n / 1e6:.0f}M)", models.make_loss_fn(static, loss), params, batch)


def compile_memory(program: Program, model: ScaleModel, b: int, clip_norm: float) -> Record:
    """Compile `program` at batch size `b` (shapes only): temp and footprint bytes, seconds."""
    start = time.perf_counter()
    fn = jax.jit(program.build(model.loss_fn, clip_norm))
    memory = fn.lower(model.params, model.batch(b)).compile().memory_analysis()
    if memory is None:
        raise RuntimeError("this backend gives no compiled memory analysis")
    return {
        "B": b,
        "microbatch": program.microbatch,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "footprint_bytes": _footprint(memory),
        "compile_s": time.perf_counter() - start,
    }


def affine_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y ≈ intercept + slope·x through (x, y) points."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise ValueError(f"an affine fit needs two distinct batch sizes, got {xs}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope /= sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def largest_batch(intercept: float, slope: float, budget: float, multiple: int = 1) -> int | None:
    """The largest multiple of `multiple` B with intercept + slope·B ≤ budget (0: not even
    one); None where the footprint does not grow with B (slope ≤ 0) and fits at all B."""
    if slope <= 0:
        return None if intercept <= budget else 0
    b = math.floor((budget - intercept) / slope + 1e-9)  # + 1e-9: a fit's rounding
    return max(0, b - b % multiple)


def fit_budgets(
    measure: Callable[[int], int],
    points: Sequence[tuple[int, int]],
    budgets: Sequence[float],
    *,
    multiple: int = 1,
    verify: bool = True,
    tries: int = 3,
) -> list[Record]:
    """Per budget (bytes, in the order given): the largest B (a multiple of `multiple`) that the
    line through the two measured (B, footprint) points nearest the budget predicts — from
    `points` and every compile made here, so a larger budget is predicted from the smaller
    ones' checks — and, with `verify`, `measure(B)` (the compiled footprint) at it. Over the
    budget, the line through that point lowers B; under it, B rises to what that line predicts
    (XLA's buffer assignment at small B can sit off the line of large B); the largest B
    compiled within the budget is kept, at most `tries` compiles per budget."""
    known = dict(points)

    def predict(budget: float, anchor: int | None = None) -> tuple[float, float, int | None]:
        """Through `anchor` (the B just compiled) and the point nearest the budget, or else the
        two nearest points."""
        order = sorted(known.items(), key=lambda p: (abs(p[1] - budget), -p[0]))
        if anchor is not None:
            order = [(anchor, known[anchor])] + [p for p in order if p[0] != anchor]
        intercept, slope = affine_fit(order[:2])
        return intercept, slope, largest_batch(intercept, slope, budget, multiple)

    out = []
    for budget in budgets:
        intercept, slope, b = predict(budget)
        row: Record = {
            "budget_bytes": budget,
            "predicted_B": b,
            "B": b,
            "footprint_bytes": None,
            "predicted_bytes": None if b is None else intercept + slope * b,
            "fits": None,
            "compiles": 0,
        }
        out.append(row)
        best: tuple[int, int] | None = None  # the largest B compiled within the budget
        while verify and b is not None and b > 0 and row["compiles"] < tries:
            footprint = known[b] = measure(b)
            row.update(B=b, footprint_bytes=footprint, compiles=row["compiles"] + 1, fits=False)
            if footprint <= budget and (best is None or b > best[0]):
                best = (b, footprint)
            after = predict(budget, anchor=b)[2]  # through this point and its nearest
            if footprint <= budget:  # below the line: try the larger B it now predicts
                if after is None or after <= b:
                    break
                b = after
            else:
                b = b - multiple if after is None else min(b - multiple, after)
                if best is not None and b <= best[0]:
                    break
        if best is not None:
            row.update(B=best[0], footprint_bytes=best[1], fits=True)
    return out


def scale_programs(config: Config) -> list[Program]:
    """Plain grad, then each implementation of `config.scale_impls` on each statistic set, in
    the order of SCALE_IMPLS (the peers' microbatch is chosen when measured)."""
    variants = {
        "factorized": Program("", "factorized"),
        "vmap": Program("", "vmap"),
        "vmap-chunked": Program("", "vmap-chunked", chunk_size=config.scale_chunk_size),
        "micro_grad": Program("", "micro_grad"),
        "jax-privacy": Program("", "jax-privacy"),
    }
    out = [Program("mean", PLAIN)] if PLAIN in config.scale_impls else []
    for impl in (i for i in SCALE_IMPLS[1:] if i in config.scale_impls):
        for stats in config.scale_stat_sets:
            names = set(stats.split("+"))
            if impl == "jax-privacy" and not (
                {"clipped_mean"} <= names <= {"clipped_mean", "sq_norms"}
            ):
                continue  # clipped_grad computes the clipped mean only
            out.append(dataclasses.replace(variants[impl], stats=stats))
    return out


def scale_rows(
    model: ScaleModel,
    programs: Sequence[Program],
    config: Config,
    done: Callable[[list[Record]], None] = lambda rows: None,
) -> list[Record]:
    """One record per program: its compiled memory at each of `config.scale_batches`, the affine
    fit, and the largest B under each budget (verified by compiling there); `done(rows)` after
    each program."""
    batches = sorted(set(config.scale_batches))
    reference = batches[-1]
    budgets = [g * 2**30 for g in config.scale_budgets_gib]
    rows = []
    for program in programs:
        row: Record = {
            "model": model.name,
            "stats": program.stats,
            "impl": program.impl,
            "chunk_size": program.chunk_size,
            "microbatch": None,
            "points": [],
            "intercept_bytes": None,
            "slope_bytes": None,
            "budgets": [],
            "note": "",
        }
        rows.append(row)
        cache: dict[int, Record] = {}
        extra, extra_s = 0, 0.0  # the microbatches tried and not kept

        chosen = [program]  # the program as measured (the peers: at the microbatch kept)

        def at(b: int, chosen: list[Program] = chosen, cache: dict[int, Record] = cache) -> Record:
            if b not in cache:
                cache[b] = compile_memory(chosen[0], model, b, config.clip_norm)
                print(
                    f"  {_label(chosen[0]):40s} B={b:<8d} footprint "
                    f"{cache[b]['footprint_bytes'] / 2**30:8.2f} GiB, "
                    f"compiled in {cache[b]['compile_s']:5.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            return cache[b]

        try:
            if program.impl in ("micro_grad", "jax-privacy"):  # the memory-best microbatch
                tried = {}
                for mb in (m for m in config.scale_microbatches if reference % m == 0):
                    candidate = dataclasses.replace(program, microbatch=mb)
                    tried[mb] = compile_memory(candidate, model, reference, config.clip_norm)
                if not tried:
                    raise ValueError(f"no microbatch in {config.scale_microbatches} divides B")
                mb = min(tried, key=lambda m: (tried[m]["footprint_bytes"], -m))
                program = chosen[0] = dataclasses.replace(program, microbatch=mb)
                cache[reference] = tried[mb]
                extra = len(tried) - 1
                extra_s = sum(r["compile_s"] for m, r in tried.items() if m != mb)
                row["microbatch"] = mb
                row["microbatch_tried"] = {m: r["footprint_bytes"] for m, r in tried.items()}
                if any(b % mb for b in batches):
                    raise ValueError(f"microbatch {mb} does not divide every B of {batches}")
            row["points"] = [at(b) for b in batches]
        except ValueError as error:  # refused for this model (pegrad, or a peer)
            row["note"] = f"not available: {str(error).splitlines()[0]}"
            print(f"  {_label(program):40s} not available", file=sys.stderr)
            done(rows)
            continue
        points = [(p["B"], p["footprint_bytes"]) for p in row["points"]]
        row["intercept_bytes"], row["slope_bytes"] = affine_fit(points)
        multiple = row["microbatch"] or 1
        verify = config.scale_verify and program.impl not in config.scale_unverified
        measure = lambda b, at=at: at(b)["footprint_bytes"]  # noqa: E731
        row["budgets"] = fit_budgets(measure, points, budgets, multiple=multiple, verify=verify)
        row["compiled"] = sorted(cache.values(), key=lambda r: r["B"])  # every B compiled
        row["compile_s"] = sum(r["compile_s"] for r in cache.values()) + extra_s
        row["compiles"] = len(cache) + extra
        done(rows)
    return rows


def run_scale(config: Config) -> list[Record]:
    """The "scale" section: every model of `config.scale_models`, one run each, written to
    `config.scale_out` (.json, .md) after every program; other runs (model, command) in that
    JSON are kept (a model's programs may come from several commands)."""
    rows: list[Record] = []
    for name in config.scale_models:
        start = time.perf_counter()
        model = scale_model(config, name)
        print(f"scale: {model.name}", file=sys.stderr, flush=True)
        meta = {**_provenance(), "model": model.name, "config": dataclasses.asdict(config)}

        def save(
            mine: list[Record], finished: bool = False, meta: Record = meta, start: float = start
        ) -> None:
            meta.update(seconds=time.perf_counter() - start, finished=finished)
            if config.scale_out:
                write_scale(config.scale_out, {"meta": meta, "rows": mine})

        mine = scale_rows(model, scale_programs(config), config, save)
        save(mine, finished=True)
        rows += mine
    if config.scale_out:
        with open(config.scale_out + ".md") as f:
            print(f.read(), flush=True)
    return rows


def _run_key(run: Record) -> tuple[str, str]:
    return run["meta"]["model"], run["meta"]["command"]


NOTES = "\n## Notes"  # PATH.md from this heading on is written by hand: every rewrite keeps it


def _scale_text(path: str, runs: list[Record]) -> str:
    """PATH.md's text: the tables from `runs`, then PATH.md's own hand-written notes, if any."""
    notes = ""
    if os.path.exists(path + ".md"):
        with open(path + ".md") as f:
            old = f.read()
        notes = old[old.index(NOTES) :] if NOTES in old else ""
    return scale_markdown(runs).rstrip("\n") + "\n" + notes if notes else scale_markdown(runs)


def rewrite_scale_markdown(path: str) -> None:
    """PATH.md again from PATH.json (after a change to the table's layout, or runs stopped)."""
    with open(path + ".json") as f:
        runs = json.load(f)["runs"]
    text = _scale_text(path, runs)
    with open(path + ".md", "w") as f:
        f.write(text)


def write_scale(path: str, run: Record) -> None:
    """Put `run` into PATH.json in place of any run of the same model and command; PATH.md
    from them all (each file replaced whole: two runs may write beside each other)."""
    runs: list[Record] = []
    if os.path.exists(path + ".json"):
        with open(path + ".json") as f:
            runs = json.load(f)["runs"]
    runs = [r for r in runs if _run_key(r) != _run_key(run)] + [run]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for suffix, text in ((".json", json.dumps({"runs": runs}, indent=1)), (".md", None)):
        text = _scale_text(path, runs) if text is None else text
        with open(f"{path}{suffix}.{os.getpid()}", "w") as f:
            f.write(text)
        os.replace(f"{path}{suffix}.{os.getpid()}", path + suffix)  # whole, for a run beside


def _provenance() -> Record:
    """The command, the commit it ran at (and whether the code it reads differed from it)."""

    def git(*args: str) -> str:
        import subprocess

        here = os.path.dirname(os.path.abspath(__file__))
        try:
            return subprocess.run(
                ["git", "-C", here, *args], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    try:
        from importlib.metadata import version

        privacy = version("jax-privacy")
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        privacy = None
    return {
        "command": "python bench.py " + " ".join(sys.argv[1:]),
        "commit": git("rev-parse", "--short", "HEAD"),
        "modified": git("status", "--porcelain", "--", "bench.py", "pegrad.py", "models.py"),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "jax_privacy": privacy,
        "device": jax.devices()[0].device_kind,
    }


def _gib(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x / 2**30, spec)


def _plain_at(plain: Record, b: int, key: str) -> float:
    """Plain grad's `key` bytes at batch size b: compiled there, or else on the line through the
    two B compiled nearest it (plain grad's footprint is affine in B at these sizes)."""
    known = {p["B"]: p[key] for p in [*plain["points"], *plain.get("compiled", [])]}
    if key == "footprint_bytes":  # the largest-B checks: footprints only
        known |= {c["B"]: c[key] for c in plain["budgets"] if c[key] is not None}
    if b in known:
        return known[b]
    intercept, slope = affine_fit(sorted(known.items(), key=lambda p: abs(p[0] - b))[:2])
    return intercept + slope * b


def scale_markdown(runs: Sequence[Record]) -> str:
    """The scale table: one section per run (model), with its command and commit."""
    lines = [
        "# Scale: compiled, never run (bench.py `--sections scale`, issue 38)",
        "",
        "Memory is XLA's compiled `memory_analysis()` of `jax.jit(f).lower(...).compile()`,"
        " float32; inputs are `jax.ShapeDtypeStruct`s, so nothing model-sized is allocated and"
        " nothing runs. temp: the temporaries; footprint: arguments + outputs + temporaries"
        " − aliased bytes (what the device holds while the step runs). B, temp and footprint:"
        " at the larger fitted B; ratios are to plain `jax.value_and_grad` of the mean loss at"
        " that B (compiled there, or on the line through plain's two nearest compiled B)."
        " GiB / example and fixed GiB: the line through the two largest B compiled. Largest B"
        " under a budget: predicted by the line through the two compiled points nearest the"
        " budget (first the fit at the run's two batch sizes), then compiled at that B; over the"
        " budget B goes down, under it up, along the line through the new point (at most 3"
        " compiles a budget); a cell gives the largest B compiled within the budget and its"
        " footprint in GiB (✓), or the last B tried (✗), or the prediction alone (fit only)."
        " micro_grad (optax) and jax-privacy: at the microbatch, of those tried, with the"
        " smallest footprint.",
    ]
    order = {impl: k for k, impl in enumerate(SCALE_IMPLS)}
    for model in dict.fromkeys(run["meta"]["model"] for run in runs):
        mine = [run for run in runs if run["meta"]["model"] == model]
        config = mine[0]["meta"]["config"]
        budgets = config["scale_budgets_gib"]
        lines += ["", f"## {model}", ""]
        for run in mine:
            meta, c = run["meta"], run["meta"]["config"]
            fitted = ", ".join(map(str, sorted(set(c["scale_batches"]))))
            state = "" if meta.get("finished") else " (partial: stopped here)"
            lines.append(
                f"- `{meta['command']}` at commit {meta['commit']}"
                + (" (with local changes)" if meta["modified"] else "")
                + f": {len(run['rows'])} programs, {meta['seconds'] / 60:.0f} min on a 2-core CPU"
                f"{state}; jax {meta['jax']}, optax {meta['optax']}, jax-privacy "
                + (meta["jax_privacy"] or "not installed")
                + f", XLA on {meta['device']}; fitted at B = {fitted}; vmap-chunked:"
                f" {c['scale_chunk_size']} example(s) a chunk; microbatches tried:"
                f" {', '.join(map(str, c['scale_microbatches']))}."
            )
        rows = [r for run in mine for r in run["rows"]]
        stats_seen = [st for run in mine for st in run["meta"]["config"]["scale_stat_sets"]]
        stat_order = {st: k for k, st in enumerate(["mean", *Config.scale_stat_sets, *stats_seen])}
        rows.sort(key=lambda r: (order.get(r["impl"], 99), stat_order.get(r["stats"], 99)))
        plain = next((r for r in rows if r["impl"] == PLAIN and r["points"]), None)
        head = ["stats", "impl", "B", "temp GiB", "footprint GiB"]
        head += ["temp / plain", "footprint / plain", "GiB / example", "fixed GiB"]
        head += [f"largest B, {g:g} GiB" for g in budgets] + ["compiles (s)", "note"]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            impl = r["impl"]
            if r["chunk_size"]:
                impl += f" (chunk {r['chunk_size']})"
            if r["microbatch"]:
                impl += f" (mb {r['microbatch']})"
            if not r["points"]:
                cells = [r["stats"], impl] + ["—"] * (len(head) - 3) + [r["note"]]
                lines.append("| " + " | ".join(cells) + " |")
                continue
            p = r["points"][-1]
            cells = [r["stats"], impl, str(p["B"]), _gib(p["temp_bytes"])]
            cells.append(_gib(p["footprint_bytes"]))
            for key in ("temp_bytes", "footprint_bytes"):
                q = None if plain is None else _plain_at(plain, p["B"], key)
                cells.append("—" if not q else f"{p[key] / q:.2f}")
            compiled = {c["B"]: c["footprint_bytes"] for c in r.get("compiled", [])}
            compiled |= {c["B"]: c["footprint_bytes"] for c in r["points"]}
            compiled |= {c["B"]: c["footprint_bytes"] for c in r["budgets"] if c["footprint_bytes"]}
            intercept, slope = affine_fit(sorted(compiled.items())[-2:])
            cells += [_gib(slope, ".3f"), _gib(intercept)]
            for budget in r["budgets"]:
                if budget["B"] is None:
                    cells.append("any (flat fit)")
                    continue
                mark = {True: " ✓", False: " ✗", None: ""}[budget["fits"]]
                got = budget["footprint_bytes"]
                shown = " (fit only)" if got is None else f" ({_gib(got, '.1f')}{mark})"
                cells.append(f"{budget['B']:,}{shown}")
            cells += [f"{r['compiles']} ({r['compile_s']:.0f})", r["note"]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Command line, generated from Config.


def _field_help() -> dict[str, str]:
    """The comment after each Config field, as its --help text."""
    pattern = re.compile(r"^\s+(\w+): [^#]*#\s*(.*)$")
    found = (pattern.match(line) for line in inspect.getsource(Config).splitlines())
    return {m.group(1): m.group(2) for m in found if m}


def parse_config(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    hints = typing.get_type_hints(Config)
    helps = _field_help()
    for field in dataclasses.fields(Config):
        flag, kind = "--" + field.name.replace("_", "-"), hints[field.name]
        text = f"{helps.get(field.name, '')} (default: {field.default})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(kind) is tuple:
            item = typing.get_args(kind)[0]
            parser.add_argument(flag, nargs="+", type=item, help=text)
        else:
            parser.add_argument(flag, type=kind, help=text)
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    preset = {
        **(QUICK if given.get("quick") else {}),
        **(ACCELERATOR if given.get("accelerator") else {}),
    }
    base = Config(**preset)
    return dataclasses.replace(base, **given)


def check(config: Config) -> None:
    if unknown := set(config.sections) - set(SECTIONS):
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    if unknown := set(config.families) - set(FAMILIES):
        raise SystemExit(f"unknown famil(ies) {sorted(unknown)}; choose from {FAMILIES}")
    if unknown := (set(config.impls) | set(config.family_impls)) - set(IMPLS):
        raise SystemExit(f"unknown implementation(s) {sorted(unknown)}; choose from {IMPLS}")
    for stats in (*config.stat_sets, *config.paper_stat_sets):
        if bad := [s for s in stats.split("+") if s not in pegrad.STATISTICS]:
            raise SystemExit(f"unknown statistic(s) {bad} in {stats!r}: {pegrad.STATISTICS}")
    if config.reps < 1 or min(config.min_time_s, config.max_program_s) < 0:
        raise SystemExit("need reps >= 1, min_time_s >= 0 and max_program_s >= 0")
    if config.clip_norm <= 0 or config.max_run_gib <= 0:
        raise SystemExit("need clip_norm > 0 and max_run_gib > 0")
    if unknown := set(config.scale_models) - set(SCALE_MODELS):
        raise SystemExit(f"unknown scale model(s) {sorted(unknown)}; choose from {SCALE_MODELS}")
    if unknown := set(config.scale_impls) - set(SCALE_IMPLS):
        raise SystemExit(f"unknown scale implementation(s) {sorted(unknown)}: {SCALE_IMPLS}")
    for stats in config.scale_stat_sets:
        if bad := [s for s in stats.split("+") if s not in pegrad.STATISTICS]:
            raise SystemExit(f"unknown statistic(s) {bad} in {stats!r}: {pegrad.STATISTICS}")
    if len(set(config.scale_batches)) < 2 or min(config.scale_batches) < 1:
        raise SystemExit("need two or more distinct scale_batches >= 1 (the fit is affine in B)")
    if config.scale_chunk_size < 1 or min(config.scale_microbatches, default=0) < 1:
        raise SystemExit("need scale_chunk_size >= 1 and scale_microbatches >= 1")


def run(config: Config) -> list[Record]:
    """Every section of `config`, printed as it completes; the records of all rows."""
    check(config)
    workloads: list[Callable[[], Workload]] = []
    if "mlp" in config.sections:
        workloads.append(lambda: mlp_workload(config, config.mlp_batch, "mlp", config.stat_sets))
    if "mlp-scaling" in config.sections:
        for b in config.mlp_batch_sizes:
            if b == config.mlp_batch and "mlp" in config.sections:
                continue  # measured in "mlp" already; the scaling table reuses those rows
            workloads.append(lambda b=b: mlp_workload(config, b, "mlp-scaling", ["mean+sq_mean"]))
    if "lm" in config.sections:
        workloads.append(lambda: lm_workload(config))
    if "paper" in config.sections:
        workloads.append(lambda: paper_workload(config))
    if "families" in config.sections:
        workloads += family_workloads(config)

    records: list[Record] = run_scale(config) if "scale" in config.sections else []
    for make in workloads:
        try:
            workload = make()
        except ValueError as error:  # a family this models.py cannot build
            print(f"skipped: {error}", file=sys.stderr)
            continue
        print(f"{workload.section}: {workload.model}, B={workload.batch_size}", file=sys.stderr)
        save = functools.partial(_save_after, list(records), config.json) if config.json else None
        rows = measure(workload, config, save)
        records += rows
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"\n### {workload.section}: {workload.model}, B = {workload.batch_size}")
        print(f"\n(load average {load:.1f} when done)\n")
        print(markdown_table(rows), flush=True)
        if config.json:  # after each model too, so that a run cut short keeps what it measured
            write_json(records, config.json)
        del workload
        gc.collect()
    if "mlp-scaling" in config.sections:
        impls = (PLAIN, "vmap", "vmap-chunked", "factorized", "hand-written")
        scaling = [
            r
            for r in records
            if r["section"] in ("mlp", "mlp-scaling")
            and (r["stats"] == "mean+sq_mean" or r["impl"] == PLAIN)
        ]
        scaling.sort(key=lambda r: (impls.index(r["impl"]), r["batch_size"]))
        print("\n### mlp-scaling: mean+sq_mean against the batch size\n")
        print(markdown_table(scaling), flush=True)
    return records


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    print("config:", json.dumps(dataclasses.asdict(config)))
    cpu = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {cpu} CPUs, load {load:.1f}",
        flush=True,
    )
    start = time.perf_counter()
    records = run(config)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ntotal {time.perf_counter() - start:.0f} s, load {load:.1f} at the end")
    if config.json:
        write_json(records, config.json)
        print(f"wrote {len(records)} records to {config.json}")


def _save_after(done: list[Record], path: str, rows: list[Record]) -> None:
    write_json(done + rows, path)


def write_json(records: Sequence[Record], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(list(records), f, indent=1)


if __name__ == "__main__":
    main()
