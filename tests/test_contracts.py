"""The contracts at the edges users compose, closed as classes by property tests (hypothesis,
fixed seed, bounded draws): for every draw either a clear refusal or equality with the formula
fed by a naive per-example loop — never a third, silently different number.

1. A rule reading statistics inside any optax composition (SPEC §4, "Composition"): global
   scalings (clip_by_global_norm, scale, a schedule) before it, wrappers around it (masked,
   inject_hyperparams, apply_if_finite), transforms after it, accumulation (multi_steps),
   eager or jitted. A transform before it that changes ḡ otherwise (coupled weight decay, an
   elementwise clip) must be refused, however small the change: the check is per coordinate.
   Changes that cancel exactly (decay(λ), scale(−2), decay(λ), decay(λ) is −2ḡ) are the
   multiple they sum to: taken as it, or refused (multi_steps checks each micro-batch before
   the later decays cancel it), never a third number.
2. Models that hold state pegrad's functional call would drop (SPEC §1): dropout drawing from
   the model's own RNG, BatchNorm in training mode, any variable the loss mutates — refused
   before any work, naming the layer; the same models in eval mode, or with the randomness
   passed per example, equal the naive loop.
"""

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import naive_unit_grads
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import optimizers
import pegrad

LR = 1e-2
EPS = {"micro_adam_msq": 1e-1}  # MicroAdamMSQ's √ReLU(v̂) is ~0 where noise hides the mean
RULES = ("adam", "micro_adam", "micro_adam_var", "micro_adam_msq", "micro_sign_sgd")
SIZES = {1: [6], 2: [2, 4], 3: [1, 2, 3]}  # micro-batches of one batch of 6 (one of 1 example)
DRAWS = settings(
    max_examples=16,
    deadline=None,
    derandomize=True,  # a fixed seed: the same draws on every run
    suppress_health_check=[HealthCheck.too_slow],
)


def mlp_loss(params: dict, example: dict) -> jax.Array:
    h = jnp.tanh(example["x"] @ params["w1"] + params["b1"])
    return 0.5 * jnp.sum((h @ params["w2"] - example["y"]) ** 2)


@functools.cache
def problem() -> tuple[dict, dict, dict]:
    """(params, batch of 6, per-example gradients from the naive loop)."""
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(3, 4))),
        "b1": jnp.asarray(rng.normal(size=4)),
        "w2": jnp.asarray(rng.normal(size=(4, 2))),
    }
    batch = {"x": jnp.asarray(rng.normal(size=(6, 3))), "y": jnp.asarray(rng.normal(size=(6, 2)))}
    _, grads = naive_unit_grads(mlp_loss, params, batch)
    return params, batch, grads


@functools.cache
def stats_fn() -> Callable:
    names = ("mean", "sq_mean", "sign_mean")
    return jax.jit(pegrad.value_and_grad_stats(mlp_loss, names, impl="factorized"))


# --------------------------------------------------------------------------------------------
# 1. Optimizer compositions.

# Transforms that may come before a rule: global scalings (accepted, read as every per-example
# gradient times c) and changes of ḡ that are not one (refused).
SCALINGS = ("clip_by_global_norm", "scale", "schedule")
CHANGES = ("decay_1e-9", "decay_1e-5", "decay_1e-2", "clip")


def before(name: str) -> optax.GradientTransformation:
    if name == "clip_by_global_norm":
        return optax.clip_by_global_norm(0.3)  # below ‖ḡ‖ here: it clips
    if name == "scale":
        return optax.scale(-2.0)
    if name == "schedule":
        return optax.scale_by_schedule(lambda count: 0.7)
    if name == "clip":
        return optax.clip(1e-6)  # every coordinate to ±1e-6: not c·ḡ
    return optax.add_decayed_weights(float(name.split("_")[1]))  # coupled L2, however small


