"""optimizers.py composed the way optax users compose: accumulation, masks and partitions,
wrappers, transformations chained before a rule, and models that are not plain trees.

The contract (optimizers.py's docstring): the statistics follow the updates' tree (masks), and
a rule reading statistics gets ḡ or one global multiple of it, or refuses. Every equality here
is at float64 against the SPEC §4 formula on a naive per-example loop (test_optimizers.reference)
or against one step on the union of the micro-batches.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_optimizers import (
    LR,
    NAMES,
    READS,
    assert_trajectories_close,
    make,
    median_grad_norm,
    mlp_loss,
    problem,
    reference,
    run,
)

import optimizers
import pegrad

STATS_READERS = ("micro_adam", "micro_adam_var", "micro_adam_msq", "micro_sign_sgd")
# The statistics a rule's error is raised with, eagerly or from inside a jitted step.
Refusal = (ValueError, jax.errors.JaxRuntimeError)


def leaf_w(tree: Any) -> np.ndarray:
    return np.asarray(tree["w"])


def leaf(tree: Any, key: str) -> np.ndarray:
    return np.asarray(tree[key])


def split(batch: dict, sizes: list[int]) -> list[dict]:
    """Consecutive micro-batches of the given sizes."""
    starts = np.cumsum([0, *sizes])
    return [
        jax.tree.map(lambda x, a=a, b=b: x[a:b], batch)
        for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]


def run_micro(opt: Any, params: dict, batches: list, sizes: list[int]) -> list:
    """Every batch fed as micro-batches of `sizes`; the parameters after each whole batch."""
    step = optimizers.make_train_step(mlp_loss, opt, impl="vmap")
    state, trajectory = opt.init(params), []
    for batch in batches:
        for micro in split(batch, sizes):
            params, state, _, _ = step(params, state, micro)
        trajectory.append(jax.tree.map(np.asarray, params))
    return trajectory


# --------------------------------------------------------------------------------------------
# Accumulation


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [5, 11, 8, 8]], ids=["equal", "unequal"])
@pytest.mark.parametrize("name", NAMES)
def test_multi_steps_equals_one_step_on_the_union(name: str, sizes: list[int]):
    """4 micro-batches through multi_steps = one step on their 32 examples, update by update."""
    _, params, batches = problem("mlp", batch_size=32)
    ours = run_micro(optimizers.multi_steps(make(name), len(sizes)), params, batches[:3], sizes)
    big = run(optimizers.make_train_step(mlp_loss, make(name), impl="vmap"), make(name),
              params, batches[:3])  # fmt: skip
    assert_trajectories_close(ours, big, rtol=1e-10)
    assert_trajectories_close(ours, reference(name, mlp_loss, params, batches[:3]), rtol=1e-9)


def test_multi_steps_returns_zero_updates_between_updates():
    _, params, batches = problem("mlp", batch_size=32)
    opt = optimizers.multi_steps(make("micro_adam"), 4)
    step = optimizers.make_train_step(mlp_loss, opt, impl="vmap")
    state = opt.init(params)
    for i, micro in enumerate(split(batches[0], [8, 8, 8, 8])):
        new, state, _, _ = step(params, state, micro)
        moved = any(
            np.any(a != b)
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True)
        )
        assert moved == (i == 3)
        params = new
        assert int(state.mini_step) == (i + 1) % 4


def var_rule() -> optax.GradientTransformationExtraArgs:
    """A rule reading the unbiased variance: its update is −σ̂² (to see what it was given)."""

    def update(updates: Any, state: Any, params: Any = None, *, stats: Any = None, **_: Any):
        if stats is None or "var" not in stats:
            raise optimizers.MissingStatistics("Var", ("mean", "var"), stats)
        return jax.tree.map(jnp.negative, stats["var"]), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("sizes", [[2, 3, 5], [1, 1, 4], [6]], ids=str)
def test_multi_steps_pools_the_variance(sizes: list[int]):
    """The Chan merge of the micro-batches' (mean, var) is the union's unbiased variance."""
    rng = np.random.default_rng(3)
    params = {"w": jnp.zeros((2, 3))}
    grads = rng.normal(size=(sum(sizes), 2, 3))
    opt = optimizers.multi_steps(var_rule(), len(sizes))
    assert optimizers.required_stats(opt, params) == ("mean", "var")
    state = opt.init(params)
    for part in np.split(grads, np.cumsum(sizes)[:-1]):
        var = part.var(0, ddof=1) if len(part) > 1 else np.zeros(part.shape[1:])
        stats = {"mean": {"w": jnp.asarray(part.mean(0))}, "var": {"w": jnp.asarray(var)},
                 "batch_size": len(part)}  # fmt: skip
        updates, state = opt.update(stats["mean"], state, params, stats=stats)
    np.testing.assert_allclose(-leaf_w(updates), grads.var(0, ddof=1), rtol=1e-12)


@pytest.mark.parametrize("kept", [[2, 0], [2, 1], [1, 0, 2]], ids=str)
@pytest.mark.parametrize("rule", ["micro_adam", "var"])
def test_multi_steps_merges_micro_batches_keeping_one_or_no_example(rule: str, kept: list[int]):
    """Micro-batches of 2 masked to keep `kept` examples each, under jit, = one step on the kept
    ones. Before: NaN (a micro-batch keeping none averaged its NaN statistics in with weight 0;
    one keeping one multiplied its NaN variance by B − 1 = 0)."""
    _, params, batches = problem("mlp", batch_size=2 * len(kept))
    names = ("mean", "sq_mean") if rule == "micro_adam" else ("mean", "var")
    fn = jax.jit(pegrad.value_and_grad_stats(mlp_loss, names, impl="vmap"))
    opt = optimizers.multi_steps(make(rule) if rule == "micro_adam" else var_rule(), len(kept))
    state = opt.init(params)
    for micro, k in zip(split(batches[0], [2] * len(kept)), kept, strict=True):
        _, st = fn(params, micro, mask=jnp.arange(2) < k)
        updates, state = opt.update(st["mean"], state, params, stats=st)
    union = jax.tree.map(
        lambda x: np.concatenate([x[2 * i : 2 * i + k] for i, k in enumerate(kept)]), batches[0]
    )
    _, st = fn(params, union)
    one = make(rule) if rule == "micro_adam" else var_rule()
    want, _ = one.update(st["mean"], one.init(params), params, stats=st)
    for key in params:
        np.testing.assert_allclose(leaf(updates, key), leaf(want, key), rtol=1e-10, err_msg=key)


@pytest.mark.parametrize("name", STATS_READERS)
def test_optax_multisteps_is_refused_naming_multi_steps(name: str):
    """optax.MultiSteps hands the rule the accumulated ḡ beside the last micro-batch's
    statistics: before, silently wrong (micro_adam_var off by ~5e5 in the parameters here)."""
    _, params, batches = problem("mlp", batch_size=32)
    refused = pytest.raises(Refusal, match=r"optimizers\.multi_steps")
    with refused, jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps is not strict-clean
        jax.block_until_ready(run_micro(optax.MultiSteps(make(name), 4), params, batches[:1],
                                        [8, 8, 8, 8]))  # fmt: skip


@pytest.mark.parametrize("name", ["adam", "sign_sgd", "sign_ema"])
def test_optax_multisteps_still_works_for_rules_reading_only_the_mean(name: str):
    _, params, batches = problem("mlp", batch_size=32)
    with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps is not strict-clean
        ours = run_micro(optax.MultiSteps(make(name), 4), params, batches[:2], [8, 8, 8, 8])
    # optax's running mean rounds otherwise than one mean of 32; Adam's ḡ/(|ḡ| + ε) magnifies
    # that 1e8-fold where |ḡ| is near ε = 1e-8.
    want = reference(name, mlp_loss, params, batches[:2])
    assert_trajectories_close(ours, want, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------------------------
# What may come before a rule: ḡ, or one global multiple of it.


@pytest.mark.parametrize("name", [*STATS_READERS, "adam"])
def test_clip_by_global_norm_before_a_rule_equals_its_max_grad_norm(name: str):
    """optax.clip_by_global_norm(C) then the rule = the rule clipping every per-example
    gradient by c (its max_grad_norm; MicroSignSGD is invariant to c)."""
    _, params, batches = problem("mlp")
    clip = median_grad_norm("mlp")
    chained = optax.chain(optax.clip_by_global_norm(clip), make(name))
    with jax.numpy_dtype_promotion("standard"):  # optax's clipping is not strict-clean
        ours = run(optimizers.make_train_step(mlp_loss, chained, impl="vmap"), chained,
                   params, batches)  # fmt: skip
    options: dict[str, Any] = {} if name == "micro_sign_sgd" else {"max_grad_norm": clip}
    assert_trajectories_close(ours, reference(name, mlp_loss, params, batches, **options), 1e-9)


def given_stats(scale: float = 1.0) -> tuple[dict, dict, dict]:
    """(params, ḡ, stats) of a batch of 4, every per-example gradient scaled by `scale`."""
    rng = np.random.default_rng(4)
    g = rng.normal(size=(4, 3)) * scale
    mean = {"w": jnp.asarray(g.mean(0))}
    stats = {"mean": mean, "sq_mean": {"w": jnp.asarray((g**2).mean(0))},
             "sign_mean": {"w": jnp.asarray(np.sign(g).mean(0))}, "batch_size": 4}  # fmt: skip
    return {"w": jnp.ones(3)}, mean, stats


@pytest.mark.parametrize("c", [0.5, -2.0])
@pytest.mark.parametrize("name", STATS_READERS)
def test_a_global_multiple_of_the_mean_scales_the_statistics(name: str, c: float):
    """update(c·ḡ, stats of g) = update(c·ḡ, stats of c·g): q → c²q, sign_mean → sign(c)·s."""
    params, mean, stats = given_stats()
    _, scaled_mean, scaled_stats = given_stats(c)
    opt = make(name, eps=0.0) if name != "micro_sign_sgd" else make(name)
    u = jax.tree.map(lambda x: c * x, mean)
    got, _ = opt.update(u, opt.init(params), params, stats=stats)
    want, _ = opt.update(scaled_mean, opt.init(params), params, stats=scaled_stats)
    np.testing.assert_allclose(leaf_w(got), leaf_w(want), rtol=1e-12)


@pytest.mark.parametrize("name", STATS_READERS)
def test_an_equal_copy_of_the_mean_gives_bitwise_the_same_update(name: str):
    params, mean, stats = given_stats()
    opt = make(name)
    same, _ = opt.update(mean, opt.init(params), params, stats=stats)
    copy, _ = opt.update(jax.tree.map(jnp.copy, mean), opt.init(params), params, stats=stats)
    np.testing.assert_array_equal(leaf_w(same), leaf_w(copy))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", STATS_READERS)
def test_an_elementwise_change_before_a_rule_is_refused(name: str, jit: bool):
    params, mean, stats = given_stats()
    opt = optax.chain(optax.clip(0.1), make(name))  # clips some coordinates, not all

    def update(u: Any, s: Any, st: Any) -> Any:
        return opt.update(u, s, params, stats=st)

    fn = jax.jit(update) if jit else update
    refused = pytest.raises(Refusal, match=r"not c·ḡ.* chain it after the rule")
    with refused, jax.numpy_dtype_promotion("standard"):
        jax.block_until_ready(fn(mean, opt.init(params), stats))


def test_statistics_of_another_tree_are_refused():
    params, mean, stats = given_stats()
    opt = make("micro_adam")
    wrong = {**stats, "sq_mean": {"v": stats["sq_mean"]["w"]}}
    with pytest.raises(ValueError, match=r"MicroAdam: stats\['sq_mean'\] does not have"):
        opt.update(mean, opt.init(params), params, stats=wrong)
    wrong = {**stats, "sq_mean": {"w": jnp.ones(4)}}
    with pytest.raises(ValueError, match=r"not shaped like the updates.*\(4,\).*\(3,\)"):
        opt.update(mean, opt.init(params), params, stats=wrong)


# --------------------------------------------------------------------------------------------
# Masks and partitions: each part of the tree its own rule, the statistics cut alike.

LABELS = {"w1": "a", "b1": "b", "w2": "a", "b2": "b"}  # the matrices, and the biases


def partitioned(name: str, other: str, how: str) -> Any:
    a, b = make(name), make(other)
    if how == "partition":
        return optax.partition({"a": a, "b": b}, LABELS)
    mask = {k: v == "a" for k, v in LABELS.items()}
    if how == "masked_fn":  # the mask as a function of the tree, as optax allows
        first = optax.masked(a, lambda tree: {k: v == "a" for k, v in LABELS.items()})
    else:
        first = optax.masked(a, mask)
    return optax.chain(first, optax.masked(b, {k: not v for k, v in mask.items()}))


@pytest.mark.parametrize("how", ["partition", "masked", "masked_fn"])
@pytest.mark.parametrize("name", NAMES)
def test_each_part_follows_its_own_formula(name: str, how: str):
    """`name` on the matrices, adam (or micro_adam beside adam) on the biases."""
    other = "micro_adam" if name == "adam" else "adam"
    _, params, batches = problem("mlp")
    opt = partitioned(name, other, how)
    assert set(optimizers.required_stats(opt, params)) == set(READS[name] + READS[other])
    ours = run(optimizers.make_train_step(mlp_loss, opt, impl="vmap"), opt, params, batches)
    rules = {k: name if v == "a" else other for k, v in LABELS.items()}
    assert_trajectories_close(ours, reference(rules, mlp_loss, params, batches), rtol=1e-9)


# --------------------------------------------------------------------------------------------
# optax's wrappers around every optimizer here.

WRAPPERS: dict[str, Callable[[Callable[[], Any]], Any]] = {
    "named_chain": lambda f: optax.named_chain(("rule", f()), ("id", optax.identity())),
    "inject_hyperparams": lambda f: optax.inject_hyperparams(lambda learning_rate: f())(
        learning_rate=LR
    ),
    "apply_if_finite": lambda f: optax.apply_if_finite(f(), max_consecutive_errors=2),
    "masked_everything": lambda f: optax.masked(
        f(), lambda tree: jax.tree.map(lambda _: True, tree)
    ),
    "multi_steps_of_1": lambda f: optimizers.multi_steps(f(), 1),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_under_every_wrapper_follows_its_formula(name: str, wrapper: str):
    _, params, batches = problem("mlp")
    opt = WRAPPERS[wrapper](lambda: make(name))
    assert optimizers.required_stats(opt, params) == READS[name]
    ours = run(optimizers.make_train_step(mlp_loss, opt, impl="vmap"), opt, params, batches[:4])
    assert_trajectories_close(ours, reference(name, mlp_loss, params, batches[:4]), rtol=1e-9)


@pytest.mark.parametrize(
    "build, names",
    [
        (
            lambda: optax.chain(
                optax.masked(
                    make("micro_adam"), {"w1": True, "b1": False, "w2": True, "b2": False}
                ),
                optax.scale(1.0),
            ),
            {"mean", "sq_mean"},
        ),  # fmt: skip
        (lambda: optimizers.multi_steps(make("micro_sign_sgd"), 3), {"mean", "sign_mean"}),
        (
            lambda: optax.partition(
                {"a": make("micro_adam_var"), "b": make("micro_sign_sgd")}, LABELS
            ),
            {"mean", "sq_mean", "sign_mean"},
        ),  # fmt: skip
        (
            lambda: optax.apply_if_finite(
                optimizers.multi_steps(
                    optax.partition({"a": make("micro_adam_msq"), "b": make("sign_ema")}, LABELS), 2
                ),
                3,
            ),
            {"mean", "sq_mean"},
        ),  # fmt: skip
    ],
    ids=["masked_in_chain", "multi_steps", "partition_of_two_readers", "nested"],
)
def test_required_stats_of_compositions(build: Callable, names: set[str]):
    _, params, _ = problem("mlp")
    found = optimizers.required_stats(build(), params)
    assert found[0] == "mean" and set(found) == names and len(found) == len(names)


# --------------------------------------------------------------------------------------------
# Models as they are: an Equinox module with non-array leaves.


class Net(eqx.Module):
    layers: eqx.nn.Sequential
    scale: float  # a Python float leaf: not a parameter

    def __init__(self, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.layers = eqx.nn.Sequential([
            eqx.nn.Linear(4, 6, key=k1, dtype=jnp.float64), eqx.nn.LayerNorm(6, dtype=jnp.float64),
            eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(6, 3, key=k2, dtype=jnp.float64),
        ])  # fmt: skip
        self.scale = 0.5

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers(x)


def net_loss(model: Net, example: dict) -> jax.Array:
    return model.scale * jnp.sum((model(example["x"]) - example["y"]) ** 2)


@pytest.mark.parametrize("name", ["micro_adam_var", "micro_sign_sgd"])
def test_a_module_trains_as_its_partitioned_parameters(name: str):
    model = Net(key=jax.random.key(0))
    _, _, batches = problem("mlp")
    opt = make(name)
    assert optimizers.required_stats(opt, model) == READS[name]
    # The module as it is ...
    step = optimizers.make_train_step(net_loss, opt, impl="vmap")
    state = opt.init(optimizers.trainable(model))
    m = model
    for batch in batches[:3]:
        m, state, _, _ = step(m, state, batch)
    assert isinstance(m, Net) and m.scale == 0.5
    # ... equals Equinox's recipe: partition, a loss that recombines, the float leaves stepped.
    params, static = eqx.partition(model, eqx.is_inexact_array)
    plain = optimizers.make_train_step(
        lambda p, ex: net_loss(eqx.combine(p, static), ex), opt, impl="vmap"
    )
    want = run(plain, opt, params, batches[:3])[-1]
    got = eqx.filter(m, eqx.is_inexact_array)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)


# --------------------------------------------------------------------------------------------
# bfloat16 parameters: every rule returns its updates in the incoming updates' dtype (optax's
# convention: optax.adam on float32 ḡ of bfloat16 parameters returns float32), so optax's
# wrappers whose other branch returns zeros of the updates (apply_if_finite, multi_steps) compose.

BF16_WRAPPERS: dict[str, Callable[[Any], Any]] = {
    "apply_if_finite": lambda rule: optax.apply_if_finite(rule, max_consecutive_errors=3),
    "chain": lambda rule: optax.chain(optax.clip_by_global_norm(0.5), rule, optax.scale(1.0)),
    "masked": lambda rule: optax.masked(rule, {"w1": True, "b1": False, "w2": True, "b2": True}),
    "multi_steps": lambda rule: optimizers.multi_steps(rule, 2),
}
BF16_STEPS, NAN_STEP = 6, 3  # a non-finite ḡ (and statistics) at this step


def bf16_stats(params: dict, t: int, poison: bool = False) -> dict:
    """Float32 statistics of step t (pegrad's for bfloat16 parameters): ḡ, q ≥ ḡ², s in [-1, 1];
    poison: NaN at one coordinate of every statistic at NAN_STEP (a non-finite example)."""
    rng = np.random.default_rng(100 + t)

    def of(p: jax.Array, scale: float) -> jax.Array:
        return jnp.asarray(scale * rng.normal(size=p.shape), jnp.float32)

    mean = {k: of(p, 0.3) for k, p in params.items()}
    sq_mean = {k: g * g + jnp.abs(of(g, 0.2)) for k, g in mean.items()}
    sign_mean = {k: jnp.clip(of(g, 0.5), -1.0, 1.0) for k, g in mean.items()}
    stats = {"mean": mean, "sq_mean": sq_mean, "sign_mean": sign_mean, "batch_size": 4}
    if poison and t == NAN_STEP:
        nan_at = lambda tree: {**tree, "w2": tree["w2"].at[0, 0].set(jnp.nan)}
        stats = {**stats, **{n: nan_at(stats[n]) for n in ("mean", "sq_mean", "sign_mean")}}
    return stats


def bf16_trajectory(opt: Any, params: dict, poison: bool) -> tuple[list, list]:
    """(params after each step, updates of each step): opt.update(ḡ, state, params, stats=) and
    p + u rounded to p's dtype, jitted, on the same float32 statistics whatever p's dtype."""
    update = jax.jit(lambda g, s, p, st: opt.update(g, s, p, stats=st))
    apply = jax.jit(
        lambda p, u: jax.tree.map(lambda a, b: (a.astype(b.dtype) + b).astype(a.dtype), p, u)
    )
    state, trajectory, steps = opt.init(params), [], []
    for t in range(BF16_STEPS):
        stats = bf16_stats(params, t, poison)
        updates, state = update(stats["mean"], state, params, stats)
        params = apply(params, updates)
        trajectory.append(params)
        steps.append(updates)
    return trajectory, steps


@pytest.mark.parametrize("wrapper", BF16_WRAPPERS)
@pytest.mark.parametrize("name", NAMES)
def test_bf16_parameters_compose_with_every_wrapper(name: str, wrapper: str):
    """The rule wrapped, on bfloat16 parameters: its updates are float32 (ḡ's dtype) at every step,
    the parameters stay bfloat16, and every step equals the same step on float32 parameters
    holding the same values, rounded to bfloat16 (the moments are float32 either way); under
    apply_if_finite a step whose ḡ and statistics hold a NaN is skipped (the others would
    carry the NaN on, or refuse it: clip_by_global_norm spreads it to every coordinate)."""
    poison = wrapper == "apply_if_finite"
    _, wide, _ = problem("mlp", dtype=jnp.float32)
    narrow = jax.tree.map(lambda p: p.astype(jnp.bfloat16), wide)
    opt = BF16_WRAPPERS[wrapper](make(name, weight_decay=0.1))
    got, got_updates = bf16_trajectory(opt, narrow, poison)
    for updates in got_updates:
        assert {x.dtype for x in jax.tree.leaves(updates)} == {jnp.dtype(jnp.float32)}
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
    # The reference: float32 parameters, rounded to bfloat16 after every step.
    update = jax.jit(lambda g, s, p, st: opt.update(g, s, p, stats=st))
    p32 = jax.tree.map(lambda p: p.astype(jnp.float32), narrow)
    state = opt.init(p32)
    for t in range(BF16_STEPS):
        stats = bf16_stats(p32, t, poison)
        updates, state = update(stats["mean"], state, p32, stats)
        want = jax.tree.map(lambda p, u: (p + u).astype(jnp.bfloat16), p32, updates)
        for k in want:
            np.testing.assert_array_equal(
                np.asarray(got[t][k], np.float32), np.asarray(want[k], np.float32),
                err_msg=f"{name} under {wrapper}, step {t}, leaf {k}",
            )  # fmt: skip
        p32 = jax.tree.map(lambda p: p.astype(jnp.float32), want)
    if poison:  # the NaN step: no update at all, the count says so
        before = got[NAN_STEP - 1]
        for k in before:
            np.testing.assert_array_equal(got[NAN_STEP][k], before[k], err_msg=k)
        assert not any(np.array_equal(got[NAN_STEP + 1][k], before[k]) for k in ("w1", "b1"))
        assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 0


@pytest.mark.parametrize(
    "grads, params", [("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float32", "float32")]
)
@pytest.mark.parametrize("name", NAMES)
def test_updates_come_back_in_the_dtype_optax_adam_returns(name: str, grads: str, params: str):
    """optax.adam's updates (standard promotion: optax is not strict-clean) and every rule's are
    of one dtype, the incoming updates': float32 ḡ of bfloat16 parameters gives float32."""
    _, wide, _ = problem("mlp", dtype=jnp.float32)
    p = jax.tree.map(lambda x: x.astype(params), wide)
    stats = bf16_stats(wide, 0)
    stats = {
        n: jax.tree.map(lambda x: x.astype(grads), v) if n != "batch_size" else v
        for n, v in stats.items()
    }
    with jax.numpy_dtype_promotion("standard"):
        tx = optax.adam(LR)
        want, _ = tx.update(stats["mean"], tx.init(p), p)
    opt = make(name)
    got, _ = opt.update(stats["mean"], opt.init(p), p, stats=stats)
    dtypes = lambda tree: {x.dtype for x in jax.tree.leaves(tree)}
    assert dtypes(got) == dtypes(want) == {jnp.dtype(grads)}
