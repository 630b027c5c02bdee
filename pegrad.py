"""Per-example gradient statistics in JAX: an exact reference and a factorized graph rewrite.

`value_and_grad_stats(loss_fn, stats, impl=...)` returns the mean loss and statistics of the
per-example gradients g_i = ∇ loss_fn(params, example_i), where `loss_fn(params, example)` is
the loss of ONE example, every batch leaf has the leading axis B, and the batch loss is the mean
(SPEC §1). The statistics, elementwise over parameters:

    mean          (1/B) Σ_i g_i                  sq_norms      ‖g_i‖² over all parameters, [B]
    sq_mean       (1/B) Σ_i g_i²                 clipped_mean  (1/B) Σ_i g_i·min(1, C/‖g_i‖)
    sign_mean     (1/B) Σ_i sign(g_i)            var           1/(B−1) Σ_i (g_i − mean)²
    dot           ⟨g_i, v⟩ for a tree v, [B]     gram          ⟨g_i, g_j⟩, [B, B]

and "batch_size", the number N of units: B, or B·T with granularity="token", where position t
of each example is a unit whose gradient is its contribution to the example's (δ_t ⊗ x_t for a
dense weight). Two implementations, equal by contract:

* impl="vmap", the exact reference: vmap(grad) in chunks, φ, reduce; the variance in two passes.
  Per token every position gets its own copy of the parameters (`Untie`).
* impl="factorized" rewrites the graph: grad(loss_fn) of ONE example traced to a flat jaxpr,
  run batched down to the inputs of each parameter's last gradient operation, and each leaf
  given the first route in `ROUTES` whose preconditions are proven on the jaxpr (a dense weight used
  once: g_i = δ_i ⊗ x_i, so Σ_i φ(g_i) = φ(Δ)ᵀφ(X) for multiplicative φ, ‖g_i‖² = ‖δ_i‖²‖x_i‖²).
  A leaf no route proves takes the exact fallback, per example in bounded chunks; a proof that
  cannot be completed refuses, never raises. `explain` returns the plan without running it.
  The mean alone is plain grad of the mean loss, unless the loss has a user backward rule.

Layout: Part I is the definition — §1 the API (value_and_grad_stats, explain, Accumulator), §2
the statistics, §3 the input checks (SPEC §6), §4 the references, §5 the jaxpr interpreter and
position tracing they run on; it reaches Part II, the engine (§6–§11, DESIGN.md), only through
`_factorized` and `Plan.build` (tests/test_layout.py). The reference shares §5 with the rewrite
(`Graph.build` builds the same `Untie`, which the token fallback runs); the independent check is
tests/helpers.py's naive loop, which never calls pegrad: `jax.grad` one example at a time, per
token of a loss written with one parameter copy per position (tests/pieces.py), equal at float64
for every statistic, implementation, granularity and batch size (tests/test_pegrad.py,
tests/test_zoo.py). Depends on jax (with numpy) and jaxtyping only: copy this file.
"""

import abc
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import math
import os
import sys
import textwrap
import types
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import ad, batching, mlir
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float, PyTree

__all__ = ["value_and_grad_stats", "explain", "Accumulator", "merge_shards", "gradient_noise_scale",
           "stat_dtype", "Plan", "LeafPlan", "ROUTES", "Untie", "STATISTICS", "Impl", "Granularity",
           "Choose", "NonFinite", "Stats", "Loss", "LossFn"]  # fmt: skip
__version__ = "0.1.0"  # the package's one version: pyproject.toml reads it ([tool.hatch.version])
Impl = Literal["vmap", "factorized"]
Granularity = Literal["example", "token"]
Choose = Literal["cheapest", "first"]
NonFinite = Literal["propagate", "drop"]
Options = tuple[Granularity, Choose, int | None, int | None]  # granularity, choose, chunk, budget
Stats = dict[str, PyTree]  # statistic name -> a tree shaped like params ([N] for sq_norms)
Loss = Float[Array, ""]
LossFn = Callable[[PyTree, PyTree], Loss | tuple[Loss, PyTree]]  # (params, ONE example)
Var = jcore.Var  # a jaxpr variable
Eqn = jcore.JaxprEqn  # a jaxpr equation
Atom = Var | jcore.Literal  # a jaxpr operand
Value = Any  # what a jaxpr value holds when evaluated: an array, a tracer, a Python scalar
Phi = Callable[[Array], Array]  # φ: identity, square or sign (multiplicative)
Axes = frozenset[int]  # axes of a value that index positions (token granularity)
_NONE: Axes = frozenset()


# ============================================================================================
# Part I — the definition. It names nothing of the engine but `_factorized` and `Plan.build`.
# §1 Public API


def value_and_grad_stats(
    loss_fn: LossFn,
    stats: str | Sequence[str] = ("mean",),
    *,
    impl: Impl = "factorized",
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    granularity: Granularity = "example",
    clip_norm: float | None = None,
    choose: Choose = "cheapest",
    has_aux: bool = False,
    nonfinite: NonFinite = "propagate",
) -> Callable[..., tuple[Any, Stats]]:  # Any: the loss, or (loss, aux) with has_aux
    """Build `fn(params, batch, mask=None, *, dot_with=None) -> (mean_loss, {name: statistic,
    ..., "batch_size": N})`; `dot_with`, a tree shaped like the parameters, is the v of "dot".

    Args:
        loss_fn: `loss_fn(params, example) -> scalar`, the loss of ONE example
            (`-> (scalar, aux)` with `has_aux`).
        stats: a name or any subset of `STATISTICS`, computed in one pass.
        impl: "vmap" (the exact reference) or "factorized" (the rewrite; the same numbers).
        chunk_size: at most this many examples' per-example gradients exist at once. None: the
            reference materializes the whole batch; the rewrite bounds it by the parameters'
            or the activations' size, whichever is larger.
        memory_budget: bytes that per-unit gradients formed at once hold at most (or one
            example's); with chunk_size the smaller chunk wins. `explain` shows each leaf's.
        granularity: "example", or "token" (units are positions; batch leaves are [B, T, ...]).
        clip_norm: C for "clipped_mean".
        choose: "cheapest": per leaf, the first route in precedence order (`ROUTES`) whose
            match succeeds, and two plan-wide savings (the mean alone is plain grad's program;
            formed gradients kept for the clip factors); "first": the routes alone (tests:
            every route a leaf can prove then runs). Same numbers.
        has_aux: `loss_fn` returns `(loss, aux)`; `fn` then returns `((mean_loss, aux), stats)`,
            every aux leaf stacked over the examples, [B, ...], as `jax.vmap` would.
        nonfinite: "propagate": a NaN or Inf in an example's loss or gradient reaches the
            statistics it enters, as in `jax.grad` of the mean loss. "drop": an example whose
            loss (one extra batched forward pass) or ‖g_i‖² is not finite is masked (below);
            in a batched convolution a non-finite gradient may drop its chunk too.

    `params` is a pytree of floating arrays, or a model (an `eqx.Module`, a flax `nnx.Module`:
    any pytree but a dict, list or tuple) whose floating-array leaves are the parameters, the
    rest held fixed; statistics then have its structure with None there (SPEC §1). `mask`, a
    bool [B]: an example with mask False counts in no statistic and not in N, "batch_size" is
    then the kept count (traced), and "var" divides by it − 1 (NaN below 2 kept units; an error
    for a concrete mask). Statistics have dtype `stat_dtype(param dtype)` (float32 or wider);
    "sq_norms" and "dot" are [N], "gram" [N, N], unit i·T + t at token granularity, 0 at masked
    units (what they are for: SPEC §2).
    """
    stats = _check_options(
        stats, impl, granularity, chunk_size, clip_norm, choose, memory_budget, nonfinite
    )
    drop = nonfinite == "drop"

    def fn(
        params: PyTree,
        batch: PyTree,
        mask: ArrayLike | None = None,
        *,
        dot_with: PyTree | None = None,
    ) -> tuple[Loss | tuple[Loss, PyTree], Stats]:
        floats, loss = _as_parameters(params, loss_fn, has_aux)
        per_example = _check_inputs(loss, floats, batch, stats, granularity)
        keep = None if mask is None else _check_mask(mask, batch, stats, per_example)
        v = None  # "dot"'s v: checked where it is given or needed
        if dot_with is not None or _of_kind(_ingredients(stats), "inner"):
            v = _check_dot_with(stats, floats, dot_with)
        if drop:  # one batched forward pass: examples with a non-finite loss
            losses = jax.vmap(lambda example: loss(floats, example)[0])(batch)
            keep = jnp.isfinite(losses) if keep is None else keep & jnp.isfinite(losses)
        if keep is not None:
            batch = _substitute(batch, keep)
        options = (granularity, choose, chunk_size, memory_budget)
        engine = _reference if impl == "vmap" else _factorized
        out = engine(loss, floats, batch, per_example, stats, options, clip_norm, keep, drop, v)
        value, stats_out, aux = out
        return ((value, aux) if has_aux else value), stats_out

    return fn


def explain(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    stats: str | Sequence[str] = ("mean",),
    *,
    granularity: Granularity = "example",
    clip_norm: float | None = None,
    choose: Choose = "cheapest",
    has_aux: bool = False,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
) -> "Plan":
    """The plan impl="factorized" follows for these statistics (and `choose`). Traces `loss_fn`
    abstractly; runs nothing. `batch` may hold `jax.ShapeDtypeStruct`s; `params` may be a model.
    This is the plan without a mask: with a mask (or nonfinite="drop") no leaf takes "constant",
    "var" is chunked, and the fallback does not transpose.

    Returns:
        A `Plan`: a tuple of `LeafPlan`s, one per parameter leaf in the tree's order, meant to
        be printed. `print(plan)` gives `plan.summary` (one line: leaves per route), then one
        entry per leaf. Each
        `LeafPlan` holds `leaf` (its key path, e.g. "['layers'][0]['w']"), `shape`, `route`
        (the route taken, a name in `ROUTES`, or "mean-loss"), `reason` (what its match
        proved), `methods` (each ingredient the statistics need -> "factorized" or
        "chunked"), `status` ("factorized", "chunked" or "fallback"), `refused` ((route, why
        it did not apply) pairs, in precedence order, up to the route taken) and `formed`
        (where per-unit gradients of the leaf exist: where, how many examples at once, their
        bytes).

    Example:
        >>> import jax.numpy as jnp, pegrad
        >>> loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]))
        >>> plan = pegrad.explain(loss, {"w": jnp.ones((3, 2))}, jnp.ones((4, 3)), "sq_mean")
        >>> [(p.leaf, p.shape, p.status) for p in plan]
        [("['w']", (3, 2), 'factorized')]
    """
    stats = _stat_names(stats)
    if "clipped_mean" in stats and clip_norm is None:
        clip_norm = 1.0  # the plan does not depend on C
    stats = _check_options(
        stats, "factorized", granularity, chunk_size, clip_norm, choose, memory_budget
    )
    floats, loss = _as_parameters(params, loss_fn, has_aux)
    per_example = _check_inputs(loss, floats, batch, stats, granularity)
    options = (granularity, choose, chunk_size, memory_budget)
    return Plan.build(loss, floats, batch, per_example, stats, options)


def _of_merge(stats: Sequence[str], merge: str) -> list[str]:
    """The statistics among `stats` whose union over groups merges so (`Statistic.merge`)."""
    return [s for s in stats if _STATISTIC[s].merge == merge]


class Accumulator(NamedTuple):
    """The statistics of k micro-batches combined into those of their union (gradient
    accumulation), exactly; a pytree (a `lax.scan` carry or a jit argument):

        acc = Accumulator.init(params, ("mean", "var"))
        for micro in batches:                       # or jax.lax.scan
            acc = acc.update(*fn(params, micro))    # fn = value_and_grad_stats(...)
        loss, stats = acc.finalize()

    Over N = Σ_k N_k units (N_k: a micro-batch's "batch_size", any size, masked or not) the
    averaged statistics and the mean loss are count-weighted, m ← m + (m_k − m)·N_k/N; the
    variance is Chan et al.'s merge of M2 = Σ_u (g_u − ḡ)², M2 ← M2 + M2_k + (ḡ_k − ḡ)²·N·N_k/
    (N + N_k) (no cancellation; it needs each "mean"), var = M2/(N − 1), with M2_k the "m2" of
    `Accumulator.value_and_grad_stats` or var_k·(N_k − 1). Only the union needs N ≥ 2 for "var";
    N = 0 gives NaN. "sq_norms" (one entry per unit) is refused.
    """

    count: Array  # N: units so far
    loss: Array  # their mean loss
    means: dict[str, PyTree]  # the averaged statistics so far
    m2: PyTree  # Σ_u (g_u − ḡ)² so far when "var" is accumulated, else None

    @staticmethod
    def init(params: PyTree, stats: str | Sequence[str]) -> "Accumulator":
        """Zeros for these statistics of `params` (a pytree of arrays, or a model)."""
        stats = _stat_names(stats)
        for s in stats:  # as `Statistic.merge` says
            if _STATISTIC[s].merge is None:
                raise ValueError(
                    f"Accumulator: '{s}' has one entry per unit of each micro-batch and is not "
                    "combined; collect it from each micro-batch's statistics instead"
                )
            if _STATISTIC[s].merge == "chan" and "mean" not in stats:
                raise ValueError(
                    f"Accumulator: '{s}' is merged with each micro-batch's 'mean': accumulate "
                    "'mean' too"
                )
        zeros = jax.tree.map(
            lambda x: jnp.zeros(jnp.shape(x), stat_dtype(x.dtype)) if _is_parameter(x) else None,
            params,
        )
        dtypes = [x.dtype for x in jax.tree.leaves(zeros)]
        if not dtypes:
            raise ValueError("Accumulator.init: params has no floating array leaves")
        dtype, m2 = _widest(dtypes), zeros if _of_merge(stats, "chan") else None
        means = {s: zeros for s in _of_merge(stats, "average")}
        return Accumulator(jnp.zeros((), dtype), jnp.zeros((), dtype), means, m2)

    @staticmethod
    def value_and_grad_stats(
        loss_fn: LossFn, stats: str | Sequence[str], **options: Any
    ) -> Callable[..., tuple[Any, Stats]]:  # as value_and_grad_stats
        """`value_and_grad_stats(loss_fn, stats, **options)` for micro-batches of any size, in
        or out of jit: "var" comes back as "m2" = Σ_u (g_u − ḡ_k)² over the kept units (0 for
        one kept unit or none, where a micro-batch's variance is undefined)."""
        names = _stat_names(stats)
        with_var = value_and_grad_stats(loss_fn, names, **options)
        if "var" not in names:
            return with_var
        if "mean" not in names:
            raise ValueError("Accumulator: 'var' is merged with each micro-batch's 'mean': ask too")
        without = value_and_grad_stats(loss_fn, [s for s in names if s != "var"], **options)
        token = options.get("granularity") == "token"

        def fn(
            params: PyTree, batch: PyTree, mask: ArrayLike | None = None, **given: Any
        ) -> tuple[Loss | tuple[Loss, PyTree], Stats]:
            # Kept units known before tracing (a traced mask keeps ≤ B): under 2, M2 is 0 ("var"
            # is NaN below 2 kept units, read as M2 = 0 here; no batch leaf: refused).
            shape = [*jnp.shape(jax.tree.leaves(batch)[0])] if jax.tree.leaves(batch) else [2]
            per_example = math.prod(shape[1:2]) if token else 1
            if per_example * (shape[0] if mask is None else min(shape[0], _concrete(mask))) < 2:
                loss, out = without(params, batch, mask, **given)
                return loss, {**out, "m2": jax.tree.map(jnp.zeros_like, out["mean"])}
            loss, out = with_var(params, batch, mask, **given)
            n = out["batch_size"]
            spread = lambda v: jnp.where(n > 1, v * (n - 1).astype(v.dtype), 0.0)  # noqa: E731
            return loss, {**out, "m2": jax.tree.map(spread, out.pop("var"))}

        return fn

    def update(self, loss: Loss | tuple[Loss, PyTree], stats: Stats) -> "Accumulator":
        """Add one micro-batch: its mean loss (or `(loss, aux)`) and statistics, as
        `value_and_grad_stats(...)(params, micro_batch)` returns them."""
        loss = loss[0] if isinstance(loss, tuple) else loss
        spread = "m2" if "m2" in stats else "var"  # Accumulator's M2_k, or value_and_grad_stats'
        missing = [
            s for s in (*self.means, *([spread] if self.m2 is not None else [])) if s not in stats
        ]
        if missing:
            raise ValueError(f"Accumulator.update: the micro-batch statistics lack {missing}")
        n_k = jnp.asarray(stats["batch_size"]).astype(self.count.dtype)

        def merge(
            m: Array, x: ArrayLike, s: ArrayLike = 0.0, s_k: ArrayLike = 0.0
        ) -> tuple[Array, Array]:
            """(mean, M2) of the union (`_chan`); a micro-batch of 0 units (which may hold
            NaN) changes nothing, one of 1 unit has M2_k = 0 (its var is NaN)."""
            dtype = m.dtype
            s_k = jnp.asarray(s_k).astype(dtype)
            s_k = s_k if spread == "m2" else s_k * (n_k - 1).astype(dtype)
            a = (self.count.astype(dtype), m, jnp.asarray(s, dtype))
            b = (n_k.astype(dtype), jnp.asarray(x).astype(dtype), jnp.where(n_k > 1, s_k, 0.0))
            _, mean, m2 = _chan(a, b)
            return jnp.where(n_k > 0, mean, m), jnp.where(n_k > 0, m2, s)

        mean = lambda m, x: merge(m, x)[0]  # noqa: E731
        means = {s: jax.tree.map(mean, m, stats[s]) for s, m in self.means.items()}
        m2 = self.m2
        if m2 is not None:  # read with the means before this micro-batch
            m2_of = lambda m, x, s, s_k: merge(m, x, s, s_k)[1]  # noqa: E731
            m2 = jax.tree.map(m2_of, self.means["mean"], stats["mean"], m2, stats[spread])
        return Accumulator(self.count + n_k, mean(self.loss, loss), means, m2)

    def finalize(self) -> tuple[Array, Stats]:
        """(mean loss, statistics) of all units added, with "batch_size" N. "var" needs N ≥ 2:
        an error when N is concrete, NaN under jit (SPEC §6); N = 0 leaves every statistic
        NaN, as value_and_grad_stats of a batch masked whole."""
        if self.m2 is not None and (n := _concrete(self.count)) < 2:  # under jit: NaN
            raise ValueError(
                f"Accumulator.finalize: 'var' is undefined for {n} unit(s) in all the "
                "micro-batches together; the union needs ≥ 2"
            )
        some = self.count > 0
        defined = lambda x: jnp.where(some, x, jnp.asarray(jnp.nan, x.dtype))  # noqa: E731
        out: Stats = {s: jax.tree.map(defined, m) for s, m in self.means.items()}
        if self.m2 is not None:
            var = lambda s: defined(s / (self.count - 1.0).astype(s.dtype))  # noqa: E731
            out["var"] = jax.tree.map(var, self.m2)
        out["batch_size"] = self.count.astype(jnp.int32)
        return defined(self.loss), out


def merge_shards(stats: Stats, axis_name: str | tuple[str, ...]) -> Stats:
    """Inside `jax.shard_map`: the statistics of all shards' units along `axis_name`, from each
    shard's own (`value_and_grad_stats`' of its part of the batch, or
    `Accumulator.value_and_grad_stats`' with "m2"), exactly, with N_k each shard's "batch_size":

        N = Σ_k N_k        an averaged statistic   x = Σ_k N_k·x_k / N        (psum)
        var                Chan's merge: M2 = Σ_k M2_k + Σ_k N_k·(ḡ_k − ḡ)², var = M2/(N − 1)
                           (psum, after the means; it needs "mean")
        sq_norms, dot      every shard's entries, in shard order: [N]      (psum of each
                           shard's entries in its place: the same on every shard)

    "gram" is refused: a pair of units on two shards needs both shards' gradients (ask for it
    under `jax.jit` with the batch sharded instead: SPEC §2.3). A shard whose N_k is 0 (masked
    whole) adds nothing, its NaN included; "var" of a union of fewer than 2 units is NaN."""
    _stat_names([s for s in stats if s not in ("batch_size", "m2")])
    if "batch_size" not in stats:
        raise ValueError("merge_shards: the statistics lack 'batch_size' (each shard's N_k)")
    pairs = [s for s in stats if s in _STATISTIC and _kind(_STATISTIC[s].is_) == "pairs"]
    if pairs:
        raise ValueError(
            f"merge_shards: {pairs} pairs units across shards, which no shard's statistics "
            "hold; compute it under jax.jit with the batch sharded (one program for the mesh)"
        )
    spread = [
        s for s in stats if s == "m2" or _STATISTIC.get(s, _STATISTIC["mean"]).merge == "chan"
    ]
    if spread and "mean" not in stats:
        raise ValueError("merge_shards: 'var' is merged with each shard's 'mean': ask for it too")
    n_k = jnp.asarray(stats["batch_size"])
    n = jax.lax.psum(n_k, axis_name)
    some = n_k > 0
    weigh = lambda x: jnp.where(some, x * n_k.astype(x.dtype), jnp.zeros((), x.dtype))  # noqa: E731
    average = lambda x: jax.lax.psum(weigh(x), axis_name) / n.astype(x.dtype)  # noqa: E731
    out: Stats = {"batch_size": n}
    for s, x in stats.items():
        if s in _STATISTIC and _STATISTIC[s].merge == "average":
            out[s] = jax.tree.map(average, x)
        elif s in _STATISTIC and _STATISTIC[s].per == "units":
            out[s] = jax.tree.map(lambda v: _placed_sum(v, axis_name), x)
    if spread:
        given_m2 = spread[0] == "m2"

        def m2(x: Array, mean_k: Array, mean: Array) -> Array:  # M2_k + N_k·(ḡ_k − ḡ)²
            local = x if given_m2 else x * (n_k - 1).astype(x.dtype)
            local = jnp.where(n_k > 1, local, jnp.zeros((), local.dtype))
            return jax.lax.psum(local + weigh((mean_k - mean) ** 2), axis_name)

        total = jax.tree.map(m2, stats[spread[0]], stats["mean"], out["mean"])
        out["var"] = jax.tree.map(lambda t: t / (n - 1).astype(t.dtype), total)
    return out


def _placed_sum(x: Array, axis_name: str | tuple[str, ...]) -> Array:
    """Every shard's `x` [n, ...] in shard order, [shards·n, ...], on every shard (a psum of
    each placed in zeros: invariant along `axis_name`, as `out_specs=P()` asks)."""
    shards = jax.lax.psum(1, axis_name)
    rows = jnp.zeros((shards * x.shape[0], *x.shape[1:]), x.dtype)
    start = jax.lax.axis_index(axis_name) * x.shape[0]
    return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(rows, x, start, 0), axis_name)


# ============================================================================================
# §2 Statistics, declared once. Each statistic is made of "ingredients" that routes form per
# leaf; an ingredient's `kind` is the computation a route implements for it. The engine reads
# these two tables and compares no statistic's name.


@dataclasses.dataclass(frozen=True)
class Ingredient:
    """What routes form per leaf for the statistics, by `kind`:

        "mean"      (1/N) Σ_u φ(g_u), φ multiplicative — φ(m·x) = φ(m)·φ(x), φ(x/m) = φ(x)/φ(m) —
                    which lets a scaling by a batch-independent m move out of the sum over units
        "spread"    Σ_u (g_u − ḡ)²/(N − 1), from centred values (two passes; groups of units
                    merged by Chan's update, `_chan`); a scaling m moves out as m²
        "norm"      ‖g_u‖² per unit ([B, U]), added over the leaves; m moves out as m²
        "inner"     ⟨g_u, v⟩ per unit ([B, U]) for a given tree v, added over the leaves
        "pairs"     ⟨g_u, g_u'⟩ per pair of units ([N, N]), added over the leaves; m → m²
        "weighted"  (1/N) Σ_u w_u g_u for weights [B, U] known once every unit's norm is

    `phi`: φ of a mean, and what a scaling after the core becomes (`_REPLAY`). `linear`: linear
    in g, so a sum over examples of it transposes through any linear tail (the fallback)."""

    kind: Literal["mean", "spread", "norm", "inner", "pairs", "weighted"]
    phi: Phi
    linear: bool = False


@dataclasses.dataclass(frozen=True)
class Statistic:
    """A statistic: the `ingredients` it needs, the one it publishes (`is_`), its shape — a tree
    shaped like the parameters, or per unit ("units": [N], [N, N] for pairs) — and how the
    statistics of two disjoint groups of units merge into their union's (`Accumulator`):
    "average", count-weighted; "chan", Chan's merge of the sums of squared deviations (it needs
    "mean"); None, not accumulated (the reason is `per`'s)."""

    ingredients: tuple[str, ...]
    is_: str
    per: Literal["params", "units"] = "params"
    merge: Literal["average", "chan"] | None = "average"


_INGREDIENT = {
    "sum": Ingredient("mean", lambda x: x, linear=True),  # (1/N) Σ_u g_u
    "sq": Ingredient("mean", jnp.square),  # (1/N) Σ_u g_u²
    "sign": Ingredient("mean", jnp.sign),  # (1/N) Σ_u sign(g_u)
    "var": Ingredient("spread", jnp.square),  # Σ_u (g_u − ḡ)²/(N − 1)
    "norms": Ingredient("norm", jnp.square),  # ‖g_u‖² per unit
    "dot": Ingredient("inner", lambda x: x),  # ⟨g_u, v⟩ per unit
    "gram": Ingredient("pairs", jnp.square),  # ⟨g_u, g_u'⟩ per pair of units
    "clipped": Ingredient("weighted", lambda x: x, linear=True),  # (1/N) Σ_u c_u g_u
}
_STATISTIC = {
    "mean": Statistic(("sum",), "sum"),
    "sq_mean": Statistic(("sq",), "sq"),
    "sign_mean": Statistic(("sign",), "sign"),
    "var": Statistic(("var",), "var", merge="chan"),
    "sq_norms": Statistic(("norms",), "norms", per="units", merge=None),
    "clipped_mean": Statistic(("norms", "clipped"), "clipped"),
    "dot": Statistic(("dot",), "dot", per="units", merge=None),
    "gram": Statistic(("gram",), "gram", per="units", merge=None),
}
_PER_UNIT = ("norm", "inner", "pairs")  # the kinds with an entry per unit (or pair of units)
_ALL_KINDS = frozenset(i.kind for i in _INGREDIENT.values())
STATISTICS = tuple(_STATISTIC)
_PHI: dict[str, Phi] = {w: i.phi for w, i in _INGREDIENT.items() if i.kind == "mean"}  # means
_REPLAY: dict[str, Phi] = {w: i.phi for w, i in _INGREDIENT.items()}  # var(m·g) = m²·var(g)


def _chan(a: tuple, b: tuple) -> tuple:
    """Merge (count, mean, M2) of two groups: Chan et al.'s pairwise variance update."""
    na, ma, sa = a
    nb, mb, sb = b
    n = na + nb
    delta = mb - ma
    safe = jnp.maximum(n, 1.0)  # two empty groups (every example masked) stay empty
    return n, ma + delta * (nb / safe), sa + sb + delta * delta * (na * nb / safe)


def _ingredients(stats: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for s in stats for i in _STATISTIC[s].ingredients))


def _kind(name: str) -> str:
    return _INGREDIENT[name].kind


# What a contraction forms per example (the sum comes with them; `CoreRoute`)
_FORMED = tuple(
    w
    for w, i in _INGREDIENT.items()
    if not i.linear and i.kind in ("mean", "spread", "norm", "inner")
)


def _of_kind(names: Sequence[str], *kinds: str) -> list[str]:
    """The ingredients among `names` of these kinds, in `names`' order."""
    return [w for w in names if _INGREDIENT[w].kind in kinds]


def stat_dtype(dtype: DTypeLike) -> jnp.dtype:
    """Statistics are accumulated in float32 or wider, even for bf16/fp16 parameters."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def gradient_noise_scale(
    stats: dict[str, PyTree], preconditioner: PyTree | None = None
) -> dict[str, PyTree]:
    """The simple gradient noise scale B_simple = tr Σ / |G|² (McCandlish et al. 2018, arXiv
    1812.06162: about the batch size past which a bigger batch stops buying proportionally fewer
    steps) from one batch's `stats`: N = stats["batch_size"] units (tokens, kept units), per
    leaf ḡ = stats["mean"] and σ̂² = stats["var"], or N/(N−1)·(q − ḡ²) from q = stats["sq_mean"]
    (which loses digits where ḡ² ≫ σ̂²: ask for "var", formed from centred quantities, SPEC §3):

        tr Σ = Σ_leaves Σ σ̂²      |G|² = ‖ḡ‖² − tr Σ / N      B_simple = tr Σ / |G|²

    For independent units both are unbiased (E[σ̂²] = Σ_jj, E[‖ḡ‖²] = |G|² + tr Σ / N); their
    ratio is not, and on one batch |G|² can be ≤ 0: smooth both over steps and divide after, as
    McCandlish et al. do (train.py logs both). N = 1 gives NaN.

    With a diagonal `preconditioner` P (a tree like the parameters, each leaf broadcastable to
    its parameter's shape; e.g. Adam's 1/(√v̂ + ε)), the same argument run on the preconditioned
    step −ηPg: tr(PΣ) = Σ P σ̂², |G|²_P = Σ P ḡ² − tr(PΣ)/N, B_P = tr(PΣ) / |G|²_P, returned
    beside as "trace_cov_p", "grad_sq_p", "b_p" (and per leaf). For P fixed before the batch
    (an optimizer's state before this step's update) E[Σ P σ̂²] = Σ P Σ_jj = tr(PΣ) and
    E[Σ P ḡ²] = GᵀPG + tr(PΣ)/N, so both parts are unbiased; a P formed from the batch itself
    is not (E[P σ̂²] ≠ P·E[σ̂²]). P = 1 gives B_simple's numbers (x·1 = x). P must be finite
    and ≥ 0 (a PSD diagonal): checked where concrete, under jit the caller's contract.

    Returns:
        A dict of these keys, the scalars in the statistics' widest dtype (float32 at least):

        * "trace_cov": tr Σ, a scalar.
        * "grad_sq": |G|², a scalar (≤ 0 on some batches).
        * "b_simple": tr Σ / |G|², a scalar.
        * "per_leaf": a dict of the same three keys, each a tree like the parameters holding
          the leaf's own scalar; per-leaf "trace_cov" and "grad_sq" sum to the totals,
          "b_simple" is the leaf's own ratio (ratios do not sum).

        With `preconditioner`, also "trace_cov_p" (tr(PΣ)), "grad_sq_p" (|G|²_P) and "b_p"
        (B_P), scalars, and the same three in "per_leaf" beside the others.

    Example:
        >>> import jax.numpy as jnp, pegrad
        >>> stats = {"mean": {"w": jnp.array([2.0, 0.0])}, "var": {"w": jnp.array([2.0, 2.0])},
        ...          "batch_size": 4}
        >>> out = pegrad.gradient_noise_scale(stats)  # tr Σ = 4, |G|² = 4 − 4/4 = 3
        >>> sorted(out), sorted(out["per_leaf"])
        (['b_simple', 'grad_sq', 'per_leaf', 'trace_cov'], ['b_simple', 'grad_sq', 'trace_cov'])
        >>> [round(float(out[k]), 4) for k in ("trace_cov", "grad_sq", "b_simple")]
        [4.0, 3.0, 1.3333]
    """
    need = ("mean", "batch_size", "var" if "var" in stats else "sq_mean")
    if missing := [k for k in need if k not in stats]:
        raise ValueError(
            f"gradient_noise_scale: no {', '.join(missing)} in the statistics; ask "
            'value_and_grad_stats for ("mean", "sq_mean") or ("mean", "var")'
        )
    mean, n = stats["mean"], jnp.asarray(stats["batch_size"])
    over = lambda x: n.astype(x.dtype)  # noqa: E731  # N in the dtype of x
    sigma2 = lambda g, q: over(g) / (over(g) - 1) * (q - g * g)  # noqa: E731
    var = stats["var"] if "var" in stats else jax.tree.map(sigma2, mean, stats["sq_mean"])
    wide = _widest([x.dtype for x in jax.tree.leaves(mean)] or [jnp.float32])
    total = lambda tree: sum((x.astype(wide) for x in jax.tree.leaves(tree)), jnp.zeros((), wide))

    def parts(weights: PyTree, suffix: str, name: str) -> dict[str, PyTree]:
        trace = jax.tree.map(lambda v, p: jnp.sum(p * v), var, weights)
        grad_sq = jax.tree.map(
            lambda t, g, p: jnp.sum(p * g * g) - t / over(g), trace, mean, weights
        )
        ratio = jax.tree.map(lambda t, g: t / g, trace, grad_sq)
        keys = (f"trace_cov{suffix}", f"grad_sq{suffix}", name)
        t, g = total(trace), total(grad_sq)
        per_leaf = dict(zip(keys, (trace, grad_sq, ratio), strict=True))
        return dict(zip(keys, (t, g, t / g), strict=True)) | {"per_leaf": per_leaf}

    out = parts(jax.tree.map(lambda g: jnp.ones((), g.dtype), mean), "", "b_simple")
    if preconditioner is None:
        return out
    found = parts(_check_preconditioner(mean, preconditioner), "_p", "b_p")
    return out | found | {"per_leaf": out["per_leaf"] | found["per_leaf"]}


def _check_preconditioner(mean: PyTree, preconditioner: PyTree) -> PyTree:
    """P leaf by leaf: shaped to broadcast to ḡ, finite and ≥ 0 (named if not), in ḡ's dtype."""
    paths = jax.tree_util.tree_leaves_with_path
    got, tree = jax.tree.flatten(preconditioner)
    if tree != jax.tree.structure(mean):
        mine, its = ({jax.tree_util.keystr(k) for k, _ in paths(t)} for t in (mean, preconditioner))
        raise ValueError(
            f"gradient_noise_scale: the preconditioner has no leaf at {sorted(mine - its)} and "
            f"extra leaves at {sorted(its - mine)}: it must have the statistics' structure "
            f"{jax.tree.structure(mean)}, got {tree}"
        )
    leaves = []
    for (path, g), p in zip(paths(mean), got, strict=True):
        where = f"gradient_noise_scale: preconditioner{jax.tree_util.keystr(path)}"
        try:
            fits = jnp.broadcast_shapes(jnp.shape(p), jnp.shape(g)) == jnp.shape(g)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"{where} of shape {jnp.shape(p)} does not broadcast to {g.shape}")
        try:
            bad = np.asarray(p)[~((np.asarray(p) >= 0) & np.isfinite(p))]  # NaN fails too
        except jax.errors.TracerArrayConversionError:
            bad = []  # under jit: the caller's contract
        if len(bad):
            raise ValueError(f"{where} holds {bad[0]}: P must be a finite diagonal ≥ 0")
        leaves.append(jnp.asarray(p).astype(g.dtype))
    return jax.tree.unflatten(tree, leaves)