def shift_of(names: list[str], shift: float = 0.0) -> float | None:
    """The multiple of p the transforms `names` add to ḡ after `shift` (coupled decay adds λ;
    scalings multiply it), or None where the change is not a shift by a constant: an
    elementwise clip, or a global-norm clip of ḡ + shift·p (its factor is data-dependent).
    A composition is one global multiple of ḡ exactly when its shift is 0: the decays in
    decay(λ), scale(−2), decay(λ), decay(λ) cancel."""
    for name in names:
        if name == "clip" or (name == "clip_by_global_norm" and shift != 0.0):
            return None
        if name.startswith("decay"):
            shift += float(name.split("_")[1])
        else:
            shift *= {"scale": -2.0, "schedule": 0.7, "clip_by_global_norm": 1.0}[name]
    return shift


def scale_of(names: list[str], mean: dict) -> float:
    """The c the scalings `names` multiply ḡ by (the oracle's own arithmetic; decays that
    cancel, `shift_of`, leave it alone)."""
    c = 1.0
    for name in names:
        if name.startswith("decay"):
            continue
        if name == "clip_by_global_norm":
            c *= min(1.0, 0.3 / (abs(c) * np.sqrt(sum(np.sum(x**2) for x in mean.values()))))
        else:
            c *= {"scale": -2.0, "schedule": 0.7}[name]
    return c


def formula(rule: str, h: dict) -> dict:
    """SPEC §4's first update from a fresh state on per-example gradients h ([N, ...] per leaf):
    −lr·m̂/(√v̂ + ε) with m̂ = ḡ and v̂ = ν; MicroSignSGD (β 0) −lr·(1/N) Σ sign(h_i)."""
    out = {}
    for k, g in h.items():
        n, mean = len(g), g.mean(0)
        var = np.sum((g - mean) ** 2, 0) / max(n - 1, 1)
        nu = {
            "adam": mean**2,
            "micro_adam": np.mean(g**2, 0),
            "micro_adam_var": var,
            "micro_adam_msq": np.maximum(mean**2 - var / n, 0.0),
        }
        if rule == "micro_sign_sgd":
            out[k] = -LR * np.mean(np.sign(g), 0)
        else:
            out[k] = -LR * mean / (np.sqrt(nu[rule]) + EPS.get(rule, 1e-8))
    return out


@st.composite
def compositions(draw: Any) -> dict[str, Any]:
    rule = draw(st.sampled_from(RULES))
    # adam reads no statistics: whatever comes before it is its input, as in optax.adam.
    transforms = st.lists(
        st.sampled_from(SCALINGS + (CHANGES if rule != "adam" else ())), max_size=2
    )
    return {
        "rule": rule,
        "k": draw(st.sampled_from(sorted(SIZES))),
        "outer": draw(transforms),  # before multi_steps: per micro-batch
        "inner": draw(transforms),  # inside multi_steps: on the accumulated ḡ
        "wrap": draw(st.sampled_from(["none", "masked", "inject", "apply_if_finite"])),
        "schedule": draw(st.booleans()),  # lr as an optax schedule
        "after": draw(st.sampled_from(["none", "clip", "scale", "decay"])),
        "jit": draw(st.booleans()),
    }


MASK = {"w1": True, "b1": False, "w2": True}


def build(c: dict[str, Any]) -> optax.GradientTransformationExtraArgs:
    lr = (lambda count: jnp.where(count < 100, LR, 0.0)) if c["schedule"] else LR
    options = {"eps": EPS[c["rule"]]} if c["rule"] in EPS else {}
    if c["wrap"] == "inject":
        rule = optax.inject_hyperparams(getattr(optimizers, c["rule"]))(lr, **options)
    else:
        rule = getattr(optimizers, c["rule"])(lr, **options)
    if c["wrap"] == "masked":
        rule = optax.masked(rule, MASK)
    elif c["wrap"] == "apply_if_finite":
        rule = optax.apply_if_finite(rule, max_consecutive_errors=3)
    inner = optax.chain(*[before(n) for n in c["inner"]], rule)
    core = optimizers.multi_steps(inner, c["k"]) if c["k"] > 1 else inner
    after = {"none": [], "clip": [optax.clip(1e-3)], "scale": [optax.scale(0.5)],
             "decay": [optax.add_decayed_weights(1e-2)]}[c["after"]]  # fmt: skip
    return optax.chain(*[before(n) for n in c["outer"]], core, *after)


