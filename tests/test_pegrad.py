"""pegrad's contract: both implementations equal the naive per-example loop, at float64.

Every statistic x implementation (vmap, vmap chunked, factorized, factorized chunked) x
granularity x model piece x batch size (1, 2, odd) is compared to `naive_stats` of
`naive_unit_grads` (one `jax.grad` per example, numpy reductions) to 1e-10 relative.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pieces import PIECES, Piece, T, naive_stats, naive_unit_grads

import pegrad

CLIP = 0.5
IMPLS = [("vmap", None), ("vmap", 2), ("factorized", None), ("factorized", 2)]


def assert_tree_close(actual, expected, what: str, rtol: float = 1e-10) -> None:
    flat_a, tree_a = jax.tree.flatten(actual)
    flat_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e, f"{what}: tree structure differs"
    for a, e in zip(flat_a, flat_e, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
        scale = max(np.max(np.abs(e)), 1e-12)
        err = np.max(np.abs(a - e)) / scale
        assert err <= rtol, f"{what}: relative error {err:.2e}"


def run_stats(piece: Piece, params, batch, impl, chunk, granularity, stats):
    fn = pegrad.value_and_grad_stats(
        piece.loss, stats, impl=impl, chunk_size=chunk, granularity=granularity, clip_norm=CLIP
    )
    return jax.jit(fn)(params, batch)


def cases():
    for piece in PIECES:
        for granularity in ["example", "token"] if piece.sequence else ["example"]:
            for batch_size in (1, 2, 5):
                yield pytest.param(
                    piece, granularity, batch_size, id=f"{piece}-{granularity}-B{batch_size}"
                )


@pytest.mark.parametrize("piece,granularity,batch_size", list(cases()))
def test_every_statistic_and_implementation_equals_the_naive_loop(piece, granularity, batch_size):
    key = jax.random.key(batch_size)
    params = piece.init(key)
    batch = piece.example(jax.random.fold_in(key, 1), batch_size)
    expected = naive_stats(naive_unit_grads(piece, params, batch, granularity), CLIP)
    units = batch_size * (T if granularity == "token" else 1)
    stats = tuple(s for s in pegrad.STATISTICS if units > 1 or s != "var")
    expected_loss = np.mean(
        [piece.loss(params, jax.tree.map(lambda x, i=i: x[i], batch)) for i in range(batch_size)]
    )
    for impl, chunk in IMPLS:
        loss, got = run_stats(piece, params, batch, impl, chunk, granularity, stats)
        what = f"{piece}/{granularity}/B={batch_size}/{impl}/chunk={chunk}"
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-12, err_msg=what)
        assert int(got["batch_size"]) == units
        for name in stats:
            assert_tree_close(got[name], expected[name], f"{what}/{name}")


def test_explain_names_the_path_of_every_leaf():
    mlp = next(p for p in PIECES if p.name == "mlp3")
    params = mlp.init(jax.random.key(0))
    batch = mlp.example(jax.random.key(1), 3)
    reports = pegrad.explain(mlp.loss, params, batch, ("mean", "sq_mean"))
    by_path = {r.path: r for r in reports}
    for i in range(3):
        assert by_path[f"[{i}]['w']"].path_taken == "factorized"
        assert by_path[f"[{i}]['w']"].route == "rank-one"
    for i in range(2):
        assert by_path[f"[{i}]['b']"].path_taken == "fallback"

    tied = next(p for p in PIECES if p.name == "tied")
    reports = pegrad.explain(tied.loss, tied.init(jax.random.key(0)), batch, ("sq_mean",))
    assert reports[0].path_taken == "fallback" and "sum of contributions" in reports[0].reason

    seq = next(p for p in PIECES if p.name == "dense_over_sequence")
    params = seq.init(jax.random.key(0))
    batch = seq.example(jax.random.key(1), 3)
    example_level = {
        r.path: r for r in pegrad.explain(seq.loss, params, batch, ("mean", "sq_mean"))
    }
    assert example_level["['w']"].route == "sequence"
    assert example_level["['w']"].methods == {"mean": "factorized", "sq_mean": "chunked"}
    tokens = {
        r.path: r
        for r in pegrad.explain(seq.loss, params, batch, ("sq_mean",), granularity="token")
    }
    assert tokens["['w']"].path_taken == "factorized" and tokens["['b']"].path_taken == "factorized"

    emb = next(p for p in PIECES if p.name == "embedding")
    params = emb.init(jax.random.key(0))
    batch = emb.example(jax.random.key(1), 3)
    rows = {r.path: r for r in pegrad.explain(emb.loss, params, batch, ("sq_mean",))}
    assert rows["['pos']"].route == "rows" and rows["['pos']"].path_taken == "factorized"
    assert rows["['emb']"].path_taken == "fallback"  # a token may repeat within an example


def _memory(fn, *args) -> int:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert analysis is not None, "this backend reports no compiled memory analysis"
    return int(analysis.temp_size_in_bytes)


def test_factorized_dense_layers_never_hold_a_batch_of_weight_gradients():
    width, batch_size = 128, 64
    keys = jax.random.split(jax.random.key(0), 4)
    params = [
        {"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)}
        for k in keys[:3]
    ]
    mlp = next(p for p in PIECES if p.name == "mlp3")
    batch = (jax.random.normal(keys[3], (batch_size, width)), jnp.zeros((batch_size, width)))
    stats = ("mean", "sq_mean")
    reports = pegrad.explain(mlp.loss, params, batch, stats)
    assert all(r.path_taken == "factorized" for r in reports if r.path.endswith("['w']"))
    one_batch_of_weight_grads = batch_size * width * width * 8
    factorized = _memory(pegrad.value_and_grad_stats(mlp.loss, stats), params, batch)
    vmapped = _memory(pegrad.value_and_grad_stats(mlp.loss, stats, impl="vmap"), params, batch)
    plain = _memory(
        jax.grad(lambda p, b: jnp.mean(jax.vmap(mlp.loss, (None, 0))(p, b))), params, batch
    )
    assert vmapped >= one_batch_of_weight_grads
    assert factorized < one_batch_of_weight_grads / 8
    assert factorized <= 3 * plain + 1_000_000


# -- properties ---------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(
    piece=st.sampled_from(PIECES),
    batch_size=st.integers(2, 6),
    chunk=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_statistics_obey_their_invariants(piece, batch_size, chunk, seed):
    key = jax.random.key(seed)
    params = piece.init(key)
    batch = piece.example(jax.random.fold_in(key, 1), batch_size)
    stats = pegrad.STATISTICS
    _, whole = run_stats(piece, params, batch, "factorized", None, "example", stats)
    _, chunked = run_stats(piece, params, batch, "factorized", chunk, "example", stats)
    for name in stats:  # results do not depend on chunk_size
        assert_tree_close(chunked[name], whole[name], f"chunk {chunk} {name}", rtol=1e-12)
    assert all(bool(jnp.all(v >= 0)) for v in jax.tree.leaves(whole["var"]))
    assert all(bool(jnp.all(jnp.abs(s) <= 1)) for s in jax.tree.leaves(whole["sign_mean"]))
    clipped_norm = np.sqrt(
        sum(float(jnp.sum(c**2)) for c in jax.tree.leaves(whole["clipped_mean"]))
    )
    assert clipped_norm <= CLIP * (1 + 1e-12)
    total_sq_mean = sum(float(jnp.sum(q)) for q in jax.tree.leaves(whole["sq_mean"]))
    np.testing.assert_allclose(
        float(jnp.sum(whole["sq_norms"])), batch_size * total_sq_mean, rtol=1e-10
    )


# -- bad input (SPEC §6) ------------------------------------------------------------------------


def _dense_piece():
    piece = next(p for p in PIECES if p.name == "dense_bias")
    return piece, piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)


def test_mismatched_leading_axes_name_the_leaf():
    piece, params, (x, y) = _dense_piece()
    fn = pegrad.value_and_grad_stats(piece.loss)
    with pytest.raises(ValueError, match=r"batch\[1\] has shape \(2, 2\)"):
        fn(params, (x, y[:2]))


def test_non_scalar_loss_is_an_error():
    _, params, batch = _dense_piece()
    fn = pegrad.value_and_grad_stats(lambda p, ex: p["w"] @ ex[0])
    with pytest.raises(ValueError, match="must return a scalar"):
        fn(params, batch)


def test_integer_parameter_leaves_are_named():
    piece, params, batch = _dense_piece()
    fn = pegrad.value_and_grad_stats(piece.loss)
    with pytest.raises(TypeError, match=r"params\['b'\] has dtype int"):
        fn({**params, "b": jnp.zeros(2, jnp.int32)}, batch)


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_variance_of_one_example_is_an_error(impl):
    piece, params, batch = _dense_piece()
    fn = pegrad.value_and_grad_stats(piece.loss, ("mean", "var"), impl=impl)
    with pytest.raises(ValueError, match="B ≥ 2"):
        fn(params, jax.tree.map(lambda x: x[:1], batch))


def test_unknown_names_and_missing_clip_norm_are_errors():
    piece, *_ = _dense_piece()
    with pytest.raises(ValueError, match="unknown statistic"):
        pegrad.value_and_grad_stats(piece.loss, ("mean", "median"))
    with pytest.raises(ValueError, match="clip_norm"):
        pegrad.value_and_grad_stats(piece.loss, ("clipped_mean",))
    with pytest.raises((ValueError, TypeError), match="impl"):  # beartype or pegrad, either
        pegrad.value_and_grad_stats(piece.loss, impl="fast")  # pyright: ignore[reportArgumentType]


def test_token_granularity_refuses_a_weight_used_once_per_example():
    piece, params, (x, y) = _dense_piece()
    batch = (jnp.broadcast_to(x[:, None], (3, T, x.shape[1])), jnp.zeros((3, T, 2)))

    def loss(p, ex):  # the weight sees the mean over positions: no per-position terms
        return dense_bias_loss_mean(p, ex, piece)

    fn = pegrad.value_and_grad_stats(loss, ("sq_mean",), granularity="token")
    with pytest.raises(ValueError, match=r"params\['[bw]'\].*per-position"):
        fn(params, batch)


def dense_bias_loss_mean(p, ex, piece):
    xs, ys = ex
    return piece.loss(p, (xs.mean(0), ys.mean(0)))


def test_bf16_parameters_get_float32_statistics():
    piece, params, batch = _dense_piece()
    params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    batch16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), batch)
    for impl in ("vmap", "factorized"):
        loss, got = pegrad.value_and_grad_stats(piece.loss, ("mean", "sq_mean"), impl=impl)(
            params16, batch16
        )
        assert loss.dtype == jnp.float32
        assert all(v.dtype == jnp.float32 for v in jax.tree.leaves((got["mean"], got["sq_mean"])))


def test_equinox_model_with_filtered_parameters():
    piece = next(p for p in PIECES if p.name == "equinox_jit_remat")
    model = piece.init(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    batch = piece.example(jax.random.key(1), 3)

    def loss(p, ex):
        return piece.loss(eqx.combine(p, static), ex)

    _, vmap_stats = pegrad.value_and_grad_stats(loss, ("sq_mean",), impl="vmap")(params, batch)
    _, fact_stats = pegrad.value_and_grad_stats(loss, ("sq_mean",))(params, batch)
    assert_tree_close(fact_stats["sq_mean"], vmap_stats["sq_mean"], "equinox sq_mean")
    reports = pegrad.explain(loss, params, batch, ("sq_mean",))
    assert [r.path_taken for r in reports if r.path.endswith(".weight")] == ["factorized"] * 2
