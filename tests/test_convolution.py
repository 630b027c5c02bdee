"""The convolution route (pegrad.Convolution): a kernel's per-example gradients formed one output
position (kernel offset) at a time, its sum folded into one convolution over the batch.

The specification, in order: the per-offset formation equals `lax.conv_general_dilated` per
example for any layout, stride, padding, dilation and group count (hypothesis); every statistic
of convolutional models (Equinox 1-D/2-D/3-D, grouped, depthwise, transposed; Flax linen) equals
the naive per-example loop at float64, with the kernels proven by the route; each
precondition, broken, sends the leaf to the exact fallback with the reason in `explain`; and
the variance of nearly equal gradients keeps its digits in float32 (no one-pass cancellation).
"""

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_every_implementation, naive_unit_grads
from hypothesis import given, settings
from hypothesis import strategies as st

import pegrad

F64 = jnp.float64


@st.composite
def convolutions(draw: Any) -> tuple[Any, ...]:
    """A convolution with random layout, shapes, strides, padding (negative too), dilations
    and feature or batch groups, and two examples' operands."""
    rank = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    batch_groups = draw(st.sampled_from([1, 2])) if groups == 1 else 1
    n = draw(st.integers(1, 2)) * batch_groups
    per_group = draw(st.integers(1, 2))
    out_features = draw(st.integers(1, 2)) * groups * batch_groups
    window = [draw(st.integers(1, 3)) for _ in range(rank)]
    size = [draw(st.integers(4, 7)) for _ in range(rank)]
    ints = lambda lo, hi: tuple(draw(st.integers(lo, hi)) for _ in range(rank))  # noqa: E731
    strides, lhs_dilation, rhs_dilation = ints(1, 2), ints(1, 2), ints(1, 2)
    padding = tuple((draw(st.integers(-1, 2)), draw(st.integers(-1, 2))) for _ in range(rank))
    specs = [tuple(draw(st.permutations(range(rank + 2)))) for _ in range(3)]
    dn = jax.lax.ConvDimensionNumbers(*specs)
    seed = draw(st.integers(0, 2**16))
    lhs = np.random.default_rng(seed).normal(size=(2, n, per_group * groups, *size))
    rhs = np.random.default_rng(seed + 1).normal(size=(2, out_features, per_group, *window))
    # canonical (N, C, spatial) -> the layout the spec names
    lhs = np.moveaxis(lhs, range(1, rank + 3), [1 + a for a in specs[0]])
    rhs = np.moveaxis(rhs, range(1, rank + 3), [1 + a for a in specs[1]])
    params = dict(
        window_strides=strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dn,
        feature_group_count=groups,
        batch_group_count=batch_groups,
        precision=None,
    )
    return jnp.asarray(lhs), jnp.asarray(rhs), params


@settings(max_examples=25, deadline=None)
@given(convolutions())
def test_per_offset_formation_equals_lax_conv_per_example(case: tuple[Any, ...]):
    lhs, rhs, params = case
    try:
        expected = jnp.stack(
            [jax.lax.conv_general_dilated(x, k, **params) for x, k in zip(lhs, rhs, strict=True)]
        )
    except (TypeError, ValueError):  # padding or dilation leaving no window: no convolution
        return
    if not expected.size:  # no output position (its leaf would be empty: route "empty")
        return
    got, sq_sum = pegrad._conv_offsets(lhs, rhs, params, F64, lambda y: [y, jnp.sum(y * y, 0)])
    out_spec = params["dimension_numbers"].out_spec
    positions = tuple(expected.shape[1 + d] for d in out_spec[2:])
    got = pegrad._conv_layout(got, params, positions)
    sq_sum = pegrad._conv_layout(sq_sum, params, positions)
    assert got.shape == expected.shape
    scale = 1.0 + float(jnp.max(jnp.abs(expected), initial=0.0))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(sq_sum, jnp.sum(expected**2, 0), rtol=0, atol=1e-12 * scale**2)