def expected(c: dict[str, Any], params: dict, grads: dict) -> dict:
    """The composition's update from the oracle: each micro-batch's per-example gradients
    times its outer c, the union's times the inner c, the formula, then the after-transform."""
    parts, start = [], 0
    for size in SIZES[c["k"]]:
        g = {k: v[start : start + size] for k, v in grads.items()}
        start += size
        scale = scale_of(c["outer"], {k: v.mean(0) for k, v in g.items()})
        parts.append({k: scale * v for k, v in g.items()})
    h = {k: np.concatenate([p[k] for p in parts]) for k in grads}
    scale = scale_of(c["inner"], {k: v.mean(0) for k, v in h.items()})
    h = {k: scale * v for k, v in h.items()}
    update = formula(c["rule"], h)
    if c["wrap"] == "masked":  # the leaves outside the mask pass the (scaled) ḡ on
        update = {k: u if MASK[k] else h[k].mean(0) for k, u in update.items()}
    update = {k: jnp.asarray(u) for k, u in update.items()}
    tail = {"clip": optax.clip(1e-3), "scale": optax.scale(0.5),
            "decay": optax.add_decayed_weights(1e-2)}.get(c["after"])  # fmt: skip
    if tail is not None:
        update, _ = tail.update(update, tail.init(params), params)
    return cast(dict, update)


def refused(error: BaseException) -> bool:
    """A refusal: pegrad's error, or (a user's own jax.jit) JAX's error carrying Equinox's
    (a JaxRuntimeError, or a ValueError under jax_enable_x64)."""
    if isinstance(error, optimizers.InconsistentUpdates):
        return True
    runtime = (jax.errors.JaxRuntimeError, ValueError)
    return isinstance(error, runtime) and "optimizers.InconsistentUpdates" in str(error)


CANCELLING = {"outer": ["decay_1e-9", "scale"], "inner": ["decay_1e-9", "decay_1e-9"]}
PLAIN = {"wrap": "none", "schedule": False, "after": "none"}


@DRAWS
@given(compositions())
# −2(ḡ + λp) + λp + λp = −2ḡ: a seed-7 draw the old oracle (refuse any decay) got wrong
@example({"rule": "micro_adam", "k": 1, **CANCELLING, **PLAIN, "jit": False})
@example({"rule": "micro_adam_var", "k": 3, **CANCELLING, **PLAIN, "jit": True})
def test_a_rule_in_any_composition_equals_its_formula_or_refuses(c: dict[str, Any]):
    params, batch, grads = problem()
    opt = build(c)
    changed = any(n in CHANGES for n in c["outer"] + c["inner"])
    outer = shift_of(c["outer"])  # per micro-batch; their mean shifts ḡ by the same
    shift = None if outer is None else shift_of(c["inner"], outer)
    must_refuse = changed and shift != 0.0  # (None too)
    cancelled = changed and shift == 0.0  # exact in exact arithmetic: equal, or refused
    state = opt.init(params)

    def update(u: Any, s: Any, p: Any, st_: Any) -> Any:
        return opt.update(u, s, p, stats=st_)

    fn = jax.jit(update) if c["jit"] else update
    start, out = 0, None
    try:
        with jax.numpy_dtype_promotion("standard"):  # optax's blocks are not strict-clean
            for size in SIZES[c["k"]]:
                micro = jax.tree.map(lambda x, a=start, b=start + size: x[a:b], batch)
                start += size
                _, stats = stats_fn()(params, micro)
                out, state = fn(stats["mean"], state, params, stats)
                jax.block_until_ready(out)
    except (ValueError, jax.errors.JaxRuntimeError) as error:
        assert refused(error), f"{c}: failed otherwise than refusing: {error}"
        assert must_refuse or cancelled, f"{c}: refused a composition that is exact: {error}"
        assert "l2=λ" in str(error) and "multi_steps" in str(error)  # it names the fixes
        event("refused")
        return
    assert not must_refuse, f"{c}: accepted a change of ḡ that is not one global multiple"
    event("equal to the formula")
    want, got = expected(c, params, grads), cast(dict, out)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-13, err_msg=f"{c} {k}")


