"""Optimizers that consume per-example gradient statistics (SPEC §4, after Roulet & Agarwala,
arXiv 2510.00236): Adam, MicroAdam, MicroAdamVar, MicroAdamMSQ, MicroSignSGD, SignSGD, SignEMA.

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
    step = make_train_step(loss_fn, opt, impl="factorized")      # one jitted step, any wrapping
    params, state, loss, stats = step(params, opt.init(params), batch)

`make_train_step` learns which statistics to ask pegrad for with `required_stats(opt, params)`,
which traces `opt.update` abstractly and so sees through any wrapper that forwards `stats=`
(attributes on the returned NamedTuple would not survive optax.chain or inject_hyperparams).

Each factory is optax's adamw pattern, `optax.chain(core, optax.add_decayed_weights(λ, mask),
optax.scale_by_learning_rate(lr))`: the update is −lr_t·(direction + λ·p), λ on the leaves the
mask (a pytree of bools shaped like params, or a function of params returning one) selects,
lr_t an optax schedule evaluated at the step count before the update, or a number. The sign
is `optax.scale_by_sign`, sign_ema's clipping `optax.clip_by_global_norm`, the states optax's
NamedTuples. The cores (direction before decay) are written here, from optax's moment helpers,
where optax's blocks would differ:

* moments stay in float32 (or the parameter dtype when wider) for bfloat16 parameters, and the
  direction comes back in the parameter dtype; optax.scale_by_adam keeps ν in the parameter
  dtype, optax.ema mixes a float32 EMA with bf16 updates by implicit promotion (this file is
  clean under jax_numpy_dtype_promotion="strict");
* `max_grad_norm` C clips by the global norm of ḡ with c = min(1, C/‖ḡ‖) as if every
  per-example gradient were scaled by c: ḡ → c·ḡ and q → c²·q (the paper tames MicroAdam's
  loss spikes with C = 1e-2). An `optax.clip_by_global_norm` chained before a rule clips ḡ
  only, not q. Sign-only rules (micro_sign_sgd, sign_sgd) are invariant to that scaling and
  take no clipping option.

Wrapping notes. `optax.inject_hyperparams` treats every callable argument as a schedule: pass
`static_args="weight_decay_mask"` when the mask is a function; it also casts hyperparameters
to the parameter dtype, where bf16 rounds b2 = 0.999 to 1: pass hyperparam_dtype=jnp.float32
for bf16 parameters. `optax.MultiSteps` accumulates the
updates (ḡ) only: rules that read `stats` would see the last micro-batch's q, so use it with
adam, sign_sgd or sign_ema.

Exact references: `adam` equals `optax.adamw` (bitwise on the same ḡ at float64), sign_sgd at
momentum 0 equals `optax.sign_sgd`, sign_ema equals optax's Signum with decoupled weight decay;
every other rule equals its formula. Proof, at float64, for impl="vmap" and impl="factorized",
against optax and against the formulas fed by a naive per-example loop: tests/test_optimizers.py.

Depends on jax, optax and jaxtyping only (`make_train_step` imports pegrad when called).
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree

Stats = dict[str, Any]
LearningRate = optax.ScalarOrSchedule  # a float, or a function of the step count
Mask = PyTree | Callable[[PyTree], PyTree] | None
Block = Literal["tensor", "row"] | None
# A hyperparameter: a number, or a scalar array when optax.inject_hyperparams passes it.
Hyper = float | Float[Array, ""]


class MissingStatistics(ValueError):
    """`update` was called without statistics its rule reads; `names` lists all of them."""

    def __init__(self, rule: str, names: tuple[str, ...], got: Stats | None):
        self.names = names
        have = "no stats=" if got is None else f"stats with {sorted(got)}"
        ask = tuple(n for n in ("mean", *names) if n != "batch_size")  # pegrad always has B
        super().__init__(
            f"{rule} reads the statistics {names} besides ḡ (the updates) but got {have}: call "
            f"update(ḡ, state, params, stats=stats) with the stats of "
            f"pegrad.value_and_grad_stats(loss_fn, {ask}), or use optimizers.make_train_step"
        )


# --------------------------------------------------------------------------------------------
# Shared pieces


def _moment_dtype(dtype: Any) -> jnp.dtype:
    # Squared bf16 gradients underflow and EMAs of them lose the update, so never below float32.
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def _zeros(params: PyTree) -> PyTree:
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _moment_dtype(p.dtype)), params)


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


def _read(rule: str, stats: Stats | None, needs: tuple[str, ...]) -> Stats:
    if needs and (stats is None or any(name not in stats for name in needs)):
        raise MissingStatistics(rule, needs, stats)
    return stats or {}


def _check_params(rule: str, params: PyTree) -> None:
    if params is None:
        raise ValueError(
            f"{rule} needs params: update(ḡ, state, params, ...) returns the direction in the "
            "parameter dtype"
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
    dtype = max((_moment_dtype(x.dtype) for x in leaves), key=lambda d: d.itemsize)
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


def _finish(
    rule: str,
    core: optax.GradientTransformationExtraArgs,
    learning_rate: LearningRate,
    weight_decay: optax.ScalarOrSchedule,
    weight_decay_mask: Mask,
) -> optax.GradientTransformationExtraArgs:
    """core, then −lr_t·(direction + λ·p) from optax's own blocks (optax.adamw's tail)."""
    _check(rule, "weight_decay", weight_decay, lambda x: x >= 0.0, ">= 0")
    return optax.chain(
        core,
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(_strict_clean(learning_rate)),
    )


# --------------------------------------------------------------------------------------------
# The Adam family: the same update, four second-moment inputs.

SecondMoment = Callable[[Array, Any, Any], Array]  # (ḡ, q or None, B or None) -> v input


def _block_mean(v: Array, block: Block) -> Array:
    if block == "tensor":
        return jnp.mean(v)
    if block == "row" and v.ndim >= 1:
        return jnp.mean(v, axis=-1, keepdims=True)
    return v  # no blocks, or a scalar leaf: its own block


def _scale_by_adam_family(
    rule: str,
    needs: tuple[str, ...],
    second_moment: SecondMoment,
    b1: Any,
    b2: Any,
    eps: Any,
    max_grad_norm: Any,
    relu_preconditioner: bool = False,
    block: Block = None,
) -> optax.GradientTransformationExtraArgs:
    """The direction m̂/(√v̂ + ε) with v fed by second_moment(ḡ, q, B); state as optax.adam's."""
    _check(rule, "b1", b1, _unit_interval, "in [0, 1)")
    _check(rule, "b2", b2, _unit_interval, "in [0, 1)")
    _check(rule, "eps", eps, lambda x: x >= 0.0, ">= 0")
    _check(rule, "max_grad_norm", max_grad_norm, lambda x: x > 0.0, "> 0 or None")
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
        stats = _read(rule, stats, needs)
        _check_params(rule, params)
        b = _batch_size(rule, stats) if "batch_size" in needs else None
        c = _clip_factor(updates, max_grad_norm)
        g = _cast(updates, state.mu, c)
        if "sq_mean" in needs:
            q = _cast(stats["sq_mean"], state.nu, None if c is None else c * c)
            nu_in = jax.tree.map(lambda gl, ql: second_moment(gl, ql, b), g, q)
        else:
            nu_in = jax.tree.map(lambda gl: second_moment(gl, None, b), g)
        count = optax.safe_increment(state.count)

        def ema(x: Array, m: Array, beta: Any) -> Array:
            return optax.tree.update_moment(x, m, _hyper(beta, m.dtype), 1)

        mu = jax.tree.map(lambda x, m: ema(x, m, b1), g, state.mu)
        nu = jax.tree.map(lambda x, v: ema(x, v, b2), nu_in, state.nu)
        widest = max((m.dtype for m in jax.tree.leaves(mu)), key=lambda d: d.itemsize,
                      default=jnp.dtype(jnp.float32))  # fmt: skip

        def debias(moments: PyTree, beta: Any) -> PyTree:
            # optax's helper on the whole tree, as optax.scale_by_adam calls it: XLA compiles
            # it per leaf differently (x·(1/c) for x/c), a last-bit difference. Array
            # arguments: the helper's Python float ** int32 count fails strict promotion.
            beta = jnp.asarray(beta).astype(widest)
            return optax.tree.bias_correction(moments, beta, jnp.asarray(count).astype(widest))

        def direction(m_hat: Array, v_hat: Array) -> Array:
            v_hat = _block_mean(v_hat, block)
            if relu_preconditioner:
                v_hat = jnp.maximum(v_hat, 0.0)
            return m_hat / (jnp.sqrt(v_hat) + _hyper(eps, m_hat.dtype))

        updates = _cast(jax.tree.map(direction, debias(mu, b1), debias(nu, b2)), params)
        return updates, optax.ScaleByAdamState(count, mu, nu)

    # optax types a state as any pytree; ours is the NamedTuple it is.
    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def _as_float(b: Any, like: Array) -> Any:
    return b if isinstance(b, int) else jnp.asarray(b).astype(like.dtype)


