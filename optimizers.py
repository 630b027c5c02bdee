"""Optimizers that consume per-example gradient statistics (SPEC §4, after Roulet & Agarwala,
arXiv 2510.00236): Adam, MicroAdam, MicroAdamVar, MicroAdamMSQ, MicroSignSGD, SignSGD, SignEMA.
MicroAdam here is that paper's: Adam with the per-example mean of squares (1/B) Σ_i g_i² as its
second moment. It is not IST-DASLab's MicroAdam (Modoranu et al., NeurIPS 2024, the package
ista_daslab_micro_adam), a memory-saving Adam with a compressed state, which shares the name.

Every factory returns an `optax.GradientTransformationExtraArgs`. Its update is

    updates, state = opt.update(ḡ, state, params, stats=stats)

where the updates coming in are the mean gradient ḡ and `stats` is the dict returned by
`pegrad.value_and_grad_stats` (keyword; rules that read only ḡ, i.e. adam, sign_sgd and
sign_ema, may omit it; the others raise `MissingStatistics` naming what to pass). So optax's
own machinery applies unchanged:

    opt = micro_adam(learning_rate=1e-3, max_grad_norm=1e-2)  # lr may be an optax schedule
    opt = optax.chain(micro_adam(1e-3), optax.clip(1e-2))        # optax.chain forwards stats=
    opt = optax.inject_hyperparams(micro_adam)(learning_rate=1e-3)  # lr settable mid-run
    opt = optax.apply_if_finite(micro_adam(1e-3), max_consecutive_errors=5)
    opt = optax.partition({"m": micro_adam(1e-3), "e": adam(1e-3)}, labels)  # or optax.masked
    opt = multi_steps(micro_adam(1e-3), every_k=4)  # accumulation: ḡ AND its statistics
    step = make_train_step(loss_fn, opt, impl="factorized")      # one jitted step, any wrapping
    params, state, loss, stats = step(params, opt.init(params), batch)

Each alias is a `scale_by_*` block (the direction, public, to chain with optax's own blocks)
followed by optax.adamw's tail, `optax.add_decayed_weights(λ, mask)` (the parameters cast to
the updates' dtype) and `optax.scale_by_learning_rate(lr)`: the update is −lr_t·(direction +
λ·p), λ on the leaves the mask (a pytree of bools shaped like params, or a function of params
returning one) selects, lr_t an optax schedule evaluated at the step count before the update,
or a number. The sign is `optax.scale_by_sign`, sign_ema's clipping `optax.clip_by_global_norm`,
the states optax's NamedTuples. The blocks are written here, from optax's moment helpers, where
optax's would differ: moments stay in float32 (or the parameter dtype when wider) for bfloat16
parameters (optax.scale_by_adam keeps ν in the parameter dtype; optax.ema mixes a float32 EMA
with bf16 updates by implicit promotion; this file is clean under
jax_numpy_dtype_promotion="strict").

Dtypes: every rule (and `multi_steps`) returns its updates in the dtype of the updates it was
given, optax's convention: float32 ḡ (pegrad's statistics of bfloat16 parameters) gives float32
updates, as optax.adam does, and `optax.apply_updates` rounds p + u to the parameters' dtype.
So optax's wrappers whose other branch returns zeros of the incoming updates compose with
bfloat16 parameters: optax.apply_if_finite (skips a non-finite step), multi_steps, optax.masked,
optax.chain (tests/test_optimizers_compose.py, every rule under each).

The statistics beside the updates (the contract every rule that reads `stats=` enforces):

* They follow the updates' tree. Under `optax.masked` and `optax.partition` (`multi_transform`)
  a rule sees the updates with `optax.MaskedNode` where the mask is False; it cuts every
  statistic it reads to the same tree, so micro_adam on the matrices and adam on the rest work
  with the one `stats` dict pegrad returns (no `mask_compatible_extra_args` needed).
* The updates must be the mean gradient the statistics were taken with, `stats["mean"]`, or c·ḡ
  for one global scalar c (c ≠ 1: optax.clip_by_global_norm, optax.scale, a schedule chained
  before the rule). A multiple is read as every per-example gradient scaled by c: q → c²·q,
  sign_mean → sign(c)·sign_mean, exactly as `max_grad_norm` does. So
  `optax.chain(optax.clip_by_global_norm(C), micro_adam(lr))` equals `micro_adam(lr,
  max_grad_norm=C)`. The test is per coordinate, not against the largest update: c is read where
  |ḡ| is largest, and every coordinate must equal c·ḡ_j to the rounding of forming it (`ULPS`
  ulps of its own, times 1 + √P for a data-dependent c that XLA may round per coordinate; +
  ULPS·tiny): a coordinate where ḡ_j = 0 must get 0. Anything else raises `InconsistentUpdates`
  naming the leaf, the coordinate, both values and the fix: optax.MultiSteps (which accumulates
  ḡ beside one micro-batch's statistics; refused when make_train_step builds the step) →
  `multi_steps`; an elementwise transform (optax.clip) → after the rule; coupled L2
  (optax.add_decayed_weights before the rule, however small λ) → the rule's `l2=λ`, exact: every
  example's gradient + λ·p. The check is free when the updates are the very arrays of
  stats["mean"] (the case in `make_train_step`, with or without wrappers that pass them on:
  chain, masked, partition, inject_hyperparams, apply_if_finite, multi_steps); otherwise it is a
  few elementwise operations, run on values under jit: `make_train_step` then waits for its step
  and raises `InconsistentUpdates` itself; a jit of your own raises Equinox's runtime error
  (`eqx.error_if`; `EQX_ON_ERROR` chooses what it does) naming the rule, the leaf and the fix:
  under `eqx.filter_jit` an `equinox.EquinoxRuntimeError` with that message, under `jax.jit`
  JAX's runtime error carrying it.
* `max_grad_norm` and the global-norm check read the leaves the rule sees (under a mask: its
  part), as optax.clip_by_global_norm inside optax.masked would.

Wrapping notes. `optax.inject_hyperparams` treats every callable argument as a schedule: pass
`static_args="mask"` when the mask is a function; it also casts hyperparameters to the
parameter dtype, where bf16 rounds b2 = 0.999 to 1: pass hyperparam_dtype=jnp.float32 for bf16
parameters. Accumulate with `multi_steps`, not `optax.MultiSteps` (refused above, except with
adam, sign_sgd and sign_ema, which read no statistics and so are right under either).

Exact references: `adam` equals `optax.adamw` at the same λ (bitwise on the same ḡ at float64;
λ defaults to 0 here and to 1e-4 in optax.adamw, so `adam(lr)` is `optax.adam(lr)`), sign_sgd at
momentum 0 equals `optax.sign_sgd`, sign_ema equals optax's Signum with decoupled weight decay;
`multi_steps` over k micro-batches equals one step on their union; every other rule equals its
formula. Proof, at float64, for impl="vmap" and impl="factorized", against optax and against
the formulas fed by a naive per-example loop: tests/test_optimizers.py and
tests/test_optimizers_compose.py.

Depends on jax (and its numpy), optax, equinox (its runtime errors) and jaxtyping only;
`make_train_step` imports pegrad when called.
"""

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PyTree

__all__ = [  # the public API (`from pegrad.optimizers import *`)
    "adam", "micro_adam", "micro_adam_var", "micro_adam_msq", "micro_sign_sgd", "sign_sgd",
    "sign_ema", "scale_by_adam", "scale_by_micro_adam", "scale_by_micro_adam_var",
    "scale_by_micro_adam_msq", "scale_by_ema", "scale_by_micro_sign_sgd", "scale_by_sign_sgd",
    "scale_by_sign_ema", "multi_steps", "MultiStepsState", "make_train_step", "required_stats",
    "trainable", "InconsistentUpdates", "MissingStatistics", "ULPS", "Step", "Stats",
    "LearningRate", "Mask", "Block", "Hyper", "Transformation", "AnyTransformation",
    "SecondMoment", "adam_preconditioner",
]  # fmt: skip
Stats = dict[str, Any]
LearningRate = optax.ScalarOrSchedule  # a float, or a function of the step count
Mask = PyTree | Callable[[PyTree], PyTree] | None
Block = Literal["tensor", "row"] | None
# A hyperparameter: a number, or a scalar array when optax.inject_hyperparams passes it.
Hyper = float | Float[Array, ""]
Transformation = optax.GradientTransformationExtraArgs
# What the functions here accept: any optax transformation (optax.MultiSteps is an object).
AnyTransformation = optax.GradientTransformation | optax.MultiSteps


