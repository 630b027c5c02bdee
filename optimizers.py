"""Optimizers that consume per-example gradient statistics (SPEC §4, after Roulet & Agarwala,
arXiv 2510.00236): Adam, MicroAdam, MicroAdamVar, MicroAdamMSQ, MicroSignSGD, SignSGD, SignEMA.

Each is a small optax-style object: hyperparameters go into a factory, the state is a NamedTuple
with a typed count, and the update rule is written in math in the factory's docstring. Instead
of a gradient, `update` takes the statistics dict of `pegrad.value_and_grad_stats`:

    opt = micro_adam(learning_rate=1e-3)           # learning_rate may be an optax schedule
    stats_fn = pegrad.value_and_grad_stats(loss_fn, opt.stats, impl="factorized")
    state = opt.init(params)
    loss, stats = stats_fn(params, batch)
    updates, state = opt.update(stats, state, params)
    params = optax.apply_updates(params, updates)

or, in one jitted call, `step = make_train_step(loss_fn, opt, impl="vmap" | "factorized")`.

Common options. `weight_decay` λ is decoupled (AdamW): the step becomes −lr·(direction + λ·p),
restricted to the leaves where `weight_decay_mask` (a pytree of Python bools shaped like params,
or a function of params returning one) is True. `max_grad_norm` C clips by the global norm of
the mean gradient: every per-example gradient is scaled by the same c = min(1, C/‖ḡ‖), so
ḡ → c·ḡ and q → c²·q (the paper tames MicroAdam's loss spikes with C = 1e-2). Sign-only rules
(micro_sign_sgd, sign_sgd) are invariant to that scaling and take no clipping option. Moments
are kept in float32 or wider (the parameter dtype when wider); updates come back in the
parameter dtype.

Composing with optax: `learning_rate` accepts any optax schedule (evaluated at the step count
before the update, as optax does); `chain(opt, *transforms)` runs optax transforms on the
updates (e.g. `optax.clip(1e-3)`) and is still an optimizer here; `as_optax(opt)` is an
`optax.GradientTransformationExtraArgs` for optax's own wrappers (chain, MultiSteps,
apply_if_finite): it reads ḡ from the incoming updates and any other statistics from the extra
argument `stats=`, so `as_optax(adam(lr))` is a drop-in replacement for `optax.adam(lr)`.

Exact references: `adam` equals `optax.adam` (and with options, `optax.chain(
optax.clip_by_global_norm(C), optax.adamw(lr, weight_decay=λ))`); every other rule equals its
formula. Proof, at float64 over ten steps, for impl="vmap" and impl="factorized", against optax
and against the formulas fed by a naive per-example loop: tests/test_optimizers.py.

Depends on jax, optax and jaxtyping only (`make_train_step` imports pegrad when called).
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

Stats = dict[str, Any]
LearningRate = optax.ScalarOrSchedule  # a float, or a function of the step count
Mask = PyTree | Callable[[PyTree], PyTree] | None


class StatsOptimizer(NamedTuple):
    """An optax-style optimizer fed with gradient statistics instead of a gradient.

    `stats` names the statistics `update` reads (pass it to `pegrad.value_and_grad_stats`);
    `init(params) -> state`; `update(stats, state, params) -> (updates, state)`; `name` is
    used in error messages.
    """

    init: Callable[[PyTree], Any]
    update: Callable[[Stats, Any, PyTree], tuple[PyTree, Any]]
    stats: tuple[str, ...]
    name: str


class AdamState(NamedTuple):
    """Adam family state: step count t and the two EMAs (float32 or wider)."""

    count: Int[Array, ""]
    mu: PyTree[Float[Array, "..."]]
    nu: PyTree[Float[Array, "..."]]


class SignState(NamedTuple):
    """Sign family state: step count t and the EMA (float32 or wider)."""

    count: Int[Array, ""]
    ema: PyTree[Float[Array, "..."]]


# --------------------------------------------------------------------------------------------
# Shared pieces


def _moment_dtype(dtype: Any) -> jnp.dtype:
    # Squared bf16 gradients underflow and EMAs of them lose the update, so never below float32.
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def _zeros(params: PyTree) -> PyTree:
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _moment_dtype(p.dtype)), params)


def _like(tree: PyTree, moments: PyTree, scale: Array | None = None) -> PyTree:
    """Cast a statistic to its moment's dtype (explicitly: strict promotion), then scale."""

    def leaf(x: Array, m: Array) -> Array:
        x = jnp.asarray(x).astype(m.dtype)
        return x if scale is None else x * scale.astype(m.dtype)

    return jax.tree.map(leaf, tree, moments)