@pytest.mark.parametrize("decay", [1e-9, 1e-5, 1e-2])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_coupled_decay_before_a_rule_is_refused_however_small(decay: float, jit: bool):
    """optax.add_decayed_weights(λ) then micro_adam: a shift λ·p the statistics do not carry.
    Accepted before at λ = 1e-9 (float64) and 1e-5 (float32): the old check compared the change
    with √ε of the largest update. Refused now, in make_train_step with pegrad's own error
    (not JAX's runtime error around it), naming where coupled L2 belongs."""
    params, batch, _ = problem()
    opt = optax.chain(optax.add_decayed_weights(decay), optimizers.micro_adam(LR))
    step = optimizers.make_train_step(mlp_loss, opt, jit=jit)
    with pytest.raises(optimizers.InconsistentUpdates, match=r"at \['\w+'\].*l2=λ"):
        jax.block_until_ready(step(params, opt.init(params), batch))


def test_optax_multisteps_around_a_statistics_rule_is_refused_before_it_runs():
    params, batch, _ = problem()
    opt = optax.MultiSteps(optimizers.micro_adam(LR), 2)
    step = optimizers.make_train_step(mlp_loss, opt)
    with pytest.raises(optimizers.InconsistentUpdates, match=r"optimizers\.multi_steps"):
        step(params, opt.init(params), batch)


@pytest.mark.parametrize("rule", ["adam", "micro_adam", "micro_adam_var", "micro_adam_msq"])
def test_l2_is_every_example_gradient_shifted_by_lambda_p(rule: str):
    """l2=λ: the rule as if (λ/2)·‖p‖² were in each example's loss (the naive loop on that
    loss), over three steps from the same state."""
    params, batch, _ = problem()
    lam = 0.3
    l2_loss = lambda p, ex: mlp_loss(p, ex) + 0.5 * lam * sum(jnp.sum(x**2) for x in p.values())
    options = {"eps": EPS[rule]} if rule in EPS else {}
    opt = getattr(optimizers, rule)(LR, l2=lam, **options)
    step = optimizers.make_train_step(mlp_loss, opt)
    plain = getattr(optimizers, rule)(LR, **options)
    oracle = optimizers.make_train_step(l2_loss, plain, impl="vmap")
    p, s, q, r = params, opt.init(params), params, plain.init(params)
    for _ in range(3):
        p, s, _, _ = step(p, s, batch)
        q, r, _, _ = oracle(q, r, batch)
    for k in params:
        np.testing.assert_allclose(p[k], q[k], rtol=1e-10, atol=1e-13, err_msg=k)
    # The first update also against the formula on the naive loop's shifted gradients.
    _, grads = naive_unit_grads(l2_loss, params, batch)
    p1, _, _, _ = step(params, opt.init(params), batch)
    want = formula(rule, grads)
    for k in params:
        np.testing.assert_allclose(p1[k] - params[k], want[k], rtol=1e-9, err_msg=k)


def test_adam_l2_equals_optax_coupled_decay_then_adam():
    params, batch, _ = problem()
    ours = optimizers.adam(LR, l2=0.3)
    theirs = optax.chain(optax.add_decayed_weights(0.3), optax.adam(LR))
    grad = jax.grad(lambda p: jnp.mean(jax.vmap(mlp_loss, (None, 0))(p, batch)))(params)
    with jax.numpy_dtype_promotion("standard"):
        a, _ = ours.update(grad, ours.init(params), params)
        b, _ = theirs.update(grad, theirs.init(params), params)
    for k in params:
        np.testing.assert_allclose(cast(dict, a)[k], cast(dict, b)[k], rtol=1e-12, err_msg=k)


# --------------------------------------------------------------------------------------------
# 2. Models that hold state: refused before any work, or equal to the naive loop.


