"""The calling conventions a JAX user brings (issue 21), each equal to the naive loop at float64
with both implementations: `stats` as one name; `has_aux=True` (per-example aux stacked [B, ...]
as jax.vmap gives it); a per-example `mask` (a masked example counts in no statistic and not in
N, whatever it holds, NaN included); `nonfinite="drop"`; models passed as they are (Equinox and
flax nnx modules: statistics at the floating-array leaves, None elsewhere); a clear refusal of
layers that couple the examples; `explain`'s one-line summary and short lines.
"""

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import IMPLS, assert_tree_close, naive_stats, naive_unit_grads, probe_like
from pieces import PIECES, Piece, piece_unit_grads

import pegrad

CLIP = 0.5


def _piece(name: str) -> Piece:
    return next(p for p in PIECES if p.name == name)


def _run(loss, params, batch, stats, impl, chunk, choice, **options) -> Any:
    fn = pegrad.value_and_grad_stats(
        loss,
        stats,
        impl=cast(pegrad.Impl, impl),
        chunk_size=chunk,
        clip_norm=CLIP if "clipped_mean" in stats else None,
        choose=cast(pegrad.Choose, choice),
        **{k: v for k, v in options.items() if k != "mask"},
    )
    # a model holds functions: jit what is an array
    v = probe_like(params) if "dot" in stats else None
    return eqx.filter_jit(fn)(params, batch, mask=options.get("mask"), dot_with=v)


def _with_nan_rows(batch: Any, rows: np.ndarray) -> Any:
    """NaN in every floating input of the given examples (what padding can hold)."""

    def spoil(x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        where = jnp.asarray(rows).reshape(-1, *[1] * (x.ndim - 1))
        return jnp.where(where, jnp.nan, x)

    return jax.tree.map(spoil, batch)


# -- stats as one name ------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_a_statistic_named_by_a_string(impl: str):
    piece = _piece("mlp3")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    _, got = _run(loss, params, batch, "mean", impl, None, "cheapest")
    assert set(got) == {"mean", "batch_size"}
    _, want = _run(loss, params, batch, ("mean",), impl, None, "cheapest")
    assert_tree_close(got["mean"], want["mean"], "mean")
    assert len(pegrad.explain(loss, params, batch, "sq_mean")) == len(jax.tree.leaves(params))


# -- has_aux ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,granularity",
    [("mlp3", "example"), ("conv_scan", "example"), ("dense_over_sequence", "token")],
)
def test_aux_is_stacked_per_example_and_leaves_the_statistics_unchanged(
    name: str, granularity: str
):
    piece = _piece(name)
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 5)

    def loss(p, ex):
        value = piece.loss(p, ex, False)
        return value, {"twice": 2.0 * value, "input": jax.tree.leaves(ex)[0], "one": 1.0}

    want_aux = jax.vmap(lambda ex: loss(params, ex)[1])(batch)
    stats = pegrad.STATISTICS
    plain = lambda p, ex: loss(p, ex)[0]  # noqa: E731
    for impl, chunk, choice in IMPLS:
        options = {"granularity": granularity}
        (value, aux), got = _run(
            loss, params, batch, stats, impl, chunk, choice, has_aux=True, **options
        )
        want_value, want = _run(plain, params, batch, stats, impl, chunk, choice, **options)
        where = f"{name}/{impl}/{chunk}/{choice}"
        np.testing.assert_allclose(value, want_value, rtol=1e-12, err_msg=where)
        assert_tree_close(aux, want_aux, f"{where}/aux", rtol=1e-12)
        for s in stats:
            assert_tree_close(got[s], want[s], f"{where}/{s}", rtol=1e-12)


def test_has_aux_with_a_scalar_loss_is_an_error():
    piece = _piece("mlp3")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)
    fn = pegrad.value_and_grad_stats(lambda p, ex: piece.loss(p, ex, False), has_aux=True)
    with pytest.raises(ValueError, match=r"has_aux=True: loss_fn must return \(loss, aux\)"):
        fn(params, batch)


# -- masks and dropped examples ---------------------------------------------------------------

MASK = np.array([True, False, True, True, False])


def _expected_over(piece: Piece, params, batch, keep: np.ndarray, granularity: str):
    """The naive loop over the kept examples; sq_norms and dot 0 at the masked units, gram 0 in
    their rows and columns."""
    kept_batch = jax.tree.map(lambda x: x[keep], batch)
    losses, grads = piece_unit_grads(piece, params, kept_batch, granularity)
    want = naive_stats(grads, CLIP)
    units = jax.tree.leaves(grads)[0].shape[0] // int(keep.sum())
    kept = np.repeat(keep, units)
    for s in ("sq_norms", "dot"):
        want[s] = np.zeros(len(kept))
        want[s][kept] = naive_stats(grads, CLIP)[s]
    gram = np.zeros((len(kept), len(kept)))
    gram[np.ix_(kept, kept)] = want["gram"]
    want["gram"] = gram
    return losses.mean(), want, int(keep.sum()) * units