# -- Models -----------------------------------------------------------------------------------


def _eqx(model: Any, loss: Callable) -> tuple[Any, Callable]:
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return params, lambda p, ex: loss(eqx.combine(p, static), ex)


def _regress(features: Callable) -> Callable:
    return lambda m, ex: jnp.sum((jnp.tanh(features(m, ex[0])) - ex[1]) ** 2)


def strided_dilated_1d(key: jax.Array) -> tuple[Any, Callable]:
    k1, k2 = jax.random.split(key)
    convs = (
        eqx.nn.Conv1d(2, 4, 3, stride=2, dilation=2, padding=2, key=k1, dtype=F64),
        eqx.nn.Conv1d(4, 2, 2, padding=((1, 0),), use_bias=False, key=k2, dtype=F64),
    )
    return _eqx(convs, _regress(lambda m, x: jnp.mean(m[1](jnp.sin(m[0](x))), -1)))


def grouped_2d(key: jax.Array) -> tuple[Any, Callable]:
    k1, k2 = jax.random.split(key)
    convs = (
        eqx.nn.Conv2d(2, 4, 3, padding="SAME", groups=2, key=k1, dtype=F64),
        eqx.nn.Conv2d(4, 2, 2, stride=(2, 1), key=k2, dtype=F64),
    )
    return _eqx(convs, _regress(lambda m, x: jnp.mean(m[1](jnp.sin(m[0](x))), (1, 2))))


def depthwise_2d(key: jax.Array) -> tuple[Any, Callable]:
    k1, k2 = jax.random.split(key)
    convs = (  # groups = channels: the kernel's gradient is a batch-grouped convolution
        eqx.nn.Conv2d(2, 2, 3, padding=1, groups=2, key=k1, dtype=F64),
        eqx.nn.Conv2d(2, 2, 1, key=k2, dtype=F64),
    )
    return _eqx(convs, _regress(lambda m, x: jnp.mean(m[1](jnp.sin(m[0](x))), (1, 2))))


def transposed_2d(key: jax.Array) -> tuple[Any, Callable]:
    conv = eqx.nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, key=key, dtype=F64)
    return _eqx(conv, _regress(lambda m, x: jnp.mean(m(x), (1, 2))))


def volume_3d(key: jax.Array) -> tuple[Any, Callable]:
    conv = eqx.nn.Conv3d(2, 2, 2, padding=1, key=key, dtype=F64)
    return _eqx(conv, _regress(lambda m, x: jnp.mean(m(x[..., None]), (1, 2, 3))))


