"""optimizers.py against optax and against its SPEC §4 formulas, at float64.

Every optimizer runs on the statistics of pegrad.value_and_grad_stats with impl="vmap" and with
impl="factorized"; the two trajectories must agree, and both must match a from-scratch numpy
implementation of the optimizer's formula fed by a naive per-example loop (jax.grad on one
example at a time), which never touches pegrad. The optimizers are optax transformations: they
are also driven through optax.chain, optax.inject_hyperparams, optax.apply_if_finite and
optax.MultiSteps, and compared bitwise with the optax optimizers they claim to be.
"""

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimizers

Impl = Literal["vmap", "factorized"]
IMPLS: tuple[Impl, ...] = ("vmap", "factorized")
STEPS = 10
LR = 1e-2
ADAM_FAMILY = ("adam", "micro_adam", "micro_adam_var", "micro_adam_msq")
SIGN_FAMILY = ("micro_sign_sgd", "sign_sgd", "sign_ema")
NAMES = ADAM_FAMILY + SIGN_FAMILY
# MicroAdamMSQ's preconditioner √ReLU(v̂) is ~0 wherever the noise hides the mean; with ε = 1e-8
# that blows the toy problems up, and exploding trajectories compare nothing.
HPARAMS: dict[str, dict[str, Any]] = {"micro_adam_msq": {"eps": 1e-1}}


# --------------------------------------------------------------------------------------------
# Two small models, loss of ONE example (SPEC §1).


def mlp_loss(params: dict, example: dict) -> jax.Array:
    h = jnp.tanh(example["x"] @ params["w1"] + params["b1"])
    return 0.5 * jnp.sum((h @ params["w2"] + params["b2"] - example["y"]) ** 2)


def seq_loss(params: dict, example: dict) -> jax.Array:
    """A dense layer at every position of a [T, d] input, plus a bias; mean over positions."""
    h = jnp.tanh(example["x"] @ params["w"] + params["b"])
    return jnp.mean((h @ params["v"] - example["y"]) ** 2)


def problem(model: str, batch_size: int = 5, dtype: Any = jnp.float64, seed: int = 0):
    """(loss_fn, params, batches): STEPS different batches of `batch_size` examples."""
    rng = np.random.default_rng(seed)

    def arr(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape), dtype)

    if model == "mlp":
        params = {"w1": arr(4, 6), "b1": arr(6), "w2": arr(6, 3), "b2": arr(3)}
        batches = [{"x": arr(batch_size, 4), "y": arr(batch_size, 3)} for _ in range(STEPS)]
        return mlp_loss, params, batches
    params = {"w": arr(3, 5), "b": arr(5), "v": arr(5)}
    batches = [{"x": arr(batch_size, 4, 3), "y": arr(batch_size, 4)} for _ in range(STEPS)]
    return seq_loss, params, batches


Optimizer = optax.GradientTransformationExtraArgs


def make(name: str, learning_rate: Any = LR, **options: Any) -> Optimizer:
    return getattr(optimizers, name)(learning_rate, **{**HPARAMS.get(name, {}), **options})


def run(step: Callable, opt: Optimizer, params: dict, batches: list) -> list:
    state = opt.init(params)
    trajectory = []
    for batch in batches:
        params, state, _, _ = step(params, state, batch)
        trajectory.append(jax.tree.map(np.asarray, params))
    return trajectory


# XLA compiles slowly on small CPUs, so each (optimizer, model, impl) step compiles once and is
# shared between tests.
@functools.cache
def train_step(name: str, model: str, impl: Impl) -> Callable:
    return optimizers.make_train_step(problem(model)[0], make(name), impl=impl)


@functools.cache
def trajectory(name: str, model: str, impl: Impl) -> list:
    _, params, batches = problem(model)
    return run(train_step(name, model, impl), make(name), params, batches)