def stateful_model(framework: str, layer: str, train: bool) -> tuple[Any, Callable]:
    """(the model as pegrad takes it, apply(model, x, key | None) -> scalar output). key None:
    the layer draws from the model's own RNG (nnx) or a key closed over (Equinox, linen)."""
    import equinox as eqx
    from flax import linen, nnx

    fixed_key = jax.random.PRNGKey(7)
    if framework == "nnx":
        rngs = nnx.Rngs(0, dropout=1)
        wide = {"dtype": jnp.float64, "param_dtype": jnp.float64}
        mid = (
            nnx.Dropout(0.5, rngs=rngs)
            if layer == "dropout"
            else nnx.BatchNorm(4, rngs=rngs, **wide)
        )

        class Net(nnx.Module):
            def __init__(self) -> None:
                self.a = nnx.Linear(3, 4, rngs=rngs, param_dtype=jnp.float64)
                self.mid = mid
                self.b = nnx.Linear(4, 1, rngs=rngs, param_dtype=jnp.float64)

            def __call__(self, x: jax.Array, key: Any) -> jax.Array:
                h = jnp.tanh(self.a(x))
                if isinstance(self.mid, nnx.Dropout) and key is not None:
                    h = self.mid(h, rngs=nnx.Rngs(dropout=key))
                else:
                    h = self.mid(h[None])[0] if isinstance(self.mid, nnx.BatchNorm) else self.mid(h)
                return self.b(h)[0]

        net = Net()
        net.train() if train else net.eval()
        wide = lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x
        return jax.tree.map(wide, net), lambda m, x, key: m(x, key)  # BatchNorm's stats: f32
    if framework == "eqx":
        keys = jax.random.split(jax.random.PRNGKey(0), 2)
        net = eqx.nn.Sequential([
            eqx.nn.Linear(3, 4, key=keys[0], dtype=jnp.float64),
            eqx.nn.Lambda(jnp.tanh),
            eqx.nn.Dropout(0.5, inference=not train),
            eqx.nn.Linear(4, "scalar", key=keys[1], dtype=jnp.float64),
        ])  # fmt: skip

        def apply_eqx(m: Any, x: jax.Array, key: Any) -> jax.Array:
            return m(x, key=fixed_key if key is None else key)

        return net, apply_eqx

    class Lin(linen.Module):
        @linen.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = jnp.tanh(linen.Dense(4, param_dtype=jnp.float64)(x))
            h = linen.Dropout(0.5, deterministic=not train)(h)
            return linen.Dense(1, param_dtype=jnp.float64)(h)[0]

    module = Lin()
    variables = module.init(jax.random.PRNGKey(0), jnp.zeros(3))

    def apply_linen(v: Any, x: jax.Array, key: Any) -> jax.Array:
        return cast(
            jax.Array, module.apply(v, x, rngs={"dropout": fixed_key if key is None else key})
        )

    return dict(variables), apply_linen


@st.composite
def stateful_cases(draw: Any) -> dict[str, Any]:
    framework = draw(st.sampled_from(["nnx", "eqx", "linen"]))
    layer = draw(st.sampled_from(["dropout", "batchnorm"] if framework == "nnx" else ["dropout"]))
    return {
        "framework": framework,
        "layer": layer,
        "train": draw(st.booleans()),
        "per_example_key": draw(st.booleans()),  # the key comes with the example
        "impl": draw(st.sampled_from(["vmap", "factorized"])),
    }


def naive_model_grads(loss: Callable, model: Any, batch: Any) -> list[np.ndarray]:
    """Per-example gradients [B, ...] of the model's floating leaves, one example at a time."""
    import equinox as eqx

    diff, static = eqx.partition(model, eqx.is_inexact_array)
    grad = jax.jit(jax.grad(lambda d, ex: loss(eqx.combine(d, static), ex)))
    n = len(batch["y"])
    rows = [jax.tree.leaves(grad(diff, jax.tree.map(lambda x, i=i: x[i], batch))) for i in range(n)]
    return [np.stack([np.asarray(r[j]) for r in rows]) for j in range(len(rows[0]))]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(stateful_cases())
