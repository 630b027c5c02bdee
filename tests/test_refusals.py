"""Refusals a new user meets in the first hour (issue 50), each one line that names the fix:
under any jit the user writes (Equinox's runtime error: `eqx.filter_jit` shows the message
first), optax.MultiSteps nested in optax.chain, a random draw with a shared key in a custom_vjp
backward rule, "var" of a micro-batch of one, a model's non-array field traced by jax.jit, a
(loss, aux) pair without has_aux=True and a batch given as a list of examples. And one that
composes now: optax.apply_if_finite around a rule with bfloat16 parameters (refused by issue 50;
issue 58: it computes)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optimizers
import pegrad


def loss_fn(params: dict, example: tuple) -> jax.Array:
    x, y = example
    return jnp.sum((params["w"].astype(x.dtype) @ x - y) ** 2)


def problem(dtype: Any = jnp.float64) -> tuple[dict, tuple]:
    x = jax.random.normal(jax.random.key(0), (8, 3))
    return {"w": jnp.ones((2, 3), dtype)}, (x, jnp.sin(x[:, :2]))


def shifted(batch: tuple, i: int) -> tuple:
    return jax.tree.map(
        lambda a: a + jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape) * (i + 1.0)), batch
    )


@pytest.mark.parametrize("jit", ["jax.jit", "eqx.filter_jit"])
def test_a_refusal_in_a_users_own_jit_names_the_rule_the_leaf_and_the_fix(jit: str):
    params, batch = problem()
    opt = optax.MultiSteps(optimizers.micro_adam(1e-3), every_k_schedule=2)
    fn = pegrad.value_and_grad_stats(loss_fn, ("mean", "sq_mean"))

    def step(params: dict, state: Any, batch: tuple) -> tuple:
        _, stats = fn(params, batch)
        updates, state = opt.update(stats["mean"], state, params, stats=stats)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step) if jit == "jax.jit" else eqx.filter_jit(step)
    # jax.jit: JAX's runtime error carrying Equinox's (a ValueError or RuntimeError by version)
    error = eqx.EquinoxRuntimeError if jit == "eqx.filter_jit" else Exception
    state = opt.init(params)
    with pytest.raises(error) as info, jax.numpy_dtype_promotion("standard"):  # optax's blocks
        for i in range(3):
            params, state = jitted(params, state, shifted(batch, i))
            jax.block_until_ready(params)
    message = str(info.value)
    assert "MicroAdam: the updates it was given are not c·ḡ" in message
    assert "at ['w']" in message and "optimizers.multi_steps(opt, every_k)" in message


def test_make_train_step_names_the_coordinate_and_both_values():
    params, batch = problem()
    opt = optax.chain(optax.add_decayed_weights(1e-2), optimizers.micro_adam(1e-3))
    step = optimizers.make_train_step(loss_fn, opt)
    with pytest.raises(
        optimizers.InconsistentUpdates, match=r"at \['w'\], flat index \d+, the update is"
    ):
        step(params, opt.init(params), batch)


@pytest.mark.parametrize("call", ["make_train_step", "required_stats"])
def test_multisteps_nested_in_a_chain_is_refused_naming_multi_steps(call: str):
    params, batch = problem()
    inner = optax.MultiSteps(optimizers.micro_adam(1e-3), every_k_schedule=2)
    opt = optax.chain(inner.gradient_transformation(), optax.scale(1.0))
    with pytest.raises(optimizers.InconsistentUpdates, match=r"optimizers\.multi_steps\(opt"):
        if call == "required_stats":
            optimizers.required_stats(opt, params)
        else:
            optimizers.make_train_step(loss_fn, opt)(params, opt.init(params), batch)


def test_multisteps_nested_around_a_rule_reading_only_the_mean_is_accepted():
    params, batch = problem()
    inner = optax.MultiSteps(optimizers.adam(1e-3), every_k_schedule=2)
    opt = optax.chain(inner.gradient_transformation(), optax.scale(1.0))
    with jax.numpy_dtype_promotion("standard"):  # optax's blocks are not strict-clean
        assert optimizers.required_stats(opt, params) == ("mean",)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_apply_if_finite_around_a_rule_computes_and_skips_a_nonfinite_step(dtype: Any):
    """Issue 50 refused apply_if_finite around a rule with bfloat16 parameters (its skip branch
    returns ḡ's float32 zeros, the rule returned bf16); the rules now return updates in ḡ's
    dtype, as optax.adam does, so it composes: the unwrapped step, equal to the float32
    computation rounded to the parameters' dtype, and a step whose ḡ is NaN is skipped."""
    params, batch = problem(dtype)
    wrapped = optax.apply_if_finite(optimizers.micro_adam(0.05), max_consecutive_errors=3)
    assert optimizers.required_stats(wrapped, params) == ("mean", "sq_mean")
    step = optimizers.make_train_step(loss_fn, wrapped)
    got, state, _, _ = step(params, wrapped.init(params), batch)
    assert got["w"].dtype == dtype and not np.array_equal(got["w"], params["w"])
    plain = optimizers.micro_adam(0.05)
    plain_step = optimizers.make_train_step(loss_fn, plain)
    want, _, _, _ = plain_step(params, plain.init(params), batch)
    np.testing.assert_array_equal(got["w"], want["w"])
    wide = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # the same values, float32
    wide_got, _, _, _ = plain_step(wide, plain.init(wide), batch)
    np.testing.assert_array_equal(got["w"], wide_got["w"].astype(dtype))
    x, y = batch
    skipped, state, _, _ = step(got, state, (x.at[0, 0].set(jnp.nan), y))  # ḡ NaN: no step
    np.testing.assert_array_equal(skipped["w"], got["w"])
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (1, 1)
    again, state, _, _ = step(skipped, state, shifted(batch, 1))  # and on: a finite step
    assert int(state.notfinite_count) == 0 and not np.array_equal(again["w"], skipped["w"])


def _noisy_backward(key_of: Any) -> Any:
    @jax.custom_vjp
    def noisy(x: jax.Array, key: jax.Array) -> jax.Array:
        return x

    def fwd(x: jax.Array, key: jax.Array) -> tuple:
        return x, key

    def bwd(key: jax.Array, g: jax.Array) -> tuple:
        return g + jax.random.normal(key_of(key), g.shape, g.dtype), None

    noisy.defvjp(fwd, bwd)
    return noisy


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
@pytest.mark.parametrize("key", ["shared", "per example"])
def test_a_draw_in_a_custom_vjp_backward_rule_needs_a_key_per_example(impl: str, key: str):
    shared = jax.random.key(7)
    noisy = _noisy_backward((lambda k: shared) if key == "shared" else (lambda k: k))

    def loss(params: dict, example: tuple) -> jax.Array:
        x, k = example
        return jnp.sum(noisy(params["w"] * x, k) ** 2)

    params = {"w": jnp.ones(3)}
    batch = (jnp.arange(12.0).reshape(4, 3), jax.random.split(jax.random.key(1), 4))
    fn = pegrad.value_and_grad_stats(loss, ("mean", "sq_mean"), impl=impl)  # type: ignore[arg-type]
    if key == "shared":
        with pytest.raises(ValueError, match="a custom_vjp backward rule of loss_fn draws"):
            fn(params, batch)
    else:
        _, stats = fn(params, batch)
        assert np.all(np.isfinite(stats["mean"]["w"]))


@pytest.mark.parametrize("where", ["batch of one", "mask keeping one"])
def test_var_of_one_unit_names_the_accumulator(where: str):
    params, batch = problem()
    fn = pegrad.value_and_grad_stats(loss_fn, ("mean", "var"))
    mask = None if where == "batch of one" else jnp.arange(8) == 3
    if mask is None:
        batch = jax.tree.map(lambda x: x[:1], batch)
    with pytest.raises(
        ValueError, match=r"'var' is undefined for 1 kept unit.*Accumulator\.value_and_grad_stats"
    ):
        fn(params, batch, mask)


class _Dropped(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.dropout(self.linear(x), key=key)


def test_a_model_field_traced_by_jax_jit_is_named_with_eqx_filter_jit():
    model = _Dropped(eqx.nn.Linear(3, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.5))
    batch = (jnp.ones((4, 3)), jax.random.split(jax.random.key(1), 4))
    fn = pegrad.value_and_grad_stats(lambda m, ex: jnp.sum(m(*ex) ** 2), ("mean", "sq_mean"))
    loss, _ = eqx.filter_jit(fn)(model, batch)
    assert np.isfinite(loss)
    with pytest.raises(
        TypeError, match=r"params\.dropout\.inference became tracers.*eqx\.filter_jit"
    ):
        jax.jit(fn)(model, batch)


def test_a_loss_and_aux_pair_without_has_aux_names_has_aux():
    params, batch = problem()
    fn = pegrad.value_and_grad_stats(lambda p, ex: (loss_fn(p, ex), ex[0]), "mean")
    with pytest.raises(ValueError, match=r"a \(loss, aux\) pair needs has_aux=True"):
        fn(params, batch)


def test_a_list_of_examples_names_stacking():
    params, batch = problem()
    examples = [jax.tree.map(lambda x, i=i: x[i], batch) for i in range(8)]
    with pytest.raises(ValueError, match=r"a list of examples\? stack them"):
        pegrad.value_and_grad_stats(loss_fn, "mean")(params, examples)