def run_optax(tx: optax.GradientTransformation, loss_fn: Callable, params: dict, batches: list):
    """The optax baseline on jax.grad of the mean loss (optax itself is not strict-clean)."""

    def mean_loss(p: dict, batch: dict) -> jax.Array:
        return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0))(p, batch))

    @jax.jit
    def step(p: dict, s: Any, batch: dict) -> tuple[Any, Any]:
        updates, s = tx.update(jax.grad(mean_loss)(p, batch), s, p)
        return optax.apply_updates(p, updates), s

    trajectory = []
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(params)
        for batch in batches:
            params, state = step(params, state, batch)
            trajectory.append(jax.tree.map(np.asarray, params))
    return trajectory


def assert_trajectories_close(a: list, b: list, rtol: float = 1e-10, atol: float = 1e-12):
    assert len(a) == len(b)
    for t, (pa, pb) in enumerate(zip(a, b, strict=True)):
        for k in pa:
            np.testing.assert_allclose(pa[k], pb[k], rtol=rtol, atol=atol, err_msg=f"{k} @ {t}")


# --------------------------------------------------------------------------------------------
# The from-scratch reference: a naive per-example loop and SPEC §4's formulas in numpy.


@functools.cache
def _example_grad(loss_fn: Callable) -> Callable:
    return jax.jit(jax.grad(loss_fn))


def per_example_grads(loss_fn: Callable, params: dict, batch: dict) -> dict[str, np.ndarray]:
    """[B, ...] per leaf: jax.grad on one example at a time."""
    n = len(next(iter(batch.values())))
    grads = [
        _example_grad(loss_fn)(
            jax.tree.map(jnp.asarray, params), jax.tree.map(lambda x, i=i: x[i], batch)
        )
        for i in range(n)
    ]
    return {k: np.stack([np.asarray(g[k]) for g in grads]) for k in params}


def block_mean(v: np.ndarray, block: str | None) -> np.ndarray:
    """micro_adam_msq's ⟨v̂⟩: the leaf's mean ("tensor"), the mean over the last axis ("row"; a
    vector is one row, a scalar its own block), or v̂ itself (None)."""
    if block == "tensor" or (block == "row" and v.ndim == 1):
        return np.full_like(v, v.mean())
    if block == "row" and v.ndim >= 2:
        return np.broadcast_to(v.mean(-1, keepdims=True), v.shape)
    return v


def reference(
    name: str | dict[str, str],
    loss_fn: Callable,
    params: dict,
    batches: list,
    learning_rate: float | Callable[[int], float] = LR,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float | None = None,
    momentum: float | None = None,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = None,
    block: str | None = None,
    eps_root: float = 0.0,
) -> list:
    """The trajectory of SPEC §4's formula; learning_rate may be a function of the step t ≥ 1;
    `name` one rule, or a rule per leaf (as optax.partition assigns them). eps None: the
    rule's in HPARAMS, else 1e-8 (as `make`)."""
    lr_at = learning_rate if callable(learning_rate) else lambda t: learning_rate
    rule_of = (lambda k: name[k]) if isinstance(name, dict) else (lambda k: name)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    trajectory = []
    for t, batch in enumerate(batches, start=1):
        g = per_example_grads(loss_fn, p, batch)
        n = len(next(iter(g.values())))
        gbar = {k: x.mean(0) for k, x in g.items()}
        c = 1.0
        if max_grad_norm is not None:
            c = min(1.0, max_grad_norm / np.sqrt(sum(np.sum(x**2) for x in gbar.values())))
        for k in p:
            rule = rule_of(k)
            eps_k = HPARAMS.get(rule, {}).get("eps", 1e-8) if eps is None else eps
            beta = momentum if momentum is not None else (0.9 if rule == "sign_ema" else 0.0)
            gi, mean = c * g[k], c * gbar[k]  # clipping scales every per-example gradient
            if rule in ADAM_FAMILY:
                if rule == "adam":
                    second = mean**2
                elif rule == "micro_adam":
                    second = np.mean(gi**2, 0)
                else:
                    var = np.sum((gi - mean) ** 2, 0) / (n - 1)  # two-pass, as in SPEC §2
                    second = var if rule == "micro_adam_var" else mean**2 - var / n
                m[k] = b1 * m[k] + (1 - b1) * mean
                v[k] = b2 * v[k] + (1 - b2) * second
                v_hat = v[k] / (1 - b2**t)
                if rule == "micro_adam_msq":
                    v_hat = np.maximum(block_mean(v_hat, block), 0.0)
                direction = m[k] / (1 - b1**t) / (np.sqrt(v_hat + eps_root) + eps_k)
            else:
                x = {"micro_sign_sgd": np.mean(np.sign(gi), 0), "sign_sgd": np.sign(mean)}
                m[k] = beta * m[k] + (1 - beta) * x.get(rule, mean)
                direction = np.sign(m[k]) if rule == "sign_ema" else m[k]
            p[k] = p[k] - lr_at(t) * (direction + weight_decay * p[k])
        trajectory.append({k: x.copy() for k, x in p.items()})
    return trajectory