def _widest(dtypes: Sequence[DTypeLike]) -> jnp.dtype:
    """Per-unit norms add up every leaf: in the widest statistic dtype."""
    return max((stat_dtype(d) for d in dtypes), key=lambda d: d.itemsize)


def _clip_factors(sq_norms: Array, clip_norm: float) -> Array:
    """min(1, C/‖g‖); a zero gradient keeps factor 1."""
    return jnp.minimum(1.0, clip_norm / jnp.sqrt(sq_norms)).astype(sq_norms.dtype)


def _publish(
    stats: tuple[str, ...], means: Mapping[str, PyTree], units: Mapping[str, Array], n_units: Value
) -> Stats:
    """The statistics dict from the ingredients: `means` per leaf (already divided by N, or
    N − 1 for var), `units` added over the leaves."""
    out: Stats = {}
    for s in stats:
        out[s] = (units if _STATISTIC[s].per == "units" else means)[_STATISTIC[s].is_]
    with jax.ensure_compile_time_eval():  # concrete under jit: consumers check B at trace time
        out["batch_size"] = jnp.asarray(n_units, jnp.int32)
    return out


def _sum0(x: Array) -> Array:
    """Σ over the leading axis. XLA:CPU reduces a [c, big] tensor over c several times slower
    than it adds c slices (a few up to 6x for the per-example squares of a weight gradient):
    up to 32 slices are added pairwise, in one fusion with what made x; longer axes are
    multiplied by a vector of ones, still faster than the reduction. On a mesh of devices one
    reduction: each device sums its examples and one all-reduce adds them (slices of the
    sharded axis would copy every example's row to every device)."""
    if _devices(x) > 1:
        return jnp.sum(x, 0)
    if x.shape[0] > 32:
        return jnp.tensordot(jnp.ones(x.shape[:1], x.dtype), x, axes=1)
    parts = [x[j] for j in range(x.shape[0])] or [jnp.zeros(x.shape[1:], x.dtype)]
    while len(parts) > 1:
        pairs = range(0, len(parts) - 1, 2)
        parts = [parts[k] + parts[k + 1] for k in pairs] + parts[len(parts) // 2 * 2 :]
    return parts[0]


def _devices(x: Any) -> int:
    """The devices of the mesh jit partitions `x` over, its manual (shard_map) axes aside: 1
    on one device. What it decides is the shape of a program, never a number: a cost choice."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    types = getattr(mesh, "axis_types", ())
    manual = getattr(getattr(jax.sharding, "AxisType", None), "Manual", None)
    sizes = [n for n, t in zip(getattr(mesh, "axis_sizes", ()), types, strict=False) if t != manual]
    return math.prod(sizes)


def _groups(xs: PyTree, n: int) -> int:
    """Into how many groups of consecutive examples a loop over the n examples of `xs` is split
    so that each device runs its own examples' chunks: gcd(devices, n), 1 on one device. A batch
    sharded over any axes of the mesh holds whole groups on each device (its shard count divides
    the mesh's and n), so chunks of a group never cross devices."""
    return math.gcd(max([_devices(x) for x in jax.tree.leaves(xs)], default=1), n)


def _chan_over(parts: tuple) -> tuple[Array, Array, Array]:
    """(count, mean, M2) of groups stacked on axis 0 merged into their union's: Chan's merge
    of any number of groups, Σ_k M2_k + Σ_k n_k (mean_k − mean)² (two reductions, no
    cancellation)."""
    counts, means, m2 = parts
    n = jnp.sum(counts)
    weights = counts.reshape(-1, *[1] * (means.ndim - 1))
    mean = jnp.sum(weights * means, 0) / jnp.maximum(n, 1.0)
    return n, mean, jnp.sum(m2 + weights * (means - mean) ** 2, 0)


def _merge01(x: Array) -> Array:
    """[B, U, ...] -> [B·U, ...]."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


# ============================================================================================
# §3 Input checks (SPEC §6): clear errors naming the offending leaf, raised at trace time.


def _stat_names(stats: str | Sequence[str]) -> tuple[str, ...]:
    stats = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [s for s in stats if s not in STATISTICS]
    if unknown:
        raise ValueError(f"unknown statistic(s) {unknown}; choose from {STATISTICS}")
    return stats


def _check_options(
    stats: str | Sequence[str],
    impl: str,
    granularity: str,
    chunk_size: int | None,
    clip_norm: float | None,
    choose: str = "cheapest",
    memory_budget: int | None = None,
    nonfinite: str = "propagate",
) -> tuple[str, ...]:
    stats = _stat_names(stats)
    for option, value, allowed in (
        ("impl", impl, Impl),
        ("granularity", granularity, Granularity),
        ("choose", choose, Choose),
        ("nonfinite", nonfinite, NonFinite),
    ):
        if value not in allowed.__args__:
            raise ValueError(f"{option} must be one of {allowed.__args__}, got {value!r}")
    for option, value in (("chunk_size", chunk_size), ("memory_budget", memory_budget)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{option} must be a positive int or None, got {value!r}")
    if "clipped_mean" in stats:
        if clip_norm is None or not clip_norm > 0:
            raise ValueError(f"'clipped_mean' needs clip_norm > 0, got clip_norm={clip_norm!r}")
    elif clip_norm is not None:
        raise ValueError("clip_norm was given but 'clipped_mean' is not among the statistics")
    return stats


def _check_inputs(
    loss_fn: Callable, params: PyTree, batch: PyTree, stats: tuple[str, ...], granularity: str
) -> int:
    """Validate params and batch; return the units per example (T at token granularity)."""
    param_leaves = jax.tree_util.tree_leaves_with_path(params)
    if not param_leaves:
        raise ValueError("params has no array leaves")
    for path, leaf in param_leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {dtype}; every parameter leaf "
                "must be a floating array (for Equinox: eqx.partition(model, eqx.is_inexact_array))"
            )
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    shapes = {jax.tree_util.keystr(p): tuple(jnp.shape(x)) for p, x in leaves}
    if not shapes:
        raise ValueError("batch has no array leaves")
    first, lead = next(iter(shapes.items()))
    axes, dims = (2, "B, T") if granularity == "token" else (1, "B")
    for name, shape in shapes.items():
        if len(shape) < axes or shape[:axes] != lead[:axes]:
            raise ValueError(
                f"every batch leaf needs the leading axes [{dims}, ...], the same for all "
                f"(granularity={granularity!r}): batch{first} has shape {lead} but batch{name} "
                f"has shape {shape}" + _STACK * isinstance(batch, list)
            )
    if 0 in lead[:axes]:
        raise ValueError(f"the batch is empty: [{dims}] = {list(lead[:axes])}, no units")
    per_example = lead[1] if axes == 2 else 1  # one position is one example
    _refuse_var(stats, lead[0] * per_example, "a batch needs B ≥ 2")
    one = _one_example(batch)
    closed, (loss_shape, _) = jax.make_jaxpr(loss_fn, return_shape=True)(params, one)
    _refuse_shared_draws(closed.jaxpr, n_params := len(jax.tree.leaves(params)))
    if not (hasattr(loss_shape, "shape") and loss_shape.shape == ()):
        raise ValueError(
            "loss_fn(params, example) must return a scalar loss for ONE example; it returned "
            f"{loss_shape}. Reduce over positions inside loss_fn; the batch mean is taken here."
        )
    if not jnp.issubdtype(loss_shape.dtype, jnp.floating):
        raise TypeError(f"loss_fn must return a floating scalar, got dtype {loss_shape.dtype}")
    if _calls(closed.jaxpr, "custom_vjp"):  # a backward rule the user wrote: its draws too
        grad = jax.make_jaxpr(jax.grad(lambda p, x: loss_fn(p, x)[0]))(params, one)
        _refuse_shared_draws(grad.jaxpr, n_params, "a custom_vjp backward rule of loss_fn")
    return per_example


def _calls(jaxpr: jcore.Jaxpr, name: str | tuple[str, ...]) -> bool:
    """Whether `jaxpr` or a sub-jaxpr holds a primitive whose name starts with `name` (one of)."""
    subs = lambda e: any(_calls(s, name) for s in _sub_jaxprs(e))
    return any(e.primitive.name.startswith(name) or subs(e) for e in jaxpr.eqns)


def _is_parameter(x: object) -> bool:
    """A floating array: what Equinox's `is_inexact_array` selects (keys, counters, integer
    buffers and Python values are held fixed)."""
    arrays = (jax.Array, np.ndarray, jax.ShapeDtypeStruct)
    return isinstance(x, arrays) and jnp.issubdtype(x.dtype, jnp.floating)


def _as_parameters(params: PyTree, loss_fn: Callable, has_aux: bool) -> tuple[PyTree, Callable]:
    """(the parameters, the loss as a function of them returning (loss, aux)): a dict, list or
    tuple is a pytree of parameters, checked leaf by leaf (an integer leaf is an error); any
    other pytree object is a model (`_model_parameters`)."""
    _refuse_coupled(params)
    if not isinstance(params, (dict, list, tuple)):
        return _model_parameters(params, loss_fn, has_aux)
    return params, lambda p, example: _with_aux(loss_fn(p, example), has_aux)  # see _check_inputs


def _with_aux(out: Any, has_aux: bool) -> tuple[Array, PyTree]:
    """loss_fn's output as (loss, aux): aux () without has_aux."""
    if not has_aux and isinstance(out, tuple):
        raise ValueError("loss_fn returned a tuple: a (loss, aux) pair needs has_aux=True")
    if not has_aux:
        return out, ()
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"has_aux=True: loss_fn must return (loss, aux), got {type(out)}")
    return out


def _model_parameters(model: PyTree, loss_fn: Callable, has_aux: bool) -> tuple[PyTree, Callable]:
    """A model (an `eqx.Module`, a flax `nnx.Module`): its floating-array leaves are the
    parameters, the rest held fixed; the parameters are the model with None elsewhere."""
    leaves, treedef = jax.tree.flatten(model)
    if not leaves:
        raise TypeError(
            f"params is a {type(model).__name__} with no array leaves: pass the model, a "
            "pytree (an eqx.Module, or for flax nnx the model itself or nnx.state(model)) "
            "whose floating arrays are the parameters; flax linen: the params dict"
        )
    fixed = [None if _is_parameter(x) else x for x in leaves]
    tracer = jax.core.Tracer  # pyright: ignore[reportAttributeAccessIssue]
    traced = [k for k, f in zip(_paths(model), fixed, strict=True) if isinstance(f, tracer)]
    params = jax.tree.unflatten(treedef, [x if _is_parameter(x) else None for x in leaves])

    def loss(p: PyTree, example: PyTree) -> tuple[Array, PyTree]:  # checked: _check_inputs
        values = iter(jax.tree.leaves(p))
        given = [next(values) if f is None else f for f in fixed]
        p = jax.tree.unflatten(treedef, given)
        try:
            out = loss_fn(p, example)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
            if not traced:
                raise
            raise TypeError(
                f"loss_fn needed a concrete value where the model's non-array field(s) "
                f"params{', params'.join(traced)} became tracers: a jax.jit around pegrad's "
                "function traces every leaf of the model; jit it with eqx.filter_jit (flax: "
                "nnx.jit), which keeps the fields that are not arrays static"
            ) from None
        _refuse_dropped_state(p, given)
        return _with_aux(out, has_aux)

    return params, loss


def _refuse_coupled(params: PyTree) -> None:
    """A layer that normalizes with the batch's own statistics couples the examples: the loss
    of one example is not a function of that example, and per-example gradients are
    undefined. Recognised by the flags BatchNorm layers carry (flax nnx, Equinox)."""
    for path, node in jax.tree_util.tree_leaves_with_path(
        params, is_leaf=lambda x: hasattr(x, "use_running_average") or hasattr(x, "inference")
    ):
        flag = "use_running_average" if hasattr(node, "use_running_average") else "inference"
        if getattr(node, flag, None) is False and (
            flag == "use_running_average" or type(node).__name__ == "BatchNorm"
        ):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is a {type(node).__module__.split('.')[0]} "
                f"{type(node).__name__} in training mode ({flag}=False): it normalizes with the "
                "batch's statistics, which couples the examples, so per-example gradients are "
                "undefined. Use eval mode (flax nnx: model.eval(); Equinox: "
                "eqx.nn.inference_mode(model)) or a per-example normalization (LayerNorm)"
            )


def _refuse_dropped_state(model: PyTree, given: list) -> None:
    """The model after loss_fn ran on it (a copy pegrad made): a leaf changed in place is
    state the loss updates (an nnx RNG stream's counter, batch statistics, a cache), which a
    per-example call would drop, every example and every step seeing the same state."""
    after = jax.tree_util.tree_leaves_with_path(model)
    for i, (path, leaf) in enumerate(after):
        if i >= len(given) or leaf is not given[i]:
            raise ValueError(
                f"loss_fn changed params{jax.tree_util.keystr(path)} in place: the model holds "
                "state the loss updates (an RNG stream that nnx.Dropout draws from, batch "
                "statistics, a cache), which a per-example call drops, so every example, at "
                f"every step, would see the same state. {_PER_EXAMPLE_RANDOMNESS}"
            )
    if len(after) != len(given):
        raise ValueError(f"loss_fn changed the model structure in place. {_PER_EXAMPLE_RANDOMNESS}")


_STACK = "; a list of examples? stack them: jax.tree.map(lambda *x: jnp.stack(x), *examples)"
_PER_EXAMPLE_RANDOMNESS = (
    "Pass randomness with the example: a key per example in the batch (jax.random.split(key, "
    "B), new each step), given to the layer (Equinox key=; flax linen rngs={'dropout': key}; "
    "nnx rngs=nnx.Rngs(dropout=key) at the call), or put the layer in eval mode "
    "(nnx model.eval(), eqx.nn.inference_mode, deterministic=True)"
)

# Random draws, by the operands that hold their key; how a higher-order primitive's operands
# reach its sub-jaxpr is in _reaches below.
_DRAWS = {"random_bits": (0,), "threefry2x32": (0, 1), "rng_bit_generator": (0,)}


def _refuse_shared_draws(jaxpr: jcore.Jaxpr, n_params: int, who: str = "loss_fn") -> None:
    """A random draw in the one-example loss whose key does not depend on the example (a key
    closed over, or held in the model) is the same draw for every example, and at every step:
    one dropout mask for the whole batch where a batched model draws one per example."""
    tainted = [i >= n_params for i in range(len(jaxpr.invars))]
    draw = _calls(jaxpr, tuple(_DRAWS)) and _example_dependence(jaxpr, tainted)[1]  # (if any)
    if draw:
        raise ValueError(
            f"{who} draws random numbers ({draw}) from a key that does not depend on the "
            "example (closed over, or held in the model): every example would get the same "
            f"draw, e.g. one dropout mask for the batch. {_PER_EXAMPLE_RANDOMNESS}. Randomness "
            "meant to be shared: draw it outside loss_fn and pass the array"
        )


def _scan_counts(p: Mapping[str, Any]) -> tuple[int, int]:  # constants, carries (JAX 0.11: ft_in)
    n = [len(tree) for tree in p["ft_in"].unpack()] if "ft_in" in p else None
    return (n[0], n[1]) if n else (p["num_consts"], p["num_carry"])


def _example_dependence(jaxpr: jcore.Jaxpr, tainted: Sequence[bool]) -> tuple[list[bool], str]:
    """(which outputs depend on the inputs marked `tainted`, the first draw whose key does
    not, or ""), through sub-jaxprs."""
    dep: dict[Var, bool] = dict(zip(jaxpr.invars, tainted, strict=True))
    read = lambda a: isinstance(a, jcore.Var) and dep.get(a, False)
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        keys = _DRAWS.get(eqn.primitive.name)
        if keys is not None and not any(ins[k] for k in keys):
            return [], eqn.primitive.name
        outs, draw = _reaches(eqn, ins)
        if draw:
            return [], draw
        dep.update(zip(eqn.outvars, outs, strict=True))
    return [read(a) for a in jaxpr.outvars], ""


def _reaches(eqn: jcore.JaxprEqn, ins: list[bool]) -> tuple[list[bool], str]:
    """_example_dependence for one equation: its operands mapped onto its sub-jaxprs' inputs
    (calls one to one; cond's branches from operand 1; scan's and while's carry to a fixed
    point). A sub-jaxpr reached otherwise is searched with no input marked: a draw in it is
    refused (an honest refusal, never a missed one)."""
    name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    inner = lambda x: x.jaxpr if isinstance(x, jcore.ClosedJaxpr) else x
    if name == "cond":
        outs, draw = [False] * n_out, ""
        for branch in params["branches"]:
            got, draw = _example_dependence(inner(branch), ins[1:])
            if draw:
                return [], draw
            outs = [a or b or ins[0] for a, b in zip(outs, got, strict=True)]
        return outs, ""
    if name in ("scan", "while"):
        body = inner(params["jaxpr" if name == "scan" else "body_jaxpr"])
        skip = 0 if name == "scan" else params["cond_nconsts"]
        nc, n_carry = _scan_counts(params) if name == "scan" else (params["body_nconsts"], n_out)
        ins_all, ins = ins, ins[skip:]
        carry = ins[nc : nc + n_carry]
        while True:
            outs, draw = _example_dependence(body, ins[:nc] + carry + ins[nc + n_carry :])
            if draw:
                return [], draw
            grown = [a or b for a, b in zip(carry, outs[:n_carry], strict=True)]
            if name == "while":  # a trip count that depends on the example: every carry does
                test = inner(params["cond_jaxpr"])
                stop, draw = _example_dependence(test, ins_all[: params["cond_nconsts"]] + grown)
                if draw:
                    return [], draw
                grown = [True] * n_carry if any(stop) else grown
            if grown == carry:
                return (carry, "") if name == "while" else (outs, "")
            carry = grown
    subs = _sub_jaxprs(eqn)
    if len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == n_out:
        return _example_dependence(subs[0], ins)  # a call: pjit, custom_jvp/vjp, remat
    for sub in subs:
        _, draw = _example_dependence(sub, [False] * len(sub.invars))
        if draw:
            return [], draw
    return [any(ins)] * n_out, ""


def _sub_jaxprs(eqn: Eqn) -> list[jcore.Jaxpr]:
    """The jaxprs among an equation's params (or in a tuple or list there), in order."""
    values = [x for v in eqn.params.values() for x in (v if isinstance(v, tuple | list) else [v])]
    jaxprs = [x.jaxpr if isinstance(x, jcore.ClosedJaxpr) else x for x in values]
    return [x for x in jaxprs if isinstance(x, jcore.Jaxpr)]


def _check_mask(mask: ArrayLike, batch: PyTree, stats: tuple[str, ...], per_example: int) -> Array:
    """The mask as a bool [B] array; a concrete one is checked against 'var'."""
    n = jax.tree.leaves(batch)[0].shape[0]
    if jnp.shape(mask) != (n,) or jnp.asarray(mask).dtype != jnp.bool_:
        raise ValueError(
            f"mask must be a bool array of shape ({n},) (one entry per example), got "
            f"{getattr(mask, 'dtype', type(mask))}{tuple(jnp.shape(mask))}"
        )
    _refuse_var(stats, _concrete(mask) * per_example, "a mask must keep ≥ 2")  # jit: NaN
    return jnp.asarray(mask)


def _check_dot_with(
    stats: tuple[str, ...], params: PyTree, dot_with: PyTree | None
) -> list[Array] | None:
    """The leaves of "dot"'s v, one per parameter leaf of the same shape, in the statistics'
    dtype; None where "dot" is not asked (and then no v may be given)."""
    inner = [s for s in stats if _of_kind(_STATISTIC[s].ingredients, "inner")]
    if not inner:
        if dot_with is not None:
            raise ValueError("dot_with was given but 'dot' is not among the statistics")
        return None
    if dot_with is None:
        raise ValueError(
            f"{inner[0]!r} needs dot_with=v, a tree shaped like the parameters (e.g. the 'mean' "
            "of a held-out batch): fn(params, batch, dot_with=v)"
        )
    want = jax.tree_util.tree_leaves_with_path(params)
    got, tree = jax.tree.flatten(dot_with)
    if tree != jax.tree.structure(params):
        raise ValueError(
            f"dot_with must have the parameters' structure {jax.tree.structure(params)}, got "
            f"{tree} (for a model: eqx.filter(v, eqx.is_inexact_array), as the statistics are)"
        )
    leaves = []
    for (path, p), x in zip(want, got, strict=True):
        if jnp.shape(x) != jnp.shape(p) or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(
                f"dot_with{jax.tree_util.keystr(path)} must be a floating array of the "
                f"parameter's shape {tuple(jnp.shape(p))}, got "
                f"{jnp.result_type(x)}{tuple(jnp.shape(x))}"
            )
        leaves.append(jnp.asarray(x).astype(stat_dtype(p.dtype)))
    return leaves


def _refuse_var(stats: tuple[str, ...], units: int, need: str) -> None:
    if "var" in stats and units < 2:
        raise ValueError(
            f"'var' is undefined for {units} kept unit(s), the unbiased 1/(N−1) Σ (g_u − ḡ)²: "
            f"{need}; a micro-batch of accumulation: pegrad.Accumulator.value_and_grad_stats"
        )


def _concrete(x: ArrayLike) -> int:
    """Σ x where x is concrete; under jit, 2 (what 'var' needs, which is then NaN below it)."""
    try:
        return int(np.sum(np.asarray(x)))
    except jax.errors.TracerArrayConversionError:
        return 2


def _substitute(batch: PyTree, keep: Array) -> PyTree:
    """The batch with each example not kept replaced by the first kept one. What a masked
    example holds (NaN padding) must not reach the others, and it can: vmap computes a
    convolution's per-example weight gradients as one grouped convolution, in which 0·NaN
    from one example's block is NaN in all of them."""
    first = jnp.argmax(keep)
    return jax.tree.map(
        lambda x: jnp.where(keep.reshape(-1, *[1] * (jnp.ndim(x) - 1)), x, x[first]), batch
    )