class LinenConvNet(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # x: [H, W, C], channels last
        h = nn.Conv(4, (3, 3), kernel_dilation=2, padding="SAME", param_dtype=F64)(x)
        h = nn.Conv(4, (2, 2), strides=2, feature_group_count=2, param_dtype=F64)(jnp.sin(h))
        return jnp.mean(h, axis=(0, 1))[:2]


def linen_conv(key: jax.Array) -> tuple[Any, Callable]:
    module = LinenConvNet()
    params = module.init(key, jnp.zeros((5, 5, 2), F64))

    def loss(p: Any, ex: Any) -> jax.Array:
        with jax.numpy_dtype_promotion("standard"):
            out = cast(jax.Array, module.apply(p, jnp.moveaxis(ex[0], 0, -1)))
        return jnp.sum((jnp.tanh(out) - ex[1]) ** 2)

    return params, loss


def stacked_kernels(key: jax.Array) -> tuple[Any, Callable]:
    """One array holds two layers' kernels, read as w[l] in a Python loop: disjoint parts,
    each a convolution."""
    params = {"w": 0.3 * jax.random.normal(key, (2, 2, 2, 3, 3), F64)}

    def loss(p: Any, ex: Any) -> jax.Array:
        h = ex[0]
        for layer in range(2):
            h = jnp.sin(jax.lax.conv(h[None], p["w"][layer], (1, 1), "SAME")[0])
        return jnp.sum((jnp.tanh(jnp.mean(h, (1, 2))) - ex[1]) ** 2)

    return params, loss


def _scanned(shared: bool) -> Callable[[jax.Array], tuple[Any, Callable]]:
    """Three conv layers run by lax.scan: stacked kernels (one per iteration: the backward
    scan's kernel gradients are hoisted out of it, then each layer is a convolution), or one
    kernel every iteration shares (accumulated in the scan's carry: not hoisted)."""

    def build(key: jax.Array) -> tuple[Any, Callable]:
        shape = (2, 2, 3, 3) if shared else (3, 2, 2, 3, 3)
        params = {"w": 0.4 * jax.random.normal(key, shape, F64)}

        def loss(p: Any, ex: Any) -> jax.Array:
            def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
                return jnp.sin(jax.lax.conv(h[None], w, (1, 1), "SAME")[0]), None

            if shared:  # a constant of the scan body
                h, _ = jax.lax.scan(lambda h, _: layer(h, p["w"]), ex[0], None, length=3)
            else:
                h, _ = jax.lax.scan(layer, ex[0], p["w"])
            return jnp.sum((jnp.tanh(jnp.mean(h, (1, 2))) - ex[1]) ** 2)

        return params, loss

    return build


MODELS = {
    "strided_dilated_1d": strided_dilated_1d,
    "grouped_2d": grouped_2d,
    "depthwise_2d": depthwise_2d,
    "transposed_2d": transposed_2d,
    "volume_3d": volume_3d,
    "linen_conv": linen_conv,
    "stacked_kernels": stacked_kernels,
    "scanned_kernels": _scanned(shared=False),
}


def _batch(key: jax.Array, b: int) -> Any:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (b, 2, 5, 5), F64), jax.random.normal(ky, (b, 2), F64)


def _batch_1d(key: jax.Array, b: int) -> Any:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (b, 2, 9), F64), jax.random.normal(ky, (b, 2), F64)


def _batch_for(name: str) -> Callable[[jax.Array, int], Any]:
    return _batch_1d if name == "strided_dilated_1d" else _batch


def _routes(loss: Callable, params: Any, batch: Any, stats: tuple[str, ...]) -> list[str]:
    return [p.route for p in pegrad.explain(loss, params, batch, stats, choose="first")]


@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_statistic_of_a_convolutional_model_equals_the_naive_loop(name: str, batch_size: int):
    params, loss = MODELS[name](jax.random.key(0))
    batch = _batch_for(name)(jax.random.key(batch_size), batch_size)
    routes = _routes(loss, params, batch, ("mean", "sq_mean"))
    want = "disjoint-parts" if name == "stacked_kernels" else "convolution"
    assert want in routes, routes
    expected = naive_unit_grads(loss, params, batch)
    check_every_implementation(loss, params, batch, expected, name)


@pytest.mark.parametrize("budget", [1, 2000])
@pytest.mark.parametrize("name", ["grouped_2d", "depthwise_2d"])
def test_convolutions_under_a_memory_budget_equal_the_naive_loop(name: str, budget: int):
    params, loss = MODELS[name](jax.random.key(0))
    batch = _batch(jax.random.key(3), 5)
    expected = naive_unit_grads(loss, params, batch)
    impls = [("factorized", None, "first")]
    check_every_implementation(
        loss, params, batch, expected, name, impls=impls, memory_budget=budget
    )


# -- Each precondition, broken: the leaf takes the fallback, exact, and explain says why. -------