class MissingStatistics(ValueError):
    """`update` was called without statistics its rule reads; `names` lists all of them.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> opt = optimizers.micro_adam(0.1)
        >>> p = {"w": jnp.ones(2)}
        >>> try:
        ...     opt.update(p, opt.init(p), p)
        ... except optimizers.MissingStatistics as err:
        ...     print(err.names)
        ('mean', 'sq_mean')
    """

    def __init__(self, rule: str, names: tuple[str, ...], got: Stats | None):
        self.names = names
        have = "no stats=" if got is None else f"stats with {sorted(got)}"
        ask = tuple(n for n in names if n != "batch_size")  # pegrad always has B
        super().__init__(
            f"{rule} reads the statistics {names} besides ḡ (the updates) but got {have}: call "
            f"update(ḡ, state, params, stats=stats) with the stats of "
            f"pegrad.value_and_grad_stats(loss_fn, {ask}), or use optimizers.make_train_step "
            "(a wrapper that drops stats=, as optax.MultiSteps inside optax.chain does: "
            "optimizers.multi_steps(opt, every_k) accumulates ḡ and the statistics)"
        )


# --------------------------------------------------------------------------------------------
# Shared pieces


def _moment_dtype(dtype: Any) -> jnp.dtype:
    # Squared bf16 gradients underflow and EMAs of them lose the update, so never below float32.
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def _zeros(params: PyTree) -> PyTree:
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _moment_dtype(p.dtype)), params)


def _widest(leaves: Sequence[Any]) -> jnp.dtype:
    dtypes = [_moment_dtype(jnp.asarray(x).dtype) for x in leaves]
    return max(dtypes, key=lambda d: d.itemsize, default=jnp.dtype(jnp.float32))


def _hyper(x: Any, dtype: Any) -> Any:
    """A hyperparameter for arithmetic in `dtype`. Python numbers stay weak, as in optax, so
    that results match optax bitwise; arrays (from optax.inject_hyperparams, in the widest
    parameter dtype) are cast, since strict promotion would refuse to mix them."""
    return x if isinstance(x, int | float) else jnp.asarray(x).astype(dtype)


def _cast(tree: PyTree, like: PyTree, scale: Array | None = None) -> PyTree:
    """Cast every leaf to its counterpart's dtype (explicitly: strict promotion), then scale."""

    def leaf(x: Array, m: Array) -> Array:
        x = jnp.asarray(x).astype(m.dtype)
        return x if scale is None else x * scale.astype(m.dtype)

    return jax.tree.map(leaf, tree, like)


def _check_params(rule: str, params: PyTree) -> None:
    if params is None:
        raise ValueError(
            f"{rule} needs params: update(ḡ, state, params, ...), as optax.adamw's (the "
            "weight decay reads them)"
        )


def _batch_size(rule: str, stats: Stats) -> Array | int:
    """B for the unbiased estimators, which divide by B − 1: B = 1 is an error, not a NaN."""
    b = stats["batch_size"]
    try:
        b = int(b)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return b  # only known at run time; pegrad's batch_size is concrete while tracing
    if b < 2:
        raise ValueError(
            f"{rule} needs at least 2 examples (units) per batch: its estimator divides by "
            f"B - 1, got B = {b}. Use micro_adam or adam for B = 1."
        )
    return b


def _clip_factor(mean: PyTree, max_grad_norm: Any) -> Array | None:
    """c = min(1, C/‖ḡ‖) over all leaves; ‖ḡ‖ = 0 gives C/0 = inf and so c = 1."""
    if max_grad_norm is None:
        return None
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(mean)]
    dtype = _widest(leaves)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(dtype))) for x in leaves))
    return jnp.minimum(1.0, _hyper(max_grad_norm, dtype) / norm)


def _check(rule: str, name: str, value: Any, ok: Callable[[Any], Any], want: str) -> None:
    """Reject a bad hyperparameter at construction. Schedules, None and traced values pass:
    under optax.inject_hyperparams in jit the factory is called with tracers."""
    if value is None or callable(value):
        return
    try:
        valid = bool(ok(value))
    except jax.errors.ConcretizationTypeError:
        return
    if not valid:
        raise ValueError(f"{rule}: {name} must be {want}, got {value!r}")


def _unit_interval(x: Any) -> Any:
    return (x >= 0.0) & (x < 1.0)


def _strict_clean(learning_rate: LearningRate) -> LearningRate:
    if not callable(learning_rate):
        return learning_rate

    def schedule(count: Any) -> Any:
        # optax's schedules mix Python ints and floats; they are not strict-promotion clean.
        with jax.numpy_dtype_promotion("standard"):
            return learning_rate(count)

    return schedule


def _with_stats(optimizer: Any) -> Any:
    """`optimizer` with an update that takes stats=: optax's wrapper drops extra arguments of a
    plain GradientTransformation; optax.MultiSteps forwards them itself."""
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer
    return optax.with_extra_args_support(optimizer)


def _add_decayed_weights(weight_decay: optax.ScalarOrSchedule, mask: Mask) -> Transformation:
    """optax.add_decayed_weights(λ, mask) with the parameters cast to the updates' dtype: u + λ·p
    is formed in the updates' dtype (float32 updates beside bfloat16 parameters are strict
    promotion clean; under standard promotion optax's block computes the same numbers)."""
    inner = optax.add_decayed_weights(weight_decay, mask)

    def like_updates(u: Any, p: Any) -> Any:
        return p if _is_masked(u) or p is None else jnp.asarray(p).astype(jnp.asarray(u).dtype)

    def update(
        updates: PyTree, state: Any, params: PyTree = None, **extra_args: Any
    ) -> tuple[PyTree, Any]:
        if params is not None:
            params = jax.tree.map(like_updates, updates, params, is_leaf=_is_masked)
        return inner.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _finish(
    rule: str,
    direction: Transformation,
    learning_rate: LearningRate,
    weight_decay: optax.ScalarOrSchedule,
    mask: Mask,
) -> Transformation:
    """direction, then −lr_t·(direction + λ·p) from optax's own blocks (optax.adamw's tail)."""
    _check(rule, "weight_decay", weight_decay, lambda x: x >= 0.0, ">= 0")
    return optax.chain(
        direction,
        _add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(_strict_clean(learning_rate)),
    )


# --------------------------------------------------------------------------------------------
# The statistics beside the updates: cut to the updates' tree, and consistent with them.


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _align(rule: str, name: str, stat: PyTree, updates: PyTree) -> PyTree:
    """`stat` (shaped like the whole parameter tree) cut to the updates' tree: where a wrapper
    (optax.masked, optax.partition) put a MaskedNode in place of a leaf or subtree, so here."""

    def leaf(u: Any, s: Any) -> Any:
        if _is_masked(u):
            return u
        if jnp.shape(s) != jnp.shape(u):
            raise ValueError(
                f"{rule}: stats[{name!r}] is not shaped like the updates: a leaf of shape "
                f"{jnp.shape(s)} beside an update of shape {jnp.shape(u)}"
            )
        return s

    try:
        return jax.tree.map(leaf, updates, stat, is_leaf=_is_masked)
    except (ValueError, TypeError) as err:
        if str(err).startswith(rule):
            raise
        raise ValueError(
            f"{rule}: stats[{name!r}] does not have the updates' tree (the parameters', or their "
            f"part under optax.masked / optax.partition): {err}"
        ) from None


# "The updates are c·ḡ" is decided coordinate by coordinate, never against the largest update:
# |u_j − c·ḡ_j| ≤ ULPS·ε·(1 + √P)·|c·ḡ_j| + ULPS·tiny at every j (ε, tiny those of the statistic
# and, where the updates are narrower, + ULPS/4 of the updates' ε for their one rounding). The
# √P: a data-dependent global factor (clip_by_global_norm's C/‖ḡ‖) is a sum of P squares, which
# XLA may round differently for different coordinates of one compiled program (33 ulps seen at
# P = 136, float32). A shift, an accumulated ḡ, an elementwise clip move some coordinate by
# more; where ḡ_j = 0, by any normal number at all; a NaN where ḡ_j is not NaN is a change too.
ULPS = 16


class InconsistentUpdates(ValueError):
    """A rule reading statistics was given updates that are not c·ḡ of its statistics' ḡ."""


_LAST_REFUSAL: dict[str, str] = {}  # the whole message of the last refusal found under jit