def _one_example(batch: PyTree) -> PyTree:
    """The shape of one example (tracing needs no values; batches may be ShapeDtypeStructs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), batch)


# ============================================================================================
# §4 The exact references: per-unit gradients materialized in chunks, φ, reduce; per token,
# the parameters untied (one copy per position).


def _chunked(
    fn: Callable,
    xs: PyTree,
    n: int,
    chunk: int | None,
    combine: Callable = jnp.add,
    over: Callable | None = None,
) -> tuple[PyTree, PyTree]:
    """Run `fn(rows) -> (partial, per_row)` over chunks of the leading axis of `xs`.

    Partials are merged with `combine` (a pytree-leaf function, or one over whole partials when
    `combine` is not jnp.add); per-row outputs are concatenated. At most `chunk` rows are
    processed at once: lax.scan over full chunks, then the remainder. On a mesh of devices the
    rows are first split into `_groups`, each looped over alone (a device's own rows; `chunk`
    shared among the groups), and the groups' partials merged by `over` (stacked on axis 0;
    summed by default)."""
    merge = (lambda a, b: jax.tree.map(jnp.add, a, b)) if combine is jnp.add else combine
    if chunk is None or chunk >= n:
        return fn(xs)
    groups = _groups(xs, n)
    if groups == 1:
        return _scan_chunks(fn, xs, n, chunk, merge)
    split = jax.tree.map(lambda x: x.reshape(groups, n // groups, *x.shape[1:]), xs)
    local = -(-chunk // groups)
    loop = lambda rows: _scan_chunks(fn, rows, n // groups, local, merge)  # noqa: E731
    parts, per_row = jax.vmap(loop)(split)
    reduce = over or (lambda p: jax.tree.map(lambda x: jnp.sum(x, 0), p))
    return reduce(parts), jax.tree.map(lambda x: x.reshape(n, *x.shape[2:]), per_row)


def _scan_chunks(fn: Callable, xs: PyTree, n: int, chunk: int, merge: Callable) -> tuple:
    """`_chunked` on one device."""
    if chunk >= n:
        return fn(xs)
    n_full, remainder = divmod(n, chunk)
    full = jax.tree.map(lambda x: x[: n_full * chunk].reshape(n_full, chunk, *x.shape[1:]), xs)

    def body(acc: PyTree, rows: PyTree) -> tuple[PyTree, PyTree]:
        part, per_row = fn(rows)
        return merge(acc, part), per_row

    first = jax.tree.map(lambda x: x[0], full)
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, first)[0])
    acc, per_row = jax.lax.scan(body, _varying_as(init, xs), full)
    per_row = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), per_row)
    if remainder:
        part, rest = fn(jax.tree.map(lambda x: x[n_full * chunk :], xs))
        acc = merge(acc, part)
        per_row = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), per_row, rest)
    return acc, per_row


def _examples_per_chunk(
    n: int, unit_bytes: int, chunk_size: int | None, memory_budget: int | None, default: int
) -> int:
    """Examples whose per-unit gradients (`unit_bytes` per example) are formed at once: the
    caller's `chunk_size` and as many as `memory_budget` bytes hold (at least one), the smaller,
    or else `default`; at most the batch. Then evened out over the chunks that bound needs
    (32 at ≤ 10 a chunk: 4 chunks of 8, not 10 + 10 + 10 + 2 or 2 padding examples' work)."""
    fits = None if memory_budget is None else max(1, memory_budget // max(1, unit_bytes))
    bounds = [b for b in (chunk_size, fits) if b is not None]
    bound = max(1, min(n, *bounds) if bounds else min(n, default))
    return -(-n // -(-n // bound))


def _reference(
    loss_fn: Callable,
    params: PyTree,
    batch: PyTree,
    per_example: int,
    stats: tuple[str, ...],
    options: Options,
    clip_norm: float | None,
    keep: Array | None = None,
    drop: bool = False,
    dot_with: Sequence[Array] | None = None,
) -> tuple[Float[Array, ""], Stats, PyTree]:
    """impl="vmap": vmap(grad) materialized chunk by chunk, the caller's bound or the whole
    batch (`options`: chunk_size, memory_budget); per token, the untied parameters' gradients.
    `loss_fn` returns (loss, aux). Examples with `keep` False, or (with `drop`) a non-finite
    loss or ‖g_i‖², are removed before any sum: their gradients are replaced by 0 (not
    multiplied by 0) and N counts the others. "gram" by blocks of two chunks (`_pairs`). In
    `jax.shard_map` the parameters vary as the batch does, so that their gradients are this
    shard's examples' (jax.grad of a parameter the shards share would add them over shards)."""
    n_examples = jax.tree.leaves(batch)[0].shape[0]
    unit = per_example * sum(x.size * stat_dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    chunk = _examples_per_chunk(n_examples, unit, *options[2:], n_examples)
    params = _varying_as(params, batch)
    untie = Untie.build(lambda p, e: loss_fn(p, e)[0], params, batch) if per_example > 1 else None

    def unit_grads(example: PyTree) -> tuple[tuple[Array, PyTree], PyTree]:
        if untie is not None:
            loss, grads = untie.value_and_grad(params, example)
            return (loss, loss_fn(params, example)[1]), grads
        out, grads = jax.value_and_grad(loss_fn, has_aux=True)(params, example)
        return out, jax.tree.map(lambda g: g[None], grads)

    def per_unit(rows: PyTree, kept: Array) -> tuple[Array, PyTree, PyTree, Array]:
        (losses, aux), grads = jax.vmap(unit_grads)(rows)
        grads = jax.tree.map(lambda g: _merge01(g).astype(stat_dtype(g.dtype)), grads)
        if drop:
            raw = _unit_sq_norms(grads).reshape(-1, per_example)
            kept = kept & jnp.isfinite(losses) & jnp.all(jnp.isfinite(raw), axis=1)
        if weighted:
            units = jnp.repeat(kept, per_example)
            grads = jax.tree.map(lambda g: _where_units(units, g), grads)
            losses = jnp.where(kept, losses, 0.0)
        return losses, aux, grads, kept

    weighted = keep is not None or drop
    rows_kept = jnp.ones((n_examples,), bool) if keep is None else keep
    need = _ingredients(stats)
    spreads = _of_kind(need, "spread")
    sums_of = [w for w in _PHI if w in need or (w == "sum" and spreads)]

    def first_pass(xs: tuple) -> tuple[dict[str, PyTree], tuple]:
        losses, aux, grads, kept = per_unit(*xs)
        sums = {w: jax.tree.map(lambda g, w=w: _sum0(_PHI[w](g)), grads) for w in sums_of}
        sums["loss"] = losses.sum()
        sq_norms = _unit_sq_norms(grads)
        dots = sq_norms if dot_with is None else _unit_dots(grads, dot_with)
        for w in _of_kind(need, "weighted"):  # the clip factors weigh the units
            assert clip_norm is not None
            factors = _clip_factors(sq_norms, clip_norm)
            weigh = lambda g, c=factors: jnp.tensordot(c.astype(g.dtype), g, axes=1)  # noqa: E731
            sums[w] = jax.tree.map(weigh, grads)
        return sums, (sq_norms, dots, aux, kept)

    xs = (batch, rows_kept)
    sums, (sq_norms, dots, aux, rows_kept) = _chunked(first_pass, xs, n_examples, chunk)
    loss_sum = sums.pop("loss")
    kept_examples = jnp.sum(rows_kept) if weighted else n_examples
    n_units = kept_examples * per_example
    loss = _over(loss_sum, kept_examples).astype(stat_dtype(loss_sum.dtype))
    means = {w: jax.tree.map(lambda s: _over(s, n_units), v) for w, v in sums.items()}
    for w in spreads:
        # The definition, two passes: Σ_u (g_u − ḡ)² with ḡ from the first pass.
        def second_pass(xs: tuple) -> tuple[PyTree, None]:
            _, _, grads, kept = per_unit(*xs)
            units = jnp.repeat(kept, per_example)
            centred = jax.tree.map(lambda g, m: _where_units(units, g - m), grads, means["sum"])
            return jax.tree.map(lambda c: jnp.sum(c * c, 0), centred), None

        centered, _ = _chunked(second_pass, (batch, rows_kept), n_examples, chunk)
        means[w] = jax.tree.map(lambda s: _over(s, n_units - 1), centered)
    units = {w: sq_norms for w in _of_kind(need, "norm")}
    units |= {w: dots for w in _of_kind(need, "inner")}
    for w in _of_kind(need, "pairs"):
        grads_of = lambda xs: jax.tree.leaves(per_unit(*xs)[2])  # noqa: E731
        units[w] = _pairs(grads_of, (batch, rows_kept), n_examples, chunk)
    return loss, _publish(stats, means, units, n_units), aux


def _unit_sq_norms(grads: PyTree) -> Array:
    """‖g_u‖² over every leaf of [N, ...] per-unit gradients, in the widest statistic dtype."""
    leaves = jax.tree.leaves(grads)
    dtype = _widest([g.dtype for g in leaves])
    return sum(
        (jnp.sum(g * g, axis=tuple(range(1, g.ndim))).astype(dtype) for g in leaves),
        jnp.zeros(leaves[0].shape[:1], dtype),
    )


def _unit_dots(grads: PyTree, v: Sequence[Array]) -> Array:
    """⟨g_u, v⟩ over every leaf of [N, ...] per-unit gradients and v's leaves, in the widest
    statistic dtype."""
    leaves = jax.tree.leaves(grads)
    dtype = _widest([g.dtype for g in leaves])
    dot = lambda g, x: jnp.tensordot(g, x.astype(g.dtype), axes=x.ndim).astype(dtype)  # noqa: E731
    return sum(
        (dot(g, x) for g, x in zip(leaves, v, strict=True)), jnp.zeros(len(leaves[0]), dtype)
    )


def _pairs(
    grads_of: Callable[[PyTree], list[Array]], xs: PyTree, n: int, chunk: int | None
) -> Array:
    """Σ_leaves J Jᵀ, the [N, N] inner products of every two units' gradients: `grads_of(rows)`
    gives a chunk of examples' per-unit gradients, one [c·U, ...] per leaf. Block (r, s) from
    chunk r's and chunk s's gradients, each formed again per block: no more than two chunks'
    gradients exist at once (the chunk loop's bound), at the price of forming them N/c + 1
    times."""

    def flat(rows: PyTree) -> list[Array]:
        return [g.reshape(g.shape[0], -1) for g in grads_of(rows)]

    if chunk is None or chunk >= n:  # one chunk: its gradients formed once
        grads = flat(xs)
        dtype = _widest([g.dtype for g in grads])
        return sum((jnp.dot(g, g.T).astype(dtype) for g in grads), jnp.zeros((), dtype))

    def row(rows: PyTree) -> tuple[None, Array]:
        mine = flat(rows)
        dtype = _widest([g.dtype for g in mine])

        def column(cols: PyTree) -> tuple[None, Array]:
            theirs = flat(cols)
            block = (jnp.dot(b, a.T).astype(dtype) for a, b in zip(mine, theirs, strict=True))
            return None, sum(block, jnp.zeros((len(theirs[0]), len(mine[0])), dtype))

        return None, _chunked(column, xs, n, chunk)[1].T  # [c·U, N·U]

    return _chunked(row, xs, n, chunk)[1]


def _over(x: Array, n: int | Array) -> Array:
    """x / n, for a count n that is an int or (with a mask) a traced integer."""
    return x / jnp.asarray(n).astype(x.dtype)


def _where_units(keep: Array, x: Array) -> Array:
    """x [N, ...] with the rows of units not kept replaced by 0 (NaN there included)."""
    return jnp.where(keep.reshape(-1, *[1] * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True, eq=False)
class Untie:
    """granularity="token" made explicit: position t uses its own copy of every parameter.

    Where a parameter meets the example (a "boundary": an operation with an example-dependent
    input and a parameter-dependent one), output slice t is computed with copy t. That is
    defined only for operations that compute slice t of their output from slice t of their
    example-dependent inputs (elementwise ops, dot_general along a batch or free dim, gathers
    along their index dims, concatenation off the position axis); any other boundary is an error
    naming the parameter. The gradient with respect to copy t is position t's contribution."""

    jaxpr: jcore.Jaxpr
    consts: tuple[Value, ...]
    n_params: int
    n_positions: int
    batched: frozenset[Var]
    param_deps: Mapping[Var, frozenset[int]]  # unbatched variables -> parameter leaves they use
    boundary_axis: Mapping[int, tuple[int, ...]]  # id(eqn) -> position axis of each output

    @staticmethod
    def build(loss_fn: Callable, params: PyTree, batch: PyTree) -> "Untie":
        paths = _paths(params)
        n_params = len(paths)
        closed, args = _flat_trace(loss_fn, params, batch, (), _CALLS)
        jaxpr = closed.jaxpr
        batched = frozenset(_depends_on(jaxpr, set(jaxpr.invars[n_params:])))
        deps = {v: frozenset({i}) for i, v in enumerate(jaxpr.invars[:n_params])}
        positions = _propagate_positions(jaxpr, _example_axes(n_params, len(args) - n_params))
        boundary_axis: dict[int, tuple[int, ...]] = {}
        for eqn in jaxpr.eqns:
            ins = [v for v in eqn.invars if isinstance(v, jcore.Var)]
            used = frozenset().union(*(deps.get(v, _NONE) for v in ins))
            deps.update((v, used) for v in eqn.outvars if v not in batched and used)
            if not (used and any(v in batched for v in ins)):
                continue
            axes = _boundary_axes(eqn, positions)
            if isinstance(axes, str):
                names = ", ".join(f"params{paths[i]}" for i in sorted(used))
                raise ValueError(
                    f"granularity='token': {names} meets the example at '{eqn.primitive.name}' "
                    f"{axes}. Per-token statistics need every use of a parameter to be "
                    "position-wise (output position t from input position t); "
                    "granularity='example' works for any model"
                )
            boundary_axis[id(eqn)] = axes
        n_positions = args[n_params].shape[0]
        return Untie(
            jaxpr, tuple(closed.consts), n_params, n_positions, batched, deps, boundary_axis
        )

    def value_and_grad(
        self, params: PyTree, example: PyTree, untied: frozenset[int] | None = None
    ) -> tuple[Array, PyTree]:
        """Loss of one example and, per parameter leaf, its per-position gradients [T, ...]
        (leaves not in `untied` come back as None)."""
        leaves, treedef = jax.tree.flatten(params)
        untied = frozenset(range(self.n_params)) if untied is None else untied
        copied = {v for v, d in self.param_deps.items() if d & untied}

        def bind(eqn: Eqn, invals: list[Value]) -> list[Value]:
            """Copied operands are mapped over positions; a boundary keeps slice t of copy t."""
            axes = [0 if isinstance(v, jcore.Var) and v in copied else None for v in eqn.invars]
            if all(a is None for a in axes):
                return _bind(eqn, invals)
            outs = jax.vmap(lambda *xs: _bind(eqn, list(xs)), in_axes=axes)(*invals)
            if id(eqn) in self.boundary_axis:
                axes_out = self.boundary_axis[id(eqn)]
                # out[..., t (at axis p), ...] = o[t, ..., t, ...]: slice t computed with copy t
                diagonal = lambda o, p: jnp.moveaxis(jnp.diagonal(o, 0, 0, p + 1), -1, p)  # noqa: E731
                outs = [diagonal(o, p) for o, p in zip(outs, axes_out, strict=True)]
            return outs

        def loss_of(copies: dict[int, Array]) -> Array:
            inputs = [copies.get(i, x) for i, x in enumerate(leaves)] + jax.tree.leaves(example)
            return _run(self.jaxpr, self.consts, inputs, bind=bind)[0]

        n = self.n_positions
        copies = {
            i: jnp.broadcast_to(leaves[i], (n, *jnp.shape(leaves[i]))) for i in sorted(untied)
        }
        loss, grads = jax.value_and_grad(loss_of)(copies)
        return loss, jax.tree.unflatten(treedef, [grads.get(i) for i in range(self.n_params)])


def _boundary_axes(eqn: Eqn, positions: Mapping[Var, Axes]) -> tuple[int, ...] | str:
    """The position axis of each output of a boundary equation, or why there is none."""
    name = eqn.primitive.name
    if name not in _ELEMENTWISE and name not in ("dot_general", "gather", "concatenate"):
        return "(an operation that is not position-wise, or opaque to pegrad)"
    if name == "gather" and _axes_of(positions, eqn.invars[0]):
        return "(a gather from an example-dependent array)"
    found = [positions.get(var, _NONE) for var in eqn.outvars]
    if wrong := [len(axes) for axes in found if len(axes) != 1]:
        return f"whose output has {wrong[0]} position axes, not one"
    return tuple(next(iter(axes)) for axes in found)


# ============================================================================================
# §5 The interpreter and position tracing: one example's jaxpr flattened and re-evaluated,
# and which axes of each value index positions (what `Untie` and the engine both read).


# Call-like primitives whose body is evaluated in place, so that the rewrite sees one graph.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint"})
# Custom-derivative calls: inlined in the gradient's jaxpr (their rules have run by then), kept
# whole in the forward jaxpr the token reference unties (so that their rules still apply).
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})


def _inner_jaxpr(eqn: Eqn) -> jcore.ClosedJaxpr | None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, jcore.ClosedJaxpr):
            return inner
        if isinstance(inner, jcore.Jaxpr):
            return jcore.ClosedJaxpr(inner, ())
    return None


def _read(env: Mapping[Var, Value], var: Atom) -> Value:
    return var.val if isinstance(var, jcore.Literal) else env[var]


def _bind(eqn: Eqn, invals: Sequence[Value]) -> list[Value]:
    invals = _varying_alike(invals)
    if eqn.primitive.name == "scan" and invals and _varying(invals[0]):
        return _scan_varying(eqn, invals)
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
        invals = (*subfuns, *invals)
    out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _varying(x: Value) -> frozenset:
    """The manual mesh axes (`jax.shard_map`) over which `x` varies."""
    aval = jax.typeof(x) if isinstance(x, jax.Array) else None
    found = getattr(getattr(aval, "mat", None), "varying", None)  # JAX ≥ 0.9
    return frozenset(found if found is not None else getattr(aval, "vma", ()))


def _vary(x: Value, axes: frozenset) -> Value:
    """`x` cast to vary over the manual `axes` too (`pcast(to="varying")`: no data moves)."""
    missing = tuple(sorted(axes - _varying(x)))
    if not missing:
        return x
    if not hasattr(jax.lax, "pcast"):  # JAX < 0.8
        return jax.lax.pvary(jnp.asarray(x), missing)  # pyright: ignore[reportAttributeAccessIssue]
    return jax.lax.pcast(jnp.asarray(x), missing, to="varying")


def _varying_alike(invals: Sequence[Value]) -> Sequence[Value]:
    """Under `jax.shard_map`'s checks an operation's operands vary over the same manual axes:
    the one-example jaxpr was traced without them, so operands that vary over fewer are cast,
    as jax.numpy does for its own operations."""
    every = frozenset().union(*[_varying(x) for x in invals])
    return [_vary(x, every) for x in invals] if every else invals


def _varying_as(tree: PyTree, like: PyTree) -> PyTree:
    """`tree`'s leaves cast to vary over every manual axis `like`'s leaves vary over: a scan's
    initial carry made of zeros, as the carry its body returns."""
    every = frozenset().union(*[_varying(x) for x in jax.tree.leaves(like)])
    cast = lambda x: _vary(x, every) if isinstance(x, jax.Array | np.ndarray) else x  # noqa: E731
    return jax.tree.map(cast, tree) if every else tree


def _scan_varying(scan: Eqn, invals: Sequence[Value]) -> list[Value]:
    """A scan of the one-example jaxpr under `jax.shard_map`'s checks: its body was typed
    without the manual axes its operands vary over, so it is run again by this interpreter
    (`jax.lax.scan` of `_run`), its carry varying as every operand does."""
    p, body = scan.params, scan.params["jaxpr"]
    nc, ncar = _scan_counts(p)
    consts, init, xs = list(invals[:nc]), list(invals[nc : nc + ncar]), list(invals[nc + ncar :])

    def step(carry: list, x: list) -> tuple[list, list]:
        outs = _run(body.jaxpr, body.consts, [*consts, *carry, *x])
        return _varying_as(outs[:ncar], invals), outs[ncar:]

    length, reverse, unroll = p["length"], p["reverse"], p.get("unroll", 1)
    carry, ys = jax.lax.scan(
        step, _varying_as(init, invals), xs, length=length, reverse=reverse, unroll=unroll
    )
    return [*carry, *ys]


Bind = Callable[[Eqn, list[Value]], list[Value]]  # evaluates one equation


def _evaluate(
    eqns: Sequence[jcore.JaxprEqn],
    env: dict[Var, Value],
    inline: frozenset[str] = frozenset(),
    bind: Bind = _bind,
) -> dict[Var, Value]:
    """Evaluate `eqns` in order in `env`, updated and returned, with `bind`, `inline` calls'
    bodies in place: the one interpreter of this file, which every re-evaluation goes through."""
    for eqn in eqns:
        invals = [_read(env, v) for v in eqn.invars]
        inner = _inner_jaxpr(eqn) if eqn.primitive.name in inline else None
        if inner is None:
            outs = bind(eqn, invals)
        else:
            outs = _run(inner.jaxpr, inner.consts, invals, inline=inline, bind=bind)
        for var, val in zip(eqn.outvars, outs, strict=True):
            if type(var).__name__ != "DropVar":  # `_`: jax.extend.core lists it in new JAX
                env[var] = val
    return env


def _run(
    jaxpr: jcore.Jaxpr,
    consts: Sequence[Value],
    args: Sequence[Value],
    *,
    inline: frozenset[str] = frozenset(),
    bind: Bind = _bind,
    outs: Sequence[Atom] | None = None,
) -> list[Value]:
    """`jaxpr` applied to `args`: its outputs (or the values of `outs`)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    _evaluate(jaxpr.eqns, env, inline, bind)
    return [_read(env, v) for v in (jaxpr.outvars if outs is None else outs)]


def _flat_trace(
    fn: Callable, params: PyTree, batch: PyTree, extra: Sequence[Value], inline: frozenset[str]
) -> tuple[jcore.ClosedJaxpr, list[Value]]:
    """The flat jaxpr of `fn(params, example, *extra)` for ONE example (the `inline` calls
    evaluated in place, recursively), whose inputs are (param leaves, example leaves, *extra),
    and those inputs (abstract)."""
    leaves, param_tree = jax.tree.flatten(params)
    example_leaves, example_def = jax.tree.flatten(_one_example(batch))
    n, n_example = len(leaves), len(example_leaves)

    def flat(*args: Value) -> Value:
        p, e = args[:n], args[n : n + n_example]
        return fn(param_tree.unflatten(p), example_def.unflatten(e), *args[n + n_example :])

    shapes = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves]
    args = [*shapes, *example_leaves, *extra]
    nested = jax.make_jaxpr(flat)(*args)
    run = lambda *values: _run(nested.jaxpr, nested.consts, values, inline=inline)  # noqa: E731
    return jax.make_jaxpr(run)(*args), args


def _paths(params: PyTree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


def _example_axes(n_params: int, n_example: int) -> list[Axes]:
    """Position axes of the inputs (param leaves, example leaves): axis 0 of each example leaf."""
    return [_NONE] * n_params + [frozenset({0})] * n_example


def _depends_on(jaxpr: jcore.Jaxpr, sources: set[Var]) -> set[Var]:
    """Variables that depend on any of `sources` (forward closure)."""
    found = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and v in found for v in eqn.invars):
            found.update(eqn.outvars)
    return found


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Position axes: which axes of a value index positions 0..T−1, traced from the example. Every
# example leaf's axis 0 is positional (granularity="token" says so). A label survives an
# operation only where the operation maps index t of that axis to index t of an output axis
# (the rules below); anything else drops it — never recognised by length.
_ELEMENTWISE = _names(
    """
    abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp
    convert_element_type copy cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor
    ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne
    neg nextafter not or polygamma pow real reduce_precision rem round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan
    tanh xor
    """
)


def _shape(v: Atom) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _reshape_axes(before: tuple[int, ...], after: tuple[int, ...], axes: Axes) -> Axes:
    """Axes of `before` that survive a reshape whole, at their place in `after`."""
    out = set()
    for k in axes:
        prefix = math.prod(before[:k])
        for j in range(len(after)):
            if after[j] == before[k] and math.prod(after[:j]) == prefix:
                out.add(j)
                break
    return frozenset(out)


# Position rules: primitive -> (eqn, the inputs' position axes) -> the outputs'. A primitive
# with no rule drops every label.
PositionRule = Callable[[Eqn, list[Axes]], list[Axes]]
_POSITIONS: dict[str, PositionRule] = {}


def _positions(*names: str) -> Callable[[PositionRule], PositionRule]:
    """Register a position rule for `names`."""
    return lambda rule: _POSITIONS.update(dict.fromkeys(names, rule)) or rule


def _kept(eqn: Eqn, ins: list[Axes], gone: Sequence[int | np.integer]) -> list[Axes]:
    """The input's axes not in `gone`, renumbered in order (squeeze, reductions)."""
    kept = [k for k in range(len(_shape(eqn.invars[0]))) if k not in gone]
    return [frozenset(j for j, k in enumerate(kept) if k in ins[0])] * len(eqn.outvars)


def _whole(eqn: Eqn, axes: Axes, size: Callable[[int], int]) -> Axes:
    """The axes that an operation keeps at full size (`size(k)`: its output extent there)."""
    return frozenset(k for k in axes if size(k) == _shape(eqn.invars[0])[k])


@_positions(*_ELEMENTWISE)
def _elementwise(eqn: Eqn, ins: list[Axes]) -> list[Axes]:
    """Operands of the output's rank may broadcast size-1 axes: those are not positions."""
    shape = _shape(eqn.outvars[0])
    found = {
        a
        for v, axes in zip(eqn.invars, ins, strict=True)
        for a in axes
        if len(_shape(v)) == len(shape) and _shape(v)[a] == shape[a]
    }
    return [frozenset(found)] * len(eqn.outvars)


_positions("optimization_barrier")(lambda eqn, ins: list(ins))
_positions("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")(lambda eqn, ins: [ins[0]])
_positions("squeeze")(lambda eqn, ins: _kept(eqn, ins, eqn.params["dimensions"]))
_positions(
    *_names("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin")
)(lambda eqn, ins: _kept(eqn, ins, eqn.params["axes"]))
_positions("transpose")(
    lambda eqn, ins: [frozenset(j for j, k in enumerate(eqn.params["permutation"]) if k in ins[0])]
)
_positions("reshape")(
    lambda eqn, ins: [_reshape_axes(_shape(eqn.invars[0]), _shape(eqn.outvars[0]), ins[0])]
)
_positions("dynamic_slice")(
    lambda eqn, ins: [_whole(eqn, ins[0], lambda k: eqn.params["slice_sizes"][k])]
)
_positions("dynamic_update_slice")(
    lambda eqn, ins: [_whole(eqn, ins[0] | ins[1], lambda k: _shape(eqn.invars[1])[k])]
)
_positions("pad")(
    lambda eqn, ins: [
        frozenset(k for k in ins[0] if tuple(eqn.params["padding_config"][k]) == (0, 0, 0))
    ]
)
_positions("concatenate")(
    lambda eqn, ins: [frozenset(k for a in ins for k in a if k != eqn.params["dimension"])]
)


@_positions("broadcast_in_dim")
def _broadcast_positions(eqn: Eqn, ins: list[Axes]) -> list[Axes]:
    src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    dims = eqn.params["broadcast_dimensions"]
    return [frozenset(int(dims[k]) for k in ins[0] if src[k] == dst[dims[k]])]


@_positions("dot_general")
def _dot_positions(eqn: Eqn, ins: list[Axes]) -> list[Axes]:
    """Batch dims first, then the free dims of each operand, in order."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    found = {j for j, (a, b) in enumerate(zip(lb, rb, strict=True)) if a in ins[0] or b in ins[1]}
    lfree = [k for k in range(len(_shape(eqn.invars[0]))) if k not in lc and k not in lb]
    rfree = [k for k in range(len(_shape(eqn.invars[1]))) if k not in rc and k not in rb]
    found |= {len(lb) + j for j, k in enumerate(lfree) if k in ins[0]}
    found |= {len(lb) + len(lfree) + j for j, k in enumerate(rfree) if k in ins[1]}
    return [frozenset(found)]


@_positions("slice")
def _slice_positions(eqn: Eqn, ins: list[Axes]) -> list[Axes]:
    shape, params = _shape(eqn.invars[0]), eqn.params
    strides = params["strides"] or (1,) * len(shape)
    ranges = zip(params["start_indices"], params["limit_indices"], strides, strict=True)
    return [frozenset(k for k, r in enumerate(ranges) if k in ins[0] and r == (0, shape[k], 1))]


@_positions("gather")
def _gather_positions(eqn: Eqn, ins: list[Axes]) -> list[Axes]:
    """Index dims of the indices keep theirs; a window axis its operand's where it is whole."""
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    op_shape, offset = _shape(eqn.invars[0]), tuple(dn.offset_dims)
    batch_out = [d for d in range(len(_shape(eqn.outvars[0]))) if d not in offset]
    index_dims = range(len(_shape(eqn.invars[1])) - 1)  # the last is the index vector
    found = {d for d, k in zip(batch_out, index_dims, strict=True) if k in ins[1]}
    gone = {*dn.collapsed_slice_dims, *dn.operand_batching_dims}
    window = [d for d in range(len(op_shape)) if d not in gone]
    fill = str(eqn.params["mode"]).endswith("FILL_OR_DROP")
    for out_d, op_d in zip(offset, window, strict=True):
        # A full-size window starts at 0 (clamped), so index t stays t; filling could move it.
        full = sizes[op_d] == op_shape[op_d] and (not fill or op_d not in dn.start_index_map)
        if op_d in ins[0] and full:
            found.add(out_d)
    return [frozenset(found)]


@_positions("scatter", "scatter-add")
def _scatter_positions(eqn: Eqn, ins: list[Axes]) -> list[Axes]:
    """The output is the operand: an axis stays positional where the scatter keeps slice t at
    t — a batching dim paired with a traced index dim, or an axis the windows cover whole."""
    operand, indices, updates = ins[:3]
    dn = eqn.params["dimension_numbers"]
    found = {
        int(d)
        for d, k in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=True)
        if d in operand or k in indices
    }
    op_shape, upd_shape = _shape(eqn.invars[0]), _shape(eqn.invars[2])
    gone = {*dn.inserted_window_dims, *dn.operand_batching_dims}
    window = [d for d in range(len(op_shape)) if d not in gone]
    for upd_d, op_d in zip(dn.update_window_dims, window, strict=True):
        whole = upd_shape[upd_d] == op_shape[op_d] and op_d not in dn.scatter_dims_to_operand_dims
        if whole and (op_d in operand or upd_d in updates):
            found.add(op_d)
    return [frozenset(found)]


@_positions(*_CALLS, *_CUSTOM)
def _call_positions(eqn: Eqn, ins: list[Axes]) -> list[Axes]:
    inner = _inner_jaxpr(eqn)
    if inner is None or len(inner.jaxpr.invars) != len(ins):
        return [_NONE] * len(eqn.outvars)
    labels = _propagate_positions(inner.jaxpr, ins)
    return [_axes_of(labels, v) for v in inner.jaxpr.outvars]


def _propagate_positions(jaxpr: jcore.Jaxpr, in_axes: Sequence[Axes]) -> dict[Var, Axes]:
    positions: dict[Var, Axes] = dict(zip(jaxpr.invars, in_axes, strict=True))
    for eqn in jaxpr.eqns:
        ins = [_axes_of(positions, v) for v in eqn.invars]
        rule = _POSITIONS.get(eqn.primitive.name)
        outs = rule(eqn, ins) if rule else [_NONE] * len(eqn.outvars)
        positions.update(zip(eqn.outvars, outs, strict=True))
    return positions


def _axes_of(positions: Mapping[Var, Axes], var: Atom) -> Axes:
    return positions.get(var, _NONE) if isinstance(var, jcore.Var) else _NONE


# ============================================================================================
# Part II — the engine: impl="factorized". Nothing above this line reads what is below it but
# `_factorized` and `Plan.build`.
# §6 The entry point of impl="factorized"; each section below is what the one above calls.


def _factorized(
    loss: Callable,
    params: PyTree,
    batch: PyTree,
    per_example: int,
    stats: tuple[str, ...],
    options: Options,
    clip_norm: float | None,
    keep: Array | None,
    drop: bool,
    dot_with: Sequence[Array] | None = None,
) -> tuple[Float[Array, ""], Stats, PyTree]:
    """impl="factorized" (an entry point): plain grad of the mean loss where proven; else the
    graph and its plan (§7, §8), then the executor (§9): the batched head, which computes each
    leaf's factorized ingredients as soon as its values exist (`_run_head`), and the chunk
    loop; then what waits for every unit's norm, with a mask, dropped examples or clipping
    (`_after_norms`); last the means over the kept examples (`_published`)."""
    wanted = (*stats, "sq_norms") if drop else stats  # drop reads the norms
    mean_loss = _mean_loss(loss, params, batch, wanted, options)
    if mean_loss == "":
        return _gradient_of_mean_loss(loss, params, batch, keep)
    weighted = keep is not None or drop  # a mask or dropped examples weigh them 0 or 1
    graph = Graph.build(loss, params, batch, per_example, wanted, options, mean_loss, weighted)
    plans = plan(graph, wanted, choose=options[1])
    need = _ingredients(wanted)
    # With `drop`, which examples count is known once every norm is: the other ingredients
    # wait for it (the head's values they read are kept until then, as for clipping).
    early = [w for w in need if _kind(w) == "norm" or (_kind(w) != "weighted" and not drop)]
    losses, env, results, aux = _run_head(graph, plans, early, params, batch, keep, dot_with)

    def loop(chunked: Mapping[int, Sequence[str]], *args: Any, **kwargs: Any) -> tuple:
        if not chunked:
            return {}, {}, {}
        head = (graph, plans, env, batch, params, _loop_chunk(graph, plans))
        return _chunk_loop(*head, chunked, *args, **kwargs)

    held = [p.index for p in plans if p.kept]  # formed once, reused by every later pass
    found, looped, kept = loop(_chunked_in(plans, early), keep, hold=held)
    results.update(found)
    per_unit = {w: _added(graph, results, looped, w) for w in early if _kind(w) in _PER_UNIT}
    if weighted or clip_norm is not None:
        later = functools.partial(loop, given=kept)
        after = (env, losses, results, per_unit, keep, drop, clip_norm, later)
        keep = _after_norms(graph, plans, need, *after)
    return _published(graph, stats, need, results, per_unit, losses, keep, aux)


def _mean_loss(
    loss: Callable, params: PyTree, batch: PyTree, stats: Sequence[str], options: Options
) -> str | None:
    """The mean-loss policy, decided once per call of an entry point: None where the statistics
    are not the mean alone as plain backpropagation, (1/N) Σ_i g_i = ∇ (1/N) Σ_i ℓ_i (no rewrite
    of that sum is cheaper): not with choose="first", per-token units (whose split the rewrite
    proves) or parameters narrower than their statistics; else why plain grad of the mean loss
    is not proven their value, "" where it is (`_user_backward`)."""
    granularity, choose = options[:2]
    dtypes = [x.dtype for x in jax.tree.leaves(params)]
    plain = _ingredients(stats) == ("sum",) and choose == "cheapest" and granularity == "example"
    if not plain or any(jnp.dtype(d) != stat_dtype(d) for d in dtypes):
        return None
    return _user_backward(loss, params, batch)


# Primitives that carry a backward rule the user wrote (jax.custom_vjp, eqx.filter_custom_vjp,
# jax.custom_transpose). JAX's own transposes are linear in the cotangent; these need not be.
_USER_RULES = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr", "custom_transpose_call"})


def _user_backward(loss_fn: Callable, params: PyTree, batch: PyTree) -> str:
    """Why plain grad of the mean loss is not proven the mean of the per-example gradients, or
    "". JAX's own transposes are linear in the cotangent, so ∇ Σ_i ℓ_i = Σ_i g_i; a backward
    rule the user wrote need not be (clipping in JAX's custom_vjp tutorial: clip(Σ_i c_i) ≠
    Σ_i clip(c_i)). The one-example jaxpr of `loss_fn` (→ (loss, aux)) is searched, deeply."""
    closed = jax.make_jaxpr(lambda p, e: loss_fn(p, e)[0])(params, _one_example(batch))
    todo = [closed.jaxpr]  # jax.extend.core.jaxprs_in_params would do: not in JAX 0.7.2
    while todo:
        for eqn in todo.pop().eqns:
            if eqn.primitive.name in _USER_RULES:
                return (
                    f"the loss calls a {eqn.primitive.name} ({eqn.params.get('name', '?')}), a "
                    "backward rule not proven linear in the cotangent: plain grad of the mean "
                    "loss may differ from the mean of per-example gradients"
                )
            todo += _sub_jaxprs(eqn)
    return ""


def _gradient_of_mean_loss(
    loss: Callable, params: PyTree, batch: PyTree, keep: Array | None
) -> tuple[Float[Array, ""], Stats, PyTree]:
    """The mean alone (every leaf "mean-loss"): plain grad of the mean loss over the kept
    examples. Where 1/N would be rounded in the loss's dtype (a loss narrower than float32) or
    a mask weighs the examples, the summed loss is differentiated and the gradient divided by
    the count in its own dtype, as the routes do (no kept example: NaN); a masked example,
    whose inputs are a kept one's, contributes 0. The loss is the routes' mean loss; in
    `jax.shard_map`, this shard's (`_reference`)."""
    params = _varying_as(params, batch)
    summed = [keep is not None]  # set once the loss's dtype is known, inside the trace

    def mean_loss(p: PyTree) -> tuple[Array, tuple[Array, PyTree]]:
        losses, aux = jax.vmap(loss, in_axes=(None, 0))(p, batch)
        summed[0] = summed[0] or jnp.dtype(losses.dtype) != stat_dtype(losses.dtype)
        if not summed[0]:
            return jnp.mean(losses), (losses, aux)
        kept = losses if keep is None else jnp.where(keep, losses, jnp.zeros((), losses.dtype))
        return jnp.sum(kept), (losses, aux)

    (total, (losses, aux)), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    n_units: int | Array = losses.shape[0] if keep is None else jnp.sum(keep)
    if summed[0]:
        grads = jax.tree.map(lambda g: _over(g, n_units), grads)
    value = losses.mean() if keep is None else _over(total, n_units)  # the routes' mean loss
    stats = _publish(("mean",), {"sum": grads}, {}, n_units)
    return value.astype(stat_dtype(losses.dtype)), stats, aux


# ============================================================================================
# §7 The graph: grad of ONE example as a flat jaxpr, and what is proven about its values.


def _producers(jaxpr: jcore.Jaxpr) -> dict[Var, Eqn]:
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def _users(jaxpr: jcore.Jaxpr) -> dict[Var, list[Eqn]]:
    """Per variable, the equations that read it (once per operand it is)."""
    users: dict[Var, list[Eqn]] = {}
    for eqn, v in ((e, v) for e in jaxpr.eqns for v in e.invars if isinstance(v, Var)):
        users.setdefault(v, []).append(eqn)
    return users


def _needed_by(jaxpr: jcore.Jaxpr, wanted: Sequence[Atom]) -> list[Eqn]:
    """The equations that `wanted` values need, in order (backward closure)."""
    needed, eqns = {v for v in wanted if isinstance(v, Var)}, []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, Var))
    return eqns[::-1]