# --------------------------------------------------------------------------------------------
# Equalities with the formulas


@functools.cache
def optax_adam_trajectory(model: str) -> list:
    loss_fn, params, batches = problem(model)
    return run_optax(optax.adam(LR), loss_fn, params, batches)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model", ["mlp", "seq"])
def test_adam_matches_optax(model: str, impl: Impl):
    assert_trajectories_close(trajectory("adam", model, impl), optax_adam_trajectory(model))


@pytest.mark.parametrize("model", ["mlp", "seq"])
@pytest.mark.parametrize("name", NAMES)
def test_impls_agree_and_match_formula(name: str, model: str):
    loss_fn, params, batches = problem(model)
    vmap, factorized = (trajectory(name, model, impl) for impl in IMPLS)
    assert_trajectories_close(vmap, factorized)
    assert_trajectories_close(vmap, reference(name, loss_fn, params, batches), rtol=1e-9)


def median_grad_norm(model: str) -> float:
    """A clipping threshold that is active in about half of the steps, so both branches run."""
    loss_fn, params, batches = problem(model)
    grads = [per_example_grads(loss_fn, params, batch) for batch in batches]
    return float(
        np.median([np.sqrt(sum(np.sum(x.mean(0) ** 2) for x in g.values())) for g in grads])
    )


def test_adam_with_mask_and_clipping_matches_optax():
    loss_fn, params, batches = problem("mlp")
    clip = median_grad_norm("mlp")
    mask = {"w1": True, "b1": False, "w2": True, "b2": False}
    opt = optimizers.adam(LR, weight_decay=0.1, mask=mask, max_grad_norm=clip)
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(LR, weight_decay=0.1, mask=mask))
    ours = run(optimizers.make_train_step(loss_fn, opt), opt, params, batches)
    assert_trajectories_close(ours, run_optax(tx, loss_fn, params, batches))


@pytest.mark.parametrize("name", ["micro_adam", "sign_ema"])
def test_weight_decay_and_clipping_follow_formula(name: str):
    loss_fn, params, batches = problem("seq")
    options: dict[str, Any] = {"weight_decay": 0.05, "max_grad_norm": median_grad_norm("seq")}
    opt = make(name, **options)
    ours = run(optimizers.make_train_step(loss_fn, opt, impl="factorized"), opt, params, batches)
    assert_trajectories_close(ours, reference(name, loss_fn, params, batches, **options), 1e-9)


def test_optax_schedule_as_learning_rate():
    loss_fn, params, batches = problem("mlp")
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 3, STEPS)  # lr_1 = schedule(0) = 0
    opt = optimizers.adam(schedule)
    ours = run(optimizers.make_train_step(loss_fn, opt), opt, params, batches)
    assert_trajectories_close(ours, run_optax(optax.adam(schedule), loss_fn, params, batches))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block", ["tensor", "row"])