def adam(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: Hyper | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Adam on the mean gradient ḡ (reads no stats); equals `optax.adamw` (`optax.adam` at λ=0).

    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·ḡ²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√v̂ + ε) + λ·p )
    """
    rule = "Adam"
    core = _scale_by_adam_family(rule, (), lambda g, q, b: g * g, b1, b2, eps, max_grad_norm)
    return _finish(rule, core, learning_rate, weight_decay, weight_decay_mask)


def micro_adam(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: Hyper | None = None,
) -> optax.GradientTransformationExtraArgs:
    """MicroAdam: Adam with the per-example second moment q = (1/B) Σ_i g_i² = ḡ² + σ²(B−1)/B
    (reads stats "sq_mean").

    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·q,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√v̂ + ε) + λ·p )
    """
    rule = "MicroAdam"
    core = _scale_by_adam_family(rule, ("sq_mean",), lambda g, q, b: q, b1, b2, eps, max_grad_norm)
    return _finish(rule, core, learning_rate, weight_decay, weight_decay_mask)


def micro_adam_var(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: Hyper | None = None,
) -> optax.GradientTransformationExtraArgs:
    """MicroAdamVar: preconditioned by the unbiased variance alone (reads stats "sq_mean" and
    "batch_size"; B ≥ 2, else ValueError).

    σ̂² = B/(B−1)·(q − ḡ²)
    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·σ̂²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√v̂ + ε) + λ·p )

    q ≥ ḡ² holds exactly (Jensen); q − ḡ² is clamped at 0 so that rounding cannot make √v̂ NaN.
    """

    def sigma2(g: Array, q: Any, b: Any) -> Array:
        bf = _as_float(b, g)
        return bf / (bf - 1.0) * jnp.maximum(q - g * g, 0.0)

    rule = "MicroAdamVar"
    core = _scale_by_adam_family(
        rule, ("sq_mean", "batch_size"), sigma2, b1, b2, eps, max_grad_norm
    )
    return _finish(rule, core, learning_rate, weight_decay, weight_decay_mask)


def micro_adam_msq(
    learning_rate: LearningRate,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: Hyper | None = None,
    block: Block = None,
) -> optax.GradientTransformationExtraArgs:
    """MicroAdamMSQ: preconditioned by the unbiased squared mean alone (reads stats "sq_mean"
    and "batch_size"; B ≥ 2, else ValueError).

    μ̂² = (B·ḡ² − q)/(B−1)          (unbiased for μ², can be negative)
    m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·μ̂²,   m̂ = m/(1−β1^t),   v̂ = v/(1−β2^t)
    u = −lr_t·( m̂/(√ReLU(⟨v̂⟩) + ε) + λ·p )

    ⟨v̂⟩ is v̂ averaged over a block of coordinates of one leaf, then broadcast back over it:
    the paper's open question, whether pooling the noisy estimate μ̂² stabilizes the rule.
    block=None: each coordinate alone, ⟨v̂⟩ = v̂. block="tensor": the mean over all elements of
    the leaf. block="row": the mean over its last axis, one value per index of the other axes
    (W in x @ W, shaped [d_in, d_out] as in models.Linear: one value per input unit; an
    embedding [vocab, d]: one per token; a stacked [L, n, m]: one per layer and row); a vector
    is one row, so "row" averages it whole; a scalar is its own block. The average is taken
    before the ReLU, so negative and positive estimates in a block cancel. v itself is kept per
    coordinate (the mean commutes with the EMA and the debiasing).
    """

    def mu2(g: Array, q: Any, b: Any) -> Array:
        bf = _as_float(b, g)
        return (bf * (g * g) - q) / (bf - 1.0)

    rule = "MicroAdamMSQ"
    core = _scale_by_adam_family(
        rule, ("sq_mean", "batch_size"), mu2, b1, b2, eps, max_grad_norm,
        relu_preconditioner=True, block=block,
    )  # fmt: skip
    return _finish(rule, core, learning_rate, weight_decay, weight_decay_mask)


# --------------------------------------------------------------------------------------------
# The sign family: where the sign sits in per-example → batch average → EMA.


def _ema(
    rule: str, momentum: Any, read: str | None = None
) -> optax.GradientTransformationExtraArgs:
    """e ← β·e + (1−β)·x with x the updates, or stats[read]; returns e in the parameter dtype.

    optax.ema(β, debias=False) computes the same but keeps e in one given dtype and mixes a
    float32 e with bf16 updates by implicit promotion; here e is per leaf float32 or wider."""
    _check(rule, "momentum", momentum, _unit_interval, "in [0, 1)")
    needs = () if read is None else (read,)

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
        stats = _read(rule, stats, needs)
        _check_params(rule, params)
        x = _cast(updates if read is None else stats[read], state.ema)

        def leaf(xl: Array, e: Array) -> Array:
            return optax.tree.update_moment(xl, e, _hyper(momentum, e.dtype), 1)

        ema = jax.tree.map(leaf, x, state.ema)
        # bf16 has float32's exponent range: the cast keeps every sign a later sign reads.
        return _cast(ema, params), optax.EmaState(optax.safe_increment(state.count), ema)

    # optax types a state as any pytree; ours is the NamedTuple it is.
    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def micro_sign_sgd(
    learning_rate: LearningRate,
    momentum: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    weight_decay_mask: Mask = None,
) -> optax.GradientTransformationExtraArgs:
    """MicroSignSGD: the sign before the batch average (reads stats "sign_mean", not ḡ).

    e ← β·e + (1−β)·s,   s = (1/B) Σ_i sign(g_i)          (β = 0: e = s, no EMA)
    u = −lr_t·( e + λ·p )
    """
    rule = "MicroSignSGD"
    core = _ema(rule, momentum, read="sign_mean")
    return _finish(rule, core, learning_rate, weight_decay, weight_decay_mask)


def sign_sgd(
    learning_rate: LearningRate,
    momentum: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    weight_decay_mask: Mask = None,
) -> optax.GradientTransformationExtraArgs:
    """SignSGD: the sign after the batch average, before the EMA (reads no stats). At β = 0
    and λ = 0 it is `optax.sign_sgd`.

    e ← β·e + (1−β)·sign(ḡ)                                (β = 0: plain signSGD)
    u = −lr_t·( e + λ·p )
    """
    rule = "SignSGD"
    core = optax.chain(optax.scale_by_sign(), _ema(rule, momentum))
    return _finish(rule, core, learning_rate, weight_decay, weight_decay_mask)


def sign_ema(
    learning_rate: LearningRate,
    momentum: Hyper = 0.9,
    weight_decay: Hyper = 0.0,
    weight_decay_mask: Mask = None,
    max_grad_norm: Hyper | None = None,
) -> optax.GradientTransformationExtraArgs:
    """SignEMA: the sign last, after the EMA (reads no stats): `optax.signum` with decoupled
    weight decay, and clipping c·ḡ = `optax.clip_by_global_norm(C)` first when C is given.

    e ← β·e + (1−β)·c·ḡ,   c = min(1, C/‖ḡ‖) (1 without C)
    u = −lr_t·( sign(e) + λ·p )
    """
    rule = "SignEMA"
    _check(rule, "max_grad_norm", max_grad_norm, lambda x: x > 0.0, "> 0 or None")
    clip = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
    core = optax.chain(*clip, _ema(rule, momentum), optax.scale_by_sign())
    return _finish(rule, core, learning_rate, weight_decay, weight_decay_mask)


# --------------------------------------------------------------------------------------------
# Which statistics an optimizer reads, and one jitted training step.


def required_stats(
    optimizer: optax.GradientTransformationExtraArgs, params: PyTree
) -> tuple[str, ...]:
    """The statistics to ask `pegrad.value_and_grad_stats` for so that `optimizer` can run:
    "mean" (ḡ, passed as the updates) and whatever its rules read from `stats=`.

    Found by tracing, not from attributes (optax.chain and inject_hyperparams build new
    NamedTuples, which drop them): `optimizer.update` is traced abstractly (jax.eval_shape, so
    nothing is computed) with a stats dict holding the names found so far; a rule that lacks
    some raises MissingStatistics naming all it reads, and the trace is repeated with those
    added. Sees through every wrapper that forwards `stats=` (optax.chain, inject_hyperparams,
    apply_if_finite, MultiSteps). "batch_size" is left out: pegrad always returns it.
    """
    grads = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(jnp.shape(p), _moment_dtype(p.dtype)), params
    )
    state = jax.eval_shape(optimizer.init, params)
    names = ["mean"]
    while True:
        # Every statistic the rules here read is shaped like the parameters.
        probe = {**dict.fromkeys(names, grads), "batch_size": jax.ShapeDtypeStruct((), jnp.int32)}
        try:
            jax.eval_shape(
                lambda u, s, p, st: optimizer.update(u, s, p, stats=st), grads, state, params, probe
            )
            return tuple(names)
        except MissingStatistics as err:
            new = [name for name in err.names if name not in probe]
            if not new:
                raise
            names += new


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    optimizer: optax.GradientTransformationExtraArgs,
    impl: Literal["factorized", "vmap"] = "factorized",
    chunk_size: int | None = None,
    stats: Sequence[str] | None = None,
    **stats_options: Any,
) -> Callable[[PyTree, Any, PyTree], tuple[PyTree, Any, Float[Array, ""], Stats]]:
    """One jitted `step(params, state, batch) -> (params, state, mean_loss, stats)`.

    `impl` switches between the exact ("vmap") and the factorized statistics; `chunk_size` and
    `stats_options` (e.g. granularity="token") go to `pegrad.value_and_grad_stats`. `stats`
    names the statistics to compute ("mean" is always added); None: `required_stats(optimizer,
    params)`, found while the step is traced.
    """
    import pegrad  # here, so that this file can be copied without pegrad for the rest

    @jax.jit
    def step(params: PyTree, state: Any, batch: PyTree) -> tuple[PyTree, Any, Any, Stats]:
        names = required_stats(optimizer, params) if stats is None else stats
        stats_fn = pegrad.value_and_grad_stats(
            loss_fn, tuple(dict.fromkeys(("mean", *names))), impl=impl, chunk_size=chunk_size,
            **stats_options,
        )  # fmt: skip
        loss, st = stats_fn(params, batch)
        updates, state = optimizer.update(st["mean"], state, params, stats=st)
        return optax.apply_updates(params, updates), state, loss, st

    return step