def _dtype(v: Atom) -> Any:  # a NumPy dtype, or JAX's extended dtype of PRNG keys
    return getattr(v.aval, "dtype")  # noqa: B009 (AbstractValue declares none)


def _dot_dims(core: Eqn) -> tuple[tuple[int, ...], ...]:
    (lc, rc), (lb, rb) = core.params["dimension_numbers"]
    return tuple(tuple(int(d) for d in dims) for dims in (lc, rc, lb, rb))


def _shift(axes: Sequence[int]) -> tuple[int, ...]:
    return tuple(a + 1 for a in axes)


def _over_examples(
    lc: Sequence[int], rc: Sequence[int], lb: Sequence[int], rb: Sequence[int]
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]:
    """Dimension numbers of a dot_general of two [B, ...] operands that contracts the leading
    axis B (or the iterations of a scan) as well as `lc`/`rc`, batching `lb`/`rb`."""
    return (((0, *_shift(lc)), (0, *_shift(rc))), (_shift(lb), _shift(rb)))


@dataclasses.dataclass(frozen=True, eq=False)
class Post:
    """One operation between a gradient's core and the gradient: layout (the same per unit), or
    a scaling by a batch-independent `factor` (a variable, a literal, or −1 for neg)."""

    eqn: Eqn
    factor: Atom | float | None = None
    divide: bool = False  # x / factor, not x * factor

    @property
    def scalar(self) -> bool:
        factor = self.factor
        return factor is None or isinstance(factor, int | float) or not _shape(factor)


Posts = tuple[Post, ...]  # the ops from a core to the gradient, in order


@dataclasses.dataclass(frozen=True, eq=False)
class Leaf:
    index: int
    path: str
    shape: tuple[int, ...]
    dtype: DTypeLike
    grad: Atom  # the variable (or literal) holding this leaf's gradient in the graph

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stat_dtype(self) -> jnp.dtype:
        return stat_dtype(self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """grad(loss_fn) for ONE example as a flat jaxpr, and what is known about its values.

    Inputs are (param leaves, example leaves, seed); outputs (loss, gradient leaves). The
    backward pass starts from `seed` (1 at run time) so that `seeded` marks the cotangent side.
    `batched`: depends on the example. `static`: computable from constants alone (`seeded` and
    `static` are found where a proof first asks). `positions`: at token granularity, each
    value's position axes (see _propagate_positions)."""

    jaxpr: jcore.Jaxpr
    consts: tuple[Value, ...]
    leaves: tuple[Leaf, ...]
    n_examples: int
    per_example: int  # units per example: T at token granularity, else 1
    producer: Mapping[Var, Eqn]
    users: Mapping[Var, tuple[Eqn, ...]]
    batched: frozenset[Var]
    positions: Mapping[Var, Axes]
    untie: Untie | None
    param_tree: Any  # a PyTreeDef
    aux_tree: Any = None  # the auxiliary outputs' structure (outputs after the gradients)
    weighted: bool = False  # a mask or dropped examples weigh the examples 0 or 1
    chunk_size: int | None = None  # the caller's bound on per-example gradients held at once
    memory_budget: int | None = None  # the caller's bound on their bytes
    user_backward: str | None = None  # the mean-loss policy's answer (`_mean_loss`)

    @property
    def token(self) -> bool:
        return self.per_example > 1

    @property
    def n_units(self) -> int:
        return self.n_examples * self.per_example

    @staticmethod
    def build(
        loss_fn: Callable,
        params: PyTree,
        batch: PyTree,
        per_example: int,
        stats: Sequence[str] = ("mean",),
        options: Options = ("example", "cheapest", None, None),
        user_backward: str | None = None,
        weighted: bool = False,
    ) -> "Graph":
        """The graph for `stats`, with the caller's bounds (`options`), the mean-loss policy's
        answer (`_mean_loss`) and `weighted`; its scans' weight-gradient dots hoisted where
        that pays (`_hoist_scans`)."""
        chunk_size, memory_budget = options[2:]
        leaves, param_tree = jax.tree.flatten(params)
        paths = _paths(params)
        aux_tree = []

        def value_and_grad(p: PyTree, e: PyTree, seed: Array) -> list[Value]:
            def seeded(p: PyTree) -> tuple[Array, tuple[Array, PyTree]]:
                loss, aux = loss_fn(p, e)
                return loss * seed.astype(loss.dtype), (loss, aux)

            (_, (loss, aux)), grads = jax.value_and_grad(seeded, has_aux=True)(p)
            aux_leaves, tree = jax.tree.flatten(aux)
            aux_tree[:] = [tree]
            return [loss, *jax.tree.leaves(grads), *aux_leaves]

        x64 = jax.config.read("jax_enable_x64")
        seed = jax.ShapeDtypeStruct((), jnp.float64 if x64 else jnp.float32)
        closed, args = _flat_trace(value_and_grad, params, batch, [seed], _CALLS | _CUSTOM)
        n = jax.tree.leaves(batch)[0].shape[0]
        if any(e.primitive.name == "scan" for e in closed.jaxpr.eqns):
            budget = None if memory_budget is None else memory_budget // n
            closed = _hoist_scans(closed, args, stats, weighted, budget)
        jaxpr = closed.jaxpr
        n_params, n_example = len(leaves), len(args) - len(leaves) - 1
        untie, positions = None, {}
        if per_example > 1:  # Untie.build raises for a leaf not position-wise
            untie = Untie.build(lambda p, e: loss_fn(p, e)[0], params, batch)
            positions = _propagate_positions(jaxpr, [*_example_axes(n_params, n_example), _NONE])
        return Graph(
            jaxpr=jaxpr,
            consts=tuple(closed.consts),
            leaves=tuple(
                Leaf(i, paths[i], tuple(jnp.shape(x)), x.dtype, jaxpr.outvars[1 + i])
                for i, x in enumerate(leaves)
            ),
            n_examples=n,
            per_example=per_example,
            producer=_producers(jaxpr),
            users={v: tuple(u) for v, u in _users(jaxpr).items()},
            batched=frozenset(_depends_on(jaxpr, set(jaxpr.invars[n_params:-1]))),  # the example's
            positions=positions,
            untie=untie,
            param_tree=param_tree,
            aux_tree=aux_tree[0],
            weighted=weighted,
            chunk_size=chunk_size,
            memory_budget=memory_budget,
            user_backward=user_backward,
        )

    # -- queries --------------------------------------------------------------------------

    @functools.cached_property
    def seeded(self) -> frozenset[Var]:
        return frozenset(_depends_on(self.jaxpr, {self.jaxpr.invars[-1]}))

    @functools.cached_property
    def static(self) -> frozenset[Var]:
        static: set[Var] = set(self.jaxpr.constvars)
        known = lambda v: isinstance(v, jcore.Literal) or v in static  # noqa: E731
        for eqn in self.jaxpr.eqns:
            if not eqn.effects and all(map(known, eqn.invars)):
                static.update(eqn.outvars)
        return frozenset(static)

    def is_batched(self, var: Atom) -> bool:
        return isinstance(var, Var) and var in self.batched

    def is_static(self, var: Atom) -> bool:
        return isinstance(var, jcore.Literal) or var in self.static

    def static_value(self, var: Atom) -> np.ndarray:
        """The concrete value of a static variable (e.g. position indices from iota): a literal
        or a table of one read off, else its equations as one program (eagerly: a compile each)."""
        eqn = self.producer.get(var) if isinstance(var, Var) else None
        fill = eqn.invars[0] if eqn and eqn.primitive.name == "broadcast_in_dim" else var
        if isinstance(fill, jcore.Literal):  # (a table of zeros, often)
            return np.full(_shape(var), fill.val, _dtype(var))
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        value = jax.jit(lambda: _read(_evaluate(_needed_by(self.jaxpr, [var]), env), var))
        return np.asarray(value.lower().compile()())

    def is_zero(self, var: Atom) -> bool:
        """Proven zero: static, and every entry 0."""
        return self.is_static(var) and not np.any(self.static_value(var))

    def nonlinear_in_seed(self, eqns: Sequence[Eqn], out: Atom | None = None) -> str:
        """Why `eqns` (computing `out`) are not proven linear in their cotangent (seeded)
        inputs, or "". Each equation that reads a cotangent must be linear in the cotangents it
        reads, the other operands fixed (`_LINEARITY`); by induction every seeded value is then
        linear in the cotangents. A value not seeded is a constant of the map: `out` must be
        seeded, or the map is affine (a custom_vjp backward that ignores its cotangent)."""
        if out is not None and not (isinstance(out, Var) and out in self.seeded):
            return "the gradient does not depend on the cotangent: affine, not linear"
        for eqn in eqns:
            seeded = [isinstance(v, Var) and v in self.seeded for v in eqn.invars]
            rule = _LINEARITY.get(eqn.primitive.name)
            unknown = f"'{eqn.primitive.name}' is not known to be linear"
            why = (rule(self, eqn, seeded) if rule else unknown) if any(seeded) else ""
            if why:
                return why
        return ""

    def position_axes(self, var: Atom) -> Axes:
        return _axes_of(self.positions, var)

    def core(self, var: Atom) -> tuple[Eqn | None, Posts]:
        """Follow a gradient back through layout ops and batch-independent scalings to the
        operation that makes it (its core): (core equation or None, the ops after it)."""
        steps: list[Post] = []
        while isinstance(var, Var) and var in self.producer:
            eqn = self.producer[var]
            name = eqn.primitive.name
            if _is_layout(eqn):
                steps.append(Post(eqn))
                var = eqn.invars[0]
            elif name == "neg":
                steps.append(Post(eqn, factor=-1.0))
                var = eqn.invars[0]
            elif name in ("mul", "div"):
                x, m = eqn.invars
                if name == "mul" and self.is_batched(m) and not self.is_batched(x):
                    x, m = m, x
                if not self.is_batched(x) or self.is_batched(m) or _shape(m) not in ((), _shape(x)):
                    break
                steps.append(Post(eqn, factor=m, divide=name == "div"))
                var = x
            else:
                break
        return (self.producer.get(var) if isinstance(var, Var) else None), tuple(steps[::-1])

    def exclusive_tail(self, var: Atom) -> tuple[Eqn, ...]:
        """The equations only this gradient needs, in order (evaluated per example by the
        fallback, so that no large intermediate of it exists for the whole batch)."""
        if not isinstance(var, Var) or var not in self.producer or self.users.get(var):
            return ()  # the head computes this value anyway: read it
        outvars = {v for v in self.jaxpr.outvars if isinstance(v, Var)}
        members = {id(self.producer[var]): self.producer[var]}

        def exclusive(v: Var) -> bool:
            if v in outvars or v in self.jaxpr.invars:
                return False
            return all(id(u) in members for u in self.users.get(v, ()))

        if not all(exclusive(v) for v in self.producer[var].outvars if v is not var):
            return ()  # it makes values others need too (a scan's other outputs): read it

        todo = [self.producer[var]]  # a member's inputs; revisited as members join
        while todo:
            for v in todo.pop().invars:
                src = self.producer.get(v) if isinstance(v, Var) else None
                if src is not None and id(src) not in members and all(map(exclusive, src.outvars)):
                    members[id(src)] = src
                    todo.append(src)
        return tuple(e for e in self.jaxpr.eqns if id(e) in members)


# Linearity rules: primitive name -> why an equation reading cotangents (`seeded`, per operand)
# is not linear in them, the other operands fixed, or "". Unknown primitives are refused.
LinearityRule = Callable[[Graph, Eqn, list[bool]], str]


def _linear_if(ok: Callable[[Graph, Eqn, list[bool]], bool]) -> LinearityRule:
    return lambda g, e, s: (
        "" if ok(g, e, s) else f"'{e.primitive.name}' is not linear in the cotangents it reads"
    )


def _linear_at(ks: Container[int]) -> LinearityRule:
    """Operands `ks` may be cotangents or instead proven zeros; no other may be seeded."""
    return _linear_if(
        lambda g, e, s: all(
            (x or g.is_zero(v)) if k in ks else not x
            for k, (x, v) in enumerate(zip(s, e.invars, strict=True))
        )
    )


# Linear in their first operand, the only one that may be a cotangent (x / m for div):
_first = _linear_if(lambda g, e, s: s[0] and not any(s[1:]))
_FIRST_ONLY = _names(
    """neg copy reduce_sum broadcast_in_dim reshape squeeze expand_dims transpose rev cumsum
    slice split unstack real imag div dynamic_slice"""
)
_LINEARITY: dict[str, LinearityRule] = dict.fromkeys(_FIRST_ONLY, _first)
_LINEARITY |= dict.fromkeys(
    ("add", "add_any", "sub", "concatenate", "stack"), _linear_at(range(sys.maxsize))
)
_LINEARITY |= dict.fromkeys(  # a product with exactly one cotangent factor
    ("mul", "dot_general", "conv_general_dilated"),
    _linear_if(lambda g, e, s: sum(s[:2]) == 1 and not any(s[2:])),
)
_LINEARITY["select_n"] = _linear_at(range(1, 64))
_LINEARITY["dynamic_update_slice"] = _linear_at((0, 1))
_LINEARITY["scatter-add"] = _linear_at((0, 2))
_LINEARITY["gather"] = lambda g, e, s: _gather_affine(e) or _first(g, e, s)
_LINEARITY["pad"] = _linear_if(lambda g, e, s: s[0] and not any(s[1:]) and g.is_zero(e.invars[1]))
_LINEARITY["convert_element_type"] = lambda g, e, s: (
    ("" if _floats_only(e) else "'convert_element_type' to or from a non-float type")
    or _first(g, e, s)
)


def _gather_affine(eqn: Eqn) -> str:
    """Why a gather is not linear in its operand, or "": out-of-bounds entries filled with a
    non-zero value (None is NaN for floats) make it affine; a mode not known here is refused."""
    mode = str(eqn.params["mode"]).rsplit(".", 1)[-1]
    fill = eqn.params.get("fill_value")
    if mode == "FILL_OR_DROP" and (fill is None or fill != 0):
        return f"'gather' fills out-of-bounds entries with {fill}: affine, not linear"
    if mode not in ("CLIP", "PROMISE_IN_BOUNDS", "FILL_OR_DROP"):
        return f"'gather' in mode {mode} is not known to be linear"
    return ""


def _is_layout(eqn: Eqn) -> bool:
    """Operations that move or relabel a gradient's entries one to one (norm-preserving)."""
    name = eqn.primitive.name
    if name in ("transpose", "reshape", "squeeze", "expand_dims", "copy"):
        return True
    if name == "convert_element_type":
        return _floats_only(eqn)
    if name == "broadcast_in_dim":
        return math.prod(_shape(eqn.invars[0])) == math.prod(_shape(eqn.outvars[0]))
    if name == "reduce_sum":  # over axes of size 1 only: sums nothing
        return all(_shape(eqn.invars[0])[a] == 1 for a in eqn.params["axes"])
    return False


def _floats_only(eqn: Eqn) -> bool:
    return all(jnp.issubdtype(_dtype(v), jnp.floating) for v in (*eqn.invars, *eqn.outvars))


def _replay(post: Sequence[Post], x: Array, env: Mapping, phi: Phi) -> Array:
    """The ops after the core, applied to `x` (a sum over units of φ(core) or one unit's core):
    layout as it is, a scaling by m as a scaling by φ(m) (by φ(1/m) for a division)."""
    for step in post:
        eqn = step.eqn
        if step.factor is None:
            name = eqn.primitive.name
            if name == "reduce_sum":
                x = jnp.sum(x, axis=tuple(eqn.params["axes"]))
            elif name != "convert_element_type":  # statistics keep their own dtype
                (x,) = _bind(eqn, [x])
            continue
        m = step.factor if isinstance(step.factor, int | float) else _read(env, step.factor)
        m = jnp.asarray(m).astype(x.dtype)
        x = x * phi(1.0 / m if step.divide else m)
    return x


def _replay_each(post: Sequence[Post], x: Array, env: Mapping, phi: Phi) -> Array:
    """_replay on each slice of x's leading axis (one unit's or one example's core)."""
    return jax.vmap(lambda u: _replay(post, u, env, phi))(x)


def _scale_sq(post: Sequence[Post], env: Mapping, dtype: DTypeLike) -> Array:
    """Π φ(m)² over the scalings after the core (all scalar: the caller checked)."""
    scale = jnp.ones((), dtype)
    for step in post:
        if step.factor is not None:
            m = step.factor if isinstance(step.factor, int | float) else _read(env, step.factor)
            m = jnp.asarray(m).astype(dtype).reshape(())
            scale = scale * (1.0 / m if step.divide else m) ** 2
    return scale


def _factor_vars(post: Sequence[Post]) -> list[Var]:
    return [s.factor for s in post if isinstance(s.factor, Var)]


# ============================================================================================
# §7′ Scan hoisting: weight-gradient contractions moved out of the backward scan.
#
# A weight stacked over layers and consumed by a scan gets its gradient as a stacked output of
# the backward scan, one dot_general per iteration; a weight shared by all iterations (an RNN
# cell) accumulates Σ_t dot_general(δ_t, x_t) in a carry that starts at zero. Either way the
# head, run batched, would hold one weight gradient per example (B × P). The rewrite below is
# exact: the scan emits the dot's operands instead (the saved activation is often a scanned
# input already), and the dot runs after the scan — batched over layers (one per iteration),
# or contracting the iterations (the accumulator). The routes then see an ordinary dot_general:
# per layer the route an unrolled layer would take.


@dataclasses.dataclass(frozen=True, eq=False)
class _Hoist:
    dot: Eqn  # the body's dot_general
    post: tuple[Eqn, ...]  # layout ops after it, in order
    accumulated: bool  # a carry Σ_t (else a stacked output)


def _hoistable(scan: Eqn, k: int, producer_out: Mapping[Var, Eqn]) -> _Hoist | None:
    """Output k of `scan` as a hoistable weight-gradient contraction, or None."""
    body = scan.params["jaxpr"].jaxpr
    nc, ncar = _scan_counts(scan.params)
    producer, users = _producers(body), _users(body)
    var = body.outvars[k]
    accumulated = k < ncar
    if accumulated:  # carry_out = add_any(carry_in, term), carry_in used there only, init 0
        carry_in, add = body.invars[nc + k], producer.get(var)
        if add is None or add.primitive.name != "add_any" or carry_in not in add.invars:
            return None
        if len(users.get(carry_in, ())) != 1 or carry_in in body.outvars:
            return None
        cast = ("broadcast_in_dim", "convert_element_type")  # how JAX starts an accumulator: 0
        init, _ = _walk_back(scan.invars[nc + k], producer_out, lambda e: e.primitive.name in cast)
        if not isinstance(init, jcore.Literal) or np.any(np.asarray(init.val)):
            return None
        (var,) = [v for v in add.invars if v is not carry_in] or [None]
    var, post = _walk_back(var, producer, _is_layout)
    dot = producer.get(var) if isinstance(var, Var) else None
    if dot is None or dot.primitive.name not in ("dot_general", "conv_general_dilated"):
        return None
    if accumulated and dot.primitive.name != "dot_general":
        return None  # a kernel every iteration shares: Σ_t over a convolution is not built
    return _Hoist(dot, post, accumulated)


def _walk_back(
    var: Atom | None, producer: Mapping[Var, Eqn], through: Callable[[Eqn], bool]
) -> tuple[Atom | None, tuple[Eqn, ...]]:
    """Follow `var` back through the equations `through` accepts, by their first operand: (the
    variable reached, those equations in order)."""
    path = []
    while isinstance(var, Var) and var in producer and through(producer[var]):
        path.append(producer[var])
        var = producer[var].invars[0]
    return var, tuple(path[::-1])


def _hoist_scans(
    closed: jcore.ClosedJaxpr,
    args: Sequence[Value | jax.ShapeDtypeStruct],
    stats: Sequence[str],
    weighted: bool,
    budget: int | None,
) -> jcore.ClosedJaxpr:
    """`closed` with the weight-gradient contractions of its scans moved after them: always
    where InScan forms all of `stats` back inside the scan (means of φ; unless `weighted`, the
    variance and norms too), else where that holds fewer numbers per example than the stacked
    per-example weight gradients (`_hoist_pays`); a convolution's where its emitted operands fit
    `budget` bytes per example (None: always)."""
    kinds = ("mean",) if weighted else ("mean", "spread", "norm")  # formable inside a scan
    always = all(_kind(w) in kinds for w in _ingredients(stats))
    jaxpr = closed.jaxpr
    producer = _producers(jaxpr)
    plans: dict[int, dict[int, _Hoist]] = {}
    scaled = lambda eqn: _is_layout(eqn) or eqn.primitive.name in ("mul", "div", "neg")
    for grad in jaxpr.outvars[1:]:
        var, _ = _walk_back(grad, producer, scaled)
        scan = producer.get(var) if isinstance(var, Var) else None
        if scan is None or scan.primitive.name != "scan":
            continue
        k = next(k for k, v in enumerate(scan.outvars) if v is var)
        hoist = _hoistable(scan, k, producer)
        if hoist is not None and _hoist_pays(scan, hoist, always, budget):
            plans.setdefault(id(scan), {})[k] = hoist
    if not plans:
        return closed

    def bind(eqn: Eqn, invals: list[Value]) -> list[Value]:
        hoists = plans.get(id(eqn))
        return _bind(eqn, invals) if hoists is None else _scan_hoisted(eqn, invals, hoists)

    return jax.make_jaxpr(lambda *values: _run(jaxpr, closed.consts, values, bind=bind))(*args)


def _operand_source(scan: Eqn, var: Atom) -> tuple[str, int]:
    """Where a body variable comes from: ("const" | "xs", index into the scan's inputs), or
    ("emit", -1) for a value the body computes (or a carry), which the scan must output."""
    body = scan.params["jaxpr"].jaxpr
    nc, ncar = _scan_counts(scan.params)
    if var in body.invars:
        i = body.invars.index(var)
        if i < nc:
            return "const", i
        if i >= nc + ncar:
            return "xs", i
    return "emit", -1


def _hoist_pays(scan: Eqn, hoist: _Hoist, always: bool, budget: int | None) -> bool:
    """Hoisting adds the emitted operands; it removes a weight gradient per iteration (or, for
    an accumulator, a weight-sized update per iteration); `always` where InScan consumes the
    operands inside the scan. A convolution (no InScan) left in the scan is computed by vmap of
    the whole backward scan; hoisted, its statistics are formed one kernel offset at a time —
    about half the time on XLA:CPU (results/bench/conv.md) — so it is hoisted unless its
    emitted operands, for every iteration, exceed `budget` bytes per example."""
    emitted = [v for v in hoist.dot.invars[:2] if _operand_source(scan, v)[0] == "emit"]
    if hoist.dot.primitive.name == "conv_general_dilated":
        size = sum(math.prod(_shape(v)) * _dtype(v).itemsize for v in emitted)
        return budget is None or size * scan.params["length"] <= budget
    numbers = sum(math.prod(_shape(v)) for v in emitted)
    return always or numbers < math.prod(_shape(hoist.dot.outvars[0])) or hoist.accumulated


def _scan_like(scan: Eqn, step: Callable, init: PyTree, xs: PyTree) -> PyTree:
    """`jax.lax.scan(step, init, xs)` with the length, direction and unrolling of the scan
    equation `scan` (a body evaluated in its place)."""
    p = scan.params
    return jax.lax.scan(
        step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1)
    )


def _scan_hoisted(scan: Eqn, invals: list[Value], hoists: Mapping[int, _Hoist]) -> list[Value]:
    """Evaluate `scan` with the `hoists` (by output index) computed after it."""
    params, body = scan.params, scan.params["jaxpr"]
    nc, ncar = _scan_counts(params)
    consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
    operands = (v for h in hoists.values() for v in h.dot.invars[:2])
    emit = list(dict.fromkeys(v for v in operands if _operand_source(scan, v)[0] == "emit"))
    n_out = len(body.jaxpr.outvars)

    def step(carry: list, x: list) -> tuple[list, tuple[list, list]]:
        values = [*consts, *carry, *x]
        outs = _run(body.jaxpr, body.consts, values, outs=[*body.jaxpr.outvars, *emit])
        new_carry = [carry[k] if k in hoists else outs[k] for k in range(ncar)]
        kept = [outs[k] for k in range(ncar, n_out) if k not in hoists]
        return new_carry, (kept, outs[n_out:])

    carry, (kept, emitted) = _scan_like(scan, step, list(init), list(xs))
    stacked = dict(zip(emit, emitted, strict=True))

    def operand(var: Atom) -> tuple[Value, bool]:
        kind, i = _operand_source(scan, var)
        if kind == "const":
            return consts[i], False
        if kind == "xs":
            return xs[i - nc - ncar], True
        return stacked[var], True

    results = {}
    for k, h in hoists.items():
        (a, a_stacked), (b, b_stacked) = operand(h.dot.invars[0]), operand(h.dot.invars[1])
        if not h.accumulated:

            def one(a_: Value, b_: Value, h: _Hoist = h) -> Value:
                local: dict[Var, Value] = {h.dot.invars[0]: a_, h.dot.invars[1]: b_}  # type: ignore[dict-item]
                _evaluate([h.dot, *h.post], local)
                return local[(h.post[-1] if h.post else h.dot).outvars[0]]

            axes = (0 if a_stacked else None, 0 if b_stacked else None)
            results[k] = jax.vmap(one, axes, axis_size=params["length"])(a, b)
            continue
        # Σ_t post(dot(a_t, b_t)) = post(one dot contracting t as well): post is layout.
        lc, rc, lb, rb = _dot_dims(h.dot)
        kwargs = {"preferred_element_type": h.dot.params.get("preferred_element_type")}
        if a_stacked and b_stacked:
            g = jax.lax.dot_general(a, b, _over_examples(lc, rc, lb, rb), **kwargs)
        else:  # a factor the same at every iteration moves out of the sum
            a = jnp.sum(a, 0) if a_stacked else a
            b = jnp.sum(b, 0) if b_stacked else b
            g = jax.lax.dot_general(a, b, ((lc, rc), (lb, rb)), **kwargs)
            if not (a_stacked or b_stacked):
                g = g * params["length"]
        for eqn in h.post:
            (g,) = _bind(eqn, [g])
        results[k] = g
    rest = iter(kept)  # the stacked outputs not hoisted, in order
    return [
        results[k] if k in hoists else carry[k] if k < ncar else next(rest) for k in range(n_out)
    ]


# ============================================================================================
# §8 Planner: per leaf, the first route whose match succeeds. Pure data, no tracing.


@dataclasses.dataclass(frozen=True, eq=False)
class InScan:
    """Where a leaf's means of φ (variance, norms) are formed inside a scan: its core is a
    dot_general of two values the scan stacks (stacked outputs or scanned inputs) that keeps
    the iterations apart (a batch dim of both operands: stacked layers). Each mean, the variance
    and each ‖g_i‖²'s part is then a reduction per slice of that axis (norms: summed), so the scan
    body forms slice t from iteration t's operands of the whole batch, and no stacked operand
    outlives the loop (plain grad contracts inside it too). A core that contracts the
    iterations (a weight every iteration shares) has no such slices, but its sum is linear:
    Σ_t of iteration t's contributions, accumulated in a carry as plain grad does."""

    route: "OuterProduct | Contraction"  # the leaf's
    scan: Eqn
    operands: tuple[Atom, Atom]  # the body's values of the core's operands at one iteration
    axis: int | None  # the core's output axis over iterations; None: summed over them
    means: tuple[str, ...]  # the ingredients formed inside: "sum", "sq", "sign", "var", "norms"


def _in_scan(graph: Graph, m: "Route", methods: Mapping[str, str]) -> InScan | None:
    """The proof that `m`'s means of φ, variance and norms can be formed inside a scan, or None."""
    if not isinstance(m, (OuterProduct, Contraction)) or _of_kind(list(methods), "inner", "pairs"):
        return None
    inside = () if graph.weighted and _of_kind(list(methods), "norm") else m.sums(tuple(methods))
    if any(w not in inside or how != "factorized" for w, how in methods.items()):
        return None  # clipping waits for every norm; nonfinite="drop" knows its examples by them
    a, b = m.core.invars[:2]
    scans = [graph.producer.get(v) for v in (a, b) if isinstance(v, Var)]
    scan = next((e for e in scans if e is not None and e.primitive.name == "scan"), None)
    x, y = (None, None) if scan is None else (_per_iteration(scan, v) for v in (a, b))
    if scan is None or x is None or y is None:
        return None
    lc, rc, lb, rb = _dot_dims(m.core)
    apart = [j for j, (p, q) in enumerate(zip(lb, rb, strict=True)) if p == 0 and q == 0]
    summed = any(p == 0 and q == 0 for p, q in zip(lc, rc, strict=True))
    if not apart and not (summed and set(methods) == {"sum"}):
        return None  # φ of a sum over iterations is no sum over iterations
    return InScan(m, scan, (x, y), apart[0] if apart else None, tuple(methods))


def _per_iteration(scan: Eqn, var: Atom) -> Atom | None:
    """The body's value at iteration t of `var`'s slice t (along axis 0): `var` a stacked
    output of `scan` or one of its scanned inputs; else None."""
    body = scan.params["jaxpr"].jaxpr
    nc, ncar = _scan_counts(scan.params)
    for k, v in enumerate(scan.outvars):
        if v is var and k >= ncar:
            return body.outvars[k]
    for k, v in enumerate(scan.invars):
        if v is var and k >= nc + ncar:
            return body.invars[k]
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class LeafPlan:
    """How impl="factorized" computes one parameter leaf's statistics (pure data).

    `methods` maps each ingredient the statistics need (§2) to "factorized" (computed from the
    route's factors, no per-unit gradient exists) or "chunked" (per-unit gradients of this leaf
    materialized a bounded chunk of examples at a time). `status` sums it up: "factorized",
    "chunked" (the route materializes some), or "fallback" (no route proved its identities and
    per-unit gradients are materialized; exact, slowest). `formed`: where per-unit gradients of
    this leaf exist, how many examples' at once and their bytes — ("chunk loop", c, bytes), or
    ("head", c, bytes) for a contraction's per-example φ."""

    leaf: str  # key path of the parameter leaf, e.g. "['layers'][0]['w']"
    shape: tuple[int, ...]
    taken: "Route"  # the route taken, holding what its match proved; it computes the statistics
    methods: Mapping[str, str]
    refused: tuple[tuple[str, str], ...]  # (route, why it did not apply), in precedence order
    index: int = dataclasses.field(repr=False, default=0)
    in_scan: InScan | None = dataclasses.field(repr=False, default=None)
    formed: tuple[tuple[str, int, int], ...] = ()
    other_kind: tuple[str, ...] = ()  # refused routes for which the leaf is not of their kind
    kept: bool = False  # per-unit gradients kept for the clip factors (`_kept_for_clipping`)

    @property
    def route(self) -> str:  # the route taken: a name in ROUTES, or "mean-loss"
        return self.taken.name

    @property
    def reason(self) -> str:  # what the route's match proved
        return self.taken.reason

    @property
    def looped(self) -> bool:  # the chunk loop forms its per-unit gradients (clipping aside)
        return any(how == "chunked" for w, how in self.methods.items() if _kind(w) != "weighted")

    @property
    def reads(self) -> list[Var]:  # the head's values its route reads
        if self.in_scan is not None:  # the operands are consumed inside the scan
            return _factor_vars(self.in_scan.route.post)
        return self.taken.reads()

    @property
    def status(self) -> str:
        if "chunked" not in self.methods.values():
            return "factorized"
        return "fallback" if self.route == "fallback" else "chunked"

    def __str__(self) -> str:
        methods = ", ".join(f"{k}: {v}" for k, v in self.methods.items())
        head = f"{self.leaf} {self.shape}: {self.route} ({self.status})"
        body = f"{self.reason} [{methods}]"
        if self.in_scan is not None:
            body += "; formed inside the scan, one iteration at a time"
        for where, c, size in self.formed:
            body += f"; per-unit gradients {c} examples at a time in the {where} ({size:,} B)"
        if self.kept:
            body += "; kept for the clip factors (formed once, not again for the clipped mean)"
        # Why each route of the leaf's kind before the one taken did not apply: its proof failed.
        lost = [f"{r}: {why}" for r, why in self.refused if r not in self.other_kind]
        if lost:
            body += "; not taken: " + "; ".join(lost)
        wrap = functools.partial(textwrap.wrap, width=100, break_on_hyphens=False)  # names whole
        lines = wrap(body, initial_indent="    ", subsequent_indent="    ")
        return "\n".join(wrap(head, subsequent_indent="    ") + lines)