class _QuietRefusals(logging.Filter):
    """JAX logs the exception of a failed callback with its traceback; a refusal's is
    Equinox's runtime error carrying the message, raised again as it is: its log is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return "optimizers.InconsistentUpdates" not in str(error)


logging.getLogger("jax._src.callback").addFilter(_QuietRefusals())


def _refusal(rule: str, paths: tuple[str, ...], bad: Any, where: Any, u: Any, cg: Any) -> str:
    """The message for the first run (under vmap) and leaf that failed the check, or ""."""
    bad = np.asarray(bad)
    if not bad.any():
        return ""
    run = np.unravel_index(np.argmax(bad.any(axis=-1)), bad.shape[:-1]) if bad.ndim > 1 else ()
    leaf = int(np.argmax(bad[run]))
    at = lambda x: np.asarray(x)[run][leaf]
    return _inconsistent(rule, paths[leaf], f"flat index {int(at(where))}, the update is "
                         f"{float(at(u))!r} where c·ḡ is {float(at(cg))!r}")  # fmt: skip


def _failed_leaf(rule: str, paths: tuple[str, ...], *values: Any) -> np.ndarray:
    """The host side of the runtime check: each run's (under vmap) failing leaf, its whole
    message (coordinate and values) kept for make_train_step, which raises it."""
    message = _refusal(rule, paths, *values)
    if message:
        _LAST_REFUSAL["message"] = message
    return np.asarray(np.argmax(np.asarray(values[0]), axis=-1), np.int32)


def _inconsistent(rule: str, path: str, coordinate: str = "") -> str:
    at = f", {coordinate}" if coordinate else " (make_train_step names the coordinate, values)"
    return (
        f"{rule}: the updates it was given are not c·ḡ, one global multiple of the mean "
        f"gradient its statistics describe (stats['mean']): at {path}{at} (every coordinate "
        "must agree to rounding). "
        "A transformation before the rule changed ḡ per coordinate or across batches. Coupled "
        "L2 (optax.add_decayed_weights before it): pass l2=λ to the rule (the Adam family: "
        "exact), or put (λ/2)·‖p‖² in the loss; decoupled decay is weight_decay=λ. Accumulation "
        "(optax.MultiSteps): optimizers.multi_steps(opt, every_k). An elementwise transform "
        "(optax.clip): chain it after the rule, or clip by the global norm (max_grad_norm=C, or "
        "optax.clip_by_global_norm before the rule)."
    )


_RUNTIME_CHECKS = [0]  # how many checks were left to run time while tracing (make_train_step)


def _scale_of(rule: str, updates: PyTree, mean: PyTree) -> Array | None:
    """c with updates = c·ḡ, checked per coordinate; None when the updates are the very arrays
    of ḡ. c is read off the coordinate where |ḡ| is largest (1 exactly when u = ḡ there)."""
    u_flat = jax.tree_util.tree_leaves_with_path(updates)
    m_leaves = jax.tree.leaves(mean)
    u_leaves = [x for _, x in u_flat]
    if len(u_leaves) == len(m_leaves) and all(
        u is m for u, m in zip(u_leaves, m_leaves, strict=True)
    ):
        return None  # passed on unchanged, as make_train_step does: nothing to check
    dtype = _widest(u_leaves)
    pairs = [
        (jnp.ravel(jnp.asarray(a)).astype(dtype), jnp.ravel(jnp.asarray(b)).astype(dtype), a, b)
        for a, b in zip(u_leaves, m_leaves, strict=True)
        if jnp.size(a) > 0
    ]
    paths = tuple(jax.tree_util.keystr(p) or "the updates" for (p, a) in u_flat if jnp.size(a) > 0)
    if not pairs:
        return jnp.ones([], dtype)
    top = [jnp.argmax(jnp.where(jnp.isnan(m), -1.0, jnp.abs(m))) for _, m, _, _ in pairs]
    m_top = jnp.stack([m[i] for (_, m, _, _), i in zip(pairs, top, strict=True)])
    u_top = jnp.stack([u[i] for (u, _, _, _), i in zip(pairs, top, strict=True)])
    k = jnp.argmax(jnp.where(jnp.isnan(m_top), -1.0, jnp.abs(m_top)))
    c = jnp.where(m_top[k] != 0, u_top[k] / jnp.where(m_top[k] != 0, m_top[k], 1), 1.0)
    size = sum(int(jnp.size(m)) for _, m, _, _ in pairs)
    bads, wheres, us, cgs = [], [], [], []
    for u, m, a, b in pairs:
        u_info, m_info = (jnp.finfo(jnp.asarray(x).dtype) for x in (a, b))
        eps = ULPS * float(m_info.eps) * (1.0 + math.sqrt(size))
        eps += ULPS / 4 * max(float(u_info.eps) - float(m_info.eps), 0.0)  # u's own rounding
        tiny = ULPS * max(float(u_info.tiny), float(m_info.tiny))
        cg = c * m
        excess = jnp.abs(u - cg) - eps * jnp.abs(cg) - tiny
        # NaN where ḡ is NaN too is apply_if_finite's business; a NaN made from a number is not.
        excess = jnp.where(jnp.isnan(u) & ~jnp.isnan(m), jnp.inf, excess)
        excess = jnp.where(jnp.isnan(excess), -jnp.inf, excess)
        j = jnp.argmax(excess)
        bads.append(excess[j] > 0)
        wheres.append(j)
        us.append(u[j])
        cgs.append(cg[j])
    bad, where, u_at, cg_at = (jnp.stack(x) for x in (bads, wheres, us, cgs))
    try:
        failed = bool(jnp.any(bad))
    except jax.errors.ConcretizationTypeError:  # traced: checked when the step runs
        failed = None
    if failed is None:  # under jit: Equinox's runtime error (eqx.filter_jit shows it first)
        _RUNTIME_CHECKS[0] += 1
        host = functools.partial(_failed_leaf, rule, paths)
        out = jax.ShapeDtypeStruct((), jnp.int32)
        find = lambda: jax.pure_callback(
            host, out, bad, where, u_at, cg_at, vmap_method="broadcast_all"
        )
        leaf = jax.lax.cond(jnp.any(bad), find, lambda: jnp.zeros((), jnp.int32))
        messages = [f"optimizers.InconsistentUpdates: {_inconsistent(rule, p)}" for p in paths]
        c = eqx.branched_error_if(c, jnp.any(bad), leaf, messages)
    elif failed:
        raise InconsistentUpdates(_refusal(rule, paths, bad, where, u_at, cg_at))
    return c


def _statistics(rule: str, updates: PyTree, stats: Stats | None, reads: tuple[str, ...]) -> Stats:
    """The statistics `reads` (and "mean", and "batch_size" if read) cut to the updates' tree
    and made consistent with them (see the module docstring); MissingStatistics if absent."""
    needs = ("mean", *reads)
    if stats is None or any(name not in stats for name in needs):
        raise MissingStatistics(rule, needs, stats)
    trees = [n for n in needs if n != "batch_size"]
    out = {n: _align(rule, n, stats[n], updates) for n in trees}
    c = _scale_of(rule, updates, out["mean"])
    if c is not None:
        out["mean"] = updates

        def scaled(name: str, x: Array) -> Array:
            x = jnp.asarray(x)
            if name in ("sq_mean", "var"):
                return x * jnp.square(c).astype(x.dtype)
            if name == "sign_mean":
                return x * jnp.sign(c).astype(x.dtype)
            return x * c.astype(x.dtype)  # a linear statistic, e.g. clipped_mean

        for n in trees[1:]:
            out[n] = jax.tree.map(functools.partial(scaled, n), out[n])
    if "batch_size" in reads:
        out["batch_size"] = stats["batch_size"]
    return out


# --------------------------------------------------------------------------------------------
# The Adam family: the same update, four second-moment inputs.

SecondMoment = Callable[[Array, Any, Any], Array]  # (ḡ, q or None, B or None) -> v input


def _block_mean(v: Array, block: Block) -> Array:
    if block == "tensor":
        return jnp.mean(v)
    if block == "row" and v.ndim >= 1:
        return jnp.mean(v, axis=-1, keepdims=True)
    return v  # no blocks, or a scalar leaf: its own block


def _debias(moments: PyTree, beta: Any, count: Any) -> PyTree:
    """moments/(1 − β^count). optax's helper on the whole tree, as optax.scale_by_adam calls it:
    XLA compiles it per leaf differently (x·(1/c) for x/c), a last-bit difference. Array
    arguments: the helper's Python float ** int32 count fails strict promotion."""
    widest = _widest(jax.tree.leaves(moments))
    beta = jnp.asarray(beta).astype(widest)
    return optax.tree.bias_correction(moments, beta, jnp.asarray(count).astype(widest))


def _divisor(v_hat: Array, eps: Any, eps_root: Any, block: Block, relu: bool) -> Array:
    """√(⟨v̂⟩ + ε_root) + ε, what an Adam-family rule divides m̂ by (v̂ block averaged, then
    ReLU'd with `relu`). optax.scale_by_adam's order: ε_root under the root, ε outside it. A
    literal 0 adds nothing: the program (and its rounding) is the one without ε_root."""
    v_hat = _block_mean(v_hat, block)
    if relu:
        v_hat = jnp.maximum(v_hat, 0.0)
    if not (isinstance(eps_root, int | float) and eps_root == 0):
        v_hat = v_hat + _hyper(eps_root, v_hat.dtype)
    return jnp.sqrt(v_hat) + _hyper(eps, v_hat.dtype)