def test_msq_blocks_match_formula(block: str, impl: Impl):
    loss_fn, params, batches = problem("seq")  # leaves: a [3, 5] matrix and two vectors
    opt = make("micro_adam_msq", block=block)
    ours = run(optimizers.make_train_step(loss_fn, opt, impl=impl), opt, params, batches)
    want = reference("micro_adam_msq", loss_fn, params, batches, block=block)
    assert_trajectories_close(ours, want, rtol=1e-9)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("name", "eps", "eps_root"),
    [
        *((n, 0.0, 1e-2) for n in ADAM_FAMILY),  # ε inside the root only
        ("micro_adam_msq", 1e-3, 1e-2),  # both
        ("micro_adam_var", 1e-3, 1e-2),
    ],
)
def test_eps_root_matches_formula(name: str, eps: float, eps_root: float, impl: Impl):
    """u = −lr·m̂/(√(v̂ + ε_root) + ε) over a training trajectory (MicroAdamMSQ: v̂ ReLU'd
    first), on pegrad's statistics from either implementation, against the formula fed by a
    naive per-example loop."""
    loss_fn, params, batches = problem("mlp")
    opt = make(name, eps=eps, eps_root=eps_root)
    ours = run(optimizers.make_train_step(loss_fn, opt, impl=impl), opt, params, batches)
    want = reference(name, loss_fn, params, batches, eps=eps, eps_root=eps_root)
    assert_trajectories_close(ours, want, rtol=1e-9)


def test_msq_eps_inside_the_root_caps_the_step_where_the_mean_is_hidden():
    """Where μ̂² ≤ 0 at step 1, ε outside gives the step m̂/ε, ε inside m̂/√ε."""
    params = {"w": jnp.zeros(2)}
    g = {"w": jnp.array([0.5, 0.5])}
    # B = 4: μ̂² = (4·0.25 − q)/3 = [−1/3, 0] for q = [2, 1].
    stats = {"mean": g, "sq_mean": {"w": jnp.array([2.0, 1.0])}, "batch_size": 4}
    eps = 1e-4
    for outside, inside, scale in ((eps, 0.0, 1 / eps), (0.0, eps, eps**-0.5)):
        opt = optimizers.scale_by_micro_adam_msq(eps=outside, eps_root=inside)
        updates, _ = opt.update(g, opt.init(params), params, stats=stats)
        got = jax.tree.map(np.asarray, updates)
        np.testing.assert_allclose(got["w"], 0.5 * scale, rtol=1e-12)


# Where ε sits in the Adam family's root: (eps, eps_root). (1e-8, 0) is the default, ε outside
# only; (0, ε) is ε inside only (optax's eps_root); both at once must add up as written.
EPS_PLACEMENTS = [(1e-3, 0.0), (0.0, 1e-3), (1e-3, 1e-2)]


@pytest.mark.parametrize(("eps", "eps_root"), EPS_PLACEMENTS, ids=["outside", "inside", "both"])
@pytest.mark.parametrize("block", [None, "tensor", "row"])
def test_msq_block_definition_on_every_rank(block: optimizers.Block, eps: float, eps_root: float):
    """One leaf of each rank 0..3 and three steps on given (ḡ, q): the docstring's math,
    m̂/(√(ReLU(⟨v̂⟩) + ε_root) + ε), with ε outside the root, inside it, or both."""
    rng = np.random.default_rng(1)
    shapes = {"scalar": (), "vector": (4,), "matrix": (3, 4), "stacked": (2, 3, 4)}
    params = {k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()}
    b, lr, b1, b2 = 4, 0.1, 0.9, 0.999
    opt = optimizers.micro_adam_msq(lr, b1=b1, b2=b2, eps=eps, block=block, eps_root=eps_root)
    state = opt.init(params)
    m = {k: np.zeros(s) for k, s in shapes.items()}
    v = {k: np.zeros(s) for k, s in shapes.items()}
    for t in range(1, 4):
        g = {k: rng.normal(size=s) for k, s in shapes.items()}
        q = {k: g[k] ** 2 + rng.uniform(0.0, 2.0, size=s) for k, s in shapes.items()}
        mean = jax.tree.map(jnp.asarray, g)
        stats = {"mean": mean, "sq_mean": jax.tree.map(jnp.asarray, q), "batch_size": b}
        updates, state = opt.update(mean, state, params, stats=stats)
        got = jax.tree.map(np.asarray, updates)
        for k in shapes:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * (b * g[k] ** 2 - q[k]) / (b - 1)
            v_hat = np.maximum(block_mean(v[k] / (1 - b2**t), block), 0.0)
            want = -lr * m[k] / (1 - b1**t) / (np.sqrt(v_hat + eps_root) + eps)
            np.testing.assert_allclose(got[k], want, rtol=1e-13, err_msg=f"{k} @ {t}")