class Plan(tuple):
    """`explain`'s answer: the `LeafPlan`s, one per parameter leaf (a tuple), whose `str`
    opens with a one-line summary: leaves per route."""

    @staticmethod
    def build(
        loss: Callable,
        params: PyTree,
        batch: PyTree,
        per_example: int,
        stats: tuple[str, ...],
        options: "Options",
    ) -> "Plan":
        """`explain`'s entry point into the engine: the graph and its plan, nothing run."""
        mean_loss = _mean_loss(loss, params, batch, stats, options)
        graph = Graph.build(loss, params, batch, per_example, stats, options, mean_loss)
        return Plan(plan(graph, stats, choose=options[1]))

    @property
    def summary(self) -> str:
        routes = [p.route for p in self]
        counts = ", ".join(f"{routes.count(r)} {r}" for r in dict.fromkeys(routes))
        return f"{len(self)} leaves: {counts}"

    def __str__(self) -> str:
        return "\n".join([self.summary, *map(str, self)])


def plan(
    graph: Graph, stats: Sequence[str], *, choose: Choose = "cheapest"
) -> tuple[LeafPlan, ...]:
    """Per leaf, the first route in precedence order (`ROUTES`) whose match succeeds; the mean
    alone, where `_mean_loss` proves it plain grad's, is every leaf's "mean-loss"; with
    choose="cheapest", gradients formed anyway are kept for clipping."""
    need = _ingredients(stats)
    if graph.user_backward == "":  # the mean alone, proven plain grad's (`_mean_loss`)
        return MeanLoss.plans(graph, need)
    plans, scans = [], any(e.primitive.name == "scan" for e in graph.jaxpr.eqns)
    for leaf in graph.leaves:
        refused = [(MeanLoss.name, graph.user_backward)] if graph.user_backward else []
        other_kind: list[str] = []
        core, post = graph.core(leaf.grad)  # a CoreRoute is tried where it is one of its cores
        for route in ROUTES:
            try:
                if issubclass(route, CoreRoute):
                    m = route.at_core(graph, leaf, core, post)
                else:
                    m = route.match(graph, leaf)
            except Exception as error:  # a route that cannot prove its case refuses it
                m = Refusal(f"its proof raised {type(error).__name__}: {error} (a pegrad bug)")
            if not isinstance(m, Refusal):
                break
            refused.append((route.name, m.reason))
            other_kind += [] if m.kind else [route.name]
        assert not isinstance(m, Refusal)  # the fallback always matches
        methods = m.methods(need)
        if graph.weighted and not isinstance(m, Empty):  # Chan merges of kept examples
            methods |= dict.fromkeys(_of_kind(list(methods), "spread"), "chunked")
        in_scan = _in_scan(graph, m, methods) if scans else None  # (formed inside a scan)
        p = LeafPlan(leaf.path, leaf.shape, m, methods, tuple(refused), leaf.index, in_scan)
        plans.append(dataclasses.replace(p, other_kind=tuple(other_kind)))
    if choose == "cheapest" and _of_kind(need, "weighted"):
        plans = _kept_for_clipping(graph, plans, need)
    loop_chunk = _loop_chunk(graph, plans) if any(p.looped for p in plans) else 0
    forms = lambda p: p.looped or isinstance(p.taken, (Contraction, Convolution))  # noqa: E731
    return tuple(_formed(graph, p, loop_chunk) if forms(p) else p for p in plans)


def _kept_for_clipping(graph: Graph, plans: list[LeafPlan], need: tuple[str, ...]) -> list:
    """With the clipped mean, leaves forming per-unit gradients for the norms anyway (chunk loop;
    a contraction's, in the head) form them once in the chunk loop and keep them for the clip
    factors: Σ_u c_u g_u weighs what exists, no second weight-gradient matmul or formation
    (GPT-2 small: results/bench/gpu-time.md). Only where the loop then holds the whole batch's
    at once (`_loop_chunk`'s bound): the factors wait for every example's norm."""

    def forms(p: LeafPlan) -> bool:
        if p.in_scan is not None:  # (formed inside the scan, one iteration at a time)
            return False
        factorized = [w for w, how in p.methods.items() if how == "factorized"]
        return p.looped or isinstance(p.taken, Contraction) and p.taken.forms(factorized)

    kept = {}
    for p in filter(forms, plans):
        every = {w: how if _kind(w) == "pairs" else "chunked" for w, how in p.methods.items()}
        kept[p.index] = dataclasses.replace(p, methods=every, kept=True)
    trial = [kept.get(p.index, p) for p in plans]
    return trial if kept and _loop_chunk(graph, trial) == graph.n_examples else plans


def _formed(graph: Graph, p: LeafPlan, loop_chunk: int) -> LeafPlan:
    """`p` with where its per-unit gradients are formed, how many examples' at once."""
    leaf = graph.leaves[p.index]
    formed = []
    if p.looped:
        size = loop_chunk * graph.per_example * leaf.size * leaf.stat_dtype.itemsize
        formed.append(("chunk loop", loop_chunk, size))
    m = p.taken
    factorized = [w for w, how in p.methods.items() if how == "factorized"]
    in_head = isinstance(m, Convolution) and any(w in m.FORMED for w in factorized)
    if isinstance(m, Contraction) and m.forms(factorized) or in_head:  # (norms by Grams: none)
        assert isinstance(m, (Contraction, Convolution))
        one = m.formed_unit()
        operands = graph.n_examples * sum(math.prod(_shape(v)) for v in m.core.invars[:2])
        if p.in_scan is not None and p.in_scan.axis is not None:  # one iteration at a time
            length = p.in_scan.scan.params["length"]
            one, operands = one // length, operands // length
        c = m.chunk(operands, one)
        formed.append(("head", c, c * one * leaf.stat_dtype.itemsize))
    if isinstance(m, Contraction) and _of_kind(factorized, "pairs"):  # two chunks at a time
        operands = graph.n_examples * sum(math.prod(_shape(v)) for v in m.core.invars[:2])
        c = m.chunk(operands, m.formed_unit(), accelerator=True)
        formed.append(("head", c, 2 * c * m.formed_unit() * leaf.stat_dtype.itemsize))
    return dataclasses.replace(p, formed=tuple(formed))


# ============================================================================================
# §9 Executor, in `_factorized`'s order: the batched head, the chunk loop, the norms' waiters.


def _run_head(
    graph: Graph,
    plans: tuple[LeafPlan, ...],
    early: Sequence[str],
    params: PyTree,
    batch: PyTree,
    keep: Array | None,
    dot_with: Sequence[Array] | None,
) -> tuple[Array, dict, dict, PyTree]:
    """Losses [B], the values the routes read (batched ones with a leading B, others once;
    "dot"'s v as `_DOT_WITH`), the factorized results of the ingredients `early` and the
    auxiliary outputs [B, ...].

    The head is every equation those values need, evaluated for one example under one vmap
    over the examples (axis `_EXAMPLES`), in segments (`_segments`). At a segment's end its
    values read later that depend on the example are held with their examples, as the graph
    reads them; the leaves whose values then exist have them gathered over the vmap's axis
    (`_examples`: the batched value, examples first) and their factorized ingredients computed;
    then (XLA:CPU, one device: DESIGN.md, "One program per platform") an optimization barrier
    makes the rest of the backward pass wait for them, holding them with what the next segment
    reads from before it (the last, with what is read after the head). The leaves formed
    inside a scan (`InScan`) have their sums formed there (`_scan_with_sums`), then `post`ed."""
    jaxpr, reads = graph.jaxpr, [p.reads for p in plans]
    in_scan = {p.index: p.in_scan for p in plans if p.in_scan is not None}
    interface = list(dict.fromkeys(v for vs in reads for v in vs))
    outputs = [jaxpr.outvars[0], *jaxpr.outvars[1 + len(graph.leaves) :]]  # loss and aux
    wanted = [v for v in [*outputs, *interface] if isinstance(v, Var)]
    jobs: dict[int, dict[int, InScan]] = {}  # scan -> leaf index -> its job
    for i, job in in_scan.items():
        jobs.setdefault(id(job.scan), {})[i] = job
    segments = _segments(graph, plans, wanted, [job.scan for job in in_scan.values()])
    read = {v for eqns, *_ in segments for e in eqns for v in e.invars if isinstance(v, Var)}
    seed, n = jnp.ones((), _dtype(jaxpr.invars[-1])), graph.n_examples
    leaves, examples = jax.tree.leaves(params), jax.tree.leaves(batch)
    mesh = max([_devices(x) for x in [*leaves, *examples]], default=1)  # on a mesh, no barrier
    # out of the vmap: the loss and aux (each [B, ...]) and what the routes read after the head
    batched = [*outputs, *(v for v in interface if graph.is_batched(v))]
    unbatched = [v for v in interface if not graph.is_batched(v)]

    def one_example(example: list) -> tuple[list, list, dict]:
        values: dict = dict(zip(jaxpr.constvars, graph.consts, strict=True))
        values.update(zip(jaxpr.invars, [*leaves, *example, seed], strict=True))
        results: dict = {}
        bind = functools.partial(_scan_with_sums, graph, jobs, keep, {*read, *wanted}, results)
        for eqns, crossing, ready, held in segments:
            _evaluate(eqns, values, bind=bind if jobs else _bind)
            for v in crossing:  # on axis 0, or 1 for a scan's stacked output (where vmap has it)
                values[v] = _examples(values[v], n, int(_stacked_output(graph, v)))
            if not ready:
                continue
            # in order (not a set of variables, whose order is their addresses'): every trace,
            # every process, lowers to the same program
            read_now = dict.fromkeys(v for i in ready for v in reads[i] if graph.is_batched(v))
            env = {**values, **{v: _examples(values[v], n) for v in read_now}, _DOT_WITH: dot_with}
            new = {}
            for i in ready:
                new |= _compute([plans[i]], early, _masked(graph, env, keep, reads[i]))
            live = [v for v in values if v in held]
            # every value varies over the manual axes any does (jax.shard_map), as a barrier
            # returns them; held on XLA:CPU only (docstring)
            both = _varying_as(b := (new, [values[v] for v in live]), b)
            new, kept = _cpu_barrier(both) if mesh == 1 else both
            values.update(zip(live, kept, strict=True))
            results.update(new)
        return [_read(values, v) for v in batched], [values[v] for v in unbatched], results

    got, once, results = jax.vmap(
        one_example, out_axes=(0, None, None), axis_name=_EXAMPLES, axis_size=n
    )(examples)
    n_out = len(outputs)
    losses, *aux = got[:n_out]
    env = dict(zip([*batched[n_out:], *unbatched], [*got[n_out:], *once], strict=True))
    env[_DOT_WITH] = dot_with
    for i, job in in_scan.items():  # their sums exist in core coordinates: apply the post
        posted = job.route.posted({w: results[w, i] for w in job.means}, env)
        results.update({(w, i): g for w, g in posted.items()})
    return losses, env, results, jax.tree.unflatten(graph.aux_tree, aux)


def _segments(
    graph: Graph, plans: Sequence[LeafPlan], wanted: Sequence[Var], scans: Sequence[Eqn]
) -> list[tuple[list[Eqn], list[Var], list[int], set[Var]]]:
    """The head — every equation the values `wanted` and the `scans` forming sums need, in
    order — cut where leaves' values exist: per segment, (its equations, those of their values
    that depend on the example and are read after it, the leaves ready at its end, the values
    held there: what the equations up to the next leaf's read from before it, or, after the
    last, every value wanted)."""
    head = _needed_by(graph.jaxpr, [*wanted, *(scan.outvars[0] for scan in scans)])
    made_at = {v: k for k, eqn in enumerate(head) for v in eqn.outvars}
    ready: dict[int, list[int]] = {}
    for p in (p for p in plans if p.in_scan is None):  # (those formed inside a scan: there)
        at = max((made_at[v] for v in p.reads if v in made_at), default=-1)
        ready.setdefault(at, []).append(p.index)
    cuts = sorted({*ready, len(head) - 1})
    last_use = {v: k for k, eqn in enumerate(head) for v in eqn.invars if isinstance(v, Var)}
    last_use |= dict.fromkeys(wanted, len(head))  # kept to the end
    segments = []
    for start, cut, end in zip([-1, *cuts[:-1]], cuts, [*cuts[1:], cuts[-1]], strict=True):
        eqns = head[start + 1 : cut + 1]
        outs = [v for e in eqns for v in e.outvars if last_use.get(v, -1) > cut]
        after = head[cut + 1 : end + 1]
        held = {v for e in after for v in e.invars if isinstance(v, Var)} if after else {*wanted}
        segments.append((eqns, [v for v in outs if graph.is_batched(v)], ready.get(cut, []), held))
    return segments


def _compute(
    plans: Sequence[LeafPlan], wanted: Sequence[str], env: Mapping, weights: Array | None = None
) -> dict:
    """The ingredients `wanted` the leaves of `plans` compute factorized ("clipped" by
    `weights`), keyed (ingredient, leaf index)."""
    out = {}
    for p in plans:
        whats = [w for w in wanted if p.methods[w] == "factorized"]
        if weights is not None:
            out.update({(w, p.index): p.taken.clipped(env, weights) for w in whats})
        elif whats:
            found = p.taken.compute_many(env, whats)
            out.update({(w, p.index): found[w] for w in whats})
    return out


def _masked(graph: Graph, env: Mapping, keep: Array | None, names: Sequence[Var]) -> dict:
    """`env` with the batched values among `names` replaced by 0 at examples not kept: every
    route's per-example gradient is then exactly 0 there (a product, sum or copy of them), so
    that its sums are over the kept examples — and a NaN there goes nowhere."""
    if keep is None:
        return dict(env)
    masked = {v: _where_units(keep, env[v]) for v in names if v in graph.batched and v in env}
    return {**env, **masked}


# The head's vmap axis, over which each leaf's values and the in-scan sums are gathered.
_EXAMPLES = "pegrad_examples"


def _examples(x: Value, n: int, axis: int | None = None) -> Array:
    """In the head's vmap over its n examples (`_EXAMPLES`). With no `axis`: every example's
    `x`, [n, ...], unbatched — the batched value with its examples moved first: `all_gather`
    over the vmap's axis without a collective, which `jax.shard_map`'s checks refuse over an
    axis that is not the mesh's. With an `axis`: `x` with its examples there, as vmap returns
    a value on that out axis (one it keeps the same for every example: broadcast)."""
    return _EXAMPLES_OF.bind(x, n=n, axis=axis)


def _examples_batched(frame: Any, xs: Sequence, dims: Sequence, n: int, axis: int | None) -> tuple:
    (x,), (d,), to = xs, dims, axis or 0
    assert frame.name == _EXAMPLES and frame.size == n, frame  # bound in the head's vmap only
    return (batching.broadcast(x, n, to, None) if d is None else jnp.moveaxis(x, d, to)), axis


def _examples_aval(aval: Any, n: int, axis: int | None) -> Any:  # gathered: [n, ...]
    return aval if axis is not None else aval.update(shape=(n, *aval.shape))


_EXAMPLES_OF = jcore.Primitive("pegrad_examples")
_EXAMPLES_OF.def_abstract_eval(_examples_aval)
batching.fancy_primitive_batchers[_EXAMPLES_OF] = _examples_batched


def _stacked_output(graph: Graph, var: Var) -> bool:
    """A stacked output of a scan (vmap gives it the examples on axis 1)."""
    eqn = graph.producer.get(var)
    if eqn is None or eqn.primitive.name != "scan":
        return False
    return eqn.outvars.index(var) >= _scan_counts(eqn.params)[1]


def _scan_with_sums(
    graph: Graph,
    every: Mapping[int, Mapping[int, InScan]],
    keep: Array | None,
    read: Container[Var],
    into: dict,
    scan: Eqn,
    invals: list[Value],
) -> list[Value | None]:
    """The head's `bind` where a scan forms sums (`every`: scan -> leaf index -> InScan): an
    equation that is no such scan is bound as it is; the scan is evaluated for one example
    inside the head's vmap, its body also forming the means of φ of its leaves: at iteration
    t the operands of the whole batch are gathered over the vmap's axis (no copy: the batched
    value itself), and the route reduces them as one slice of its core (the iteration axis of
    size 1). Returns the scan's outputs, adding `into` per (ingredient, leaf index) the
    stacked means in the core's coordinates (unbatched). Stacked outputs nobody `read`s are
    not formed (None): the operands hoisting emitted for these leaves, now consumed inside."""
    if id(scan) not in every:
        return _bind(scan, invals)
    jobs, params, body = every[id(scan)], scan.params, scan.params["jaxpr"]
    nc, ncar = _scan_counts(params)
    consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
    stacked = [k for k in range(ncar, len(scan.outvars)) if scan.outvars[k] in read]
    extra = [v for job in jobs.values() for v in job.operands]
    wanted = [*body.jaxpr.outvars[:ncar], *(body.jaxpr.outvars[k] for k in stacked), *extra]

    zeros = lambda m: jnp.zeros(_shape(m.core.outvars[0]), m.dtype)  # noqa: E731
    totals = {i: zeros(job.route) for i, job in jobs.items() if job.axis is None}

    def step(carry: tuple[list, dict], x: list) -> tuple[tuple[list, dict], tuple[list, dict]]:
        scan_carry, totals = carry
        outs = _run(body.jaxpr, body.consts, [*consts, *scan_carry, *x], outs=wanted)
        n_out = ncar + len(stacked)
        operands, sums = iter(outs[n_out:]), {}
        for i, job in jobs.items():
            m, env = job.route, {}
            for var in m.core.invars[:2]:
                value = _examples(next(operands), graph.n_examples)
                value = value if keep is None else _where_units(keep, value)
                env[var] = jnp.expand_dims(value, 1)  # the core's operand, one iteration
            found = m.core_sums(env, m.dtype, job.means)
            if job.axis is None:  # the one iteration it contracts: its contribution
                totals = {**totals, i: totals[i] + found["sum"]}
            else:
                for w in job.means:  # norms [B] per iteration, the rest one slice of the core
                    one = found[w] if _kind(w) == "norm" else found[w].squeeze(job.axis)
                    sums[w, i, job.axis] = one
        return (outs[:ncar], totals), (outs[ncar:n_out], sums)

    (carry, totals), (ys_read, sums) = _scan_like(scan, step, (list(init), totals), list(xs))
    found = {("sum", i): total for i, total in totals.items()}
    for (w, i, axis), each in sums.items():  # stacked per iteration; norms: summed over them
        found[w, i] = each.sum(0) if _kind(w) == "norm" else jnp.moveaxis(each, 0, axis)
    ys = dict(zip(stacked, ys_read, strict=True))
    into.update(found)
    return [*carry, *(ys.get(k) for k in range(ncar, len(scan.outvars)))]


def _loop_chunk(graph: Graph, plans: Sequence[LeafPlan]) -> int:
    """Examples per chunk of the chunk loop: the largest number whose materialized per-unit
    gradients hold no more numbers than the parameters or the batched head values the routes
    read (activations and their gradients), whichever is larger — memory the step needs
    anyway — or the caller's bound (chunk_size, memory_budget)."""
    looped = [graph.leaves[p.index] for p in plans if p.looped]
    parameters = sum(leaf.size for leaf in graph.leaves)
    reads = dict.fromkeys(v for p in plans for v in p.reads)
    activations = sum(graph.n_examples * math.prod(_shape(v)) for v in reads if graph.is_batched(v))
    materialized = graph.per_example * sum(leaf.size for leaf in looped) or 1
    unit = graph.per_example * sum(leaf.size * leaf.stat_dtype.itemsize for leaf in looped)
    bound = max(parameters, activations) // materialized
    return _examples_per_chunk(graph.n_examples, unit, graph.chunk_size, graph.memory_budget, bound)


def _chunk_loop(
    graph: Graph,
    plans: tuple[LeafPlan, ...],
    env: Mapping,
    batch: PyTree,
    params: PyTree,
    chunk: int,
    chunked: Mapping[int, Sequence[str]],
    keep: Array | None,
    weights: Array | None = None,
    hold: Collection[int] = (),
    given: Mapping[int, Array] | None = None,
) -> tuple[dict[tuple[str, int], Array], dict[str, Array], dict[int, Array]]:
    """Per-unit gradients of the `chunked` leaves, `chunk` examples at a time, reduced to the
    ingredients each needs: means of φ, the variance (chunk by chunk, merged with Chan's
    update: no cancellation), or — given per-unit `weights` [B, U] — the clipped mean; and,
    summed over these leaves, the per-unit norms and inner products with v ([B, U]) and the
    pairs ([N, N], `_pairs`: blocks of two chunks). Leaves in `hold` (one chunk) also return
    their per-unit gradients [B, U, ...]; a later call `given` them reads, not forms, them."""
    given = {i: g for i, g in (given or {}).items() if i in chunked}
    assert not (hold or given) or chunk >= graph.n_examples  # kept whole: one chunk
    routes = {i: plans[i].taken for i in chunked}
    formers = [r for i, r in routes.items() if i not in given]
    keys = list(dict.fromkeys(v for r in formers for v in r.reads() if v in graph.batched))
    dtype = _widest([leaf.dtype for leaf in graph.leaves])
    shape = (graph.n_examples, graph.per_example)
    w = jnp.ones(shape, dtype) if weights is None else weights
    k = jnp.ones(shape, bool) if keep is None else jnp.broadcast_to(keep[:, None], shape)
    per = {u: _kind(u) for ws in chunked.values() for u in _of_kind(ws, "norm", "inner")}

    def formed(which: Sequence[int], value: list, example: PyTree, kept: Array, had: dict) -> dict:
        local = {**env, **dict(zip(keys, value, strict=True))}  # one example's values
        grads = {
            i: had[i] if i in had else routes[i].per_unit(local, example, params) for i in which
        }
        if keep is not None:  # replaced, not multiplied: a masked example may hold NaN
            grads = {i: _where_units(kept, g) for i, g in grads.items()}
        return grads

    def one(value: list, example: PyTree, kept: Array, had: dict) -> tuple[dict, dict]:
        grads = formed(looped, value, example, kept, had)
        out = {}
        for u, kind in per.items():  # [U] each, added over the leaves
            terms = (
                jnp.sum(g * g, axis=tuple(range(1, g.ndim)))
                if kind == "norm"
                else jnp.tensordot(g, env[_DOT_WITH][i].astype(g.dtype), axes=g.ndim - 1)
                for i, g in grads.items()
                if u in chunked[i]
            )
            out[u] = sum((t.astype(dtype) for t in terms), jnp.zeros((graph.per_example,), dtype))
        return grads, out

    def per_chunk(xs: tuple) -> tuple[dict, dict]:
        values, examples, unit_w, unit_k, had = xs
        grads, units = jax.vmap(one)(values, examples, unit_k, had)
        out: dict = {("held", i): grads[i] for i in hold if i in grads}
        for i, g in grads.items():
            out |= _chunk_sums(_merge01(g), i, chunked[i], unit_w, unit_k, keep, graph.n_units)
        return out, units

    examples = batch if graph.token else None  # the untied fallback reads the example itself
    xs = ([env[v] for v in keys], examples, w, k, given)
    looped = [i for i, ws in chunked.items() if [u for u in ws if _kind(u) != "pairs"]]
    acc, units = {}, {}
    if looped:
        acc, units = _chunked(per_chunk, xs, graph.n_examples, chunk, _combine, _over_groups)
    held = {key[1]: acc.pop(key) for key in [key for key in acc if key[0] == "held"]}
    out = {key: v[2] / (v[0] - 1) if _kind(key[0]) == "spread" else v for key, v in acc.items()}
    units = {} if weights is not None else units
    for u in {u for ws in chunked.values() for u in _of_kind(ws, "pairs")}:
        paired = [i for i, ws in chunked.items() if u in ws]
        grads_of = lambda xs, p=paired: [  # noqa: E731
            _merge01(g)
            for g in jax.vmap(functools.partial(formed, p))(xs[0], xs[1], xs[3], xs[4]).values()
        ]
        units[u] = _pairs(grads_of, xs, graph.n_examples, chunk)
    return out, units, held


def _chunk_sums(
    g: Array, i: int, wanted: Sequence[str], w: Array, k: Array, keep: Array | None, n_units: int
) -> dict:
    """One chunk's part of leaf i's chunked ingredients from its units' gradients g [c·U, ...]:
    Σ φ(g)/N per mean; (count, mean, M2) for the variance (with `keep`, over the units kept, k
    [c, U]); Σ w_u g_u / N for the clipped mean (unit weights w [c, U])."""
    out: dict = {}
    for what in wanted:
        if what in _PHI:
            out[what, i] = _sum_rows(_PHI[what](g)) * (1.0 / n_units)
        elif _kind(what) == "spread" and keep is None:
            mean = jnp.mean(g, 0)
            count = jnp.asarray(g.shape[0], g.dtype)
            out[what, i] = (count, mean, _sum_rows((g - mean) ** 2))
        elif _kind(what) == "spread":  # over the kept units of the chunk (masked: 0)
            kept = _merge01(k)
            count = jnp.sum(kept).astype(g.dtype)
            mean = _sum_rows(g) / jnp.maximum(count, 1.0)
            out[what, i] = (count, mean, _sum_rows(_where_units(kept, g - mean) ** 2))
        elif _kind(what) == "weighted":
            out[what, i] = jnp.tensordot(_merge01(w).astype(g.dtype), g, axes=1) / n_units
    return out


def _combine(acc: dict, part: dict) -> dict:
    """The chunk loop's running sums with one more chunk's (variances by Chan's update)."""
    merge = lambda k, v: _chan(acc[k], v) if _kind(k[0]) == "spread" else acc[k] + v  # noqa: E731
    return {k: merge(k, v) for k, v in part.items()}


def _over_groups(sums: dict) -> dict:
    """The chunk loop's sums of the device groups, stacked on axis 0, merged."""
    return {k: _chan_over(v) if _kind(k[0]) == "spread" else jnp.sum(v, 0) for k, v in sums.items()}


def _chunked_in(plans: Sequence[LeafPlan], wanted: Sequence[str]) -> dict[int, list[str]]:
    """Per leaf that chunks any of `wanted`, those it chunks."""
    found = {p.index: [w for w in wanted if p.methods[w] == "chunked"] for p in plans}
    return {i: ws for i, ws in found.items() if ws}


def _added(graph: Graph, results: Mapping, looped: Mapping[str, Array], w: str) -> Array:
    """A per-unit ingredient ([N], or [N, N] for pairs) added over the leaves."""
    dtype = _widest([leaf.dtype for leaf in graph.leaves])
    shape = (graph.n_units,) * (2 if _kind(w) == "pairs" else 1)
    parts = [results[w, i] for i in range(len(graph.leaves)) if (w, i) in results]
    parts += [looped[w]] if w in looped else []
    return sum((x.reshape(shape).astype(dtype) for x in parts), jnp.zeros(shape, dtype))


def _after_norms(
    graph: Graph,
    plans: tuple[LeafPlan, ...],
    need: Sequence[str],
    env: Mapping,
    losses: Array,
    results: dict,
    per_unit: dict[str, Array],
    keep: Array | None,
    drop: bool,
    clip_norm: float | None,
    loop: Callable[..., tuple],
) -> Array | None:
    """What waits for every unit's norm, added to `results` and `per_unit` (0 at the units
    not kept): the examples `drop` discards, then the ingredients that waited for them (all
    but the norms) and the clipped mean; returns the examples kept."""
    if drop:  # the examples whose loss and every unit's ‖g‖² are finite
        by_example = per_unit[_of_kind(need, "norm")[0]].reshape(graph.n_examples, -1)
        finite = jnp.isfinite(losses) & jnp.all(jnp.isfinite(by_example), axis=1)
        keep = finite if keep is None else keep & finite
    units = None if keep is None else jnp.repeat(keep, graph.per_example)
    per_unit.update({w: _masked_units(units, w, x) for w, x in per_unit.items()})
    sq_norms = next((per_unit[w] for w in _of_kind(need, "norm")), None)
    env = _masked(graph, env, keep, [v for v in env if v in graph.batched])
    late = [w for w in need if _kind(w) not in ("norm", "weighted")] if drop else []
    results.update(_compute(plans, late, env))
    found, looped, _ = loop(_chunked_in(plans, late), keep)
    results.update(found)
    for w in _of_kind(late, *_PER_UNIT):
        per_unit[w] = _masked_units(units, w, _added(graph, results, looped, w))
    weighted = _of_kind(need, "weighted")  # by the clip factors
    if weighted:
        assert clip_norm is not None and sq_norms is not None
        factors = _clip_factors(sq_norms, clip_norm)
        factors = factors if units is None else _where_units(units, factors)
        weights = factors.reshape(graph.n_examples, graph.per_example)
        results.update(_compute(plans, weighted, env, weights))
        results.update(loop(_chunked_in(plans, weighted), keep, weights)[0])
    return keep


def _masked_units(units: Array | None, w: str, x: Array) -> Array:
    """A per-unit ingredient with 0 at the units not kept (a NaN there included)."""
    if units is None:
        return x
    if _kind(w) == "pairs":
        return jnp.where(units[:, None] & units[None, :], x, jnp.zeros((), x.dtype))
    return _where_units(units, x)


def _published(
    graph: Graph,
    stats: tuple[str, ...],
    need: Sequence[str],
    results: Mapping,
    per_unit: Mapping[str, Array],
    losses: Array,
    keep: Array | None,
    aux: PyTree,
) -> tuple[Float[Array, ""], Stats, PyTree]:
    """The mean loss, the statistics (each leaf's means in the parameters' structure) and aux;
    with `keep`, the means over the kept units: sums over them divided by N_eff, not N."""
    by_leaf = lambda w: [results[w, i] for i in range(len(graph.leaves))]  # noqa: E731
    means = {w: graph.param_tree.unflatten(by_leaf(w)) for w in need if _kind(w) not in _PER_UNIT}
    n_units: int | Array = graph.n_units
    if keep is None:
        loss = losses.mean()
    else:  # the sums above are over kept units, divided by all N
        kept = jnp.sum(keep)
        loss = _over(jnp.sum(jnp.where(keep, losses, 0.0)), kept)
        n_units = kept * graph.per_example
        scale = graph.n_units / n_units
        for w in _of_kind(list(means), "mean", "weighted"):  # (1/N) Σ over the kept units
            means[w] = jax.tree.map(lambda x: x * scale.astype(x.dtype), means[w])
    return loss.astype(stat_dtype(losses.dtype)), _publish(stats, means, per_unit, n_units), aux