def _check_masked(piece: Piece, granularity: str, keep: np.ndarray, nan: bool, **options):
    params = piece.init(jax.random.key(0))
    batch = piece.example(jax.random.key(1), len(keep))
    want_loss, want, n_kept = _expected_over(piece, params, batch, keep, granularity)
    stats = tuple(s for s in pegrad.STATISTICS if s != "var" or n_kept > 1)
    if nan:
        batch = _with_nan_rows(batch, ~keep)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    for impl, chunk, choice in IMPLS:
        value, got = _run(
            loss, params, batch, stats, impl, chunk, choice, granularity=granularity, **options
        )
        where = f"{piece}/{granularity}/{impl}/{chunk}/{choice}"
        np.testing.assert_allclose(value, want_loss, rtol=1e-12, err_msg=where)
        assert int(got["batch_size"]) == n_kept, where
        for s in stats:
            if s == "sign_mean":  # signs decided by round-off are no test (helpers' rule)
                continue
            assert_tree_close(got[s], want[s], f"{where}/{s}")


MASKED = [
    ("mlp3", "example"),
    ("tied", "example"),
    ("broadcast", "example"),
    ("control_flow", "example"),
    ("conv_scan", "example"),
    ("embedding", "example"),
    ("attention", "example"),
    ("dense_over_sequence", "token"),
    ("embedding", "token"),
]


@pytest.mark.parametrize("name,granularity", MASKED)
def test_a_masked_example_counts_nowhere_even_holding_nan(name: str, granularity: str):
    _check_masked(_piece(name), granularity, MASK, nan=True, mask=jnp.asarray(MASK))


@pytest.mark.parametrize("name", ["mlp3", "conv_scan"])
def test_a_mask_keeping_one_example_gives_every_statistic_but_var(name: str):
    keep = np.array([False, True, False])
    _check_masked(_piece(name), "example", keep, nan=False, mask=jnp.asarray(keep))


@pytest.mark.parametrize("name", ["mlp3", "conv_scan", "control_flow"])
def test_dropping_nonfinite_examples_equals_the_loop_over_the_others(name: str):
    _check_masked(_piece(name), "example", MASK, nan=True, nonfinite="drop")
    both = MASK & np.array([True, True, True, False, True])  # a mask and a NaN example
    piece = _piece(name)
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 5)
    want_loss, want, _ = _expected_over(piece, params, batch, both, "example")
    batch = _with_nan_rows(batch, ~np.array([True, True, True, False, True]))
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    for impl in ("vmap", "factorized"):
        value, got = _run(
            loss,
            params,
            batch,
            ("mean", "var"),
            impl,
            None,
            "cheapest",
            nonfinite="drop",
            mask=jnp.asarray(MASK),
        )
        np.testing.assert_allclose(value, want_loss, rtol=1e-12)
        assert_tree_close(got["var"], want["var"], f"{impl}/var")


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_nan_propagates_by_default(impl: str):
    piece = _piece("mlp3")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)
    batch = _with_nan_rows(batch, np.array([False, True, False]))
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    value, got = _run(loss, params, batch, ("mean",), impl, None, "cheapest")
    assert np.isnan(value) and any(np.isnan(x).any() for x in jax.tree.leaves(got["mean"]))


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_variance_of_one_kept_example_is_an_error_or_nan_under_jit(impl: str):
    piece = _piece("mlp3")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    fn = pegrad.value_and_grad_stats(loss, ("var",), impl=cast(pegrad.Impl, impl))
    one = jnp.array([False, True, False])
    with pytest.raises(ValueError, match="kept unit"):
        fn(params, batch, mask=one)
    _, got = jax.jit(fn)(params, batch, mask=one)
    assert all(np.isnan(x).all() for x in jax.tree.leaves(got["var"]))


def test_a_mask_of_the_wrong_shape_or_dtype_is_an_error():
    piece = _piece("mlp3")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)
    fn = pegrad.value_and_grad_stats(lambda p, ex: piece.loss(p, ex, False))
    with pytest.raises(ValueError, match=r"mask must be a bool array of shape \(3,\)"):
        fn(params, batch, mask=jnp.ones(3))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        fn(params, batch, mask=jnp.ones(4, bool))


# -- models as they are ----------------------------------------------------------------------


def _mlp_batch(n: int) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(5))
    return jax.random.normal(k1, (n, 3)), jax.random.normal(k2, (n, 2))


class _Tagged(eqx.Module):
    mlp: eqx.nn.MLP
    steps: jax.Array  # an integer buffer: held fixed, as eqx.filter_grad holds it