# --------------------------------------------------------------------------------------------
# The optimizers are optax transformations: the same ḡ in, bitwise the optax optimizer's out.


def optax_pairs(case: str) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    """(ours, the optax optimizer it claims to be)."""
    mask = {"w1": True, "b1": False, "w2": True, "b2": False}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 3, STEPS)
    signum_with_decay = optax.chain(
        optax.ema(0.9, debias=False),
        optax.scale_by_sign(),
        optax.add_decayed_weights(0.1, mask),
        optax.scale_by_learning_rate(LR),
    )
    return {
        "adam": (optimizers.adam(LR), optax.adam(LR)),
        "adam_eps_root": (
            optimizers.adam(LR, eps=1e-6, eps_root=1e-4),
            optax.adam(LR, eps=1e-6, eps_root=1e-4),
        ),
        "adam_schedule": (optimizers.adam(schedule), optax.adam(schedule)),
        "adamw_masked": (
            optimizers.adam(LR, weight_decay=0.1, mask=mask),
            optax.adamw(LR, weight_decay=0.1, mask=mask),
        ),
        "sign_sgd": (optimizers.sign_sgd(LR), optax.sign_sgd(LR)),
        "sign_ema_is_signum": (optimizers.sign_ema(LR), optax.signum(LR)),
        "sign_ema_with_decay": (
            optimizers.sign_ema(LR, weight_decay=0.1, mask=mask),
            signum_with_decay,
        ),
        "sign_ema_clipped": (
            optimizers.sign_ema(LR, max_grad_norm=0.5),
            optax.chain(optax.clip_by_global_norm(0.5), optax.signum(LR)),
        ),
        "multisteps_adam": (
            optax.MultiSteps(optimizers.adam(LR), 2).gradient_transformation(),
            optax.MultiSteps(optax.adam(LR), 2).gradient_transformation(),
        ),
    }[case]


def updates_on(tx: optax.GradientTransformation, params: Any, grads: list, promotion: str) -> list:
    """tx's updates, step after step, fed the given ḡ sequence. Op by op, not jitted: XLA
    fuses the two programs differently, and a fused multiply-add rounds once, not twice."""
    with jax.numpy_dtype_promotion(promotion):  # optax's own code is not strict-clean
        state, out = tx.init(params), []
        for g in grads:
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
            out.append(jax.tree.map(np.asarray, updates))
    return out


@pytest.mark.parametrize(
    "case",
    [
        "adam", "adam_eps_root", "adam_schedule", "adamw_masked", "sign_sgd",
        "sign_ema_is_signum",
        "sign_ema_with_decay", "sign_ema_clipped", "multisteps_adam",
    ],
)  # fmt: skip
def test_bitwise_equal_to_optax(case: str):
    _, params, _ = problem("mlp")
    rng = np.random.default_rng(2)
    noise = lambda p: jnp.asarray(0.1 * rng.normal(size=p.shape))
    grads = [jax.tree.map(noise, params) for _ in range(STEPS)]
    ours, theirs = optax_pairs(case)
    expected = updates_on(theirs, params, grads, "standard")
    promotion = "standard" if case == "multisteps_adam" else "strict"  # MultiSteps is optax's
    for t, (a, b) in enumerate(
        zip(updates_on(ours, params, grads, promotion), expected, strict=True)
    ):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k} @ {t}")


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sign_ema_as_train_builds_it_is_optax_signum_plus_weight_decay(weight_decay: float):
    """SignEMA as train.make_optimizer builds it for the studies (β = 0.9, warmup then cosine lr
    in float32, decoupled decay λ on the matrices only), against optax twice: (1) optax's own
    blocks, chain(ema(β, debias=False), scale_by_sign, add_decayed_weights(λ, mask),
    scale_by_learning_rate(lr_t)); (2) optax.signum(lr_t, β) itself, plus −lr_t·λ·p on the
    decayed leaves written out. Float64, STEPS steps along a trajectory, to rounding."""
    import train  # the studies' optimizer factory

    beta = 0.9
    cfg = train.Config(
        model="mlp", optimizer="sign_ema", momentum=beta, lr=3e-2, warmup=3, steps=STEPS,
        schedule="cosine", weight_decay=weight_decay, dtype="float64",
    )  # fmt: skip
    lr: Any = train.make_schedule(cfg)  # a schedule of the step count (optax types it wider)
    matrices = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    blocks = optax.chain(
        optax.ema(beta, debias=False),
        optax.scale_by_sign(),
        optax.add_decayed_weights(weight_decay, matrices),
        optax.scale_by_learning_rate(lr),
    )
    _, params, _ = problem("mlp")
    rng = np.random.default_rng(3)
    noise = lambda p: jnp.asarray(0.1 * rng.normal(size=p.shape))
    grads = [jax.tree.map(noise, params) for _ in range(STEPS)]
    ours = updates_on(train.make_optimizer(cfg), params, grads, "strict")
    expected = updates_on(blocks, params, grads, "standard")
    for t, (a, b) in enumerate(zip(ours, expected, strict=True)):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-14, atol=0, err_msg=f"{k} @ {t}")
    # (2): signum's updates do not read the parameters; the decay reads ours, p_t before step t.
    signum = updates_on(optax.signum(lr, beta), params, grads, "standard")
    p = {k: np.asarray(v) for k, v in params.items()}
    for t, (a, b) in enumerate(zip(ours, signum, strict=True)):
        lr_t = float(lr(jnp.asarray(t)))
        for k in a:
            decay = weight_decay * p[k] if p[k].ndim >= 2 else 0.0
            np.testing.assert_allclose(
                a[k], b[k] - lr_t * decay, rtol=1e-13, atol=1e-17, err_msg=f"{k} @ {t}"
            )
            p[k] = p[k] + a[k]
    assert any(float(lr(jnp.asarray(t))) != cfg.lr for t in range(STEPS))  # a real schedule