def _require(name: str, stats: Stats, needs: tuple[str, ...]) -> None:
    missing = [s for s in needs if s not in stats]
    if missing:
        raise ValueError(
            f"{name} needs the statistics {needs} but {missing} are missing (got "
            f"{sorted(stats)}); build them with pegrad.value_and_grad_stats(loss_fn, opt.stats)"
        )


def _batch_size(name: str, stats: Stats) -> Array | int:
    """B for the unbiased estimators, which divide by B − 1: B = 1 is an error, not a NaN."""
    b = stats["batch_size"]
    try:
        b = int(b)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return b  # only known at run time; pegrad's batch_size is concrete while tracing
    if b < 2:
        raise ValueError(
            f"{name} needs at least 2 examples (units) per batch: its estimator divides by "
            f"B - 1, got B = {b}. Use micro_adam or adam for B = 1."
        )
    return b


def _clip_factor(stats: Stats, max_grad_norm: float | None) -> Array | None:
    """c = min(1, C/‖ḡ‖) over all leaves; ‖ḡ‖ = 0 gives C/0 = inf and so c = 1."""
    if max_grad_norm is None:
        return None
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(stats["mean"])]
    dtype = max((_moment_dtype(x.dtype) for x in leaves), key=lambda d: d.itemsize)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(dtype))) for x in leaves))
    return jnp.minimum(1.0, max_grad_norm / norm)


def _learning_rate(learning_rate: LearningRate, count: Int[Array, ""]) -> Any:
    if callable(learning_rate):
        # optax schedules mix Python ints and floats internally; they are not strict-clean.
        with jax.numpy_dtype_promotion("standard"):
            return learning_rate(count)
    return learning_rate


def _apply_lr(
    direction: PyTree, params: PyTree, lr: Any, weight_decay: float, mask: Mask
) -> PyTree:
    """−lr·(direction + λ·p) per leaf, computed in the moment dtype, returned in p's dtype."""

    def leaf(d: Array, p: Array, decay: bool) -> Array:
        if weight_decay and decay:
            d = d + weight_decay * p.astype(d.dtype)
        return (-jnp.asarray(lr, d.dtype) * d).astype(p.dtype)

    if mask is None:
        mask_tree = jax.tree.map(lambda _: True, params)
    elif callable(mask) and jax.tree.structure(mask) != jax.tree.structure(params):
        mask_tree = mask(params)  # a function of params, as in optax
    else:
        mask_tree = mask  # a pytree of bools (an Equinox module is callable yet one of these)
    return jax.tree.map(leaf, direction, params, mask_tree)


def _check_options(
    name: str, betas: dict[str, float], weight_decay: float, max_grad_norm: float | None
) -> None:
    for key, beta in betas.items():
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}: {key} must lie in [0, 1), got {beta!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay!r}")
    if max_grad_norm is not None and not max_grad_norm > 0.0:
        raise ValueError(f"{name}: max_grad_norm must be > 0 or None, got {max_grad_norm!r}")


# --------------------------------------------------------------------------------------------
# The Adam family: the same update, four second-moment inputs.

SecondMoment = Callable[[Array, Any, Any], Array]  # (ḡ, q or None, B or None) -> v input


def _adam_family(
    name: str,
    needs: tuple[str, ...],
    second_moment: SecondMoment,
    learning_rate: LearningRate,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    weight_decay_mask: Mask,
    max_grad_norm: float | None,
    unbiased: bool = False,
    relu_preconditioner: bool = False,
) -> StatsOptimizer:
    """second_moment(ḡ, q, B) is the input of v; `unbiased` ones divide by B − 1."""
    _check_options(name, {"b1": b1, "b2": b2}, weight_decay, max_grad_norm)
    if not eps >= 0.0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps!r}")

    def init(params: PyTree) -> AdamState:
        return AdamState(jnp.zeros([], jnp.int32), _zeros(params), _zeros(params))

    def update(stats: Stats, state: AdamState, params: PyTree) -> tuple[PyTree, AdamState]:
        _require(name, stats, needs)
        b = _batch_size(name, stats) if unbiased else None
        c = _clip_factor(stats, max_grad_norm)
        g = _like(stats["mean"], state.mu, c)
        if "sq_mean" in needs:
            q = _like(stats["sq_mean"], state.nu, None if c is None else c * c)
            nu_in = jax.tree.map(lambda gl, ql: second_moment(gl, ql, b), g, q)
        else:
            nu_in = jax.tree.map(lambda gl: second_moment(gl, None, b), g)
        count = state.count + 1
        mu = jax.tree.map(lambda m, x: b1 * m + (1.0 - b1) * x, state.mu, g)
        nu = jax.tree.map(lambda v, x: b2 * v + (1.0 - b2) * x, state.nu, nu_in)

        def direction(m: Array, v: Array) -> Array:
            t = count.astype(m.dtype)
            v_hat = v / (1.0 - b2**t)
            if relu_preconditioner:
                v_hat = jnp.maximum(v_hat, 0.0)
            return (m / (1.0 - b1**t)) / (jnp.sqrt(v_hat) + eps)

        lr = _learning_rate(learning_rate, state.count)
        updates = _apply_lr(
            jax.tree.map(direction, mu, nu), params, lr, weight_decay, weight_decay_mask
        )
        return updates, AdamState(count, mu, nu)

    return StatsOptimizer(init, update, needs, name)