def test_a_model_with_state_equals_the_naive_loop_or_is_refused_before_any_work(c: dict):
    model, apply = stateful_model(c["framework"], c["layer"], c["train"])
    rng = np.random.default_rng(1)
    batch = {"x": jnp.asarray(rng.normal(size=(3, 3))), "y": jnp.asarray(rng.normal(size=3)),
             "key": jax.random.split(jax.random.PRNGKey(3), 3)}  # fmt: skip

    def loss(m: Any, ex: dict) -> jax.Array:
        return (apply(m, ex["x"], ex["key"] if c["per_example_key"] else None) - ex["y"]) ** 2

    random = c["layer"] == "dropout" and c["train"]
    must_refuse = (random and not c["per_example_key"]) or (
        c["layer"] == "batchnorm" and c["train"]
    )
    fn = pegrad.value_and_grad_stats(loss, ("mean", "sq_mean"), impl=c["impl"])
    if must_refuse:
        event("refused")
        what = r"(draws random numbers|changed params|couples the examples)"
        with pytest.raises(ValueError, match=what):
            pegrad.explain(loss, model, batch, ("mean", "sq_mean"))  # before any work: a trace
        with pytest.raises(ValueError, match=what):
            fn(model, batch)
        return
    event("equal to the naive loop")
    import equinox as eqx

    _, stats = eqx.filter_jit(fn)(model, batch)
    grads = naive_model_grads(loss, model, batch)
    for name, phi in (("mean", lambda g: g.mean(0)), ("sq_mean", lambda g: (g**2).mean(0))):
        got = jax.tree.leaves(stats[name])
        assert len(got) == len(grads), (c, name)
        for a, g in zip(got, grads, strict=True):
            np.testing.assert_allclose(a, phi(g), rtol=1e-10, atol=1e-14, err_msg=f"{c} {name}")


@pytest.mark.parametrize(
    ("framework", "says"),
    [
        ("nnx", r"changed params\.mid\.rngs\.count\.value in place"),
        ("eqx", r"draws random numbers \(random_bits\) from a key that does not depend"),
        ("linen", r"draws random numbers \(random_bits\) from a key that does not depend"),
    ],
)
def test_dropout_drawing_the_same_mask_for_every_example_is_refused(framework: str, says: str):
    """Before: accepted, one mask for the whole batch, and under nnx the RNG never advanced,
    so every step reused it. The refusal names the leaf or the draw and the fix."""
    model, apply = stateful_model(framework, "dropout", train=True)
    batch = {"x": jnp.ones((2, 3)), "y": jnp.zeros(2)}
    loss = lambda m, ex: (apply(m, ex["x"], None) - ex["y"]) ** 2
    with pytest.raises(ValueError, match=says + r".*a key per example in the batch"):
        pegrad.value_and_grad_stats(loss, ("mean", "sq_mean"))(model, batch)


# --------------------------------------------------------------------------------------------
# Found by an adversarial probe of the contracts above (each failed before its fix).


CLIP_IN_FLOAT32 = """
import jax, jax.numpy as jnp, numpy as np, optax
from pegrad import optimizers
key = jax.random.split(jax.random.PRNGKey(0), 4)
params = {"a": 0.3 * jax.random.normal(key[0], (16, 8)), "b": jax.random.normal(key[1], (8,))}
batch = {"x": jax.random.normal(key[2], (8, 16)), "y": jax.random.normal(key[3], (8,))}
loss = lambda p, ex: (jnp.tanh(ex["x"] @ p["a"]) @ p["b"] - ex["y"]) ** 2
chained = optax.chain(optax.clip_by_global_norm(1e-3), optimizers.micro_adam(1e-3))
own = optimizers.micro_adam(1e-3, max_grad_norm=1e-3)
out = []
for opt in (chained, own):
    step, p, s = optimizers.make_train_step(loss, opt, impl="vmap"), params, opt.init(params)
    for k in range(5):
        p, s, _, _ = step(p, s, jax.tree.map(lambda x, k=k: jnp.roll(x, k, 0), batch))
    out.append(p)
for k in params:
    np.testing.assert_allclose(out[0][k], out[1][k], rtol=1e-5, atol=1e-7, err_msg=k)
print("equal")
"""