# --------------------------------------------------------------------------------------------
# optax wrappers: statistics pass through chain, inject_hyperparams and apply_if_finite.

READS = {
    "adam": ("mean",), "micro_adam": ("mean", "sq_mean"), "micro_adam_var": ("mean", "sq_mean"),
    "micro_adam_msq": ("mean", "sq_mean"), "micro_sign_sgd": ("mean", "sign_mean"),
    "sign_sgd": ("mean",), "sign_ema": ("mean",),
}  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_required_stats_of_every_optimizer(name: str):
    _, params, _ = problem("mlp")
    assert optimizers.required_stats(make(name), params) == READS[name]


WRAPPERS: dict[str, tuple[Callable[[Callable], Any], float]] = {
    # (how to build the wrapped optimizer from a factory of lr, the lr the formula then has)
    "chain_then_scale": (lambda f: optax.chain(f(LR), optax.scale(0.5)), LR / 2),
    "identity_then_chain": (lambda f: optax.chain(optax.identity(), f(LR)), LR),
    "apply_if_finite": (lambda f: optax.apply_if_finite(f(LR), max_consecutive_errors=3), LR),
    "inject_in_chain": (
        lambda f: optax.chain(optax.inject_hyperparams(f)(learning_rate=LR), optax.scale(2.0)),
        2 * LR,
    ),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", ["micro_adam_var", "micro_sign_sgd"])
def test_wrapped_optimizers_read_their_stats_and_match_formula(name: str, wrapper: str):
    loss_fn, params, batches = problem("seq")
    build, lr = WRAPPERS[wrapper]
    opt = build(lambda learning_rate: make(name, learning_rate))
    assert optimizers.required_stats(opt, params) == READS[name]
    step = optimizers.make_train_step(loss_fn, opt, impl="factorized")
    ours = run(step, opt, params, batches)
    assert_trajectories_close(ours, reference(name, loss_fn, params, batches, lr), rtol=1e-9)


@pytest.mark.parametrize(
    "name, options",
    [
        ("micro_adam", {}),
        ("micro_adam_msq", {"eps": 1e-1}),
        ("micro_sign_sgd", {}),
        ("sign_ema", {"momentum": 0.8}),
        # A function as mask: inject_hyperparams must be told it is no schedule.
        ("micro_adam", {"weight_decay": 0.05, "mask": "all"}),
    ],
    ids=["micro_adam", "micro_adam_msq", "micro_sign_sgd", "sign_ema", "micro_adam_mask_fn"],
)
def test_inject_hyperparams_changes_the_learning_rate_mid_run(name: str, options: dict):
    loss_fn, params, batches = problem("seq")
    switch, lr_after = 4, LR / 4
    static = ()
    if options.get("mask") == "all":
        options = {**options, "mask": lambda p: jax.tree.map(lambda _: True, p)}
        static = ("mask",)
    factory = optax.inject_hyperparams(getattr(optimizers, name), static_args=static)
    opt = factory(learning_rate=LR, **options)
    step = optimizers.make_train_step(loss_fn, opt, impl="factorized")
    state, ours = opt.init(params), []
    for t, batch in enumerate(batches, start=1):
        if t == switch + 1:
            assert isinstance(state, optax.InjectStatefulHyperparamsState)
            lr = jnp.asarray(state.hyperparams["learning_rate"])
            state.hyperparams["learning_rate"] = jnp.asarray(lr_after, lr.dtype)
        params, state, _, _ = step(params, state, batch)
        ours.append(jax.tree.map(np.asarray, params))
    assert step._cache_size() == 1  # pyright: ignore[reportFunctionMemberAccess]
    formula = {k: v for k, v in options.items() if k != "mask"}
    lr_at = lambda t: LR if t <= switch else lr_after
    want = reference(name, loss_fn, *problem("seq")[1:], learning_rate=lr_at, **formula)
    assert_trajectories_close(ours, want, rtol=1e-9)


def test_missing_stats_is_a_clear_error():
    _, params, batches = problem("mlp")
    opt = optax.chain(optax.identity(), optimizers.micro_adam(LR))
    state = opt.init(params)
    with pytest.raises(
        optimizers.MissingStatistics, match=r"MicroAdam reads .*\('mean', 'sq_mean'\)"
    ):
        opt.update(params, state, params)
    with pytest.raises(ValueError, match=r"pegrad.value_and_grad_stats\(loss_fn, \('mean', 'sq"):
        opt.update(params, state, params, stats={"mean": params})
    # Rules that read only ḡ need no stats: adam is a plain optax optimizer.
    adam = optimizers.adam(LR)
    adam.update(params, adam.init(params), params)
    # Statistics named explicitly in make_train_step, too few of them: the same error.
    step = optimizers.make_train_step(mlp_loss, optimizers.micro_sign_sgd(LR), stats=())
    with pytest.raises(optimizers.MissingStatistics, match=r"MicroSignSGD reads .*sign_mean"):
        step(params, optimizers.micro_sign_sgd(LR).init(params), batches[0])


# --------------------------------------------------------------------------------------------
# Edge cases


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_of_one_adam_equals_micro_adam(impl: Impl):
    loss_fn, params, batches = problem("seq", batch_size=1)
    a, b = optimizers.adam(LR), optimizers.micro_adam(LR)
    traj_a = run(optimizers.make_train_step(loss_fn, a, impl=impl), a, params, batches)
    traj_b = run(optimizers.make_train_step(loss_fn, b, impl=impl), b, params, batches)
    assert_trajectories_close(traj_a, traj_b)


RULES = {"micro_adam_var": "MicroAdamVar", "micro_adam_msq": "MicroAdamMSQ"}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["micro_adam_var", "micro_adam_msq"])
def test_batch_of_one_is_a_clear_error_for_unbiased_estimators(name: str, impl: Impl):
    loss_fn, params, batches = problem("mlp", batch_size=1)
    opt = make(name)
    error = rf"{RULES[name]} needs at least 2 .* B = 1"
    stats = {"mean": params, "sq_mean": params, "batch_size": jnp.asarray(1)}
    with pytest.raises(ValueError, match=error):
        opt.update(params, opt.init(params), params, stats=stats)
    # In a jitted step too, while tracing: pegrad's batch_size is concrete at trace time.
    step = optimizers.make_train_step(loss_fn, opt, impl=impl)
    with pytest.raises(ValueError, match=error):
        step(params, opt.init(params), batches[0])