def _fixed_image(key: jax.Array) -> tuple[Any, Callable]:
    """The kernel convolves a constant image: its gradient's input does not depend on the
    example."""
    params = {"w": jax.random.normal(key, (2, 1, 3, 3), F64)}
    image = jnp.linspace(-1.0, 1.0, 25, dtype=F64).reshape(1, 1, 5, 5)

    def loss(p: Any, ex: Any) -> jax.Array:
        h = jax.lax.conv(image, p["w"], (1, 1), "SAME")[0]
        return jnp.sum((jnp.tanh(ex[0][:2] * h) - ex[0][:2]) ** 2) + jnp.sum(ex[1])

    return params, loss


def _learned_image(size: int) -> Callable[[jax.Array], tuple[Any, Callable]]:
    """A learned image convolved with each example's own kernel: the image's gradient is a
    convolution with one output position per pixel."""

    def build(key: jax.Array) -> tuple[Any, Callable]:
        params = {"image": jax.random.normal(key, (1, 2, size, size), F64)}

        def loss(p: Any, ex: Any) -> jax.Array:
            kernel = ex[0][:, :3, :3][None]  # [1, 2, 3, 3] from the example
            h = jax.lax.conv(p["image"], kernel, (1, 1), "SAME")
            return jnp.sum((jnp.tanh(h) - 0.5) ** 2) + jnp.sum(ex[1])

        return params, loss

    return build


@pytest.mark.parametrize(
    "build, refusal",
    [
        (_fixed_image, "an operand of the convolution does not depend on the example"),
        (_learned_image(17), "its output has 289 positions (> 256 dots)"),
    ],
    ids=["operand_without_the_example", "too_many_output_positions"],
)
def test_a_broken_precondition_takes_the_exact_fallback(build: Callable, refusal: str):
    params, loss = build(jax.random.key(0))
    batch = _batch(jax.random.key(1), 3)
    (plan,) = pegrad.explain(loss, params, batch, ("mean", "sq_mean"), choose="first")
    assert plan.route != "convolution"
    assert ("convolution", refusal) in plan.refused
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "")


def test_a_memory_budget_below_the_emitted_operands_keeps_scanned_kernels_in_their_scan():
    """Hoisting emits each layer's operands from the scan; where they exceed the budget the
    kernels' gradients stay inside the scan (computed batched, exact) — not a convolution."""
    params, loss = _scanned(shared=False)(jax.random.key(0))
    batch = _batch(jax.random.key(1), 3)
    stats = ("mean", "sq_mean")
    (unbounded,) = pegrad.explain(loss, params, batch, stats, choose="first")
    (bounded,) = pegrad.explain(loss, params, batch, stats, choose="first", memory_budget=64)
    assert unbounded.route == "convolution" and bounded.route != "convolution"
    impls = [("factorized", None, "first")]
    expected = naive_unit_grads(loss, params, batch)
    check_every_implementation(loss, params, batch, expected, "", impls=impls, memory_budget=64)


def test_a_kernel_every_scan_iteration_shares_takes_the_exact_fallback():
    """Σ_t over iterations of a convolution is not hoisted out of the backward scan."""
    params, loss = _scanned(shared=True)(jax.random.key(0))
    batch = _batch(jax.random.key(1), 3)
    assert _routes(loss, params, batch, ("mean", "sq_mean")) == ["fallback"]
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "")


def test_a_learned_image_with_few_positions_is_a_convolution_and_exact():
    params, loss = _learned_image(4)(jax.random.key(0))
    batch = _batch(jax.random.key(1), 3)
    assert _routes(loss, params, batch, ("mean", "sq_mean")) == ["convolution"]
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "")


def test_per_token_statistics_of_a_convolution_are_refused_with_a_clear_error():
    """A kernel mixes positions: no position's contribution is its own, so granularity="token"
    is refused before any work, naming the parameter and the operation."""
    conv = eqx.nn.Conv1d(3, 3, 3, padding=1, key=jax.random.key(0), dtype=F64)
    params, loss = _eqx(conv, lambda m, ex: jnp.mean((m(ex[0].T).T - ex[1]) ** 2))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = jax.random.normal(kx, (2, 4, 3), F64), jax.random.normal(ky, (2, 4, 3), F64)
    with pytest.raises(
        ValueError, match="params.weight meets the example at 'conv_general_dilated'"
    ):
        pegrad.value_and_grad_stats(loss, "sq_mean", granularity="token")(params, batch)