def _eqx_loss(model: _Tagged, ex: Any) -> jax.Array:
    x, y = ex
    return jnp.sum((model.mlp(x) - y) ** 2) + 0.0 * model.steps.astype(x.dtype)


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_an_equinox_module_as_it_is(impl: str):
    model = _Tagged(eqx.nn.MLP(3, 2, 6, 2, key=jax.random.key(0)), jnp.asarray(3))
    batch = _mlp_batch(4)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    _, grads = naive_unit_grads(lambda p, ex: _eqx_loss(eqx.combine(p, static), ex), params, batch)
    want = naive_stats(grads, CLIP)
    stats = ("mean", "sq_mean", "var", "sq_norms", "clipped_mean")
    _, got = _run(_eqx_loss, model, batch, stats, impl, None, "cheapest")
    for s in stats:
        assert_tree_close(got[s], want[s], f"eqx/{impl}/{s}")  # the structure of filter_grad's
    assert got["mean"].steps is None and got["mean"].mlp.activation is None
    plans = pegrad.explain(_eqx_loss, model, batch, "mean")
    assert len(plans) == len(jax.tree.leaves(params))


class _NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(3, 6, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)  # keys and counters
        self.out = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(jnp.tanh(self.hidden(x))))


def _nnx_loss(model: _NnxModel, ex: Any) -> jax.Array:
    x, y = ex
    return jnp.sum((model(x) - y) ** 2)


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_a_flax_nnx_module_as_it_is(impl: str):
    model = _NnxModel(nnx.Rngs(0))
    model = jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, model)
    batch = _mlp_batch(4)
    leaves, treedef = jax.tree.flatten(model)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(floats) < len(leaves)  # the dropout's key and counter are not parameters

    def loss_of_floats(p: list, ex: Any) -> jax.Array:
        rebuilt = list(leaves)
        for i, value in zip(floats, p, strict=True):
            rebuilt[i] = value
        return _nnx_loss(jax.tree.unflatten(treedef, rebuilt), ex)

    _, grads = naive_unit_grads(loss_of_floats, [leaves[i] for i in floats], batch)
    want = naive_stats(grads, CLIP)
    stats = ("mean", "sq_mean", "var", "clipped_mean")
    _, got = _run(_nnx_loss, model, batch, stats, impl, None, "cheapest")
    for s in stats:
        assert_tree_close(jax.tree.leaves(got[s]), want[s], f"nnx/{impl}/{s}")


def test_batch_norm_in_training_mode_is_refused_naming_the_framework():
    batch = _mlp_batch(4)
    bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    fn = pegrad.value_and_grad_stats(lambda m, ex: jnp.sum(m(ex[0].astype(jnp.float32))))
    with pytest.raises(ValueError, match="flax BatchNorm in training mode"):
        fn(bn, batch)
    bn.eval()
    fn(jax.tree.map(lambda x: x, bn), batch)  # inference mode: per-example, accepted
    layer = eqx.nn.BatchNorm(3, "batch", mode="batch")
    with pytest.raises(ValueError, match="equinox BatchNorm in training mode"):
        pegrad.explain(lambda m, ex: jnp.sum(ex[0]), layer, batch)


def test_integer_leaves_of_a_plain_pytree_are_still_an_error():
    fn = pegrad.value_and_grad_stats(lambda p, ex: jnp.sum(p["w"] * ex))
    with pytest.raises(TypeError, match=r"params\['n'\] has dtype int"):
        fn({"w": jnp.ones(2), "n": jnp.zeros(2, jnp.int32)}, jnp.ones((3, 2)))


# -- explain ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp3", "attention", "conv_scan"])
def test_explain_opens_with_a_summary_and_keeps_lines_short(name: str):
    piece = _piece(name)
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)
    plans = pegrad.explain(lambda p, ex: piece.loss(p, ex, False), params, batch, "sq_mean")
    text = str(plans).splitlines()
    routes = [p.route for p in plans]  # per route taken, in order of first use, its leaves
    counts = ", ".join(f"{routes.count(r)} {r}" for r in dict.fromkeys(routes))
    assert text[0] == f"{len(plans)} leaves: {counts}", text[0]
    assert all(len(line) <= 100 for line in text), max(text, key=len)


def test_every_function_of_pegrad_is_annotated_so_pytest_checks_it_at_run_time():
    """jaxtyping's pytest plugin checks a function's arguments only where they are annotated:
    an unannotated parameter (a route method's, say) is a hole in the runtime check."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(pegrad))
    holes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            args += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            bare = [a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")]
            if bare or node.returns is None:
                holes.append(f"line {node.lineno} {node.name}: {bare or 'return'}")
    assert not holes, "unannotated: " + "; ".join(holes)