def test_clip_by_global_norm_before_a_rule_is_accepted_in_float32_under_jit():
    """XLA may round the global norm of clip_by_global_norm differently for different
    coordinates of one compiled program (33 float32 ulps at 136 parameters, impl="vmap"): a
    check at 16 ulps refused this exact composition. It equals micro_adam(max_grad_norm=C) to
    float32 rounding. A subprocess: float32 and XLA's default optimizations, as users run it
    (the suite runs float64 with XLA's passes off, where the norm is rounded once)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_ENABLE_X64")}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CLIP_IN_FLOAT32], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-2000:]


def test_a_nan_made_by_a_transform_does_not_switch_the_check_off():
    """An elementwise clip of ḡ plus one NaN was accepted (the NaN won argmax and compared
    False), scaling q by a c no coordinate had; a NaN where ḡ is NaN stays apply_if_finite's."""
    params = {"w": jnp.ones(4)}
    stats = {"mean": {"w": jnp.array([4.0, 1.0, -2.0, 0.5])},
             "sq_mean": {"w": jnp.array([20.0, 2.0, 5.0, 1.0])}, "batch_size": 8}  # fmt: skip
    opt = optimizers.micro_adam(1.0)
    for u in ([0.1, 0.1, -0.1, 0.1], [0.1, 0.1, -0.1, jnp.nan], [jnp.nan, 1.0, -2.0, 0.5]):
        with pytest.raises(optimizers.InconsistentUpdates):
            opt.update({"w": jnp.array(u)}, opt.init(params), params, stats=stats)
    both = {**stats, "mean": {"w": jnp.array([4.0, jnp.nan, -2.0, 0.5])}}
    out, _ = opt.update(both["mean"], opt.init(params), params, stats=both)  # NaN in both: ok
    assert np.isnan(np.asarray(cast(dict, out)["w"])[1])


def test_updates_narrower_than_the_statistics_may_round_once_not_rescale_a_leaf():
    """bf16 updates beside float32 statistics: 16 bf16 ulps (12.5 %) let a leaf rescaled by
    1.08 through; now one bf16 rounding is allowed (ULPS/4 of its ε), not a rescale."""
    params = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16)}
    mean = {
        "a": jnp.array([1.0, -0.5, 0.25], jnp.float32),
        "b": jnp.array([0.3, -0.2], jnp.float32),
    }
    stats = {"mean": mean, "sq_mean": jax.tree.map(lambda g: 2.0 * g * g, mean), "batch_size": 4}
    opt = optimizers.micro_adam(1e-3)
    cast = lambda tree, s: {k: (g * s[k]).astype(jnp.bfloat16) for k, g in tree.items()}
    opt.update(cast(mean, {"a": 1.0, "b": 1.0}), opt.init(params), params, stats=stats)  # rounds
    with pytest.raises(optimizers.InconsistentUpdates, match=r"at \['b'\]"):
        opt.update(cast(mean, {"a": 1.0, "b": 1.08}), opt.init(params), params, stats=stats)


def test_a_shared_draw_through_rng_bit_generator_is_refused():
    key = jax.random.key_data(jax.random.PRNGKey(5))
    params = {"w": jnp.ones((3, 2))}

    def loss(p, x):
        _, bits = jax.lax.rng_bit_generator(key, (2,), jnp.uint32)
        keep = (bits % 2).astype(x.dtype)
        return jnp.sum(keep * (x @ p["w"])) ** 2

    with pytest.raises(ValueError, match=r"rng_bit_generator"):
        pegrad.value_and_grad_stats(loss, "mean")(params, jnp.ones((4, 3)))


def test_a_key_advanced_an_example_dependent_number_of_times_is_per_example():
    """fori_loop(0, n(x), split): its trip count depends on the example, so does the key; it was
    refused as shared. Equal to the naive loop now."""
    params = {"w": jnp.linspace(0.5, 1.5, 6).reshape(3, 2)}
    key = jax.random.PRNGKey(1)

    def loss(p, x):
        n = (jnp.abs(x[0]) * 4).astype(jnp.int32)
        k = jax.lax.fori_loop(0, n, lambda _, k: jax.random.split(k)[0], key)
        keep = jax.random.bernoulli(k, 0.5, (2,)).astype(x.dtype)
        return jnp.sum(keep * jnp.tanh(x @ p["w"])) ** 2

    batch = jnp.asarray(np.random.default_rng(3).normal(size=(4, 3)))
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, ("mean", "sq_mean")))(params, batch)
    _, grads = naive_unit_grads(loss, params, batch)
    np.testing.assert_allclose(got["mean"]["w"], grads["w"].mean(0), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(got["sq_mean"]["w"], (grads["w"] ** 2).mean(0), rtol=1e-10)