def core_state(state: Any) -> Any:
    """The rule's own state (count and moments) inside the chain of optax states."""
    kinds = (optax.ScaleByAdamState, optax.EmaState)
    (core,) = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, kinds))
               if isinstance(s, kinds)]  # fmt: skip
    return core


@pytest.mark.parametrize("name", NAMES)
def test_zero_gradients_give_no_nan(name: str):
    _, params, batches = problem("mlp")
    params = jax.tree.map(jnp.zeros_like, params)
    batch = jax.tree.map(jnp.zeros_like, batches[0])  # zero input, zero target: zero residual
    for impl in IMPLS:
        p, state = params, make(name).init(params)
        for _ in range(3):
            p, state, _, stats = train_step(name, "mlp", impl)(p, state, batch)
        stats.pop("batch_size")
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(stats))
        for leaf in jax.tree.leaves((p, state)):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
        assert_trajectories_close([p], [params], rtol=0, atol=0)


def _signature(tree: Any) -> list:
    return [(x.dtype, jax.typeof(x).weak_type, x.shape) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("name", NAMES)
def test_bf16_params_float32_state_stable_dtypes_no_retrace(name: str):
    traces = []

    def counting_loss(params: dict, example: dict) -> jax.Array:
        traces.append(1)  # runs only while JAX traces
        return mlp_loss(params, example)

    # bf16 parameters under x64: the moments must stay float32 (not bf16, not float64 through
    # a Python float), with no weak types, or step 2 would retrace.
    _, params, batches = problem("mlp", dtype=jnp.bfloat16)
    opt = make(name, weight_decay=0.01)
    step = optimizers.make_train_step(counting_loss, opt, impl="factorized")
    state = opt.init(params)
    before = _signature(state), _signature(params)
    params, state, loss, stats = step(params, state, batches[0])
    traced_once = len(traces)
    assert traced_once > 0
    stats.pop("batch_size")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(stats))
    for batch in batches[1:4]:
        params, state, loss, _ = step(params, state, batch)
        assert (_signature(state), _signature(params)) == before
    assert len(traces) == traced_once
    assert step._cache_size() == 1  # pyright: ignore[reportFunctionMemberAccess]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    core = core_state(state)
    assert core.count.dtype == jnp.int32 and int(core.count) == 4
    moments = jax.tree.leaves(core[1:])
    assert moments and all(x.dtype == jnp.float32 for x in moments)
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(params))
    assert np.isfinite(float(loss))


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: optimizers.micro_adam(LR, b1=1.0), "MicroAdam: b1 must be in"),
        (lambda: optimizers.sign_ema(LR, max_grad_norm=0.0), "SignEMA: max_grad_norm must be > 0"),
        (lambda: optimizers.sign_sgd(LR, momentum=-0.1), "SignSGD: momentum must be in"),
        (lambda: optimizers.adam(LR, weight_decay=-1.0), "Adam: weight_decay must be >= 0"),
        # The type checker of the tests catches it first; without one, the factory does.
        (lambda: optimizers.micro_adam_msq(LR, block="col"), "block"),  # pyright: ignore[reportArgumentType]
    ],
    ids=["b1", "max_grad_norm", "momentum", "weight_decay", "block"],
)
def test_bad_hyperparameters_are_a_clear_error(build: Callable, message: str):
    with pytest.raises((ValueError, TypeError), match=message):
        build()


@pytest.mark.parametrize("mask", ["default", "module"])
def test_equinox_parameters_with_weight_decay(mask: str):
    """An Equinox module is callable: a mask given as a module must not be called as a function."""
    import equinox as eqx

    model = eqx.nn.Linear(3, 2, key=jax.random.key(0), dtype=jnp.float64)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    decay_mask = None if mask == "default" else jax.tree.map(lambda _: True, params)
    opt = optimizers.adam(0.1, weight_decay=0.5, mask=decay_mask)
    state = opt.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, state, params)
    # Zero gradient: the whole step is weight decay, -lr·λ·p on every leaf.
    expected = jax.tree.map(lambda p: -0.1 * 0.5 * p, params)
    for u, e in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(u, e, rtol=1e-12)
    assert isinstance(eqx.combine(optax.apply_updates(params, updates), static), eqx.nn.Linear)
