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
* families: the model families people train (families.py's registry, every one proven exact
  at float64 by tests/test_zoo.py), B = `family_batch`, mean and mean+sq_mean: an MLP;
  transformers as a list of blocks, as stacked blocks in `lax.scan` or read as W[l] in a Python
  loop, and with grouped-query attention + RoPE; a GPT written with flax.linen layers called on
  x[None], as a list of blocks and in nn.scan (needs flax, from the test extra); a named-axis
  GPT; CNNs on 16×16 and 8×8 images and as stacked kernels in `lax.scan`; a GRU; a top-1
  mixture of experts. Beside pegrad's implementations, "micro_grad" is optax's
  `optax.microbatching.micro_grad` (per-example gradients one microbatch at a time, transformed
  to (g, g²) and averaged): the JAX peer.

The other two benchmarks live beside results/bench/gpu_aot.py: the compiled scale fit (GPT-2
small and a ResNet-18 compiled never run, the largest batch under a memory budget) is
results/bench/scale_fit.py, and the accelerator preset (this table on a GPU or TPU, measured
beside hlo_cost.py's estimate) is results/bench/gpu_run.py.

Programs whose compiled temporary memory exceeds `max_run_gib` are compiled (their memory is
reported) but not timed; the table says so. A statistic set that `pegrad` refuses for a model
is listed with the reason.

Run (CPU, float32):

    python bench.py                       # everything: ~8 minutes on 2 busy CPU cores
    python bench.py --quick               # small sizes, few rounds: a smoke test (< 1 minute)
    python bench.py --sections mlp lm --reps 11 --json runs/bench.json
    python bench.py --help                # every option, from `Config` below

tests/test_bench.py runs every section at tiny sizes and proves the hand-written MLP floor and
optax's peer compute the naive loop's numbers.
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
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree

import families
import hlo_cost
import models
import pegrad
from hlo_cost import H200

IMPLS = ("vmap", "vmap-chunked", "factorized", "factorized-token", "micro_grad")
SECTIONS = ("mlp", "mlp-scaling", "lm", "paper", "families")
FAMILIES = tuple(families.FAMILIES)  # the registry's names, in its order
SIZE = families.BENCH  # the families' size by default (Config's field `families` hides the module)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the benchmark measures. Each field is a flag: `mlp_width` is --mlp-width."""

    quick: bool = False  # smoke-test sizes (QUICK below); flags given explicitly still win
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
    family_width: int = SIZE.width  # width (transformer d_model, GRU state, ...)
    family_seq: int = SIZE.seq  # sequence length of the transformers (GRU: half of it)
    family_layers: int = SIZE.layers  # transformer blocks
    family_stat_sets: tuple[str, ...] = ("mean", "mean+sq_mean")  # statistic sets of "families"
    family_impls: tuple[str, ...] = ("vmap", "factorized", "micro_grad")  # their implementations
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

PLAIN = "plain"
Record = dict[str, Any]
T = typing.TypeVar("T")
CODE = ("bench.py", "families.py", "pegrad.py", "models.py")  # what a record's numbers read


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


# -- the families: families.py's registry, at the size of --family-width/--family-seq/... -----


def family_workloads(config: Config) -> list[Callable[[], Workload]]:
    """The "families" section: one workload per family of `config.families` (families.py's
    registry, the models tests/test_zoo.py proves exact), built when measured."""
    size = families.Size(config.family_width, config.family_seq, config.family_layers)
    key = jax.random.key(config.seed)

    def workload(family: families.Family) -> Workload:
        params, loss = family.build(size, key)
        n = sum(x.size for x in jax.tree.leaves(params))
        b = config.family_batch
        programs = _programs(config.family_stat_sets, b, config, config.family_impls, token=False)
        label = f"{family.describe(size)} ({n / 1e6:.2f}M)"
        batch = family.batch(size, key, b)
        return Workload("families", label, loss, params, batch, tuple(programs), True)

    return [functools.partial(workload, families.FAMILIES[name]) for name in config.families]


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


def _provenance(script: str = "bench.py") -> Record:
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
        "command": f"python {script} " + " ".join(sys.argv[1:]),
        "commit": git("rev-parse", "--short", "HEAD"),
        "modified": git("status", "--porcelain", "--", script, *CODE),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "jax_privacy": privacy,
        "device": jax.devices()[0].device_kind,
    }


# --------------------------------------------------------------------------------------------
# Command line, generated from Config.


def _field_help(cls: type) -> dict[str, str]:
    """The comment after each field of the dataclass `cls`, as its --help text."""
    pattern = re.compile(r"^\s+(\w+): [^#]*#\s*(.*)$")
    found = (pattern.match(line) for line in inspect.getsource(cls).splitlines())
    return {m.group(1): m.group(2) for m in found if m}


def parse_fields(
    cls: Callable[..., T],
    argv: Sequence[str] | None,
    description: str,
    presets: dict[str, dict[str, Any]] | None = None,
    preset: dict[str, Any] | None = None,
) -> T:
    """The dataclass `cls` from command-line flags, one per field (`mlp_width` is --mlp-width,
    its --help the comment after the field): `preset`'s fields, then those of each boolean flag
    of `presets` given (--quick: QUICK), then every flag given explicitly."""
    assert dataclasses.is_dataclass(cls) and isinstance(cls, type)
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(cls)
    helps = _field_help(cls)
    for field in dataclasses.fields(cls):
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
    chosen = dict(preset or {})
    for flag, fields in (presets or {}).items():
        chosen |= fields if given.get(flag) else {}
    return cast(T, dataclasses.replace(cls(**chosen), **given))


def parse_config(argv: Sequence[str] | None = None, preset: dict[str, Any] | None = None) -> Config:
    """bench.py's flags; `preset` (results/bench/gpu_run.py's ACCELERATOR) under them."""
    description = (__doc__ or "").split("\n\n")[0]
    return parse_fields(Config, argv, description, {"quick": QUICK}, preset)


def check(config: Config) -> None:
    if "scale" in config.sections:  # bench.py's own section until issue 51
        raise SystemExit("the scale fit is results/bench/scale_fit.py (the same --scale-* flags)")
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

    records: list[Record] = []
    for make in workloads:
        try:
            workload = make()
        except ValueError as error:  # a family that cannot be built here (no flax, say)
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


def main(argv: Sequence[str] | None = None, preset: dict[str, Any] | None = None) -> None:
    config = parse_config(argv, preset)
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