def adam_preconditioner(
    state: optax.ScaleByAdamState,
    *,
    b2: Hyper,
    eps: Hyper,
    eps_root: Hyper = 0.0,
    block: Block = None,
    relu: bool = False,
) -> PyTree:
    """P = 1/(√(⟨v̂⟩ + ε_root) + ε), the diagonal an Adam-family rule with these
    hyperparameters divides its momentum by when its second moment is `state`'s: v̂ =
    ν/(1 − β₂^t) at the state's count t, block averaged and ReLU'd as the rule does
    (micro_adam_msq: relu=True and its block). The same `_divisor` as the rule's direction, so
    m̂·P is the rule's direction to one rounding. Taken from the state BEFORE a step's update
    it does not depend on that step's batch (what `pegrad.gradient_noise_scale`'s B_P needs to
    be unbiased); at t = 0 (no update yet, v̂ = 0/0) every entry is NaN.

    Args:
        state: the rule's `optax.ScaleByAdamState` (count t, ν).
        b2: second-moment decay β2 of the rule.
        eps: ε, added outside the square root.
        eps_root: ε_root, added inside it; 0: none.
        block: micro_adam_msq's block (None, "tensor" or "row"); None for the others.
        relu: True for micro_adam_msq (ReLU(⟨v̂⟩)), False for the others.

    Returns:
        P, a tree like ν: each leaf shaped like its ν (a block's value repeated over the
        block), in its dtype.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from pegrad import optimizers
        >>> nu = {"w": jnp.array([0.01, 4.0])}
        >>> state = optax.ScaleByAdamState(jnp.array(1), {"w": jnp.zeros(2)}, nu)
        >>> p = optimizers.adam_preconditioner(state, b2=0.5, eps=0.0)  # v̂ = ν/(1 − 0.5)
        >>> print(p["w"].round(4))
        [7.0711 0.3536]
    """
    v_hat = _debias(state.nu, b2, state.count)
    p = lambda v: jnp.broadcast_to(1.0 / _divisor(v, eps, eps_root, block, relu), v.shape)  # noqa: E731
    return jax.tree.map(p, v_hat)


def _scale_by_adam_family(
    rule: str,
    reads: tuple[str, ...],
    second_moment: SecondMoment,
    b1: Any,
    b2: Any,
    eps: Any,
    max_grad_norm: Any,
    relu_preconditioner: bool = False,
    block: Block = None,
    eps_root: Any = 0.0,
    l2: Any = 0.0,
) -> Transformation:
    """The direction m̂/(√(v̂ + ε_root) + ε) with v fed by second_moment(ḡ, q, B) (v̂ block
    averaged, then ReLU'd, before ε_root is added); state as optax.adam's. Coupled L2 shifts
    every example's (clipped) gradient by d = λ·p: ḡ → ḡ + d, q → q + 2d·ḡ + d²."""
    _check(rule, "b1", b1, _unit_interval, "in [0, 1)")
    _check(rule, "b2", b2, _unit_interval, "in [0, 1)")
    _check(rule, "eps", eps, lambda x: x >= 0.0, ">= 0")
    _check(rule, "eps_root", eps_root, lambda x: x >= 0.0, ">= 0")
    _check(rule, "max_grad_norm", max_grad_norm, lambda x: x > 0.0, "> 0 or None")
    _check(rule, "l2", l2, lambda x: x >= 0.0, ">= 0")
    shift = not (isinstance(l2, int | float) and l2 == 0)  # literal 0: the program without
    if block not in ("tensor", "row", None):
        raise ValueError(f"{rule}: block must be 'tensor', 'row' or None, got {block!r}")

    def init(params: PyTree) -> optax.ScaleByAdamState:
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), _zeros(params), _zeros(params))

    def update(
        updates: PyTree,
        state: optax.ScaleByAdamState,
        params: PyTree = None,
        *,
        stats: Stats | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, optax.ScaleByAdamState]:
        st = _statistics(rule, updates, stats, reads) if reads else {}
        _check_params(rule, params)
        b = _batch_size(rule, st) if "batch_size" in reads else None
        c = _clip_factor(updates, max_grad_norm)
        g = _cast(updates, state.mu, c)
        q = (
            _cast(st["sq_mean"], state.nu, None if c is None else c * c)
            if "sq_mean" in reads
            else None
        )
        if shift:  # every example's gradient + d: its mean + d, its mean square + 2d·ḡ + d²
            d = jax.tree.map(lambda p, m: p.astype(m.dtype) * _hyper(l2, m.dtype), params, g)
            if q is not None:
                q = jax.tree.map(lambda ql, gl, dl: ql + dl * (2.0 * gl + dl), q, g, d)
            g = jax.tree.map(jnp.add, g, d)
        if q is not None:
            nu_in = jax.tree.map(lambda gl, ql: second_moment(gl, ql, b), g, q)
        else:
            nu_in = jax.tree.map(lambda gl: second_moment(gl, None, b), g)
        count = optax.safe_increment(state.count)

        def ema(x: Array, m: Array, beta: Any) -> Array:
            return optax.tree.update_moment(x, m, _hyper(beta, m.dtype), 1)

        mu = jax.tree.map(lambda x, m: ema(x, m, b1), g, state.mu)
        nu = jax.tree.map(lambda x, v: ema(x, v, b2), nu_in, state.nu)

        def direction(m_hat: Array, v_hat: Array) -> Array:
            return m_hat / _divisor(v_hat, eps, eps_root, block, relu_preconditioner)

        m_hat, v_hat = _debias(mu, b1, count), _debias(nu, b2, count)
        # In the incoming updates' dtype, as optax's rules return theirs (optax.apply_if_finite
        # and multi_steps' skip branches return zeros of that dtype beside it).
        direction_ = _cast(jax.tree.map(direction, m_hat, v_hat), updates)
        return direction_, optax.ScaleByAdamState(count, mu, nu)

    # optax types a state as any pytree; ours is the NamedTuple it is.
    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def _as_float(b: Any, like: Array) -> Any:
    return b if isinstance(b, int) else jnp.asarray(b).astype(like.dtype)


def _sigma2(g: Array, q: Any, b: Any) -> Array:
    bf = _as_float(b, g)
    return bf / (bf - 1.0) * jnp.maximum(q - g * g, 0.0)


def _mu2(g: Array, q: Any, b: Any) -> Array:
    bf = _as_float(b, g)
    return (bf * (g * g) - q) / (bf - 1.0)