def _as_float(b: Any, like: Array) -> Any:
    return b if isinstance(b, int) else jnp.asarray(b).astype(like.dtype)


def adam(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: float | None = None,
) -> StatsOptimizer:
    """Adam on the mean gradient ḡ (needs "mean"); equals `optax.adam` / `optax.adamw`.

    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·ḡ²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    p ← p − lr_t·( m̂/(√v̂ + ε) + λ·p )
    """
    return _adam_family(
        "Adam", ("mean",), lambda g, q, b: g * g, learning_rate, b1, b2, eps,
        weight_decay, weight_decay_mask, max_grad_norm,
    )  # fmt: skip


def micro_adam(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: float | None = None,
) -> StatsOptimizer:
    """MicroAdam: Adam with the per-example second moment q = (1/B) Σ_i g_i² = ḡ² + σ²(B−1)/B.

    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·q,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    p ← p − lr_t·( m̂/(√v̂ + ε) + λ·p )
    """
    return _adam_family(
        "MicroAdam", ("mean", "sq_mean"), lambda g, q, b: q, learning_rate, b1, b2, eps,
        weight_decay, weight_decay_mask, max_grad_norm,
    )  # fmt: skip


def micro_adam_var(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: float | None = None,
) -> StatsOptimizer:
    """MicroAdamVar: preconditioned by the unbiased variance alone (B ≥ 2, else ValueError).

    σ̂² = B/(B−1)·(q − ḡ²)
    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·σ̂²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    p ← p − lr_t·( m̂/(√v̂ + ε) + λ·p )

    q ≥ ḡ² holds exactly (Jensen); q − ḡ² is clamped at 0 so that rounding cannot make √v̂ NaN.
    """

    def sigma2(g: Array, q: Any, b: Any) -> Array:
        bf = _as_float(b, g)
        return bf / (bf - 1.0) * jnp.maximum(q - g * g, 0.0)

    return _adam_family(
        "MicroAdamVar", ("mean", "sq_mean"), sigma2, learning_rate, b1, b2, eps,
        weight_decay, weight_decay_mask, max_grad_norm, unbiased=True,
    )  # fmt: skip