# ============================================================================================
# §10 Routes. A route is a class whose `match` proves on the jaxpr the mathematics it uses for a
# leaf's gradient and returns an instance owning what it proved (its operands), or a Refusal
# saying why not. The instance computes the leaf's ingredients (§2) from values the batched
# head provides ("env": a leading axis B on batched values); `per_unit` gives one example's
# per-unit gradients [U, *leaf shape] for the chunk loop.


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a route does not apply. `kind=False`: the leaf is not of the route's kind at all
    (no entries to drop, a gradient that depends on the example, another core operation):
    `explain` leaves those out; the others say which proof failed."""

    reason: str
    kind: bool = True


Env = Mapping[Any, Any]  # graph variables -> values (batched ones with a leading axis B)
_DOT_WITH = "dot_with"  # env[_DOT_WITH]: the leaves of "dot"'s v (`_check_dot_with`)


@dataclasses.dataclass(frozen=True, eq=False)
class Route(abc.ABC):
    """One way to compute a leaf's statistics, proven for `leaf`; subclasses document their
    identities and hold the operands their `match` proved. Abstract: `match` (the proof),
    `reads`, `compute` (one factorized ingredient), `clipped` and `per_unit`. The rest is each
    route's unless it says otherwise: an ingredient of a kind in `KINDS` is factorized, the
    others chunked; ingredients are computed one at a time."""

    name: ClassVar[str]
    # The kinds of ingredient (§2) the route computes from its factors; the others it gives the
    # chunk loop, which forms per-unit gradients (`per_unit`).
    KINDS: ClassVar[frozenset[str]] = frozenset({"mean", "spread", "norm", "weighted"})
    graph: Graph = dataclasses.field(repr=False)
    leaf: Leaf = dataclasses.field(repr=False)
    reason: str  # what was proven (explain prints it)

    @classmethod
    @abc.abstractmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "Route | Refusal":
        """Recognise the pattern in `var` (default: the leaf's gradient) and prove every
        precondition the route's identities need, or say why not."""

    @property
    def dtype(self) -> jnp.dtype:  # the statistics'
        return self.leaf.stat_dtype

    @abc.abstractmethod
    def reads(self) -> list[Var]:
        """The head's values this route reads."""

    @abc.abstractmethod
    def compute(self, env: Env, what: str) -> Array:
        """One factorized ingredient: "sum"/"sq"/"sign" (means), "var", "norms" ([B, U])."""

    @abc.abstractmethod
    def clipped(self, env: Env, weights: Array) -> Array:
        """(1/N) Σ_u w_u g_u, with `weights` shaped [B, U]."""

    @abc.abstractmethod
    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        """One example's per-unit gradients [U, *leaf shape] (env without the axis B)."""

    def methods(self, need: tuple[str, ...]) -> dict[str, str]:
        """Per ingredient needed, "factorized" or "chunked" (`LeafPlan`)."""
        return {w: "factorized" if _kind(w) in self.KINDS else "chunked" for w in need}

    def compute_many(self, env: Env, wanted: Sequence[str]) -> dict[str, Array]:
        """The factorized ingredients `wanted` (a route may share work between them)."""
        return {what: self.compute(env, what) for what in wanted}


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class CoreRoute(Route):
    """A route reading the operands of its core, the gradient being `post` (layout,
    batch-independent scalings) after it. Norms factorize where every scaling is by a scalar
    (Π φ(m)² then multiplies ‖g_u‖²); else they are chunked, and so is the sum of a route
    that forms per-example gradients in the head (`FORMED`): once they exist, it is free.
    A route may form several ingredients together in the core's coordinates (`sums`,
    `core_sums`), then replay `post` on each (var(m·g) = m²·var(g); ‖post(g)‖² = Π φ(m)²·‖g‖²,
    the scalings being scalars where norms are factorized); the rest one at a time."""

    cores: ClassVar[frozenset[str]]  # the primitives its core may be (`plan` looks it up by)
    FORMED: ClassVar[tuple[str, ...]] = ()  # the ingredients formed per example in the head
    core: Eqn
    post: Posts

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "Route | Refusal":
        return cls.at_core(graph, leaf, *graph.core(leaf.grad if var is None else var))

    @classmethod
    def at_core(cls, graph: Graph, leaf: Leaf, core: Eqn | None, post: Posts) -> "Route | Refusal":
        """`prove`, where `core` is one of `cores` (`plan` finds a leaf's core once)."""
        if core is None or core.primitive.name not in cls.cores:
            return Refusal(f"the gradient's core is not a {' or '.join(sorted(cls.cores))}", False)
        return cls.prove(graph, leaf, core, post)

    @classmethod
    @abc.abstractmethod
    def prove(cls, graph: Graph, leaf: Leaf, core: Eqn, post: Posts) -> "Route | Refusal":
        """Prove every precondition the route's identities need of `core`, one of `cores`."""

    @property
    def scalar(self) -> bool:  # every scaling after the core is by a scalar
        return all(s.scalar for s in self.post)

    def methods(self, need: tuple[str, ...]) -> dict[str, str]:
        scalar = self.scalar  # else a norm's scaling does not move out of the sum over entries
        factored = lambda k: k in self.KINDS and (scalar or k not in ("norm", "pairs"))  # noqa: E731
        methods = {w: "factorized" if factored(_kind(w)) else "chunked" for w in need}
        looped = any(how == "chunked" and _kind(w) != "pairs" for w, how in methods.items())
        if self.FORMED and "sum" in methods and looped:  # (pairs: a loop of their own)
            methods["sum"] = "chunked"
        return methods

    def reads(self) -> list[Var]:
        return [v for v in (*self.core.invars, *_factor_vars(self.post)) if isinstance(v, Var)]

    def pulled(self, env: Env) -> Array:
        """The leaf's v of "dot" in the core's coordinates, postᵀ v: ⟨post(x), v⟩ = ⟨x, postᵀ v⟩
        (post is linear: layout ops and batch-independent scalings)."""
        v = env[_DOT_WITH][self.leaf.index]
        core = jax.ShapeDtypeStruct(_shape(self.core.outvars[0]), self.dtype)
        return jax.linear_transpose(lambda x: self.replay(x, env), core)(v)[0]

    def replay(self, x: Array, env: Env, phi: Phi = _PHI["sum"], units: bool = False) -> Array:
        """`post` applied to x in the core's coordinates (to each of its leading units)."""
        return (_replay_each if units else _replay)(self.post, x, env, phi)

    def chunk(self, operands: int, one: int, accelerator: bool = False) -> int:
        """Examples whose gradients (`one` numbers each) core_sums forms at once: as many as
        hold the `operands` numbers of the batch's operands — on an accelerator, or the batched
        values of the whole step if more (a chunk loop's iterations cost kernel launches
        there, memory on XLA:CPU: results/bench/gpu-time.md) — or the caller's bound."""
        graph, unit = self.graph, one * self.dtype.itemsize
        if accelerator:
            values = sum(math.prod(_shape(v)) for v in graph.batched) * graph.n_examples
            operands = max(operands, values)
        n, bound = graph.n_examples, max(1, operands // max(1, one))
        return _examples_per_chunk(n, unit, graph.chunk_size, graph.memory_budget, bound)

    def sums(self, wanted: Sequence[str]) -> Container[str]:
        """The ingredients `core_sums` forms, of those `wanted` together (none: each alone)."""
        return ()

    def core_sums(self, env: Env, dtype: DTypeLike, wanted: Sequence[str]) -> dict[str, Array]:
        """The means of φ and variance in the core's coordinates, norms [B]."""
        return {}

    def compute_many(self, env: Env, wanted: Sequence[str]) -> dict[str, Array]:
        sums = self.core_sums(env, self.dtype, [w for w in wanted if w in self.sums(wanted)])
        out = self.posted(sums, env)
        return {**out, **{w: self.compute(env, w) for w in wanted if w not in out}}

    def posted(self, core: Mapping[str, Array], env: Env) -> dict[str, Array]:
        """`post` replayed on sums in the core's coordinates (here or after a scan: InScan)."""
        sq = lambda w, g: g[:, None] * _scale_sq(self.post, env, self.dtype)  # noqa: E731
        replay = lambda w, g: self.replay(g, env, _REPLAY[w])  # noqa: E731
        posted = {"norm": sq, "inner": lambda w, g: g}  # ⟨g, postᵀv⟩: post is in v
        return {w: posted.get(_kind(w), replay)(w, g) for w, g in core.items()}


def _operands(core: Eqn, env: Env, dtype: DTypeLike, tie: bool) -> tuple[Array, Array]:
    """The core's two batched factors in `dtype`; with `tie`, the second made to depend on the
    first. x exists from the forward pass, δ only in the backward pass: left alone, XLA makes
    φ(x), or the copy of x a product batched over examples reads, in the forward pass and holds
    it until the backward pass (an extra activation per layer); adding zero times one entry of
    each example's δ makes it wait for δ: both live only around their product, and a NaN stays
    in its example (a barrier there measured costlier on XLA:CPU). Untied: clipping, keeping every
    factor until all norms are known; convolutions, rank-one norms and variance (measured)."""
    a, b = (_read(env, v).astype(dtype) for v in core.invars[:2])
    if tie and a.size:
        b = b + a.reshape(len(a), -1)[:, 0].reshape(-1, *[1] * (b.ndim - 1)) * 0.0
    return a, b


def _formed_sums(
    route: CoreRoute,
    form: Callable[[Array, Array, list[str], Array | int], list],
    unit: int,
    env: Env,
    dtype: DTypeLike,
    wanted: Sequence[str],
    in_leaf: tuple[Callable, Callable[[dict], dict], Callable[[dict], dict]] | None = None,
) -> dict[str, Array]:
    """Ingredients from per-example gradients formed c examples at a time (one scan over
    chunks; c examples' `unit` numbers formed at once hold at most as many numbers as the
    operands, or the caller's bound; on a GPU or TPU all at once, without a loop, where they
    hold no more than the step's batched values — `CoreRoute.chunk`): (1/N) Σ_i φ(g_i) for
    "sum", "sq", "sign"; the variance
    Σ_i (g_i − ḡ)²/(N − 1) for "var", each chunk's (mean, M2) merged by Chan's update (no
    cancellation); ‖g_i‖² ([B]) for "norms". form(a, b, names, r) gives, for a chunk's operands
    of which the first r are examples, what `_moments` gives. Padding examples have zero
    operands: the core is bilinear, so g = 0 and φ(0) = 0; norms are cut off. With `in_leaf` =
    (leaf_form, posted, leaf_posted) they come back in the leaf's layout: formed at once, from
    each example's gradient in it (leaf_form; XLA:GPU fuses the layout into the reductions,
    where a transpose of each sum was a kernel: the Flax list, results/bench/gpu-time.md)."""
    n = route.graph.n_examples
    names = _of_kind([w for w in _INGREDIENT if w in wanted], "mean", "spread", "norm", "inner")
    a, b = _operands(route.core, env, dtype, tie=route.core.primitive.name == "dot_general")
    c, whole = (route.chunk(a.size + b.size, unit, accelerator) for accelerator in (False, True))
    same = lambda found: found  # noqa: E731
    leaf_form, posted, leaf_posted = in_leaf or (form, same, same)
    chunked = lambda: posted(_chunked_sums(form, a, b, c, names, dtype, n))  # noqa: E731
    if whole == n:  # no loop on an accelerator: the batch's gradients formed at once, untied
        untied = lambda: _operands(route.core, env, dtype, tie=False)  # noqa: E731
        one = lambda: leaf_posted(_sums_of(leaf_form(*untied(), names, n), names, n))  # noqa: E731
        # both traced, one lowered: the chunk loop on XLA:CPU (the tests' flag: the other)
        return one() if _AS_ON_ACCELERATOR else jax.lax.platform_dependent(cpu=chunked, default=one)
    return chunked()


_AS_ON_ACCELERATOR = False  # tests set it: XLA:CPU then runs what a GPU or TPU would


def _sum_rows(x: Array) -> Array:
    """`_sum0` as one primitive lowered per platform: on XLA:CPU x of at most 2¹⁵ entries (a
    bias's rows: as fast either way) one reduction, slices only growing the program; GPU: halves."""
    if _devices(x) > 1 or any(jax.typeof(x).sharding.spec):
        return _sum0(x)  # on a mesh
    return _sum_halves(x) if _AS_ON_ACCELERATOR else _SUM0.bind(x)  # (the tests' flag: a GPU's)


def _sum_halves(x: Array) -> Array:
    """`_sum0` on a GPU: up to 32 rows by halves, x[:h] + x[h:2h] (an odd row after), 2·log₂ c
    slices fused into the loop making x as `_sum0`'s c are (XLA:TPU's kernels: more)."""
    if not 1 < x.shape[0] <= 32:
        return _sum0(x)
    h = x.shape[0] // 2
    half = _sum_halves(x[:h] + x[h : 2 * h]) if h > 1 else x[0] + x[1]
    return half + x[2 * h] if x.shape[0] % 2 else half


_SUM0 = jcore.Primitive("pegrad_sum0")
_SUM0.def_impl(_sum0)
_SUM0.def_abstract_eval(lambda aval: aval.update(shape=aval.shape[1:]))
batching.primitive_batchers[_SUM0] = lambda xs, dims: (jax.vmap(_sum0, dims)(*xs), 0)
ad.deflinear2(_SUM0, lambda ct, x: [jnp.broadcast_to(ct, x.aval.shape)])
mlir.register_lowering(_SUM0, mlir.lower_fun(_sum0, multiple_results=False))  # XLA:TPU: pairs
for _gpu in ("cuda", "rocm"):
    mlir.register_lowering(_SUM0, mlir.lower_fun(_sum_halves, multiple_results=False), _gpu)
_cpu_sum0 = lambda x: jnp.sum(x, 0) if x.size <= 2**15 else _sum0(x)  # noqa: E731
mlir.register_lowering(_SUM0, mlir.lower_fun(_cpu_sum0, multiple_results=False), platform="cpu")


def _cpu_barrier(tree: PyTree) -> PyTree:
    """An optimization barrier where XLA:CPU lowers the program, none on a GPU or TPU: one
    primitive lowered per platform, whose JVP and transpose barrier tangents as JAX's does."""
    leaves, treedef = jax.tree.flatten(tree)
    return tree if _AS_ON_ACCELERATOR else treedef.unflatten(_CPU_BARRIER.bind(*leaves))


_CPU_BARRIER = jcore.Primitive("pegrad_cpu_barrier")
_CPU_BARRIER.multiple_results = True
_CPU_BARRIER.def_impl(lambda *xs: list(xs))
_CPU_BARRIER.def_abstract_eval(lambda *avals: list(avals))
batching.primitive_batchers[_CPU_BARRIER] = lambda xs, dims: (_CPU_BARRIER.bind(*xs), dims)
_held = lambda ts: _CPU_BARRIER.bind(*map(ad.instantiate_zeros, ts))  # noqa: E731
ad.primitive_jvps[_CPU_BARRIER] = lambda xs, ts: (_CPU_BARRIER.bind(*xs), _held(ts))
ad.primitive_transposes[_CPU_BARRIER] = lambda cts, *xs: _held(cts)
mlir.register_lowering(_CPU_BARRIER, lambda ctx, *xs: list(xs))
_barrier_op = lambda ctx, *xs: stablehlo.OptimizationBarrierOp(list(xs)).results  # noqa: E731
mlir.register_lowering(_CPU_BARRIER, _barrier_op, platform="cpu")


def _sums_of(out: list, names: Sequence[str], n: int) -> dict[str, Array]:
    """What `_moments` gives (for all n examples, or summed and merged over chunks), as
    `_formed_sums` returns it."""
    means = [w for w in names if w in _PHI]
    found = {w: t * (1.0 / n) for w, t in zip(means, out[: len(means)], strict=True)}
    for w in _of_kind(names, "spread"):
        found[w] = out[len(means) + 1] * (1.0 / (n - 1))  # M2 / (N − 1)
    rows = _of_kind(names, "norm", "inner")  # per example, last
    return found | dict(zip(rows, out[len(out) - len(rows) :], strict=True))


def _chunked_sums(
    form: Callable, a: Array, b: Array, c: int, names: list[str], dtype: DTypeLike, n: int
) -> dict[str, Array]:
    """`_formed_sums` c examples at a time: one scan over chunks, padded to a multiple of c; on
    a mesh of devices one scan per group of examples (`_groups`: each device its own), the
    groups' sums added and their moments merged by Chan's update."""
    var = bool(_of_kind(names, "spread"))
    groups = _groups((a, b), n)
    if groups == 1:
        sums, moments, norms = _scan_sums(form, a, b, c, names, dtype, n)
    else:
        split = lambda x: x.reshape(groups, n // groups, *x.shape[1:])  # noqa: E731
        each = -(-c // groups), names, dtype, n // groups
        sums, parts, norms = jax.vmap(lambda x, y: _scan_sums(form, x, y, *each))(
            split(a), split(b)
        )
        sums = [jnp.sum(t, 0) for t in sums]
        moments = ()
        if var:
            count, mean, m2 = moments = _chan_over(parts)
            if "sum" in names:  # Σ g = N·ḡ, the merge's: one all-reduce fewer
                sums[[w for w in names if w in _PHI].index("sum")] = count * mean
        norms = [x.reshape(n) for x in norms]
    return _sums_of([*sums, *list(moments)[1:], *norms], names, n)  # (count,) mean, M2


def _scan_sums(
    form: Callable, a: Array, b: Array, c: int, names: list[str], dtype: DTypeLike, n: int
) -> tuple[list, tuple, list]:
    """`_chunked_sums` on one device: the k sums, (count, mean, M2) and the per-row norms."""
    k, var = sum(w in _PHI for w in names), bool(_of_kind(names, "spread"))
    pad = -n % c
    a, b = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (a, b))
    counts = jnp.minimum(c, n - c * jnp.arange((n + pad) // c)).astype(dtype)
    one = jnp.ones((), dtype)
    shapes = jax.eval_shape(lambda x, y: form(x, y, names, one), a[:c], b[:c])

    def chunk(carry: tuple, xs: tuple[Array, Array, Array]) -> tuple[tuple, list]:
        sums, moments = carry
        x, y, r = xs
        out = form(x, y, names, r)
        sums = [t + s for t, s in zip(sums, out[:k], strict=True)]
        if var:
            moments = _chan(moments, (r, out[k], out[k + 1]))
        return (sums, moments), out[k + 2 * var :]

    split = lambda x: x.reshape(-1, c, *x.shape[1:])  # noqa: E731
    zero = lambda s: jnp.zeros(s.shape, dtype)  # noqa: E731
    sums = [zero(s) for s in shapes[:k]]
    moments: tuple[Array, ...] = ()
    if var:
        moments = (jnp.zeros((), dtype), zero(shapes[k]), zero(shapes[k + 1]))
    init = _varying_as((sums, moments), (a, b))
    (sums, moments), norms = jax.lax.scan(chunk, init, (split(a), split(b), counts))
    return sums, moments, [x.reshape(-1)[:n] for x in norms]  # padding cut off


def _moments(g: Array, names: Sequence[str], r: Array | int, v: Array | None = None) -> list[Array]:
    """For per-example values g [c, ...] whose first r rows are examples (the rest padding):
    Σ φ(g) per mean in `names`; the mean and M2 over the r examples for "var" (the padding
    left out, not subtracted); per row, the norms for "norms" and ⟨g, v⟩ for "dot"."""
    out = [_sum_rows(_PHI[w](g)) for w in names if w in _PHI]
    if _of_kind(names, "spread"):
        mean = _sum_rows(g) / r
        centred = g - mean  # with padding rows (r traced), those rows left out
        if not isinstance(r, int):  # (a `where` XLA:GPU would materialize g for)
            centred = _where_units(jnp.arange(g.shape[0], dtype=r.dtype) < r, centred)
        out += [mean, _sum_rows(centred * centred)]
    for w in _of_kind(names, "norm", "inner"):
        x = g if _kind(w) == "norm" else v
        assert x is not None  # "dot" is asked with its v
        out.append(jnp.sum(g * x, axis=tuple(range(1, g.ndim))))
    return out


def _units_layout(x: Array, batch: Sequence[int], units: Sequence[int]) -> Array:
    """[B, ...] -> [B, U, nb, f]: units, batch dims (in order), free dims (in order)."""
    batch1, units1 = _shift(batch), _shift(units)
    free1 = tuple(d for d in range(1, x.ndim) if d not in batch1 + units1)
    x = jnp.transpose(x, (0, *units1, *batch1, *free1))
    nu = math.prod(x.shape[1 : 1 + len(units1)])
    nb = math.prod(x.shape[1 + len(units1) : 1 + len(units1) + len(batch1)])
    return x.reshape(x.shape[0], nu, nb, -1)


class Empty(Route):
    """A leaf with no entries: every statistic is an empty array."""

    name = "empty"
    KINDS = _ALL_KINDS

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "Empty | Refusal":
        return (
            Refusal("the leaf has entries", False) if leaf.size else cls(graph, leaf, "no entries")
        )

    def reads(self) -> list[Var]:
        return []

    def compute(self, env: Env, what: str) -> Array:
        if _kind(what) in _PER_UNIT:
            n = self.graph.n_units
            return jnp.zeros((n, n) if _kind(what) == "pairs" else (n,), self.dtype)
        return jnp.zeros(self.leaf.shape, self.dtype)

    def clipped(self, env: Env, weights: Array) -> Array:
        return jnp.zeros(self.leaf.shape, self.dtype)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        return jnp.zeros((self.graph.per_example, *self.leaf.shape), self.dtype)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Constant(Route):
    """The gradient does not depend on the example: g_u = g for every unit, so every mean is
    φ(g), the variance is 0 and each unit's norm is ‖g‖². At token granularity only a proven
    zero gradient (an unused parameter) splits over positions."""

    name = "constant"
    KINDS = _ALL_KINDS
    grad: Atom

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "Constant | Refusal":
        var = leaf.grad if var is None else var
        if graph.is_batched(var):
            return Refusal("the gradient depends on the example", kind=False)
        if graph.weighted:
            return Refusal("a mask weighs the examples: the gradient is taken per example")
        if graph.token and not graph.is_zero(var):
            return Refusal("an example-independent gradient has no per-position split")
        if graph.token:
            return cls(graph, leaf, "unused: the gradient is 0", grad=var)
        return cls(graph, leaf, "the gradient does not depend on the example", grad=var)

    def reads(self) -> list[Var]:
        return [self.grad] if isinstance(self.grad, Var) else []

    def _g(self, env: Env) -> Array:
        g = jnp.asarray(_read(env, self.grad)).astype(self.dtype)
        return jnp.broadcast_to(g, self.leaf.shape)

    def compute(self, env: Env, what: str) -> Array:
        g, n = self._g(env), self.graph.n_units
        if _kind(what) in ("norm", "pairs"):  # ⟨g, g⟩ for every unit and pair of units
            return jnp.full((n,) * (1 + (_kind(what) == "pairs")), jnp.sum(g * g))
        if _kind(what) == "inner":
            return jnp.full((n,), jnp.sum(g * env[_DOT_WITH][self.leaf.index]))
        return jnp.zeros_like(g) if _kind(what) == "spread" else _PHI[what](g)

    def clipped(self, env: Env, weights: Array) -> Array:
        return self._g(env) * (jnp.sum(weights) / self.graph.n_units).astype(self.dtype)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        return jnp.broadcast_to(self._g(env), (self.graph.per_example, *self.leaf.shape))


def _gauge(a: Array, b: Array) -> tuple[Array, Array]:
    """Rank-one factors [N, nb, f] rescaled, a_u s_u and b_u / s_u (the same outer products),
    so that every nonzero b_u has unit norm and a sign aligned with the b_u of largest norm:
    units whose outer products nearly agree get factors that nearly agree."""
    norm = jnp.sqrt(jnp.sum(b * b, -1, keepdims=True))  # [N, nb, 1]
    largest = jnp.take_along_axis(b, jnp.argmax(norm, 0, keepdims=True), 0)  # [1, nb, f]
    sign = jnp.where(jnp.sum(b * largest, -1, keepdims=True) < 0, -1.0, 1.0).astype(b.dtype)
    nonzero = norm > 0
    return a * jnp.where(nonzero, sign * norm, 0.0), b * jnp.where(nonzero, sign / norm, 0.0)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class OuterProduct(CoreRoute):
    """Rank one per unit: the core is dot_general(a, b) of two example-dependent factors that
    contracts nothing but the unit axes — no axis at example granularity (a dense weight used
    once: g_i = δ_i ⊗ x_i), exactly the traced position axis at token granularity (a weight
    used at every position: g_t = δ_t ⊗ x_t). With u over units (and each batch-dim slice):

        Σ_u φ(a_u ⊗ b_u) = φ(A)ᵀφ(B)     ‖a_u ⊗ b_u‖² = ‖a_u‖²‖b_u‖²     Σ_u c_u a_u ⊗ b_u = (c∘A)ᵀB
        Σ_u (a_u ⊗ b_u − ḡ)² from centred factors A = ā + Ã, B = b̄ + B̃ (no cancellation),
            with K = ÃᵀB̃ (so ḡ = ā⊗b̄ + K/N) and P = Ã∘(Ã + 2ā) = A² − ā², Q likewise:
            ā²⊗ΣB̃² + ΣÃ²⊗b̄² + PᵀQ − 2(ā⊗b̄)∘K − K²/N       (two contractions over units)

    The factors are unique up to a scalar per unit (a_u s_u ⊗ b_u / s_u): before centring,
    each b_u is scaled to unit norm, its sign aligned with the largest b_u's (`_gauge`), so
    that nearly equal gradients have nearly equal factors and the centred factors are small
    where the variance is (W x and c·x giving one gradient would else cancel O(1) terms)."""

    name = "outer-product"
    KINDS = _ALL_KINDS
    cores = frozenset({"dot_general"})
    # The operands' contracted axes that index units besides the example, whose units
    # clipping weighs (none for a contraction, which shares `core_sum` and `clipped`).
    units: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @classmethod
    def prove(cls, graph: Graph, leaf: Leaf, core: Eqn, post: Posts) -> "OuterProduct | Refusal":
        a, b = core.invars
        if not (graph.is_batched(a) and graph.is_batched(b)):
            return Refusal("a factor of the dot_general does not depend on the example")
        lc, rc, _, _ = _dot_dims(core)
        # An axis of size 1 (a model called on x[None]) sums one term: it is no position.
        summed = [k for k, d in enumerate(lc) if _shape(a)[d] != 1]
        if not graph.token and summed:
            return Refusal(f"the dot_general sums {len(summed)} axes per example (not rank one)")
        if not graph.token:
            reason = "dense weight used once per example: g_i = δ_i ⊗ x_i"
            return cls(graph, leaf, reason, core=core, post=post, units=(lc, rc))
        if len(summed) != 1:
            return Refusal(f"sums {len(summed)} axes; a per-token term sums one (positions)")
        (k,) = summed
        if lc[k] not in graph.position_axes(a) or rc[k] not in graph.position_axes(b):
            return Refusal("the contracted axes are not both traced to the example's positions")
        reason = "weight at every position: g_t = δ_t ⊗ x_t over the traced position axis"
        return cls(graph, leaf, reason, core=core, post=post, units=((lc[k],), (rc[k],)))

    def sums(self, wanted: Sequence[str]) -> Container[str]:
        return _of_kind(list(_INGREDIENT), "mean", "spread")

    def core_sums(self, env: Env, dtype: DTypeLike, wanted: Sequence[str]) -> dict[str, Array]:
        spread = {w: self._variance(env) for w in _of_kind(wanted, "spread")}
        found = {w: self.core_sum(env, dtype, w) for w in wanted if w in _PHI}
        if spread and "sum" in found and _devices(_read(env, self.core.invars[0])) > 1:
            # on a mesh ḡ = ā⊗b̄ + K/N from the variance's contractions: one all-reduce fewer
            found["sum"] = next(iter(spread.values()))[1]
        return found | {w: var for w, (var, _) in spread.items()}

    def core_sum(
        self, env: Env, dtype: DTypeLike, what: str, weights: Array | None = None
    ) -> Array:
        """(1/N) Σ_u φ(a_u ⊗ b_u) in the core's coordinates (before `post`), as one
        dot_general contracting the examples and the unit axes (φ = identity when `weights`
        [B, U] scale the units): per slice of the dot's batch dims, so that it can also be
        formed one scan iteration at a time (InScan)."""
        phi = _PHI[what]
        a, b = _operands(self.core, env, dtype, tie=weights is None)
        a = phi(a)
        if weights is not None:  # [B, U] broadcast against a's unit axes
            shape = [len(a)] + [1] * (a.ndim - 1)
            for k in self.units[0]:
                shape[k + 1] = weights.shape[1]
            a = a * weights.astype(dtype).reshape(shape)
        dn = _over_examples(*_dot_dims(self.core))
        n = self.graph.n_units
        return jax.lax.dot_general(a * (1.0 / n), phi(b), dn, preferred_element_type=dtype)

    def clipped(self, env: Env, weights: Array) -> Array:
        return self.replay(self.core_sum(env, self.dtype, "sum", weights), env)

    def compute(self, env: Env, what: str) -> Array:  # norms; the variance for core_sums
        dtype = self.dtype
        lc, rc, lb, rb = _dot_dims(self.core)
        a, b = _operands(self.core, env, dtype, tie=False)
        ua, ub = self.units
        A, B = _units_layout(a, lb, ua), _units_layout(b, rb, ub)  # [B, U, nb, f]
        if _kind(what) == "norm":
            norms = jnp.sum(jnp.sum(A * A, -1) * jnp.sum(B * B, -1), -1)  # [B, U]
            return norms * _scale_sq(self.post, env, dtype)
        if _kind(what) == "inner":  # a_uᵀ V b_u per batch-dim slice, V = postᵀ v
            V = self.pulled(env).reshape(A.shape[2], A.shape[3], B.shape[3])
            return jnp.einsum("bunf,nfg,bung->bu", A, V, B, preferred_element_type=dtype)
        if _kind(what) == "pairs":  # ⟨a_u ⊗ b_u, a_w ⊗ b_w⟩ = ⟨a_u, a_w⟩⟨b_u, b_w⟩ per slice
            gram = lambda x: jnp.einsum("unf,wnf->nuw", x, x)  # noqa: E731
            pairs = jnp.sum(gram(_merge01(A)) * gram(_merge01(B)), 0)  # [N, N]
            return pairs * _scale_sq(self.post, env, dtype)
        return self._variance(env)[0]

    def _variance(self, env: Env) -> tuple[Array, Array]:
        """The variance and the mean ā⊗b̄ + K/N, in core coordinates."""
        dtype, n = self.dtype, self.graph.n_units
        lc, rc, lb, rb = _dot_dims(self.core)
        a, b = _operands(self.core, env, dtype, tie=False)
        ua, ub = self.units
        A, B = _units_layout(a, lb, ua), _units_layout(b, rb, ub)  # [B, U, nb, f]
        A, B = _gauge(_merge01(A), _merge01(B))  # [N, nb, f], the variance in core coordinates
        abar, bbar = jnp.mean(A, 0), jnp.mean(B, 0)
        Ac, Bc = A - abar, B - bbar

        def outer(x: Array, y: Array) -> Array:
            return jnp.einsum("unf,ung->nfg", x, y, preferred_element_type=dtype)

        # Every scalar (1/(N−1) too) rides on a small factor, and a total that rounding left
        # just below 0 is folded back by |·| (as close to the truth as max(·, 0)): XLA:CPU fuses
        # all this into the two dots and gives each scalar operand of the fusion a buffer of
        # the weight's size (three scalars were three weight-sized buffers).
        s = 1.0 / (n - 1)
        Kt = outer(Ac * math.sqrt(s / n), Bc)  # K/√(N(N−1)): its square is K²/N/(N−1)
        a_, b_ = abar[:, :, None], bbar[:, None, :]
        total = (
            (a_ * a_ * s) * jnp.sum(Bc * Bc, 0)[:, None, :]
            + (jnp.sum(Ac * Ac, 0) * s)[:, :, None] * (b_ * b_)
            + outer(Ac * (Ac + 2.0 * abar) * s, Bc * (Bc + 2.0 * bbar))
            - (a_ * (2.0 * math.sqrt(n * s))) * b_ * Kt
            - Kt * Kt
        )
        dot = lambda x, y: jax.lax.dot_general(x, y, ((lc, rc), (lb, rb)))  # noqa: E731
        shape = jax.eval_shape(dot, a[0], b[0]).shape  # a scan's slice
        mean = a_ * b_ + Kt * math.sqrt((n - 1) / n)  # K/N
        return jnp.abs(total).reshape(shape), mean.reshape(shape)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        a, b = (_read(env, v).astype(self.dtype) for v in self.core.invars[:2])
        lc, rc, lb, rb = _dot_dims(self.core)
        if not self.graph.token:  # what it contracts are axes of size 1
            g = jax.lax.dot_general(a, b, ((lc, rc), (lb, rb)))[None]
        else:  # the position axis becomes a batch axis: one outer product per position
            (ua,), (ub,) = self.units
            ones = ([d for d in lc if d != ua], [d for d in rc if d != ub])  # size 1
            g = jax.lax.dot_general(a, b, (ones, ((ua, *lb), (ub, *rb))))
        return self.replay(g, env, units=True)


class Contraction(CoreRoute):
    """A dense weight applied at several places per example (example granularity): the core
    contracts K terms, g_i = Σ_k a_ik ⊗ b_ik. Linear ingredients contract over examples too:
    Σ_i g_i = AᵀB over (i, k); so does clipping, (c∘A)ᵀB. Non-linear φ (sq, sign), the variance
    and norms have no such identity: per-example gradients are formed a bounded chunk at a time
    right where the head has the operands, so that they die where plain grad's do; the variance
    from each chunk's centred (mean, M2), merged by Chan's update (SPEC §3: never q − ḡ²); the sum
    comes with them. Norms alone (beside clipping, whose weights wait for every norm) take the
    Gram identity ‖Σ_k a_k ⊗ b_k‖² = ⟨AAᵀ, BBᵀ⟩ where it takes fewer products (K(a + b) < ab),
    with rounding error ~ε·K·(Σ_k ‖a_k‖‖b_k‖)², not ε‖g_i‖², where an example's terms cancel (SPEC
    §3); after a non-scalar scaling, in the chunk loop."""

    name = "contraction"
    KINDS = _ALL_KINDS
    FORMED: ClassVar[tuple[str, ...]] = _FORMED  # formed per example in the head
    cores = frozenset({"dot_general"})
    units: ClassVar[tuple[tuple[int, ...], tuple[int, ...]]] = ((), ())
    core_sum = OuterProduct.core_sum  # Σ_i g_i = AᵀB over (i, k); clipping (c∘A)ᵀB
    clipped = OuterProduct.clipped

    @classmethod
    def prove(cls, graph: Graph, leaf: Leaf, core: Eqn, post: Posts) -> "Contraction | Refusal":
        if graph.token:
            return Refusal("per-token terms are rank one (outer-product) or not split")
        a, b = core.invars
        if not (graph.is_batched(a) and graph.is_batched(b)):
            return Refusal("a factor of the dot_general does not depend on the example")
        lc, _, _, _ = _dot_dims(core)
        if not lc:
            return Refusal("the dot_general sums nothing (rank one: outer-product)")
        terms = math.prod(_shape(a)[k] for k in lc)
        if terms == 1:
            return Refusal("the dot_general sums one term (rank one: outer-product)")
        reason = f"weight applied at {terms} places: g_i = Σ_k δ_k ⊗ x_k"
        return cls(graph, leaf, reason, core=core, post=post)

    def gram(self, ingredients: Container[str]) -> bool:
        """Norms by the Gram identity: nothing else forms this leaf's per-example gradients
        (no sum, sq, sign or var beside them) and the Grams take fewer products than a gradient."""
        lc, _, lb, rb = _dot_dims(self.core)
        a, b = (_shape(v) for v in self.core.invars)
        terms = math.prod(a[k] for k in lc)  # K
        free_a = math.prod(a) // (terms * math.prod(a[k] for k in lb))
        free_b = math.prod(b) // (terms * math.prod(b[k] for k in rb))
        beside = _of_kind([w for w in _INGREDIENT if w in ingredients], "mean", "spread", "inner")
        return not beside and terms * (free_a + free_b) < free_a * free_b

    def forms(self, ingredients: Container[str]) -> bool:
        """Whether core_sums forms per-example gradients for these ingredients: for a non-linear
        φ, the variance or norms (not by Grams), or ⟨g_i, v⟩ beside the sum (one formation
        against two contractions; ⟨g_i, v⟩ alone is one contraction, `compute`)."""
        formed = [w for w in self.FORMED if w in ingredients]
        if not formed or self.gram(ingredients):
            return False
        return "sum" in ingredients or any(_kind(w) != "inner" for w in formed)

    def core_sums(
        self, env: Env, dtype: DTypeLike, wanted: Sequence[str], posted: bool = False
    ) -> dict[str, Array]:
        """sq, sign, var, norms and ⟨g_i, v⟩ from per-example gradients formed a bounded chunk
        at a time (`_formed_sums`), which give the sum too (`forms`); norms alone by the Gram
        identity, ⟨g_i, v⟩ alone by one contraction. `posted`: the formed ones `post`ed (in the
        leaf's layout: on an accelerator each example's gradient is replayed before φ)."""
        if _of_kind(wanted, "norm") and self.gram(wanted):
            return {w: self.compute(env, w) for w in wanted}
        if not self.forms(wanted):
            sums = {w: self.core_sum(env, dtype, w) for w in wanted if w in _PHI}
            return sums | {w: self.compute(env, w) for w in _of_kind(wanted, "inner")}
        inner = _of_kind(wanted, "inner")
        v = self.pulled(env) if inner else None

        def form(a: Array, b: Array, names: list[str], r: Array | int) -> list:
            return _moments(self.gradients(a, b), names, r, v)

        def leaf_form(a: Array, b: Array, names: list[str], r: Array | int) -> list:
            u = env[_DOT_WITH][self.leaf.index].astype(dtype) if inner else None
            return _moments(self.replay(self.gradients(a, b), env, units=True), names, r, u)

        leaf = (
            leaf_form,
            lambda found: self.posted(found, env),
            lambda found: {w: x[:, None] if _kind(w) == "norm" else x for w, x in found.items()},
        )
        unit = self.formed_unit()
        return _formed_sums(self, form, unit, env, dtype, wanted, leaf if posted else None)

    def compute_many(self, env: Env, wanted: Sequence[str]) -> dict[str, Array]:
        n, pairs = self.graph.n_examples, _of_kind(wanted, "pairs")
        a, b = _operands(self.core, env, self.dtype, tie=False)
        if pairs and self.chunk(a.size + b.size, self.formed_unit(), accelerator=True) >= n:
            # J formed once for J Jᵀ (one block, `compute`): the rest read off it, not the
            # sum's weight-gradient matmul beside it (mean + gram: results/bench/inner-products.md)
            g = self.gradients(a, b)
            names = [w for w in _INGREDIENT if w in wanted and w in self.sums(wanted)]
            v = self.pulled(env) if _of_kind(names, "inner") else None
            found = self.posted(_sums_of(_moments(g, names, n, v), names, n), env)
            flat = g.reshape(n, -1)
            found |= dict.fromkeys(pairs, flat @ flat.T * _scale_sq(self.post, env, self.dtype))
            return found | {w: self.compute(env, w) for w in wanted if w not in found}
        formed = [w for w in wanted if w in self.sums(wanted)]
        if not self.forms(formed) or _of_kind(formed, "norm") and self.gram(formed):
            return super().compute_many(env, wanted)
        found = self.core_sums(env, self.dtype, formed, posted=True)
        return found | {w: self.compute(env, w) for w in wanted if w not in found}

    def sums(self, wanted: Sequence[str]) -> Container[str]:
        return _of_kind(list(_INGREDIENT), "mean", "spread", "norm", "inner")

    def gradients(self, a: Array, b: Array) -> Array:
        """Per-example gradients in the core's coordinates, [c, …], of c examples' operands."""
        lc, rc, lb, rb = _dot_dims(self.core)
        return jax.vmap(lambda x, y: jax.lax.dot_general(x, y, ((lc, rc), (lb, rb))))(a, b)

    def formed_unit(self) -> int:
        """Numbers of one example's gradient core_sums forms at once."""
        return math.prod(_shape(self.core.outvars[0]))

    def compute(self, env: Env, what: str) -> Array:
        """Norms for core_sums by the Gram identity, [B] before `post`; ⟨g_i, v⟩ = Σ_k a_kᵀ V b_k
        (V = postᵀ v: one contraction, as the weight gradient's)."""
        lc, rc, lb, rb = _dot_dims(self.core)
        a, b = _operands(self.core, env, self.dtype, tie=True)
        ga, gb = _units_layout(a, lb, lc), _units_layout(b, rb, rc)  # [B, terms, nb, free]
        if _kind(what) == "inner":
            V = self.pulled(env).reshape(ga.shape[2], ga.shape[3], gb.shape[3])
            return jnp.einsum("bknf,nfg,bkng->b", ga, V, gb, preferred_element_type=self.dtype)
        if _kind(what) == "pairs":  # J Jᵀ from per-example gradients, blocks of two chunks
            a, b = _operands(self.core, env, self.dtype, tie=False)
            c = self.chunk(a.size + b.size, self.formed_unit(), accelerator=True)
            grads_of = lambda xs: [self.gradients(*xs)]  # noqa: E731
            pairs = _pairs(grads_of, (a, b), self.graph.n_examples, c)
            return pairs * _scale_sq(self.post, env, self.dtype)
        assert _kind(what) == "norm"
        gram = lambda x: jnp.einsum("bsnf,btnf->bnst", x, x)  # noqa: E731
        return jnp.sum(gram(ga) * gram(gb), axis=(1, 2, 3))

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        a, b = (_read(env, v).astype(self.dtype) for v in self.core.invars[:2])
        lc, rc, lb, rb = _dot_dims(self.core)
        return self.replay(jax.lax.dot_general(a, b, ((lc, rc), (lb, rb))), env)[None]


_MAX_CONV_DOTS = 256  # output positions of a per-example convolution formed as one dot each


def _conv_positions(core: Eqn) -> tuple[int, ...]:
    """The spatial sizes of a convolution's output: its positions."""
    _, _, out_spec = core.params["dimension_numbers"]
    return tuple(_shape(core.outvars[0])[d] for d in out_spec[2:])


def _conv_offsets(
    lhs: Array, rhs: Array, params: Mapping, dtype: DTypeLike, reduce: Callable
) -> list[Array]:
    """conv_general_dilated(lhs_e, rhs_e, **params) for each example e of [E, ...] operands,
    one output position k at a time (a scan), each position's [E, n, o] values passed through
    `reduce` (to a list of arrays) before the next is formed: out[n, o, k] = Σ_{c, q}
    lhs_pd[n, c, k·s + q·r] · rhs[o, c, q] (lhs_pd padded and dilated, s the strides, r the
    kernel dilation) is one dot_general batched over examples (and groups). For a kernel's
    gradient k runs over the kernel's offsets: few steps, one offset's per-example values live
    at a time (a batched convolution is a grouped one, far slower on XLA:CPU, and forms all of
    them). Returns the reduced values stacked over positions (`_conv_layout` places them)."""
    lhs_spec, rhs_spec, _ = params["dimension_numbers"]
    lhs = jnp.transpose(lhs, (0, *_shift(lhs_spec)))  # [E, N, C, *S]
    rhs = jnp.transpose(rhs, (0, *_shift(rhs_spec)))  # [E, O, I, *W]
    config = [(0, 0, 0)] * 3
    pads = zip(params["padding"], params["lhs_dilation"], strict=True)
    config += [(lo, hi, d - 1) for (lo, hi), d in pads]
    lhs = jax.lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
    e, n, _, *size = lhs.shape
    _, o, i, *window = rhs.shape
    strides, dilation = params["window_strides"], params["rhs_dilation"]
    reach = [(w - 1) * r + 1 for w, r in zip(window, dilation, strict=True)]
    out = tuple((m - w) // s + 1 for m, w, s in zip(size, reach, strides, strict=True))
    groups, batch_groups = params["feature_group_count"], params["batch_group_count"]
    n_groups, per_group = groups * batch_groups, n // batch_groups  # at most one above 1
    # lhs -> [E, groups, n', I, *S] and rhs -> [E, groups, o', I, *W]
    lhs = lhs.reshape(e, batch_groups, per_group, groups, i, *size)
    lhs = jnp.moveaxis(lhs, 3, 2).reshape(e, n_groups, per_group, i, *size)
    rhs = rhs.reshape(e, n_groups, o // n_groups, i, *window)
    contract = tuple(range(3, rhs.ndim))

    def position(_: None, k: Array) -> tuple[None, list[Array]]:
        at = jnp.unravel_index(k, out)
        start = (0, 0, 0, 0, *(t * s for t, s in zip(at, strides, strict=True)))
        part = jax.lax.dynamic_slice(lhs, start, (e, n_groups, per_group, i, *reach))
        part = part[(slice(None),) * 4 + tuple(slice(None, None, r) for r in dilation)]
        dn = ((contract, contract), ((0, 1), (0, 1)))
        y = jax.lax.dot_general(part, rhs, dn, preferred_element_type=dtype)  # [E, G, n', o']
        return None, reduce(jnp.moveaxis(y, 1, 2).reshape(e, per_group, o))

    _, ys = jax.lax.scan(position, None, jnp.arange(math.prod(out)))
    return list(ys)


def _conv_layout(y: Array, params: Mapping, out: Sequence[int]) -> Array:
    """[positions, ..., n, o] from `_conv_offsets` -> [..., *output] in the convolution's
    output layout (`out`: its spatial sizes)."""
    lead = y.ndim - 3
    y = y.reshape(*out, *y.shape[1:])
    y = jnp.moveaxis(y, tuple(range(len(out))), tuple(range(-len(out), 0)))  # [..., n, o, *out]
    _, _, out_spec = params["dimension_numbers"]
    layout = tuple(lead + int(a) for a in np.argsort(out_spec))
    return jnp.transpose(y, (*range(lead), *layout))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Convolution(CoreRoute):
    """A convolution's kernel (example granularity): the core is conv_general_dilated(x, δ) of
    two example-dependent values, g_i = conv(x_i, δ_i) summing over the example's positions.
    Linear ingredients contract the examples inside one convolution, as plain grad does:

        Σ_i w_i conv(x_i, δ_i) = conv(x′, δ′)   (the examples folded into the contracted
                                                 feature axis of both operands, per group)

    Non-linear φ, norms and the variance have no such identity: each example's gradient is
    formed, a bounded chunk of examples and one kernel offset at a time, right where the head
    has the operands (`_conv_offsets`: a dot_general per offset), and reduced before the next
    offset is formed — the variance two-pass within a chunk, chunks merged by Chan's update."""

    FORMED: ClassVar[tuple[str, ...]] = tuple(_of_kind(_FORMED, "mean", "spread", "norm"))

    name = "convolution"
    cores = frozenset({"conv_general_dilated"})

    @classmethod
    def prove(cls, graph: Graph, leaf: Leaf, core: Eqn, post: Posts) -> "Convolution | Refusal":
        if graph.token:
            return Refusal("per-token terms of a convolution are not split (positions share it)")
        a, b = core.invars
        if not (graph.is_batched(a) and graph.is_batched(b)):
            return Refusal("an operand of the convolution does not depend on the example")
        positions = math.prod(_conv_positions(core))
        if positions > _MAX_CONV_DOTS:
            return Refusal(f"its output has {positions} positions (> {_MAX_CONV_DOTS} dots)")
        reason = f"convolution kernel: g_i = conv(x_i, δ_i), {positions} offsets, a dot each"
        return cls(graph, leaf, reason, core=core, post=post)

    def formed_unit(self) -> int:
        """Numbers of one example's gradient core_sums forms at once: one offset's."""
        return math.prod(_shape(self.core.outvars[0])) // math.prod(self.positions)

    def folded(self, env: Env, weights: Array | None = None) -> Array:
        """(1/N) Σ_i w_i conv(x_i, δ_i) as one convolution over the batch (w_i = 1 if None)."""
        dtype, n = self.dtype, self.graph.n_units
        x, d = _operands(self.core, env, dtype, tie=False)
        if weights is not None:
            x = x * weights.reshape(-1, *[1] * (x.ndim - 1)).astype(dtype)
        params = self.core.params
        lhs_spec, rhs_spec, _ = params["dimension_numbers"]
        groups, f, g = params["feature_group_count"], lhs_spec[1], rhs_spec[1]
        # lhs feature axis C = groups·I (group-major) -> groups·(B·I); rhs's I -> B·I
        x = jnp.moveaxis(x, 0, f)
        shape = x.shape
        x = x.reshape(*shape[:f], shape[f], groups, shape[f + 1] // groups, *shape[f + 2 :])
        x = jnp.swapaxes(x, f, f + 1)
        x = x.reshape(*shape[:f], shape[f] * shape[f + 1], *shape[f + 2 :])
        d = jnp.moveaxis(d, 0, g)
        d = d.reshape(*d.shape[:g], d.shape[g] * d.shape[g + 1], *d.shape[g + 2 :])
        keys = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers")
        conv = {k: params[k] for k in (*keys, "batch_group_count", "precision")}
        conv = {**conv, "feature_group_count": groups, "preferred_element_type": dtype}
        return jax.lax.conv_general_dilated(x * (1.0 / n), d, **conv)

    @property
    def positions(self) -> tuple[int, ...]:
        return _conv_positions(self.core)

    def sums(self, wanted: Sequence[str]) -> Container[str]:
        return (*_PHI, *self.FORMED)

    def core_sums(self, env: Env, dtype: DTypeLike, wanted: Sequence[str]) -> dict[str, Array]:
        """Means of φ in the core's coordinates and norms ([B]) from one pass over chunks of
        examples and kernel offsets; the sum alone folded into one convolution."""
        params = self.core.params
        if not any(w in self.FORMED for w in wanted):
            return {"sum": self.folded(env)} if "sum" in wanted else {}

        def form(a: Array, b: Array, names: list[str], r: Array | int) -> list:
            # one offset's [E, n, o] at a time, E − r of it padding
            out = _conv_offsets(a, b, params, dtype, lambda y: _moments(y, names, r))
            k = len(out) - len(_of_kind(names, "norm"))
            placed = [_conv_layout(y, params, self.positions) for y in out[:k]]
            return placed + [jnp.sum(y, axis=0) for y in out[k:]]

        return _formed_sums(self, form, self.formed_unit(), env, dtype, wanted)

    def compute(self, env: Env, what: str) -> Array:  # every ingredient is in `sums`
        return self.compute_many(env, [what])[what]

    def clipped(self, env: Env, weights: Array) -> Array:
        return self.replay(self.folded(env, weights), env)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        a, b = (_read(env, v).astype(self.dtype)[None] for v in self.core.invars[:2])
        (g,) = _conv_offsets(a, b, self.core.params, self.dtype, lambda y: [y])
        return self.replay(_conv_layout(g, self.core.params, self.positions)[0], env)[None]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class UnitSum(CoreRoute):
    """The core sums an example-dependent value z over some of its axes (a bias or a norm
    layer's scale or shift applied at every position, a per-channel gate): unit u's gradient
    is z summed over those axes, except, at token granularity, the one summed axis traced to
    the positions (`axis`), which indexes the units. Small (N × leaf): formed from z by one
    reduction and reduced directly — no per-unit tail, no chunk loop. Exact by construction:
    it is the computation the gradient itself performs, batched."""

    name = "unit-sum"
    KINDS = _ALL_KINDS
    cores = frozenset({"reduce_sum"})
    axis: int | None  # None at example granularity: one unit per example

    @classmethod
    def prove(cls, graph: Graph, leaf: Leaf, core: Eqn, post: Posts) -> "UnitSum | Refusal":
        z = core.invars[0]
        if not graph.is_batched(z):
            return Refusal("the summed value does not depend on the example")
        if not graph.token:
            reason = "a sum over positions (bias, scale, gate): g_i = Σ_k z_ik, one reduction"
            return cls(graph, leaf, reason, core=core, post=post, axis=None)
        found = graph.position_axes(z) & set(core.params["axes"])
        if len(found) != 1:
            return Refusal(f"the sum runs over {len(found)} traced position axes, not one")
        reason = "a sum over positions (bias, scale): g_t = z_t"
        return cls(graph, leaf, reason, core=core, post=post, axis=next(iter(found)))

    def _units(self, z: Array) -> Array:
        """[B, ...] -> [B, U, *core output]: each unit's own sum (U = 1 per example)."""
        rest = tuple(a + 1 for a in self.core.params["axes"] if a != self.axis)
        z = jnp.sum(z, axis=rest, keepdims=True)
        z = z[:, None] if self.axis is None else jnp.moveaxis(z, self.axis + 1, 1)
        return z.reshape(z.shape[0], z.shape[1], *_shape(self.core.outvars[0]))

    def compute(self, env: Env, what: str) -> Array:
        dtype, n = self.dtype, self.graph.n_units
        g = self._units(_read(env, self.core.invars[0]).astype(dtype))
        if _kind(what) == "norm":
            return jnp.sum(g * g, axis=tuple(range(2, g.ndim))) * _scale_sq(self.post, env, dtype)
        if _kind(what) == "inner":  # [B, U]
            v = self.pulled(env)
            return jnp.tensordot(g, v, axes=v.ndim)
        g = _merge01(g)
        if _kind(what) == "pairs":
            g = g.reshape(g.shape[0], -1)
            return jnp.dot(g, g.T) * _scale_sq(self.post, env, dtype)
        if _kind(what) == "spread":
            centered = g - _sum_rows(g) / g.shape[0]
            return self.replay(_sum_rows(centered * centered) / (n - 1), env, jnp.square)
        phi = _PHI[what]
        return self.replay(_sum_rows(phi(g)) * (1.0 / n), env, phi)

    def clipped(self, env: Env, weights: Array) -> Array:
        g = _merge01(self._units(_read(env, self.core.invars[0]).astype(self.dtype)))
        w = weights.reshape(-1).astype(self.dtype)
        return self.replay(jnp.tensordot(w, g, axes=1) / self.graph.n_units, env)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        z = _read(env, self.core.invars[0]).astype(self.dtype)
        return self.replay(self._units(z[None])[0], env, units=True)


class _Rows:
    """What the two row routes share (row-scatter, segment-rows; each is `(_Rows, CoreRoute)`):
    rows of batched updates scattered into a zero table, the statistics from rows (`_units`)
    such that each entry of a unit's gradient is one row's update or 0."""

    graph: Graph  # what they read of the CoreRoute they are
    leaf: Leaf
    core: Eqn
    post: Posts
    dtype: jnp.dtype
    replay: Callable[..., Array]
    pulled: Callable[[Env], Array]

    KINDS = _ALL_KINDS
    cores = frozenset({"scatter-add"})
    segments: ClassVar[bool]  # the rows are summed per index first (segment-rows)

    @staticmethod
    def _refused(graph: Graph, core: Eqn) -> Refusal | None:
        """Why not, where the scatter does not add batched rows into a proven-zero table (one
        window per row, a mode that clamps or drops)."""
        operand, indices, updates = core.invars
        dn = core.params["dimension_numbers"]
        if not graph.is_zero(operand):
            return Refusal("the scatter adds into a table not proven zero")
        if not graph.is_batched(updates):
            return Refusal("the scattered rows do not depend on the example")
        n = _row_axes(core)
        window = tuple(dn.update_window_dims) == tuple(range(n, len(_shape(updates))))
        same = _shape(updates)[:n] == _shape(indices)[:n]
        if not (window and same) or dn.operand_batching_dims:
            return Refusal("not one window per row of the updates")
        mode = str(core.params["mode"]).rsplit(".", 1)[-1]
        if mode not in ("CLIP", "FILL_OR_DROP", "PROMISE_IN_BOUNDS"):
            return Refusal(f"scatter mode {mode}")
        return None

    def _rows(self, env: Env) -> tuple[Array, Array]:
        """Indices [B·R, k] (broadcast when static) and updates [B·R, *window]."""
        _, indices, updates = self.core.invars
        idx, upd = _read(env, indices), _read(env, updates).astype(self.dtype)
        if not self.graph.is_batched(indices):
            idx = jnp.broadcast_to(idx, (upd.shape[0], *jnp.shape(idx)))
        window = upd.shape[1 + _row_axes(self.core) :]
        return idx.reshape(-1, idx.shape[-1]), upd.reshape(-1, *window)

    def _scatter(self, idx: Array, upd: Array) -> Array:
        """scatter-add(0, idx [R, k], upd [R, *window]) as the core writes its rows."""
        zeros = jnp.zeros(_shape(self.core.outvars[0]), upd.dtype)
        mode = self.core.params["mode"]
        return jax.lax.scatter_add(zeros, idx, upd, _rows_dn(self.core), mode=mode)

    def _gather(self, table: Array, idx: Array) -> Array:
        """The rows `idx` [R, k] of `table`: [R, *window] (clamped: read where they land)."""
        dn = _rows_dn(self.core)
        gather_dn = jax.lax.GatherDimensionNumbers(
            offset_dims=tuple(dn.update_window_dims),
            collapsed_slice_dims=tuple(dn.inserted_window_dims),
            start_index_map=tuple(dn.scatter_dims_to_operand_dims),
        )
        clip = jax.lax.GatherScatterMode.CLIP
        return jax.lax.gather(table, idx, gather_dn, _window_sizes(self.core), mode=clip)

    def _limit(self, idx: Array) -> Array:
        """[k]: the largest start of each indexed dimension whose window fits the table."""
        dims = self.core.params["dimension_numbers"].scatter_dims_to_operand_dims
        sizes, table = _window_sizes(self.core), _shape(self.core.outvars[0])
        return jnp.asarray([table[d] - sizes[d] for d in dims], idx.dtype)

    def _in_bounds(self, idx: Array) -> Array:
        """[rows] bool: the row's window is written (always, after clamping, in CLIP mode)."""
        if str(self.core.params["mode"]).endswith("CLIP"):
            return jnp.ones(idx.shape[:1], bool)
        return jnp.all((idx >= 0) & (idx <= self._limit(idx)), axis=-1)

    @abc.abstractmethod
    def _units(self, env: Env, what: str) -> tuple[Array, Array, Array]:
        """Rows (indices [R', k], updates [R', *window], written [R'] bool) such that every
        entry of every unit's gradient is one row's update or 0 (for `what` = "sum", such
        that the rows add up to it)."""

    def compute(self, env: Env, what: str) -> Array:
        dtype, n = self.dtype, self.graph.n_units
        idx, upd, ok = self._units(env, what)
        written = ok.reshape(-1, *[1] * (upd.ndim - 1))
        if what in _PHI:
            phi = _PHI[what]
            rows = jnp.where(written, phi(upd), 0.0) * (1.0 / n)
            return self.replay(self._scatter(idx, rows), env, phi)
        per_row = lambda x: jnp.sum(x, axis=tuple(range(1, x.ndim))) * ok.astype(dtype)  # noqa: E731
        b, units = self.graph.n_examples, self.graph.n_units // self.graph.n_examples
        by_unit = lambda x: jnp.sum(x.reshape(b, units, -1), -1)  # rows [B·R] -> [B, U]  # noqa: E731
        if _kind(what) == "norm":
            return by_unit(per_row(upd * upd)) * _scale_sq(self.post, env, dtype)
        if _kind(what) == "inner":  # Σ over a unit's rows of ⟨update, v's row⟩, v = postᵀ v
            return by_unit(per_row(upd * self._gather(self.pulled(env), idx)))
        if _kind(what) == "pairs":  # rows at one index add, others are disjoint entries
            flat = jnp.where(written, upd, 0.0).reshape(len(upd), -1)
            # two rows add where they land at one start (clamped into the table in CLIP mode)
            clip = str(self.core.params["mode"]).endswith("CLIP")
            at = jnp.clip(idx, 0, self._limit(idx)) if clip else idx
            same = jnp.all(at[:, None, :] == at[None, :, :], -1)
            k = len(upd) // (b * units)  # rows per unit
            rows = jnp.where(same, flat @ flat.T, 0.0).reshape(b, units, k, b, units, k)
            pairs = jnp.sum(rows, (2, 5)).reshape(b * units, b * units)
            return pairs * _scale_sq(self.post, env, dtype)
        # Σ_u (g_u − ḡ)²: units writing an entry contribute (upd − ḡ)², the others ḡ².
        mean = self._scatter(idx, jnp.where(written, upd, 0.0)) / n
        spread = self._scatter(idx, jnp.where(written, (upd - self._gather(mean, idx)), 0.0) ** 2)
        writers = self._scatter(idx, jnp.where(written, 1.0, 0.0) * jnp.ones_like(upd))
        var = (spread + (n - writers) * mean * mean) / (n - 1)
        return self.replay(var, env, jnp.square)

    def clipped(self, env: Env, weights: Array) -> Array:
        n = self.graph.n_examples
        idx, upd = self._rows(env)
        w = jnp.broadcast_to(weights.astype(self.dtype).reshape(n, -1), (n, upd.shape[0] // n))
        upd = upd * w.reshape(-1, *[1] * (upd.ndim - 1)) / self.graph.n_units
        return self.replay(self._scatter(idx, upd), env)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        _, indices, updates = self.core.invars
        idx, upd = _read(env, indices), _read(env, updates).astype(self.dtype)
        idx = jnp.reshape(idx, (-1, jnp.shape(idx)[-1]))
        upd = upd.reshape(-1, *upd.shape[_row_axes(self.core) :])
        if self.graph.token:
            g = jax.vmap(lambda i, u: self._scatter(i[None], u[None]))(idx, upd)
        else:
            g = self._scatter(idx, upd)[None]
        return self.replay(g, env, units=True)


class RowScatter(_Rows, CoreRoute):
    """Rows written into a zero table (the backward pass of a lookup `table[indices]`): the core is
    scatter-add(0, idx, upd) with one window per row of `upd` (the leading axes of `idx` but its
    last, in any layout: `x[None]` adds a unit axis). Example granularity: the indices are static
    and the windows — start and size, after the mode's clamping — are pairwise disjoint (position
    embeddings), so each entry of g_i is one update entry or 0, Σ_i φ(g_i) = scatter(Σ_i φ(upd_i))
    and ‖g_i‖² = ‖upd_i‖². Token granularity: one row axis is the traced position axis (the others
    of size 1), one row per unit, the same identities per unit. Out-of-bounds rows are dropped by
    the scatter's mode (and left out of the norms) as they are in g."""

    name = "row-scatter"
    segments = False

    @classmethod
    def prove(cls, graph: Graph, leaf: Leaf, core: Eqn, post: Posts) -> "RowScatter | Refusal":
        if (refused := cls._refused(graph, core)) is not None:
            return refused
        indices, updates = core.invars[1:]
        if graph.token:
            rows = _shape(updates)[: _row_axes(core)]
            found = graph.position_axes(updates) & set(range(len(rows)))
            if len(found) != 1 or math.prod(rows) != rows[next(iter(found))]:
                return Refusal("not one row axis traced to the positions (others of size 1)")
            reason = "embedding rows: g_t = onehot(row_t) ⊗ δ_t, rows traced to positions"
            return cls(graph, leaf, reason, core=core, post=post)
        if not graph.is_static(indices):
            return Refusal("rows depend on the example (repeated rows add up before φ)")
        mode = str(core.params["mode"]).rsplit(".", 1)[-1]
        if overlap := _windows_overlap(core, graph.static_value(indices), mode):
            return Refusal(overlap)
        reason = "rows at static, pairwise disjoint windows (e.g. positions)"
        return cls(graph, leaf, reason, core=core, post=post)

    def _units(self, env: Env, what: str) -> tuple[Array, Array, Array]:  # the core's rows
        idx, upd = self._rows(env)
        return idx, upd, self._in_bounds(idx)


class SegmentRows(_Rows, CoreRoute):
    """Example granularity, rows that depend on the example (a token table's lookup): rows with the
    same index add up before φ, so each example's rows are first summed per index — a stable sort of
    the row keys and a segment sum, O(R log R + R·window) per example, never the [B, table]
    gradient. Then each entry of g_i is one segment's sum or 0, and the row identities hold with
    segments for rows. Proven: every indexed dimension has window size 1 or is read whole, so two
    rows' windows (after the mode's clamping) are identical or disjoint."""

    name = "segment-rows"
    segments = True

    @classmethod
    def prove(cls, graph: Graph, leaf: Leaf, core: Eqn, post: Posts) -> "SegmentRows | Refusal":
        if graph.token:
            return Refusal("token granularity: one row per unit (row-scatter)")
        if (refused := cls._refused(graph, core)) is not None:
            return refused
        dims = core.params["dimension_numbers"].scatter_dims_to_operand_dims
        sizes, table = _window_sizes(core), _shape(core.outvars[0])
        if any(sizes[d] not in (1, table[d]) for d in dims):
            return Refusal("a window spans several rows: windows may partly overlap")
        if math.prod(table[d] for d in dims) >= 2**31 - 1:
            return Refusal("too many rows to key in 32 bits")
        reason = (
            "lookup rows, repeated rows summed per example (segment sums): g_i = Σ_r onehot ⊗ δ"
        )
        return cls(graph, leaf, reason, core=core, post=post)

    def _units(self, env: Env, what: str) -> tuple[Array, Array, Array]:
        idx, upd = self._rows(env)
        ok = self._in_bounds(idx)
        if what == "sum":  # linear: the rows add up the same without segments
            return idx, upd, ok
        examples = self.graph.n_examples
        per = idx.shape[0] // examples
        dims = self.core.params["dimension_numbers"].scatter_dims_to_operand_dims
        table, sizes = _shape(self.core.outvars[0]), _window_sizes(self.core)
        starts = [table[d] - sizes[d] + 1 for d in dims]  # 1 for a dimension read whole
        limits = jnp.asarray([n - 1 for n in starts], idx.dtype)
        at = jnp.clip(idx, 0, limits)  # where a row lands (CLIP); other rows out of bounds: ok 0
        strides = np.cumprod([1, *starts[:0:-1]])[::-1]
        key = jnp.where(ok, at @ jnp.asarray(strides, idx.dtype), -1)

        def segments(key: Array, at: Array, upd: Array, ok: Array) -> tuple[Array, Array, Array]:
            order = jnp.argsort(key, stable=True)
            key, at, upd, ok = key[order], at[order], upd[order], ok[order]
            starts = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
            segment = jnp.cumsum(starts) - 1
            kept = jnp.where(ok.reshape(-1, *[1] * (upd.ndim - 1)), upd, 0.0)
            sums = jax.ops.segment_sum(kept, segment, per)
            where = jnp.zeros_like(at).at[segment].set(at)
            written = jax.ops.segment_sum(ok.astype(jnp.int32), segment, per) > 0
            return where, sums, written

        shaped = [x.reshape(examples, per, *x.shape[1:]) for x in (key, at, upd, ok)]
        where, sums, written = jax.vmap(segments)(*shaped)
        return where.reshape(idx.shape), sums.reshape(upd.shape), written.reshape(-1)


def _row_axes(core: Eqn) -> int:
    """How many leading axes of a scatter's updates index rows: all of its indices' but the
    last (the index vector)."""
    return len(_shape(core.invars[1])) - 1


def _rows_dn(core: Eqn) -> jax.lax.ScatterDimensionNumbers:
    """The scatter's dimension numbers for rows laid out [R, *window]."""
    dn = core.params["dimension_numbers"]
    shift = _row_axes(core) - 1
    return dn._replace(update_window_dims=tuple(d - shift for d in dn.update_window_dims))


def _window_sizes(core: Eqn) -> tuple[int, ...]:
    dn = core.params["dimension_numbers"]
    operand, updates = _shape(core.outvars[0]), _shape(core.invars[2])
    window = iter(updates[_row_axes(core) :])
    return tuple(1 if d in dn.inserted_window_dims else next(window) for d in range(len(operand)))


def _windows_overlap(core: Eqn, indices: np.ndarray, mode: str) -> str:
    """Why the static windows of a row scatter are not pairwise disjoint and in bounds, or ""."""
    dn = core.params["dimension_numbers"]
    operand, sizes = _shape(core.outvars[0]), _window_sizes(core)
    dims = list(dn.scatter_dims_to_operand_dims)
    starts = np.asarray(indices).reshape(-1, len(dims)).astype(np.int64)
    limits = np.asarray([operand[d] - sizes[d] for d in dims])
    if mode == "CLIP":
        starts = np.clip(starts, 0, limits)
    elif np.any((starts < 0) | (starts > limits)):
        return "a window is out of bounds"
    if len(starts) > 4096:
        return f"{len(starts)} windows: too many to check for overlap"
    width = np.asarray([sizes[d] for d in dims])
    apart = np.abs(starts[:, None, :] - starts[None, :, :]) >= width  # [R, R, k]
    clash = ~np.any(apart, axis=-1) & ~np.eye(len(starts), dtype=bool)
    if np.any(clash):
        i, j = np.argwhere(clash)[0]
        where = f"starts {starts[i].tolist()} and {starts[j].tolist()}, sizes {width.tolist()}"
        return f"windows overlap ({where})"
    return ""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class _Composite(Route):
    """A gradient made of `parts`, each proven by a route of its own, then `post`: every
    ingredient is the parts' ingredients combined (`_combine`)."""

    parts: tuple[CoreRoute, ...]
    post: Posts = ()

    @abc.abstractmethod
    def _combine(self, parts: list[Array], what: str, env: Env) -> Array: ...

    def compute_many(self, env: Env, wanted: Sequence[str]) -> dict[str, Array]:
        """Each part's ingredients at once (a part may share work between them), combined."""
        found = [p.compute_many(env, wanted) for p in self.parts]
        return {w: self._combine([f[w] for f in found], w, env) for w in wanted}

    def compute(self, env: Env, what: str) -> Array:
        return self.compute_many(env, [what])[what]

    def clipped(self, env: Env, weights: Array) -> Array:
        return self._combine([p.clipped(env, weights) for p in self.parts], "sum", env)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        return self._combine([p.per_unit(env, example, params) for p in self.parts], "sum", env)

    def reads(self) -> list[Var]:
        parts = [v for p in self.parts for v in p.reads()]
        return list(dict.fromkeys([*parts, *_factor_vars(self.post)]))


class Terms(_Composite):
    """Token granularity: several per-position contributions added (a tied embedding and
    output head, W + Wᵀ): unit t's gradient is the sum of its terms at t, each proven by a
    per-token route; linear ingredients add up term by term, the others are chunked."""

    name = "terms"

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "Terms | Refusal":
        if not graph.token:
            return Refusal("contributions added before φ (a weight used twice per example)")
        terms = _split_terms(graph, leaf, leaf.grad if var is None else var, ())
        if isinstance(terms, Refusal):
            return terms
        if len(terms) < 2:
            return Refusal("not a sum of contributions")
        reason = f"{len(terms)} per-position contributions added"
        return cls(graph, leaf, reason, parts=tuple(terms))

    def methods(self, need: tuple[str, ...]) -> dict[str, str]:
        return {w: "factorized" if _INGREDIENT[w].linear else "chunked" for w in need}

    def _combine(self, parts: list[Array], what: str, env: Env) -> Array:
        return sum(parts[1:], parts[0])


def _split_terms(graph: Graph, leaf: Leaf, var: Atom, outer: Posts) -> list[CoreRoute] | Refusal:
    """Split a sum of contributions into per-token terms (the layout and scaling ops after the
    sum are linear, so each term takes them too)."""
    core, post = graph.core(var)
    post = (*post, *outer)
    if core is not None and core.primitive.name == "add_any":
        terms: list[CoreRoute] = []
        for operand in core.invars:
            sub = _split_terms(graph, leaf, operand, post)
            if isinstance(sub, Refusal):
                return sub
            terms += sub
        return terms
    refusals = []
    for route in _UNIT_ROUTES:
        m = route.match(graph, leaf, var)
        if isinstance(m, CoreRoute):
            return [dataclasses.replace(m, post=(*m.post, *outer))]
        refusals.append(m.reason)
    return Refusal(f"a term no per-token route proves ({refusals[0]})")


@dataclasses.dataclass(frozen=True)
class Placement:
    starts: tuple[int, ...]
    part_shape: tuple[int, ...]  # in the leaf (with the stacked axis, if any)
    stacked: int | None = None  # `stack` places the part as index starts[axis] of this axis


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class DisjointParts(_Composite):
    """Example granularity: the gradient is a sum of parts placed at static, pairwise disjoint
    windows of the leaf (`places`; a stacked weight read as w[l] in a Python loop: each read's
    gradient is padded into place), summed by `core`, then `post`. Every entry of g_i comes
    from one part or is 0, so φ and the variance act part by part —
    Σ_i φ(Σ_k place_k(p_ik)) = Σ_k place_k(Σ_i φ(p_ik)) — and norms add up. Each part takes
    its own route (one per layer, as if unrolled)."""

    name = "disjoint-parts"
    core: Eqn
    places: tuple[Placement, ...]

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "DisjointParts | Refusal":
        if graph.token:
            return Refusal("token granularity: parts are split per position instead")
        core, post = graph.core(leaf.grad if var is None else var)
        if core is None or core.primitive.name not in ("add_any", *_PLACEMENTS):
            return Refusal("not a sum of parts placed into the leaf")
        parts = _placed_parts(graph, leaf, core)
        if isinstance(parts, Refusal):
            return parts
        if not parts:
            return Refusal("every placed part is zero")
        windows = [w for w, _, _ in parts]
        for a, b in [(a, b) for i, a in enumerate(windows) for b in windows[:i]]:
            if all(lo < hi_b and lo_b < hi for (lo, hi), (lo_b, hi_b) in zip(a, b, strict=True)):
                return Refusal(f"parts overlap (windows {a} and {b})")
        reason = f"{len(parts)} parts at disjoint static windows"
        routes, places = tuple(r for _, r, _ in parts), tuple(p for *_, p in parts)
        return cls(graph, leaf, reason, parts=routes, core=core, post=post, places=places)

    def methods(self, need: tuple[str, ...]) -> dict[str, str]:
        # its parts' routes read the whole leaf's v: inner products chunked
        by_parts = lambda w: all(p.methods((w,))[w] == "factorized" for p in self.parts)  # noqa: E731
        factored = {w for w in need if _kind(w) in self.KINDS and by_parts(w)}
        if not all(s.scalar for s in self.post):
            factored -= set(_of_kind(need, "norm"))
        return {w: "factorized" if w in factored else "chunked" for w in need}

    def _combine(self, parts: list[Array], what: str, env: Env) -> Array:
        """The parts put in place (with any leading unit axes), then the ops after the sum;
        norms add up."""
        if _kind(what) == "norm":
            return sum(parts[1:], parts[0]) * _scale_sq(self.post, env, parts[0].dtype)
        phi = _REPLAY[what]
        first = self.places[0]
        lead = parts[0].shape[: parts[0].ndim - len(first.part_shape) + (first.stacked is not None)]
        shape = _shape(self.core.outvars[0])
        tiling = _tiling(self.places, shape)
        if tiling is not None:  # the parts tile one axis: one concatenation, not a write each
            tiles = [parts[i].reshape(*lead, *self.places[i].part_shape) for i in tiling[1]]
            out = jnp.concatenate(tiles, axis=len(lead) + tiling[0])
        else:
            out = jnp.zeros((*lead, *shape), parts[0].dtype)
            for part, place in zip(parts, self.places, strict=True):
                if place.stacked is not None:
                    part = jnp.expand_dims(part, len(lead) + place.stacked)
                out = jax.lax.dynamic_update_slice(out, part, (0,) * len(lead) + place.starts)
        return (_replay_each if lead else _replay)(self.post, out, env, phi)


def _tiling(places: Sequence[Placement], shape: tuple[int, ...]) -> tuple[int, list[int]] | None:
    """(axis, the parts in order along it) where the parts' windows tile `shape` along one
    axis, each spanning every other axis; else None."""
    for k, n in enumerate(shape):
        cut = lambda t, k=k: t[:k] + t[k + 1 :]  # noqa: E731
        if all(not any(cut(p.starts)) and cut(p.part_shape) == cut(shape) for p in places):
            spans = sorted(
                (p.starts[k], p.starts[k] + p.part_shape[k], i) for i, p in enumerate(places)
            )
            if [a for a, *_ in spans] == [0, *(b for _, b, _ in spans[:-1])] and spans[-1][1] == n:
                return k, [i for *_, i in spans]
    return None


# The ops that put a part into a zero table: the transposes of slicing, indexing and
# splitting (`concatenate` with proven-zero operands is how jnp.split's unused parts come back).
_PLACEMENTS = ("pad", "dynamic_update_slice", "concatenate", "stack")
Part = tuple[tuple[tuple[int, int], ...], CoreRoute, Placement]  # (window, route, placement)


def _placed_parts(graph: Graph, leaf: Leaf, core: Eqn) -> list[Part] | Refusal:
    """The parts of a sum of placements, each proven by a route of its own; windows as
    ((lo, hi) per axis) after clamping."""
    found: list[Part] = []
    if core.primitive.name == "add_any":
        for operand in core.invars:
            inner, post = graph.core(operand)
            if inner is None or post:
                return Refusal("a summand is not a placement")
            sub = _placed_parts(graph, leaf, inner)
            if isinstance(sub, Refusal):
                return sub
            found += sub
        return found
    if core.primitive.name in ("concatenate", "stack"):  # each operand not proven 0 is a part
        stacked = core.primitive.name == "stack"
        dim = int(core.params["axis" if stacked else "dimension"])
        offset = 0
        for operand in core.invars:
            at = [0] * len(_shape(core.outvars[0]))
            at[dim] = offset
            offset += 1 if stacked else _shape(operand)[dim]
            if graph.is_zero(operand):
                continue
            placed = _placed_part(graph, leaf, operand, at, dim if stacked else None)
            if isinstance(placed, Refusal):
                return placed
            found.append(placed)
        return found
    if core.primitive.name not in _PLACEMENTS:
        return Refusal(f"a summand made by '{core.primitive.name}', not a placement")
    shape = _shape(core.outvars[0])
    part = core.invars[0] if core.primitive.name == "pad" else core.invars[1]
    size = _shape(part)
    if core.primitive.name == "pad":
        config = [tuple(int(c) for c in dim) for dim in core.params["padding_config"]]
        not_border = any(lo < 0 or hi < 0 or mid for lo, hi, mid in config)
        if not graph.is_zero(core.invars[1]) or not_border:
            return Refusal("a padding that is not a zero border")
        starts = [lo for lo, _, _ in config]
    else:
        if not graph.is_zero(core.invars[0]):
            return Refusal("a slice written into a table not proven zero")
        if not all(graph.is_static(v) for v in core.invars[2:]):
            return Refusal("a slice written at a place that depends on the example")
        starts = [
            int(np.clip(graph.static_value(v), 0, n - k))
            for v, n, k in zip(core.invars[2:], shape, size, strict=True)
        ]
    placed = _placed_part(graph, leaf, part, starts)
    return placed if isinstance(placed, Refusal) else [placed]


def _placed_part(
    graph: Graph, leaf: Leaf, part: Atom, starts: Sequence[int], stacked: int | None = None
) -> Part | Refusal:
    """A part placed at `starts` (as one index of axis `stacked`), proven by its own route."""
    size = _shape(part)
    if stacked is not None:
        size = (*size[:stacked], 1, *size[stacked:])
    part_leaf = dataclasses.replace(leaf, shape=_shape(part), grad=part)  # a leaf of its shape
    for route in _PART_ROUTES:
        m = route.match(graph, part_leaf, part)
        if isinstance(m, CoreRoute):
            window = tuple((s, s + k) for s, k in zip(starts, size, strict=True))
            return (window, m, Placement(tuple(starts), size, stacked))
    return Refusal("a part no route proves")


_MAX_PLACES = 64  # places a routed part may take (one contraction each)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class RoutedPart(Route):
    """Example granularity: the gradient is one part written into a zero table at a place the
    example chooses (`core`, a dynamic_update_slice whose starts depend on the example), then
    `post`: a mixture of experts reading one expert's matrix per example, experts[choice] @ x.
    The part is a dense weight's outer product, p_i = δ_i ⊗ x_i (`part`). Every entry of g_i is
    p_i's or 0, so with s_i example i's place (clamped as XLA clamps it) and S the places it
    can take (`places`):

        Σ_i φ(g_i) = Σ_s place_s(Σ_{i: s_i = s} φ(p_i))   (per place, (1_s∘φ(Δ))ᵀφ(X))
        Σ_i c_i g_i = Σ_s place_s(Σ_{i: s_i = s} c_i p_i)      ‖g_i‖² = ‖p_i‖²

    S contractions of the batch (S ≤ _MAX_PLACES); the variance is formed per example."""

    name = "routed-part"
    part: OuterProduct
    core: Eqn
    post: Posts
    places: tuple[tuple[int, ...], ...]  # each place's starts, every axis

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "RoutedPart | Refusal":
        if graph.token:
            return Refusal("token granularity: a unit is a position, not an example")
        core, post = graph.core(leaf.grad if var is None else var)
        if core is None or core.primitive.name != "dynamic_update_slice":
            return Refusal("not one part written into the leaf")
        table, update, *starts = core.invars
        if not graph.is_zero(table):
            return Refusal("a slice written into a table not proven zero")
        if all(graph.is_static(v) for v in starts):
            return Refusal("the place does not depend on the example")
        shape, size = _shape(core.outvars[0]), _shape(update)
        ranges = [
            [int(np.clip(graph.static_value(v), 0, n - k))]
            if graph.is_static(v)
            else list(range(n - k + 1))
            for v, n, k in zip(starts, shape, size, strict=True)
        ]
        n_places = math.prod(len(r) for r in ranges)
        if n_places > _MAX_PLACES:
            return Refusal(f"the part may take {n_places} places (> {_MAX_PLACES})")
        part = OuterProduct.match(graph, leaf, update)
        if not isinstance(part, OuterProduct):
            return Refusal(f"the part: {part.reason}")
        places = tuple(itertools.product(*ranges))
        reason = f"one outer product per example at one of {n_places} places the example picks"
        return cls(graph, leaf, reason, part=part, core=core, post=post, places=places)

    def methods(self, need: tuple[str, ...]) -> dict[str, str]:
        kinds = {"spread"} | (set() if all(s.scalar for s in self.post) else {"norm"})
        chunked = lambda k: k in kinds or k not in self.KINDS  # noqa: E731
        return {w: "chunked" if chunked(_kind(w)) else "factorized" for w in need}

    def reads(self) -> list[Var]:
        starts = [v for v in self.core.invars[2:] if isinstance(v, Var)]
        return list(dict.fromkeys([*self.part.reads(), *starts, *_factor_vars(self.post)]))

    def _starts(self, env: Env) -> list[Array]:
        """The place of the part on each axis, clamped as dynamic_update_slice clamps it
        ([B] under the batched head, a scalar per example in the chunk loop)."""
        shape, size = _shape(self.core.outvars[0]), _shape(self.core.invars[1])
        return [
            jnp.clip(jnp.asarray(_read(env, v)), 0, d - k).astype(jnp.int32)
            for v, d, k in zip(self.core.invars[2:], shape, size, strict=True)
        ]

    def _at(self, env: Env) -> Array:
        """[B, S]: 1 where example i's part sits at place s."""
        n = self.graph.n_examples
        starts = jnp.stack([jnp.broadcast_to(x, (n,)) for x in self._starts(env)], axis=1)
        at = starts[:, None, :] == jnp.asarray(self.places, jnp.int32)[None]
        return jnp.all(at, axis=2).astype(self.dtype)

    def _sums(self, env: Env, what: str, weights: Array | None = None) -> Array:
        """Each place's sum in its window (windows of a wide part may overlap: added)."""
        at = self._at(env)
        weights = at if weights is None else at * weights.astype(self.dtype)
        what = "sum" if _kind(what) == "weighted" else what  # weighted by the clip factors
        part, phi, n = self.part, _PHI[what], len(self.places)
        sums = [part.core_sum(env, self.dtype, what, weights[:, s, None]) for s in range(n)]
        per_place = [part.replay(x, env, phi) for x in sums]
        out = jnp.zeros(_shape(self.core.outvars[0]), per_place[0].dtype)
        size = _shape(self.core.invars[1])
        for starts, x in zip(self.places, per_place, strict=True):
            window = tuple(slice(s, s + k) for s, k in zip(starts, size, strict=True))
            out = out.at[window].add(x.reshape(size))
        return _replay(self.post, out, env, phi)

    def compute(self, env: Env, what: str) -> Array:
        if _kind(what) == "norm":
            return self.part.compute(env, what) * _scale_sq(self.post, env, self.dtype)
        return self._sums(env, what)

    def clipped(self, env: Env, weights: Array) -> Array:
        return self._sums(env, "clipped", weights.reshape(weights.shape[0], 1))

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        p = self.part.per_unit(env, example, params)  # [1, *part]
        shape, size = _shape(self.core.outvars[0]), _shape(self.core.invars[1])
        starts = [x.reshape(()) for x in self._starts(env)]
        zero = jnp.zeros((1, *shape), p.dtype)
        placed = jax.lax.dynamic_update_slice(zero, p.reshape(1, *size), (jnp.int32(0), *starts))
        return _replay_each(self.post, placed, env, _PHI["sum"])


_IN_HEAD = "its per-example gradient is a value of the backward pass"


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class HeadValue(Route):
    """Example granularity: the gradient needs no op of its own after the backward pass (a bias, a
    norm layer's scale used once per example), or only layout and batch-independent scalings (a bias
    added to x[None]: a sum over an axis of size 1): g_i is a value v_i (`grad`) the batched head
    computes anyway — plain grad holds it too, as the cotangent it sums — or post(v_i). Every
    statistic reads it right there: (1/B) Σ_i φ(g_i), ‖g_i‖², the variance in two passes; nothing is
    formed again, and the value dies where plain grad's does."""

    name = "head-value"
    KINDS = _ALL_KINDS
    grad: Var
    post: Posts

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "HeadValue | Refusal":
        if graph.token:
            return Refusal("token granularity: a unit is a position, not an example")
        value, post = leaf.grad, ()
        tail = graph.exclusive_tail(leaf.grad)
        if tail:
            _, post = graph.core(leaf.grad)
            if {id(e) for e in tail} != {id(p.eqn) for p in post}:
                return Refusal("the gradient needs ops of its own after the backward pass")
            value = post[0].eqn.invars[0]
        if not (isinstance(value, Var) and graph.is_batched(value)):
            return Refusal("the gradient does not depend on the example")
        reason = _IN_HEAD if not post else f"{_IN_HEAD}, after {len(post)} layout/scaling ops"
        return cls(graph, leaf, reason, grad=value, post=tuple(post))

    def reads(self) -> list[Var]:
        return [self.grad, *_factor_vars(self.post)]

    def _g(self, env: Env) -> Array:
        """[B, leaf size]: every example's gradient."""
        g = jnp.asarray(_read(env, self.grad)).astype(self.dtype)
        if self.post:
            g = _replay_each(self.post, g, env, _PHI["sum"])
        return g.reshape(g.shape[0], -1)

    def compute(self, env: Env, what: str) -> Array:
        n, g = self.graph.n_examples, self._g(env)
        if what in _PHI:  # a mean, not a dot with ones: here XLA then holds fewer buffers
            return jnp.mean(_PHI[what](g), axis=0).reshape(self.leaf.shape)
        if _kind(what) == "norm":
            return jnp.sum(g * g, axis=1)
        if _kind(what) == "inner":
            return g @ env[_DOT_WITH][self.leaf.index].reshape(-1)
        if _kind(what) == "pairs":
            return jnp.dot(g, g.T)
        assert _kind(what) == "spread"
        ones = jnp.full((n,), 1.0 / n, self.dtype)
        centred = g - ones @ g
        return (ones @ (centred * centred) * (n / (n - 1))).reshape(self.leaf.shape)

    def clipped(self, env: Env, weights: Array) -> Array:
        g = self._g(env)
        total = jnp.tensordot(weights.reshape(-1).astype(g.dtype), g, axes=1) / self.graph.n_units
        return total.reshape(self.leaf.shape)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        g = jnp.asarray(_read(env, self.grad)).astype(self.dtype)
        return _replay(self.post, g, env, _PHI["sum"])[None]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Fallback(Route):
    """Exact for any leaf. Example granularity: the leaf's exclusive gradient `tail` (the ops
    only its gradient needs; empty when the head computes it) evaluated per example, a bounded
    chunk of examples at a time; `linear` when the tail is proven linear in its cotangent
    inputs, so that sums over examples transpose into it. Token granularity: the untied
    reference (§4) for this leaf, per example, in chunks."""

    name = "fallback"
    grad: Atom
    tail: tuple[Eqn, ...]
    linear: bool

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "Fallback | Refusal":
        if graph.token:
            reason = "exact: this leaf untied per position, per example"
            return cls(graph, leaf, reason, grad=leaf.grad, tail=(), linear=False)
        tail = graph.exclusive_tail(leaf.grad)
        if not tail:
            return cls(graph, leaf, f"exact: {_IN_HEAD}", grad=leaf.grad, tail=(), linear=True)
        why = graph.nonlinear_in_seed(tail, leaf.grad)
        linear = not why and leaf.stat_dtype == jnp.dtype(leaf.dtype)
        how = f" ({why or 'half precision'})"
        how = "; sums over examples transposed into them" if linear else how
        reason = f"exact: its own gradient ops ({len(tail)}) per example{how}"
        return cls(graph, leaf, reason, grad=leaf.grad, tail=tail, linear=linear)

    def methods(self, need: tuple[str, ...]) -> dict[str, str]:
        # With a mask a masked example's inputs may be anything (NaN): no transposition.
        linear = self.linear and not self.graph.token and not self.graph.weighted
        methods = {w: "factorized" if linear and _INGREDIENT[w].linear else "chunked" for w in need}
        looped = any(methods[w] == "chunked" for w in need if _kind(w) not in ("weighted", "pairs"))
        if "sum" in methods and looped:
            methods["sum"] = "chunked"  # once per-example gradients exist, their sum is free
        return methods

    def reads(self) -> list[Var]:
        return [] if self.graph.token else _inputs(self.grad, self.tail)

    def compute(self, env: Env, what: str) -> Array:
        assert what == "sum"
        return self.clipped(env, None)

    def clipped(self, env: Env, weights: Array | None) -> Array:
        """(1/N) Σ_i w_i g_i for a gradient the head computes (read it) or whose tail is
        linear in its cotangent inputs c_i given its primal inputs x_i: g_i = L_{x_i}(c_i).
        Then Σ_i L_{x_i}(c_i) = Mᵀ(c) with M(W) = (L_{x_i}ᵀ W)_i — JAX transposes the tail
        twice, and the second transpose sums over examples inside the operation (as plain
        grad does: one weight-gradient convolution over the batch, not B of them)."""
        graph, leaf, grad, tail = self.graph, self.leaf, self.grad, self.tail
        dtype, n, b = self.dtype, graph.n_units, graph.n_examples
        w = jnp.ones((b,), dtype) if weights is None else weights.reshape(-1).astype(dtype)
        if not tail:
            g = jnp.broadcast_to(jnp.asarray(_read(env, grad)).astype(dtype), (b, *leaf.shape))
            return jnp.tensordot(w / n, g, axes=1)
        inputs = _inputs(grad, tail)
        cts = [v for v in inputs if v in graph.seeded]
        primals = [v for v in inputs if v not in graph.seeded and v in graph.batched]
        fixed = {v: env[v] for v in inputs if v not in graph.seeded and v not in graph.batched}

        def run_tail(c: list, x: list) -> Array:
            local = {**fixed, **dict(zip(cts, c, strict=True))}
            local.update(zip(primals, x, strict=True))
            return _read(_evaluate(tail, local), grad)

        per_example = [jax.ShapeDtypeStruct(_shape(v), _dtype(v)) for v in cts]

        def transposed(w_: Array, x: list) -> list:
            (c,) = jax.linear_transpose(lambda c: run_tail(c, x), per_example)(w_)
            return c

        def to_batch(w_: Array) -> list:
            return jax.vmap(transposed, (None, 0), axis_size=b)(w_, [env[v] for v in primals])

        scale = (w / n).astype(leaf.dtype)
        c_all = [
            jnp.broadcast_to(env[v], (b, *_shape(v)))
            * scale.reshape(-1, *[1] * len(_shape(v))).astype(_dtype(v))
            for v in cts
        ]
        leaf_struct = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        (total,) = jax.linear_transpose(to_batch, leaf_struct)(c_all)
        return total.astype(dtype)

    def per_unit(self, env: Env, example: PyTree, params: PyTree) -> Array:
        if self.graph.token:
            assert self.graph.untie is not None
            untied = frozenset({self.leaf.index})
            _, grads = self.graph.untie.value_and_grad(params, example, untied)
            return jax.tree.leaves(grads)[0].astype(self.dtype)
        local = _evaluate(self.tail, dict(env))
        return jnp.asarray(_read(local, self.grad)).astype(self.dtype)[None]


def _inputs(grad: Atom, tail: Sequence[Eqn]) -> list[Var]:
    """What the head provides for `tail` to compute `grad` (the gradient itself if no tail)."""
    if not tail:
        return [grad] if isinstance(grad, Var) else []
    produced = {v for e in tail for v in e.outvars}
    ins = (v for e in tail for v in e.invars if isinstance(v, Var) and v not in produced)
    return list(dict.fromkeys(ins))


@dataclasses.dataclass(frozen=True, eq=False)
class MeanLoss(Route):
    """The mean alone, every leaf at once, where `_mean_loss` allows it: plain grad of the mean
    loss (`_gradient_of_mean_loss`). Not in ROUTES: no leaf's proof."""

    name = "mean-loss"
    KINDS = _ALL_KINDS
    proof: ClassVar[str] = (
        "the mean alone is the gradient of the mean loss (its backward pass is JAX's own, "
        "linear in the cotangent): plain backpropagation, which sums over examples as it "
        "forms each gradient"
    )

    @classmethod
    def match(cls, graph: Graph, leaf: Leaf, var: Atom | None = None) -> "MeanLoss":
        return cls(graph, leaf, cls.proof)  # every leaf's, where `plan` takes it

    @classmethod
    def plans(cls, graph: Graph, need: tuple[str, ...]) -> tuple[LeafPlan, ...]:
        methods = dict.fromkeys(need, "factorized")  # shared: a Mapping, read, never written
        return tuple(
            LeafPlan(leaf.path, leaf.shape, cls.match(graph, leaf), methods, (), leaf.index)
            for leaf in graph.leaves
        )

    def reads(self) -> list[Var]:  # as `LeafPlan.reads` says: none of the head's
        return []

    def _never(self, *args: Any) -> Any:  # _gradient_of_mean_loss runs instead
        raise AssertionError("mean-loss is plain grad of the mean loss, not a leaf's route")

    compute = compute_many = clipped = per_unit = _never  # type: ignore


_UNIT_ROUTES: tuple[type[CoreRoute], ...] = (OuterProduct, UnitSum, RowScatter)  # per-token terms
_PART_ROUTES: tuple[type[CoreRoute], ...] = (OuterProduct, Contraction, Convolution, UnitSum)
# The routes, in precedence order (the planner takes the first that matches): what `match`
# proves on the jaxpr -> how the ingredients' kinds (§2) are computed.
#   empty           no entries -> empty arrays
#   constant        g independent of the example -> φ(g), var 0, ‖g‖², ⟨g, v⟩ per unit
#   outer-product   dot(a, b) contracting only unit axes (dense weight once) -> φ(A)ᵀφ(B),
#                   ‖a‖²‖b‖², centred factors for var, aᵀVb, (AAᵀ)∘(BBᵀ) for pairs
#   contraction     the same dot over K places -> AᵀB for linear; per-example gradients formed
#                   in the head (chunks) for φ, var, norms (or Grams), inner; pairs by blocks
#   convolution     conv(x, δ) -> one convolution over the batch; per kernel offset the rest
#   unit-sum        reduce_sum of a batched value (bias, scale) -> every unit's gradient formed
#   row-scatter     rows into a zero table at static disjoint windows -> φ, norms, inner, pairs
#   segment-rows    the same at batched indices -> rows with one index summed first, then as above
#   head-value      g is a value of the backward pass -> read there
#   terms           per-position contributions added (token granularity) -> linear term by term
#   disjoint-parts  a stacked weight read at static disjoint slices -> each part routed, placed
#   routed-part     a dense weight's outer product placed at a batched index -> per place
#   fallback        anything -> the leaf's gradient tail per example in chunks (exact, slowest)
ROUTES: tuple[type[Route], ...] = (Empty, Constant, OuterProduct, Contraction, Convolution)
ROUTES += (UnitSum, RowScatter, SegmentRows, HeadValue, Terms, DisjointParts, RoutedPart, Fallback)


# ============================================================================================
# §11 The package's other modules (not the definition, not the engine).


def __getattr__(name: str) -> types.ModuleType:
    """`from pegrad import models, optimizers, train` (PEP 562; `pegrad.plots` and trainkit,
    train's plumbing, too): the package's modules when installed, else the files beside this one
    loaded by path as `pegrad.<name>` (never a user's own file of that name; train.py's `from .
    import` is this)."""
    if name not in ("models", "optimizers", "train", "trainkit", "plots"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    full = f"{__name__}.{name}"
    if "__path__" in globals():  # the wheel: a submodule of the package
        return importlib.import_module(full)
    if full not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, path)
        if not os.path.isfile(path) or spec is None or spec.loader is None:
            raise ImportError(f"{full} is the file {path}, missing: pegrad.py was copied alone")
        sys.modules[full] = module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[full]
            raise
    globals()[name] = sys.modules[full]
    return sys.modules[full]