def scale_by_adam(
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    max_grad_norm: Hyper | None = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """Adam's direction m̂/(√(v̂ + ε_root) + ε) on the mean gradient ḡ (reads no stats):
    optax.scale_by_adam with moments in float32 for bfloat16 parameters, and optional clipping.

    m ← β1·m + (1−β1)·c·ḡ,   v ← β2·v + (1−β2)·(c·ḡ)²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    direction m̂/(√(v̂ + ε_root) + ε), with c = min(1, C/‖ḡ‖) (1 without C).

    Args:
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root (optax's convention).
        max_grad_norm: C, clipping ḡ by its global norm; None: no clipping.
        eps_root: ε_root ≥ 0, added inside the square root (optax's eps_root); 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        A transformation whose state is `optax.ScaleByAdamState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_adam()
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> print(updates["w"].round(4))  # step 1: m̂ = ḡ, v̂ = ḡ², so ḡ/(|ḡ| + ε)
        [ 1. -1.]
    """
    return _scale_by_adam_family(
        "Adam", (), lambda g, q, b: g * g, b1, b2, eps, max_grad_norm, eps_root=eps_root, l2=l2
    )


def scale_by_micro_adam(
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    max_grad_norm: Hyper | None = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """MicroAdam's direction: Adam with the per-example second moment q = (1/B) Σ_i g_i²
    (reads stats "mean", "sq_mean").

    m ← β1·m + (1−β1)·c·ḡ,   v ← β2·v + (1−β2)·c²·q,   direction m̂/(√(v̂ + ε_root) + ε)
    with c = min(1, C/‖ḡ‖) applied as if to every per-example gradient.

    Args:
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root.
        max_grad_norm: C, clipping every per-example gradient by c; None: no clipping.
        eps_root: ε_root ≥ 0, added inside the square root (optax's eps_root); 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        A transformation whose state is `optax.ScaleByAdamState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_micro_adam()
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))  # step 1: ḡ/(√q + ε)
        [ 0.7071 -1.    ]
    """
    return _scale_by_adam_family(
        "MicroAdam", ("sq_mean",), lambda g, q, b: q, b1, b2, eps, max_grad_norm,
        eps_root=eps_root, l2=l2,
    )  # fmt: skip


def scale_by_micro_adam_var(
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    max_grad_norm: Hyper | None = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """MicroAdamVar's direction: preconditioned by the unbiased variance alone (reads stats
    "mean", "sq_mean", "batch_size"; B ≥ 2, else ValueError).

    σ̂² = B/(B−1)·(q − ḡ²),   v ← β2·v + (1−β2)·σ̂²,   direction m̂/(√(v̂ + ε_root) + ε)

    q ≥ ḡ² holds exactly (Jensen); q − ḡ² is clamped at 0 so that rounding cannot make √v̂ NaN.

    Args:
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root.
        max_grad_norm: C, clipping every per-example gradient by c; None: no clipping.
        eps_root: ε_root ≥ 0, added inside the square root (optax's eps_root); 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        A transformation whose state is `optax.ScaleByAdamState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_micro_adam_var()
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))  # step 1: ḡ/(√σ̂² + ε), σ̂² = 4/3·(q − ḡ²) = [1/3, 0]
        [ 8.66e-01 -5.00e+07]
    """
    return _scale_by_adam_family(
        "MicroAdamVar", ("sq_mean", "batch_size"), _sigma2, b1, b2, eps, max_grad_norm,
        eps_root=eps_root, l2=l2,
    )  # fmt: skip


def scale_by_micro_adam_msq(
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    max_grad_norm: Hyper | None = None,
    block: Block = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """MicroAdamMSQ's direction: preconditioned by the unbiased squared mean alone (reads stats
    "mean", "sq_mean", "batch_size"; B ≥ 2, else ValueError).

    μ̂² = (B·ḡ² − q)/(B−1)  (unbiased for μ², can be negative),  v ← β2·v + (1−β2)·μ̂²,
    direction m̂/(√(ReLU(⟨v̂⟩) + ε_root) + ε)

    Where ε goes: the paper's preconditioner is √ReLU(v̂) + ε (eps=ε, eps_root=0, the default);
    eps=0, eps_root=ε is √(ReLU(v̂) + ε), optax's eps_root placement. Where μ̂² ≤ 0 the first
    gives the step m̂/ε, the second m̂/√ε: the same ε caps the step far lower inside the root
    when ε < 1.

    ⟨v̂⟩ is v̂ averaged over a block of coordinates of one leaf, then broadcast back over it:
    the paper's open question, whether pooling the noisy estimate μ̂² stabilizes the rule.
    block=None: each coordinate alone, ⟨v̂⟩ = v̂. block="tensor": the mean over all elements of
    the leaf. block="row": the mean over its last axis, one value per index of the other axes.
    For `eqx.nn.Linear`'s weight, shaped [out, in] (y = W @ x), a row is one OUTPUT unit: the
    weights into it from every input. An embedding [vocab, d]: one per token; a stacked
    [L, out, in]: one per layer and output unit; a vector is one row, so "row" averages it
    whole; a scalar is its own block. The average is taken before the ReLU, so negative and
    positive estimates in a block cancel. v itself is kept per coordinate (the mean commutes
    with the EMA and the debiasing).

    Args:
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root.
        max_grad_norm: C, clipping every per-example gradient by c; None: no clipping.
        block: None, "tensor" or "row" (above).
        eps_root: ε_root ≥ 0, added inside the square root after the ReLU; 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        A transformation whose state is `optax.ScaleByAdamState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_micro_adam_msq(eps=0.1, block="tensor")
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))  # μ̂² = [1/6, 1/4], ⟨v̂⟩ = 5/24 per tensor
        [ 0.8986 -0.8986]
        >>> inside = optimizers.scale_by_micro_adam_msq(eps=0.0, eps_root=0.1)
        >>> updates, _ = inside.update(g, inside.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))  # ḡ/√(μ̂² + ε_root) = ḡ/√[0.2667, 0.35]
        [ 0.9682 -0.8452]
    """
    return _scale_by_adam_family(
        "MicroAdamMSQ", ("sq_mean", "batch_size"), _mu2, b1, b2, eps, max_grad_norm,
        relu_preconditioner=True, block=block, eps_root=eps_root, l2=l2,
    )  # fmt: skip


def adam(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    mask: Mask = None,
    max_grad_norm: Hyper | None = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """Adam on the mean gradient ḡ (reads no stats); equals `optax.adamw` at the same λ, whose
    default is 0 here and 1e-4 in optax.adamw (`adam(lr)` is `optax.adam(lr)`).

    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·ḡ²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√(v̂ + ε_root) + ε) + λ·p )

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root.
        weight_decay: λ, decoupled weight decay.
        mask: the leaves λ applies to: a pytree of bools like params, or a function of params
            returning one (optax.add_decayed_weights'); None: all.
        max_grad_norm: C, clipping ḡ by its global norm first; None: no clipping.
        eps_root: ε_root ≥ 0, added inside the square root (optax.adam's eps_root); 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        `chain(scale_by_adam(...), add_decayed_weights(λ, mask), scale_by_learning_rate(lr))`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.adam(learning_rate=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> print(updates["w"].round(4))
        [-0.1  0.1]
    """
    core = scale_by_adam(b1, b2, eps, max_grad_norm, eps_root, l2)
    return _finish("Adam", core, learning_rate, weight_decay, mask)


def micro_adam(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    mask: Mask = None,
    max_grad_norm: Hyper | None = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """MicroAdam: Adam with the per-example second moment q = (1/B) Σ_i g_i² = ḡ² + σ²(B−1)/B
    (reads stats "mean", "sq_mean").

    Which MicroAdam: Roulet & Agarwala's (arXiv 2510.00236), Adam whose second moment is the
    per-example mean of squares. Not IST-DASLab's optimizer of the same name (Modoranu et al.,
    NeurIPS 2024; the package ista_daslab_micro_adam), which compresses Adam's state and
    reads no per-example statistics.

    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·q,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√(v̂ + ε_root) + ε) + λ·p )

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root.
        weight_decay: λ, decoupled weight decay.
        mask: the leaves λ applies to (as in `adam`); None: all.
        max_grad_norm: C, clipping every per-example gradient by c = min(1, C/‖ḡ‖): ḡ → c·ḡ,
            q → c²·q (the paper tames MicroAdam's loss spikes with C = 1e-2); None: none.
        eps_root: ε_root ≥ 0, added inside the square root (optax's eps_root); 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        `chain(scale_by_micro_adam(...), add_decayed_weights(λ, mask),
        scale_by_learning_rate(lr))`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.micro_adam(learning_rate=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))
        [-0.0707  0.1   ]
    """
    core = scale_by_micro_adam(b1, b2, eps, max_grad_norm, eps_root, l2)
    return _finish("MicroAdam", core, learning_rate, weight_decay, mask)


def micro_adam_var(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    mask: Mask = None,
    max_grad_norm: Hyper | None = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """MicroAdamVar: preconditioned by the unbiased variance alone (reads stats "mean",
    "sq_mean" and "batch_size"; B ≥ 2, else ValueError).

    σ̂² = B/(B−1)·(q − ḡ²)
    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·σ̂²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√(v̂ + ε_root) + ε) + λ·p )

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root.
        weight_decay: λ, decoupled weight decay.
        mask: the leaves λ applies to (as in `adam`); None: all.
        max_grad_norm: C, clipping every per-example gradient (as in `micro_adam`).
        eps_root: ε_root ≥ 0, added inside the square root (optax's eps_root); 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        `chain(scale_by_micro_adam_var(...), add_decayed_weights(λ, mask),
        scale_by_learning_rate(lr))`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.micro_adam_var(learning_rate=0.1, eps=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))  # ḡ/(√σ̂² + ε), σ̂² = [1/3, 0]
        [-0.0738  0.5   ]
    """
    core = scale_by_micro_adam_var(b1, b2, eps, max_grad_norm, eps_root, l2)
    return _finish("MicroAdamVar", core, learning_rate, weight_decay, mask)


def micro_adam_msq(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    mask: Mask = None,
    max_grad_norm: Hyper | None = None,
    block: Block = None,
    eps_root: Hyper = 0.0,
    l2: Hyper = 0.0,
) -> Transformation:
    """MicroAdamMSQ: preconditioned by the unbiased squared mean alone (reads stats "mean",
    "sq_mean" and "batch_size"; B ≥ 2, else ValueError).

    μ̂² = (B·ḡ² − q)/(B−1)          (unbiased for μ², can be negative)
    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·μ̂²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√(ReLU(⟨v̂⟩) + ε_root) + ε) + λ·p ),   ⟨v̂⟩: see `scale_by_micro_adam_msq`

    The paper's placement √ReLU(v̂) + ε is eps=ε, eps_root=0 (the default); eps=0,
    eps_root=ε puts ε inside the root (optax's eps_root), capping the step where μ̂² ≤ 0 at
    lr·m̂/√ε instead of lr·m̂/ε.

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        b1: first-moment decay β1, in [0, 1).
        b2: second-moment decay β2, in [0, 1).
        eps: ε, added outside the square root.
        weight_decay: λ, decoupled weight decay.
        mask: the leaves λ applies to (as in `adam`); None: all.
        max_grad_norm: C, clipping every per-example gradient (as in `micro_adam`).
        block: v̂ averaged per None (coordinate), "tensor" (leaf) or "row" (output unit of an
            [out, in] weight) before the root.
        eps_root: ε_root ≥ 0, added inside the square root after the ReLU; 0: none.
        l2: λ₂ ≥ 0, coupled L2 (the gradient of (λ₂/2)·‖p‖² in every example's loss): each
            example's gradient + λ₂·p, so ḡ → ḡ + λ₂p and q → q + 2λ₂p·ḡ + λ₂²p² exactly
            (σ̂² unchanged): optax.add_decayed_weights before the rule, made exact. With
            max_grad_norm the clip comes first (c from ḡ alone, the decay not clipped);
            0: none.

    Returns:
        `chain(scale_by_micro_adam_msq(...), add_decayed_weights(λ, mask),
        scale_by_learning_rate(lr))`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.micro_adam_msq(learning_rate=0.1, eps=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))  # ḡ/(√μ̂² + ε), μ̂² = [1/6, 1/4]
        [-0.0984  0.0833]
        >>> opt = optimizers.micro_adam_msq(learning_rate=0.1, eps=0.0, eps_root=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))  # ḡ/√(μ̂² + ε)
        [-0.0968  0.0845]
    """
    core = scale_by_micro_adam_msq(b1, b2, eps, max_grad_norm, block, eps_root, l2)
    return _finish("MicroAdamMSQ", core, learning_rate, weight_decay, mask)


# --------------------------------------------------------------------------------------------
# The sign family: where the sign sits in per-example → batch average → EMA.


def _ema(rule: str, momentum: Any, read: str | None = None) -> Transformation:
    """e ← β·e + (1−β)·x with x the updates, or stats[read]; returns e in the updates' dtype.

    optax.ema(β, debias=False) computes the same but keeps e in one given dtype and mixes a
    float32 e with bf16 updates by implicit promotion; here e is per leaf float32 or wider."""
    _check(rule, "momentum", momentum, _unit_interval, "in [0, 1)")

    def init(params: PyTree) -> optax.EmaState:
        return optax.EmaState(jnp.zeros([], jnp.int32), _zeros(params))

    def update(
        updates: PyTree,
        state: optax.EmaState,
        params: PyTree = None,
        *,
        stats: Stats | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, optax.EmaState]:
        x = updates if read is None else _statistics(rule, updates, stats, (read,))[read]
        _check_params(rule, params)
        x = _cast(x, state.ema)

        def leaf(xl: Array, e: Array) -> Array:
            return optax.tree.update_moment(xl, e, _hyper(momentum, e.dtype), 1)

        ema = jax.tree.map(leaf, x, state.ema)
        # In the incoming updates' dtype (optax's convention); bf16 updates have float32's
        # exponent range: the cast keeps every sign a later sign reads.
        return _cast(ema, updates), optax.EmaState(optax.safe_increment(state.count), ema)

    # optax types a state as any pytree; ours is the NamedTuple it is.
    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def scale_by_ema(momentum: Hyper = 0.9) -> Transformation:
    """The EMA of the updates without debiasing, e ← β·e + (1−β)·u (reads no stats):
    optax.ema(β, debias=False) with e in float32 for bfloat16 parameters.

    Args:
        momentum: β, in [0, 1); 0 passes the updates through.

    Returns:
        A transformation whose state is `optax.EmaState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_ema(0.5)
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> print(updates["w"].round(4))  # (1 − β)·ḡ
        [ 0.25 -0.25]
    """
    return _ema("EMA", momentum)


def scale_by_micro_sign_sgd(momentum: Hyper = 0.0) -> Transformation:
    """MicroSignSGD's direction, the sign before the batch average: the EMA of
    s = (1/B) Σ_i sign(g_i) (reads stats "mean", "sign_mean"; ḡ only for the consistency check).

    e ← β·e + (1−β)·s                                     (β = 0: e = s, no EMA)

    Args:
        momentum: β, in [0, 1).

    Returns:
        A transformation whose state is `optax.EmaState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_micro_sign_sgd()
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))
        [ 0.5 -1. ]
    """
    return _ema("MicroSignSGD", momentum, read="sign_mean")


def scale_by_sign_sgd(momentum: Hyper = 0.0) -> Transformation:
    """SignSGD's direction, the sign after the batch average and before the EMA (reads no
    stats): `chain(optax.scale_by_sign(), scale_by_ema(β))`.

    e ← β·e + (1−β)·sign(ḡ)                                (β = 0: plain signSGD)

    Args:
        momentum: β, in [0, 1).

    Returns:
        A chain whose states are optax.scale_by_sign's and `optax.EmaState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_sign_sgd()
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> print(updates["w"].round(4))
        [ 1. -1.]
    """
    return optax.chain(optax.scale_by_sign(), _ema("SignSGD", momentum))


def scale_by_sign_ema(momentum: Hyper = 0.9, max_grad_norm: Hyper | None = None) -> Transformation:
    """SignEMA's direction, the sign last, after the EMA (reads no stats):
    `chain(optax.clip_by_global_norm(C), scale_by_ema(β), optax.scale_by_sign())`.

    e ← β·e + (1−β)·c·ḡ,   c = min(1, C/‖ḡ‖) (1 without C),   direction sign(e)

    Args:
        momentum: β, in [0, 1).
        max_grad_norm: C for the clipping before the EMA; None: no clipping.

    Returns:
        A chain of optax's blocks and `scale_by_ema`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.scale_by_sign_ema()
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> print(updates["w"].round(4))
        [ 1. -1.]
    """
    rule = "SignEMA"
    _check(rule, "max_grad_norm", max_grad_norm, lambda x: x > 0.0, "> 0 or None")
    clip = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
    return optax.chain(*clip, _ema(rule, momentum), optax.scale_by_sign())


def micro_sign_sgd(
    learning_rate: LearningRate,
    momentum: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    mask: Mask = None,
) -> Transformation:
    """MicroSignSGD: the sign before the batch average (reads stats "mean", "sign_mean").

    e ← β·e + (1−β)·s,   s = (1/B) Σ_i sign(g_i)          (β = 0: e = s, no EMA)
    u = −lr_t·( e + λ·p )

    Sign-only rules are invariant to a positive scale of the gradients and take no clipping.

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        momentum: β, in [0, 1).
        weight_decay: λ, decoupled weight decay.
        mask: the leaves λ applies to (as in `adam`); None: all.

    Returns:
        `chain(scale_by_micro_sign_sgd(β), add_decayed_weights(λ, mask),
        scale_by_learning_rate(lr))`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.micro_sign_sgd(learning_rate=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        >>> print(updates["w"].round(4))
        [-0.05  0.1 ]
    """
    core = scale_by_micro_sign_sgd(momentum)
    return _finish("MicroSignSGD", core, learning_rate, weight_decay, mask)


def sign_sgd(
    learning_rate: LearningRate,
    momentum: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    mask: Mask = None,
) -> Transformation:
    """SignSGD: the sign after the batch average, before the EMA (reads no stats). At β = 0
    and λ = 0 it is `optax.sign_sgd`.

    e ← β·e + (1−β)·sign(ḡ)                                (β = 0: plain signSGD)
    u = −lr_t·( e + λ·p )

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        momentum: β, in [0, 1).
        weight_decay: λ, decoupled weight decay.
        mask: the leaves λ applies to (as in `adam`); None: all.

    Returns:
        `chain(scale_by_sign_sgd(β), add_decayed_weights(λ, mask), scale_by_learning_rate(lr))`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.sign_sgd(learning_rate=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> print(updates["w"].round(4))
        [-0.1  0.1]
    """
    core = scale_by_sign_sgd(momentum)
    return _finish("SignSGD", core, learning_rate, weight_decay, mask)


def sign_ema(
    learning_rate: LearningRate,
    momentum: Hyper = 0.9,
    weight_decay: Hyper = 0.0,
    mask: Mask = None,
    max_grad_norm: Hyper | None = None,
) -> Transformation:
    """SignEMA: the sign last, after the EMA (reads no stats): `optax.signum` with decoupled
    weight decay, and clipping c·ḡ = `optax.clip_by_global_norm(C)` first when C is given.

    e ← β·e + (1−β)·c·ḡ,   c = min(1, C/‖ḡ‖) (1 without C)
    u = −lr_t·( sign(e) + λ·p )

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        momentum: β, in [0, 1).
        weight_decay: λ, decoupled weight decay.
        mask: the leaves λ applies to (as in `adam`); None: all.
        max_grad_norm: C; None: no clipping.

    Returns:
        `chain(scale_by_sign_ema(β, C), add_decayed_weights(λ, mask),
        scale_by_learning_rate(lr))`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> params, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.5])}
        >>> stats = {"mean": g, "sq_mean": {"w": jnp.array([0.5, 0.25])},
        ...          "sign_mean": {"w": jnp.array([0.5, -1.0])}, "batch_size": 4}
        >>> opt = optimizers.sign_ema(learning_rate=0.1)
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> print(updates["w"].round(4))
        [-0.1  0.1]
    """
    core = scale_by_sign_ema(momentum, max_grad_norm)
    return _finish("SignEMA", core, learning_rate, weight_decay, mask)


# --------------------------------------------------------------------------------------------
# Accumulation: k micro-batches, one update, the statistics of their union.

# How each statistic of a union of micro-batches follows from theirs: per-unit averages merge
# weighted by their unit counts; the variance by the pooled (Chan) formula below.
_AVERAGES = ("mean", "sq_mean", "sign_mean", "clipped_mean")
_MERGEABLE = (*_AVERAGES, "var")


class MultiStepsState(NamedTuple):
    """The state of `multi_steps`."""

    mini_step: Int[Array, ""]  # micro-batches accumulated since the last update, 0 .. k−1
    units: Array  # the units (examples) in them, N = Σ_j B_j
    acc: dict[str, PyTree]  # per statistic the inner rule reads, its value on their union
    inner_state: Any  # the inner transformation's


def multi_steps(optimizer: AnyTransformation, every_k: int) -> Transformation:
    """Gradient accumulation that keeps the statistics exact: `optimizer` updates once per
    `every_k` micro-batches, with ḡ AND every statistic it reads those of the union of the
    micro-batches, so k micro-batches of B equal one step on kB examples. The other steps
    return zero updates and leave the inner state alone (as optax.MultiSteps).

    Over micro-batches j with B_j units each (stats["batch_size"], 1 when no stats are given),
    N = Σ_j B_j, and for ḡ, "sq_mean", "sign_mean", "clipped_mean" (averages over units):
    x = Σ_j B_j·x_j / N; B = N; "var" (unbiased) by the pooled (Chan) merge of two groups,
    (N−1)·σ² = (N_a−1)·σ_a² + (N_b−1)·σ_b² + (ḡ_b − ḡ_a)²·N_a·N_b/N. Per-example statistics
    ("sq_norms") cannot be accumulated in a fixed-size state: an inner rule reading them is
    refused. Incoming updates are checked against their statistics as the rules check them
    (one global multiple c·ḡ allowed, which scales the statistics alike), per micro-batch.

    Args:
        optimizer: the inner transformation (any composition of the rules here and optax's).
        every_k: micro-batches per update, ≥ 1.

    Returns:
        A transformation whose state is `MultiStepsState`.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> p = {"w": jnp.zeros(1)}
        >>> opt = optimizers.multi_steps(optimizers.micro_adam(1.0, b1=0.0, b2=0.0), 2)
        >>> state = opt.init(p)
        >>> for g, q in [(1.0, 2.0), (3.0, 10.0)]:  # two micro-batches of 1 example
        ...     st = {"mean": {"w": jnp.array([g])}, "sq_mean": {"w": jnp.array([q])},
        ...           "batch_size": 1}
        ...     u, state = opt.update(st["mean"], state, p, stats=st)
        >>> round(u["w"].tolist()[0], 4)  # −ḡ/√q on the union: ḡ = 2, q = 6
        -0.8165
    """
    if not (isinstance(every_k, int) and every_k >= 1):
        raise ValueError(f"multi_steps: every_k must be an int >= 1, got {every_k!r}")
    rule = "multi_steps"
    inner_tx = _with_stats(optimizer)

    def init(params: PyTree) -> MultiStepsState:
        names = required_stats(inner_tx, params)
        cannot = [n for n in names if n not in _MERGEABLE]
        if cannot:
            raise ValueError(
                f"multi_steps: the inner optimizer reads {cannot}, per-example statistics that "
                f"have no fixed-size accumulation; it can accumulate {_MERGEABLE}"
            )
        zero = jnp.zeros([], _widest(jax.tree.leaves(params)))
        acc = {n: _zeros(params) for n in names}
        return MultiStepsState(jnp.zeros([], jnp.int32), zero, acc, inner_tx.init(params))

    def update(
        updates: PyTree,
        state: MultiStepsState,
        params: PyTree = None,
        *,
        stats: Stats | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, MultiStepsState]:
        reads = tuple(n for n in state.acc if n != "mean")
        if reads:
            st = _statistics(rule, updates, stats, (*reads, "batch_size"))
        else:  # an inner rule that reads ḡ only: count-weighted if B is known
            st = {"mean": updates, "batch_size": (stats or {}).get("batch_size", 1)}
        old = state.units
        b = jnp.asarray(st["batch_size"]).astype(old.dtype)
        units = old + b
        w = b / jnp.maximum(units, 1)
        # A micro-batch keeping no example adds nothing (its statistics are NaN, 0·NaN is not
        # 0); one keeping one has no spread of its own, only its mean's distance to the rest.

        def average(a: Array, x: Array) -> Array:
            x = jnp.asarray(x).astype(a.dtype)
            return jnp.where(b > 0, a + (x - a) * w.astype(a.dtype), a)

        acc = {n: jax.tree.map(average, state.acc[n], st[n]) for n in state.acc if n != "var"}
        if "var" in state.acc:
            # Chan: the sums of squared deviations add, plus the spread of the two means.
            def pooled(va: Array, vb: Array, ma: Array, mb: Array) -> Array:
                vb, mb, f = vb.astype(va.dtype), mb.astype(va.dtype), lambda x: x.astype(va.dtype)
                m2 = va * f(jnp.maximum(old - 1, 0)) + jnp.where(b > 1, vb * f(b - 1), 0.0)
                spread = jnp.square(mb - ma) * f(old * b / jnp.maximum(units, 1))
                m2 = m2 + jnp.where(b > 0, spread, 0.0)
                return m2 / f(jnp.maximum(units - 1, 1))

            acc["var"] = jax.tree.map(
                pooled, state.acc["var"], st["var"], state.acc["mean"], st["mean"]
            )
        emit = state.mini_step == every_k - 1
        mean = jax.tree.map(lambda a, u: a.astype(jnp.asarray(u).dtype), acc["mean"], updates)

        def apply(n: Array) -> tuple[PyTree, Any]:
            inner_stats = {**acc, "mean": mean, "batch_size": n}
            return inner_tx.update(mean, state.inner_state, params, stats=inner_stats, **extra_args)

        def skip(n: Array) -> tuple[PyTree, Any]:
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0])
            return zeros, state.inner_state

        try:  # eagerly only the branch taken runs: a rule's checks on N see the union's count
            now = bool(emit)
        except jax.errors.ConcretizationTypeError:
            now = None
        if now:
            new_updates, inner_state = apply(units)
        else:
            shapes = jax.eval_shape(apply, units)  # N abstract: no rule checks it here
            if now is False:
                new_updates, inner_state = skip(units)
            else:
                new_updates, inner_state = jax.lax.cond(emit, apply, skip, units)
        restart = lambda x: jnp.where(emit, jnp.zeros_like(x), x)
        return new_updates, MultiStepsState(
            jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
            restart(units),
            jax.tree.map(restart, acc),
            inner_state,
        )

    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


# --------------------------------------------------------------------------------------------
# Which statistics an optimizer reads, and one training step.


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_float_array(x: Any) -> bool:
    return _is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def trainable(tree: PyTree) -> PyTree:
    """The floating-point arrays of a pytree (e.g. an `eqx.Module`), None in place of every
    other leaf: what the optimizers update, as Equinox's `eqx.filter(m, eqx.is_inexact_array)`.

    Args:
        tree: parameters, or a model holding them beside other leaves (functions, ints, ...).

    Returns:
        The same tree with None at each leaf that is not a floating-point array.

    Example:
        >>> import jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> model = {"w": jnp.ones(2), "steps": jnp.array(3), "act": jnp.tanh, "eps": 1e-5}
        >>> sorted(k for k, v in optimizers.trainable(model).items() if v is not None)
        ['w']
    """
    return jax.tree.map(lambda x: x if _is_float_array(x) else None, tree)


def _combine(part: PyTree, whole: PyTree) -> PyTree:
    """`whole` with its leaves replaced by `part`'s where `part` is not None."""
    return jax.tree.map(
        lambda p, w: w if p is None else p, part, whole, is_leaf=lambda x: x is None
    )


def required_stats(optimizer: AnyTransformation, params: PyTree) -> tuple[str, ...]:
    """The statistics to ask `pegrad.value_and_grad_stats` for so that `optimizer` can run:
    "mean" (ḡ, passed as the updates) and whatever its rules read from `stats=`.

    Found by tracing, not from attributes (optax.chain and inject_hyperparams build new
    NamedTuples, which drop them): `optimizer.update` is traced abstractly (jax.eval_shape, so
    nothing is computed) with a stats dict holding the names found so far; a rule that lacks
    some raises MissingStatistics naming all it reads, and the trace is repeated with those
    added. Sees through every wrapper that forwards `stats=` (optax.chain, named_chain,
    masked, partition, inject_hyperparams, apply_if_finite, multi_steps). "batch_size" is left
    out: pegrad always returns it. optax.MultiSteps around a rule that reads statistics is
    refused here (`InconsistentUpdates`: use `multi_steps`), before anything is computed.

    Args:
        optimizer: any transformation, composed of the rules here and optax's blocks.
        params: the parameters, or a model holding them (its `trainable` part is used).

    Returns:
        The statistics' names, "mean" first.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from pegrad import optimizers
        >>> params = {"emb": jnp.ones((3, 2)), "w": jnp.ones((2, 2))}
        >>> opt = optax.partition({"a": optimizers.adam(1e-3),
        ...                        "s": optimizers.micro_sign_sgd(1e-3)}, {"emb": "a", "w": "s"})
        >>> optimizers.required_stats(opt, params)
        ('mean', 'sign_mean')
    """
    params = trainable(params)
    _refuse_multisteps(optimizer, params)
    return _traced_stats(optimizer, params)


def _traced_stats(optimizer: AnyTransformation, params: PyTree) -> tuple[str, ...]:
    """required_stats' trace (MissingStatistics where a wrapper drops stats=)."""
    params = trainable(params)
    tx = _with_stats(optimizer)
    grads = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(jnp.shape(p), _moment_dtype(p.dtype)), params
    )
    state = jax.eval_shape(tx.init, params)
    names = ["mean"]
    while True:
        # Every statistic the rules here read is shaped like the parameters.
        probe = {**dict.fromkeys(names, grads), "batch_size": jax.ShapeDtypeStruct((), jnp.int32)}
        try:
            jax.eval_shape(
                lambda u, s, p, st: tx.update(u, s, p, stats=st), grads, state, params, probe
            )
            return tuple(names)
        except MissingStatistics as err:
            new = [name for name in err.names if name not in probe]
            if not new:
                raise
            names += new


def _refuse_multisteps(optimizer: AnyTransformation, params: PyTree) -> None:
    """optax.MultiSteps around a rule that reads statistics: refused before anything runs;
    nested (optax.chain(optax.MultiSteps(...).gradient_transformation(), ...)), found by its
    state, where its rules would get no stats= at all."""
    if isinstance(optimizer, optax.MultiSteps):
        reads = [n for n in required_stats(optimizer.inner_opt, params) if n != "mean"]
        where = "its inner optimizer"
    else:
        state = jax.eval_shape(optimizer.init, trainable(params))
        nested = lambda x: isinstance(x, optax.MultiStepsState)
        if not any(nested(x) for x in jax.tree.leaves(state, is_leaf=nested)):
            return
        try:
            reads = [n for n in _traced_stats(optimizer, params) if n != "mean"]
        except MissingStatistics as err:  # the stats= MultiSteps dropped
            reads = [n for n in err.names if n not in ("mean", "batch_size")]
        where = "a rule inside it"
    if reads:
        raise InconsistentUpdates(
            f"optax.MultiSteps accumulates ḡ over micro-batches, but {where} reads {reads}, "
            "which would be one micro-batch's (or none): use optimizers.multi_steps(opt, "
            "every_k), which accumulates ḡ and the statistics, in place of optax.MultiSteps"
        )


def _apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """optax.apply_updates, strict promotion clean: p + u in the wider of the two dtypes, then
    rounded to p's (float32 updates of bfloat16 parameters; the numbers of optax's function
    under standard promotion)."""

    def leaf(p: Any, u: Any) -> Any:
        if p is None:
            return None
        p, u = jnp.asarray(p), jnp.asarray(u)
        with jax.numpy_dtype_promotion("standard"):  # the dtype alone: the sum is explicit
            wide = jnp.promote_types(p.dtype, u.dtype)
        return (p.astype(wide) + u.astype(wide)).astype(p.dtype)

    return jax.tree.map(leaf, params, updates, is_leaf=lambda x: x is None)


class _Static:
    """The leaves of a model that are not arrays, hashable: a static argument of jax.jit."""

    def __init__(self, tree: PyTree):
        self.tree = tree
        leaves, self.treedef = jax.tree.flatten(tree)
        self.key = (self.treedef, tuple(leaves))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.key == other.key


Step = Callable[[PyTree, Any, PyTree], tuple[PyTree, Any, Float[Array, ""], Stats]]


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    optimizer: AnyTransformation,
    impl: Literal["factorized", "vmap"] = "factorized",
    chunk_size: int | None = None,
    stats: Sequence[str] | None = None,
    *,
    extra_stats: Sequence[str] = (),
    jit: bool = True,
    **stats_options: Any,
) -> Step:
    """One training step, `step(params, state, batch) -> (params, state, mean_loss, stats)`:
    the statistics from `pegrad.value_and_grad_stats`, then `optimizer.update(stats["mean"],
    state, params, stats=stats)` and `optax.apply_updates`. The one step train.py, its
    vectorized sweeps and the tests build on.

    `params` may be a model (an `eqx.Module`, any pytree): its floating-point arrays
    (`trainable`) are the parameters, its other leaves pass through unchanged; initialize the
    optimizer with `optimizer.init(trainable(model))`.

    Args:
        loss_fn: `loss_fn(params, example) -> scalar`, the loss of ONE example (params as given
            to the step: the model itself for a model).
        optimizer: any transformation composed of the rules here and optax's blocks.
        impl: "factorized" or "vmap" (pegrad's exact reference): the same numbers.
        chunk_size: at most this many per-example gradients at once (pegrad).
        stats: the statistics to compute; None: `required_stats(optimizer, params)`, found
            while the step is traced. "mean" is always added.
        extra_stats: statistics computed besides those (e.g. for diagnostics), returned too.
        jit: False returns the pure function, to jit (with shardings) or vmap yourself; for a
            model with leaves that are not arrays, with a filtered jit such as eqx.filter_jit.
        **stats_options: for pegrad.value_and_grad_stats, e.g. granularity="token".

    Returns:
        The step function; its stats dict is pegrad's.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from pegrad import optimizers
        >>> loss_fn = lambda p, ex: 0.5 * jnp.sum((ex["x"] @ p["w"] - ex["y"]) ** 2)
        >>> params = {"w": jnp.zeros((3, 2))}
        >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 2))}
        >>> opt = optimizers.micro_adam(1e-2)
        >>> step = optimizers.make_train_step(loss_fn, opt, impl="vmap")
        >>> params, state, loss, stats = step(params, opt.init(params), batch)
        >>> float(loss), sorted(stats)
        (1.0, ['batch_size', 'mean', 'sq_mean'])
    """
    import pegrad  # here, so that this file can be copied without pegrad for the rest

    tx = _with_stats(optimizer)
    traced_checks = [False]  # a check of the updates against ḡ left to run time (below)

    def pure(params: PyTree, state: Any, batch: PyTree) -> tuple[PyTree, Any, Any, Stats]:
        p = trainable(params)
        _refuse_multisteps(optimizer, p)  # also when stats are given
        names = required_stats(tx, p) if stats is None else stats
        names = tuple(dict.fromkeys(("mean", *names, *extra_stats)))
        loss = lambda p, example: loss_fn(_combine(p, params), example)
        stats_fn = pegrad.value_and_grad_stats(
            loss, names, impl=impl, chunk_size=chunk_size, **stats_options
        )
        value, st = stats_fn(p, batch)
        updates, state = tx.update(st["mean"], state, p, stats=st)
        return _combine(_apply_updates(p, updates), params), state, value, st

    if not jit:
        return pure

    @functools.partial(jax.jit, static_argnums=3)
    def jitted(arrays: PyTree, state: Any, batch: PyTree, static: _Static) -> tuple:
        params, state, value, st = pure(_combine(arrays, static.tree), state, batch)
        return jax.tree.map(lambda x: x if _is_array(x) else None, params), state, value, st

    def step(params: PyTree, state: Any, batch: PyTree) -> tuple[PyTree, Any, Any, Stats]:
        arrays = jax.tree.map(lambda x: x if _is_array(x) else None, params)
        static = _Static(jax.tree.map(lambda x: None if _is_array(x) else x, params))
        before = _RUNTIME_CHECKS[0]
        try:
            out = jitted(arrays, state, batch, static)
            traced_checks[0] |= _RUNTIME_CHECKS[0] != before
            if traced_checks[0]:  # the step checks values: wait for them, say what they found
                jax.block_until_ready(out)
        except (jax.errors.JaxRuntimeError, ValueError) as err:  # JAX's, carrying Equinox's
            ours = "optimizers.InconsistentUpdates" in str(err) and "message" in _LAST_REFUSAL
            if ours and not isinstance(err, InconsistentUpdates):
                raise InconsistentUpdates(_LAST_REFUSAL["message"]) from None
            raise
        new, state, value, st = out
        return _combine(new, params), state, value, st

    step._cache_size = jitted._cache_size  # pyright: ignore  # the tests count compilations
    return step