@pytest.mark.parametrize("chunk", [2, 3, 4])
def test_a_padded_chunk_leaves_the_variance_of_nearly_equal_kernel_gradients_exact(chunk: int):
    """B = 5 in chunks of 2, 3 or 4: the last chunk holds r < chunk examples and padding. Its
    padding rows must be left out of the chunk's M2, not subtracted as (E − r)·mean², which
    cancels where mean² ≫ variance (relative error 1e-6 at this spread before)."""
    kx, kn, kw = jax.random.split(jax.random.key(0), 3)
    base = jax.random.normal(kx, (1, 2, 6), F64)
    images = base + 1e-6 * jax.random.normal(kn, (5, 2, 6), F64)
    params = {"k": 0.5 * jax.random.normal(kw, (2, 2, 3), F64)}

    def loss(p: Any, ex: Any) -> jax.Array:
        y = jax.lax.conv_general_dilated(ex[None], p["k"], (1,), "SAME")
        return jnp.sum(jnp.tanh(y) ** 2)

    (_, grads) = naive_unit_grads(loss, params, images)
    want = np.var(grads["k"], axis=0, ddof=1)
    assert _routes(loss, params, images, ("var",)) == ["convolution"]
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, "var", chunk_size=chunk))(params, images)
    # Chan's merge of chunks keeps ~ε·mean²/variance; the subtraction lost ~1e-6 here.
    assert np.max(np.abs(np.asarray(got["var"]["k"]) - want)) / np.max(want) < 1e-9


@pytest.mark.parametrize("batch_size", [5, 32])
def test_the_variance_of_nearly_equal_kernel_gradients_keeps_its_digits_in_float32(
    batch_size: int,
):
    """g_i = conv(x_i, δ_i) with x_i = base + 1e-3·noise_i: mean²/variance ≈ 1e6, where a
    one-pass E[g²] − ḡ² in float32 loses every digit. Two-pass per chunk and Chan's merge keep
    the float32 variance within 1e-3 of the float64 one (also across chunks of 2)."""
    kb, kn, kw, kv = jax.random.split(jax.random.key(0), 4)
    f32 = jnp.float32
    base = jax.random.normal(kb, (1, 2, 6, 6), f32)
    images = base + 1e-3 * jax.random.normal(kn, (batch_size, 2, 6, 6), f32)
    params = {"w": jax.random.normal(kw, (3, 2, 3, 3), f32)}
    v = jax.random.normal(kv, (3, 6, 6), f32)

    def loss(p: Any, ex: Any) -> jax.Array:
        h = jax.lax.conv(ex[None], p["w"], (1, 1), "SAME")[0]
        return jnp.sum(jnp.tanh(h) * v.astype(ex.dtype))

    as64 = lambda t: jax.tree.map(lambda x: x.astype(F64), t)  # noqa: E731
    (_, grads) = naive_unit_grads(loss, as64(params), as64(images))
    want = np.var(grads["w"], axis=0, ddof=1)
    assert float(np.max(np.mean(grads["w"], 0) ** 2 / want)) > 1e5  # the regime named above
    assert _routes(loss, params, images, ("var",)) == ["convolution"]
    for chunk in (None, 2):
        fn = pegrad.value_and_grad_stats(loss, "var", chunk_size=chunk)
        _, got = jax.jit(fn)(params, images)
        assert got["var"]["w"].dtype == jnp.float32
        err = np.max(np.abs(np.asarray(got["var"]["w"], np.float64) - want)) / np.max(want)
        assert err < 1e-3, (chunk, err)