def micro_adam_msq(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: float | None = None,
) -> StatsOptimizer:
    """MicroAdamMSQ: preconditioned by the unbiased squared mean alone (B ≥ 2, else ValueError).

    μ̂² = (B·ḡ² − q)/(B−1)          (unbiased for μ², can be negative)
    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·μ̂²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    p ← p − lr_t·( m̂/(√ReLU(v̂) + ε) + λ·p )
    """

    def mu2(g: Array, q: Any, b: Any) -> Array:
        bf = _as_float(b, g)
        return (bf * (g * g) - q) / (bf - 1.0)

    return _adam_family(
        "MicroAdamMSQ", ("mean", "sq_mean"), mu2, learning_rate, b1, b2, eps,
        weight_decay, weight_decay_mask, max_grad_norm, unbiased=True,
        relu_preconditioner=True,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The sign family: where the sign sits in per-example → batch average → EMA.


def _sign_family(
    name: str,
    needs: tuple[str, ...],
    ema_input: Callable[[Stats, PyTree, Array | None], PyTree],
    sign_last: bool,
    learning_rate: LearningRate,
    momentum: float,
    weight_decay: float,
    weight_decay_mask: Mask,
    max_grad_norm: float | None = None,
) -> StatsOptimizer:
    _check_options(name, {"momentum": momentum}, weight_decay, max_grad_norm)

    def init(params: PyTree) -> SignState:
        return SignState(jnp.zeros([], jnp.int32), _zeros(params))

    def update(stats: Stats, state: SignState, params: PyTree) -> tuple[PyTree, SignState]:
        _require(name, stats, needs)
        x = ema_input(stats, state.ema, _clip_factor(stats, max_grad_norm))
        ema = jax.tree.map(lambda e, xl: momentum * e + (1.0 - momentum) * xl, state.ema, x)
        direction = jax.tree.map(jnp.sign, ema) if sign_last else ema
        lr = _learning_rate(learning_rate, state.count)
        updates = _apply_lr(direction, params, lr, weight_decay, weight_decay_mask)
        return updates, SignState(state.count + 1, ema)

    return StatsOptimizer(init, update, needs, name)


def micro_sign_sgd(
    learning_rate: LearningRate,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
) -> StatsOptimizer:
    """MicroSignSGD: the sign before the batch average (needs "sign_mean").

    e ← β·e + (1−β)·s,   s = (1/B) Σ_i sign(g_i)          (β = 0: e = s, no EMA)
    p ← p − lr_t·( e + λ·p )
    """
    return _sign_family(
        "MicroSignSGD", ("sign_mean",), lambda st, e, c: _like(st["sign_mean"], e),
        False, learning_rate, momentum, weight_decay, weight_decay_mask,
    )  # fmt: skip


def sign_sgd(
    learning_rate: LearningRate,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
) -> StatsOptimizer:
    """SignSGD: the sign after the batch average, before the EMA (needs "mean").

    e ← β·e + (1−β)·sign(ḡ)                                (β = 0: plain signSGD)
    p ← p − lr_t·( e + λ·p )
    """
    return _sign_family(
        "SignSGD", ("mean",), lambda st, e, c: jax.tree.map(jnp.sign, _like(st["mean"], e)),
        False, learning_rate, momentum, weight_decay, weight_decay_mask,
    )  # fmt: skip


def sign_ema(
    learning_rate: LearningRate,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: float | None = None,
) -> StatsOptimizer:
    """SignEMA (Signum-like): the sign last, after the EMA (needs "mean").

    e ← β·e + (1−β)·ḡ
    p ← p − lr_t·( sign(e) + λ·p )
    """
    return _sign_family(
        "SignEMA", ("mean",), lambda st, e, c: _like(st["mean"], e, c),
        True, learning_rate, momentum, weight_decay, weight_decay_mask, max_grad_norm,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Composition with optax, and one jitted training step.


def as_optax(optimizer: StatsOptimizer) -> optax.GradientTransformationExtraArgs:
    """`optimizer` as an optax transformation: `update(grads, state, params, stats=stats)`.

    The incoming updates are taken as ḡ; the other statistics come from the extra argument
    `stats` (optax.chain forwards it). Transforms placed before it therefore act on ḡ alone and
    not on q: clip with `max_grad_norm`, which scales every per-example gradient alike.
    Optimizers that read only "mean" (adam, sign_sgd, sign_ema) need no `stats`.
    """
    name = optimizer.name

    def update(
        updates: PyTree, state: Any, params: PyTree = None, *, stats: Stats | None = None, **_: Any
    ) -> tuple[PyTree, Any]:
        if stats is None and optimizer.stats != ("mean",):
            raise ValueError(
                f"{name} reads the statistics {optimizer.stats}: pass them as "
                "update(grads, state, params, stats=stats)"
            )
        if params is None:
            raise ValueError(f"{name} needs params (updates come back in the parameter dtype)")
        return optimizer.update({**(stats or {}), "mean": updates}, state, params)

    def init(params: PyTree) -> Any:
        return optimizer.init(params)

    return optax.GradientTransformationExtraArgs(init, update)


def chain(optimizer: StatsOptimizer, *transforms: optax.GradientTransformation) -> StatsOptimizer:
    """`optimizer`, then optax `transforms` applied to its updates; reads the same statistics."""
    tx = optax.chain(as_optax(optimizer), *transforms)

    def update(stats: Stats, state: Any, params: PyTree) -> tuple[PyTree, Any]:
        return tx.update(stats["mean"], state, params, stats=stats)

    return StatsOptimizer(tx.init, update, optimizer.stats, optimizer.name)


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    optimizer: StatsOptimizer,
    impl: Literal["factorized", "vmap"] = "factorized",
    chunk_size: int | None = None,
    **stats_options: Any,
) -> Callable[[PyTree, Any, PyTree], tuple[PyTree, Any, Float[Array, ""], Stats]]:
    """One jitted `step(params, state, batch) -> (params, state, mean_loss, stats)`.

    `impl` switches between the exact ("vmap") and the factorized statistics; `chunk_size` and
    `stats_options` (e.g. granularity="token") go to `pegrad.value_and_grad_stats`.
    """
    import pegrad  # here, so that this file can be copied without pegrad for the rest

    stats_fn = pegrad.value_and_grad_stats(
        loss_fn, optimizer.stats, impl=impl, chunk_size=chunk_size, **stats_options
    )

    @jax.jit
    def step(params: PyTree, state: Any, batch: PyTree) -> tuple[PyTree, Any, Any, Stats]:
        loss, stats = stats_fn(params, batch)
        updates, state = optimizer.update(stats, state, params)
        return optax.apply_updates(params, updates), state, loss, stats

    return step
