"""pegrad's contract: both implementations equal the naive per-example loop, at float64, and
every route's precondition, broken, sends the leaf elsewhere.

Every statistic x implementation (vmap, vmap chunked, factorized, factorized chunked) x
granularity x model piece (tests/pieces.py) x batch size (1, 2, odd) is compared to the SPEC §2
statistics of a naive loop (one `jax.grad` per example; per token, untied copies) to 1e-10
relative. Models written the way other libraries write them are in tests/test_zoo.py.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_tree_close,
    check_every_implementation,
    compiled_temp_bytes,
    naive_stats,
    naive_unit_grads,
    probe_like,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pieces import PIECES, Piece, T, piece_unit_grads

import pegrad

CLIP = 0.5


def cases():
    for piece in PIECES:
        for granularity in ["example", "token"] if piece.sequence else ["example"]:
            for batch_size in (1, 2, 5):
                yield pytest.param(
                    piece, granularity, batch_size, id=f"{piece}-{granularity}-B{batch_size}"
                )


@pytest.mark.parametrize("piece,granularity,batch_size", list(cases()))
def test_every_statistic_and_implementation_equals_the_naive_loop(
    piece: Piece, granularity: str, batch_size: int
):
    key = jax.random.key(batch_size)
    params = piece.init(key)
    batch = piece.example(jax.random.fold_in(key, 1), batch_size)
    expected = piece_unit_grads(piece, params, batch, granularity)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    check_every_implementation(loss, params, batch, expected, str(piece), granularity=granularity)


def _piece(name: str) -> Piece:
    return next(p for p in PIECES if p.name == name)


def _plans(loss, params, batch, stats=("mean", "sq_mean"), **options) -> dict[str, pegrad.LeafPlan]:
    """The routes a leaf can take (the first that matches: these models are tiny)."""
    plans = pegrad.explain(loss, params, batch, stats, choose="first", **options)
    return {p.leaf: p for p in plans}


def test_explain_names_the_route_of_every_leaf():
    mlp = _piece("mlp3")
    params = mlp.init(jax.random.key(0))
    batch = mlp.example(jax.random.key(1), 3)
    plans = _plans(mlp.loss, params, batch)
    for i in range(3):
        assert plans[f"[{i}]['w']"].route == "outer-product"
        assert plans[f"[{i}]['w']"].status == "factorized"
    for i in range(2):  # a bias gradient is δ itself, a value of the backward pass
        assert plans[f"[{i}]['b']"].route == "head-value"
        assert plans[f"[{i}]['b']"].status == "factorized"
    assert "outer-product" in str(plans["[0]['w']"])

    tied = _piece("tied")
    plan = _plans(tied.loss, tied.init(jax.random.key(0)), batch, ("sq_mean",))["['w']"]
    assert plan.route == "fallback"
    assert dict(plan.refused)["terms"].startswith("contributions added")

    seq = _piece("dense_over_sequence")
    params = seq.init(jax.random.key(0))
    batch = seq.example(jax.random.key(1), 3)
    example_level = _plans(seq.loss, params, batch)
    assert example_level["['w']"].route == "contraction"
    # the head holds both operands: sq is formed per example in bounded chunks of the batch,
    # and the sum comes out of the same scan
    assert dict(example_level["['w']"].methods) == {"sum": "factorized", "sq": "factorized"}
    assert _plans(seq.loss, params, batch, ("mean",))["['w']"].status == "factorized"
    tokens = _plans(seq.loss, params, batch, ("sq_mean",), granularity="token")
    assert tokens["['w']"].route == "outer-product" and tokens["['b']"].route == "unit-sum"
    assert all(p.status == "factorized" for p in tokens.values())

    emb = _piece("embedding")
    params = emb.init(jax.random.key(0))
    batch = emb.example(jax.random.key(1), 3)
    rows = _plans(emb.loss, params, batch, ("sq_mean",))
    assert rows["['pos']"].route == "row-scatter" and rows["['pos']"].status == "factorized"
    # a token may repeat within an example: row-scatter refuses, segment-rows sums the repeats
    assert rows["['emb']"].route == "segment-rows" and rows["['emb']"].status == "factorized"
    assert "depend on the example" in dict(rows["['emb']"].refused)["row-scatter"]


def test_explain_runs_nothing():
    """explain traces abstractly: a batch of shapes is enough, and the loss is never run."""
    mlp = _piece("mlp3")
    params = mlp.init(jax.random.key(0))
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp.example(jax.random.key(1), 4)
    )
    plans = pegrad.explain(mlp.loss, params, batch, pegrad.STATISTICS, clip_norm=1.0)
    assert [p.leaf for p in plans] == [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)
    ]


def test_factorized_dense_layers_never_hold_a_batch_of_weight_gradients():
    width, batch_size = 128, 64
    keys = jax.random.split(jax.random.key(0), 4)
    params = [
        {"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)}
        for k in keys[:3]
    ]
    mlp = _piece("mlp3")
    batch = (jax.random.normal(keys[3], (batch_size, width)), jnp.zeros((batch_size, width)))
    stats = ("mean", "sq_mean")
    plans = pegrad.explain(mlp.loss, params, batch, stats)  # the default plan
    assert all(p.status == "factorized" for p in plans if p.leaf.endswith("['w']"))
    one_batch_of_weight_grads = batch_size * width * width * 8
    factorized = compiled_temp_bytes(pegrad.value_and_grad_stats(mlp.loss, stats), params, batch)
    plain = compiled_temp_bytes(
        jax.grad(lambda p, b: jnp.mean(jax.vmap(mlp.loss, (None, 0))(p, b))), params, batch
    )
    assert factorized < one_batch_of_weight_grads / 8
    assert factorized <= 3 * plain + 1_000_000


def _positionwise(depth: int, seq: int = 32, d: int = 64, hidden: int = 256, b: int = 16):
    """Residual position-wise MLP blocks (weights used at every position), params and batch."""
    keys = jax.random.split(jax.random.key(depth), 2 * depth + 2)
    params = [
        {
            "up": jax.random.normal(keys[2 * i], (d, hidden)) / np.sqrt(d),
            "down": jax.random.normal(keys[2 * i + 1], (hidden, d)) / np.sqrt(hidden),
        }
        for i in range(depth)
    ]

    def loss(p: list, ex: tuple) -> jax.Array:
        h, y = ex
        for w in p:
            h = h + jnp.tanh(h @ w["up"]) @ w["down"]
        return jnp.mean((h - y) ** 2)

    batch = (jax.random.normal(keys[-2], (b, seq, d)), jax.random.normal(keys[-1], (b, seq, d)))
    return loss, params, batch


@pytest.mark.parametrize("stats", ["sq_norms", ("mean", "sq_mean"), "sign_mean"], ids=str)
def test_what_a_contraction_adds_to_plain_grads_memory_does_not_grow_with_depth(stats: str | tuple):
    """Per-example gradients formed in the head (the mean of squares, of signs) and norms by
    the Gram identity: left alone, XLA makes each layer's copy of its input for the batched
    product in the forward pass and holds it until the backward pass, so the memory beyond
    plain grad's grew by 5-10 activations per two blocks; tied to the cotangent, each copy
    lives only around its product: what is added is about a chunk at any depth (one copy held
    per block would add two activations here)."""
    extra = []
    for depth in (2, 4):
        loss, params, batch = _positionwise(depth)
        plans = pegrad.explain(loss, params, batch, stats)
        assert {p.route for p in plans} == {"contraction"}
        plain = jax.value_and_grad(lambda p, b, f=loss: jnp.mean(jax.vmap(f, (None, 0))(p, b)))
        factorized = pegrad.value_and_grad_stats(loss, stats)
        temp = compiled_temp_bytes(factorized, params, batch)
        extra.append(temp - compiled_temp_bytes(plain, params, batch))
    activation = batch[0].nbytes  # [B, T, d]
    assert extra[1] - extra[0] < activation, extra


@pytest.mark.parametrize("platform, held", [("cpu", True), ("cuda", False), ("tpu", False)])
def test_the_backward_pass_waits_behind_a_barrier_only_on_xla_cpu(platform: str, held: bool):
    """The head's optimization barrier (the backward pass waits for each leaf's statistics) is
    lowered for XLA:CPU alone. Measured on bench.py's families compiled for an H200: XLA:GPU
    materializes every value a barrier holds, a transformer's factorized statistics then
    holding 1.8x plain grad's temporaries, 0.9-1.0x without; XLA:CPU holds less with it."""
    loss, params, batch = _positionwise(2)
    fn = jax.jit(pegrad.value_and_grad_stats(loss, ("mean", "sq_mean")))
    text = fn.trace(params, batch).lower(lowering_platforms=(platform,)).as_text()
    assert ("optimization_barrier" in text) == held


def _wide_over_positions(b: int, seq: int = 2, d: int = 12):
    """A weight used at two positions whose per-example gradient (d² numbers) outnumbers its
    operands (2·seq·d): XLA:CPU forms it in chunks of fewer than B examples."""
    k = jax.random.split(jax.random.key(b), 4)
    params = {"w": jax.random.normal(k[0], (d, d)), "v": jax.random.normal(k[1], (d, 3))}

    def loss(p: dict, ex: tuple) -> jax.Array:
        x, y = ex
        return jnp.sum((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)

    return (
        loss,
        params,
        (jax.random.normal(k[2], (b, seq, d)), jax.random.normal(k[3], (b, seq, 3))),
    )


def _heads_over_positions(b: int, seq: int = 3, d: int = 6, heads: int = 2):
    """Flax's DenseGeneral on x[None]: a [d, heads, k] kernel read as [d, heads·k] by a
    reshape, a batch axis of one, a scalar scaling after the dot; the leaf's layout is not the
    dot's (its per-example gradients are replayed into it)."""
    k = jax.random.split(jax.random.key(b), 4)
    params = {"w": jax.random.normal(k[0], (d, heads, 4)), "v": jax.random.normal(k[1], (4, 3))}

    def loss(p: dict, ex: tuple) -> jax.Array:
        x, y = ex
        h = (x[None] @ (0.5 * p["w"]).reshape(d, heads * 4)).reshape(1, seq, heads, 4)
        return jnp.sum((jnp.tanh(h).sum(2) @ p["v"] - y[None]) ** 2)

    return (
        loss,
        params,
        (jax.random.normal(k[2], (b, seq, d)), jax.random.normal(k[3], (b, seq, 3))),
    )


@pytest.mark.parametrize("batch_size", [5, 40])
def test_sums_over_examples_on_each_side_of_the_32_row_bound_equal_the_naive_loop(
    batch_size: int,
):
    """The per-example gradients' sums over examples (every statistic, vmap whole and in chunks
    of 8): up to 32 rows added pairwise (B 5, the chunks), more rows a vector of ones (B 40),
    for the kernel's rows and the bias's: each equals the naive loop."""
    k = jax.random.split(jax.random.key(batch_size), 4)
    params = {"w": jax.random.normal(k[0], (128, 64)), "b": jax.random.normal(k[1], (64,))}

    def loss(p: dict, ex: tuple) -> jax.Array:
        x, y = ex
        return jnp.sum((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    batch = (jax.random.normal(k[2], (batch_size, 128)), jax.random.normal(k[3], (batch_size, 64)))
    expected = naive_unit_grads(loss, params, batch)
    impls = [("vmap", None, "cheapest"), ("vmap", 8, "cheapest")]
    check_every_implementation(loss, params, batch, expected, "sum0", impls=impls)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 8, 13, 31, 32, 33, 40])
@pytest.mark.parametrize("sum0", ["_sum0", "_sum_halves"])
def test_sums_over_rows_add_every_row_once(sum0: str, rows: int):
    """`_sum0`'s pairs and `_sum_halves`'s halves (an odd row kept aside at each step), and the
    vector of ones beyond 32 rows, add each row exactly once: rows of distinct powers of two
    (exact in float64) sum to the naive loop's total bit for bit, whatever the order of adds."""
    x = jnp.stack([jnp.full((3,), 2.0**r) for r in range(rows)]) if rows else jnp.zeros((0, 3))
    total = sum((2.0**r for r in range(rows)), 0.0)
    assert jnp.array_equal(getattr(pegrad, sum0)(x), jnp.full((3,), total)), rows


@pytest.mark.parametrize("model", [_wide_over_positions, _heads_over_positions])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_on_an_accelerator_the_gradients_formed_at_once_equal_the_naive_loop(
    batch_size: int, model: Callable, monkeypatch: pytest.MonkeyPatch
):
    """A GPU or TPU forms a contraction's per-example gradients for the whole batch at once
    (no chunk loop: its iterations cost kernel launches there) from untied operands, each in
    the leaf's layout; XLA:CPU runs that program here, every statistic against the naive loop."""
    loss, params, batch = model(batch_size)
    routes = [p.route for p in pegrad.explain(loss, params, batch, ("mean", "sq_mean"))]
    assert routes == ["contraction", "contraction"], routes
    fn = jax.jit(pegrad.value_and_grad_stats(loss, ("mean", "sq_mean")))
    text = fn.trace(params, batch).lower(lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.while" in text or batch_size == 1  # XLA:CPU chunks; this test does not
    monkeypatch.setattr(pegrad, "_AS_ON_ACCELERATOR", True)
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "wide")


@pytest.mark.parametrize("platform, loops", [("cpu", True), ("cuda", False), ("tpu", False)])
def test_a_chunk_loop_of_formed_gradients_is_lowered_for_xla_cpu_only(platform: str, loops: bool):
    """Compiled for an H200 (hlo_cost.py, results/bench/gpu-time.md), the transformer's chunk
    loops were two thirds of its kernel launches and made it slower than vmap; on XLA:CPU they
    bound the memory the formed gradients hold."""
    loss, params, batch = _wide_over_positions(5)
    for stats in [("mean", "sq_mean"), ("mean", "var"), ("mean", "sq_norms")]:
        fn = jax.jit(pegrad.value_and_grad_stats(loss, stats))
        text = fn.trace(params, batch).lower(lowering_platforms=(platform,)).as_text()
        assert ("stablehlo.while" in text) == loops, (stats, platform)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_sums_over_examples_and_the_barrier_are_lowered_for_each_platform(platform: str):
    """The engine's sums over examples (`_sum_rows`) and the head's barrier are primitives
    lowered per platform: XLA:CPU reduces a bias's rows at once (no slice) and holds the backward
    pass with a barrier; a GPU adds the rows by halves (2·log₂ B slices per sum, fused into the
    loop that made them), a TPU pairwise (B slices), and neither has a barrier. On XLA:CPU the
    statistics equal the naive loop."""
    k = jax.random.split(jax.random.key(5), 2)
    params, batch = {"b": jax.random.normal(k[0], (16,))}, jax.random.normal(k[1], (8, 4, 16))

    def loss(p: dict, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x + p["b"]) ** 2)

    stats = ("mean", "sq_mean")
    assert [p.route for p in pegrad.explain(loss, params, batch, stats)] == ["unit-sum"]
    fn = jax.jit(pegrad.value_and_grad_stats(loss, stats))
    text = fn.trace(params, batch).lower(lowering_platforms=(platform,)).as_text()
    cpu = platform == "cpu"
    slices = {"cpu": 0, "cuda": 2 * 6, "tpu": 2 * 8}[platform]  # 2 sums of 8 rows
    assert text.count("stablehlo.slice") == slices, platform
    assert ("stablehlo.optimization_barrier" in text) == cpu, platform
    if cpu:
        expected = naive_unit_grads(loss, params, batch)
        check_every_implementation(loss, params, batch, expected, "bias rows")


def _static_tables(p: dict, x: jax.Array) -> tuple[jax.Array, tuple]:
    """Static values of each kind the routes' proofs read: position indices (x[arange]), a
    causal mask (iota, compare, select: floats), a zero table written into, a zero border
    (pad), the zero parts of a split."""
    t = x.shape[0]
    h = x + p["pos"][jnp.arange(t)]
    mask = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], 1.0, -1e9) / 3.0
    h = jax.nn.softmax(h @ h.T * mask) @ h
    table = jnp.zeros((t + 2, h.shape[1])).at[jnp.array([1, 3])].set(h[:2])
    padded = jnp.pad(h @ p["w"], ((1, 2), (0, 0)))
    first, _ = jnp.split(p["stack"], 2)
    return jnp.sum(table**2) + jnp.sum(padded**2) + jnp.sum((h @ first[0]) ** 2), ()


def test_static_values_are_those_jax_evaluates():
    """`Graph.static_value` reads a literal or a table of one off the jaxpr and runs the other
    static values' equations as one program: every static value of the graph is, bit for bit
    and in dtype and shape, what JAX evaluates equation by equation."""
    k = jax.random.split(jax.random.key(6), 4)
    params = {
        "pos": jax.random.normal(k[0], (4, 3)),
        "w": jax.random.normal(k[1], (3, 2)),
        "stack": jax.random.normal(k[2], (2, 3, 3)),
    }
    batch = jax.random.normal(k[3], (5, 4, 3))
    graph = pegrad.Graph.build(_static_tables, params, batch, 1)
    static = [v for e in graph.jaxpr.eqns for v in e.outvars if v in graph.static]
    static = [v for v in static if type(v).__name__ != "DropVar"]  # (`_`, in JAX 0.7)
    kinds = {e.primitive.name for e in graph.jaxpr.eqns if e.outvars[0] in graph.static}
    assert {"iota", "broadcast_in_dim", "select_n", "gather", "div"} <= kinds, kinds
    for var in static:
        env = dict(zip(graph.jaxpr.constvars, graph.consts, strict=True))
        with jax.ensure_compile_time_eval():
            pegrad._evaluate(pegrad._needed_by(graph.jaxpr, [var]), env)
        want, got = np.asarray(env[var]), graph.static_value(var)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), var
        np.testing.assert_array_equal(got, want, strict=True)


# -- the mean alone: plain grad of the mean loss ----------------------------------------------

KEPT = {1: [True], 2: [True, False], 5: [True, False, True, True, False]}


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("piece", PIECES, ids=str)
def test_the_mean_alone_is_plain_grad_of_the_mean_loss(piece: Piece, batch_size: int, masked: bool):
    """Every leaf "mean-loss", the naive loop's mean over the kept examples, and (unmasked)
    plain grad's own program: the same compiled temporary memory."""
    params = piece.init(jax.random.key(batch_size))
    batch = piece.example(jax.random.key(10 + batch_size), batch_size)
    keep = np.array(KEPT[batch_size] if masked else [True] * batch_size)
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731
    assert {p.route for p in pegrad.explain(loss, params, batch, "mean")} == {"mean-loss"}
    losses, grads = naive_unit_grads(loss, params, jax.tree.map(lambda x: x[keep], batch))
    fn = pegrad.value_and_grad_stats(loss, "mean")
    value, got = jax.jit(fn)(params, batch, jnp.asarray(keep) if masked else None)
    np.testing.assert_allclose(value, np.mean(losses), rtol=1e-12)
    assert_tree_close(got["mean"], jax.tree.map(lambda g: g.mean(0), grads), f"{piece}/mean")
    assert int(got["batch_size"]) == keep.sum()
    if not masked:
        plain = jax.value_and_grad(lambda p, b: jnp.mean(jax.vmap(loss, (None, 0))(p, b)))
        assert compiled_temp_bytes(fn, params, batch) == compiled_temp_bytes(plain, params, batch)


@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_the_mean_of_a_half_precision_loss_is_not_rounded_by_one_over_b(batch_size: int):
    """float32 parameters, a bfloat16 loss: plain grad of jnp.mean would scale every example's
    cotangent by 1/B rounded to bfloat16 (0.2 % off at B 3); the mean is exact to float32."""
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)}
    batch = jnp.arange(3.0 * batch_size, dtype=jnp.float32).reshape(batch_size, 3) / 7.0
    loss = lambda p, x: jnp.sum(jnp.tanh(p["w"] @ x)).astype(jnp.bfloat16)  # noqa: E731
    plans = pegrad.explain(loss, params, batch, "mean")
    assert {p.route for p in plans} == {"mean-loss"}
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, "mean"))(params, batch)
    each = [jax.grad(lambda p, x: loss(p, x).astype(jnp.float32))(params, x) for x in batch]
    want = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *each)
    np.testing.assert_allclose(got["mean"]["w"], want["w"], rtol=1e-6)
    assert got["mean"]["w"].dtype == jnp.float32


PLAIN_MEAN_BROKEN = {  # what the mean alone is not, or must not be computed as plain grad
    "another statistic": dict(stats=("mean", "sq_mean")),
    "the routes asked for": dict(choose="first"),
    "per-token units": dict(granularity="token"),
    "half-precision parameters": dict(dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("broken", sorted(PLAIN_MEAN_BROKEN))
def test_the_mean_takes_the_routes_where_plain_grad_is_not_its_definition(broken: str):
    options = dict(PLAIN_MEAN_BROKEN[broken])
    stats, dtype = options.pop("stats", "mean"), options.pop("dtype", None)
    piece = _piece("dense_over_sequence")
    params, batch = piece.init(jax.random.key(0)), piece.example(jax.random.key(1), 3)
    if dtype is not None:
        params, batch = jax.tree.map(lambda x: x.astype(dtype), (params, batch))
    plans = pegrad.explain(lambda p, ex: piece.loss(p, ex, False), params, batch, stats, **options)
    assert "mean-loss" not in {p.route for p in plans}, str(plans)


@jax.custom_vjp
def _clip_cotangent(x):
    return x


_clip_cotangent.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.05, 0.05),))


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("applied_to", ["activation", "parameter"])
def test_the_mean_alone_is_not_plain_grad_where_the_loss_has_its_own_backward_rule(
    applied_to: str, masked: bool
):
    """Gradient clipping as JAX's custom_vjp tutorial writes it: plain grad of the mean loss
    would clip c_i/B (an activation's cotangent) or Σ_i c_i once (a parameter's), where each
    g_i clips c_i. The routes run instead, `explain` says why, and the mean is the naive one."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "v": jnp.linspace(0.5, 2.0, 3)}

    def loss(p, x):
        w = _clip_cotangent(p["w"]) if applied_to == "parameter" else p["w"]
        h = jnp.tanh(w @ x)
        h = _clip_cotangent(h) if applied_to == "activation" else h
        return jnp.sum(p["v"] * h) ** 2

    batch = jax.random.normal(jax.random.key(0), (5, 4), jnp.float64)
    keep = np.array([True, False, True, True, False] if masked else [True] * 5)
    plans = pegrad.explain(loss, params, batch, "mean")
    assert "mean-loss" not in {p.route for p in plans}, str(plans)
    for p in plans:
        assert dict(p.refused)["mean-loss"].startswith("the loss calls a custom_vjp"), p.refused
    losses, grads = naive_unit_grads(loss, params, batch[keep])
    fn = pegrad.value_and_grad_stats(loss, "mean")
    value, got = jax.jit(fn)(params, batch, jnp.asarray(keep) if masked else None)
    np.testing.assert_allclose(value, np.mean(losses), rtol=1e-12)
    assert_tree_close(got["mean"], jax.tree.map(lambda g: g.mean(0), grads), "mean alone")
    plain = jax.grad(lambda p: jnp.mean(jax.vmap(loss, (None, 0))(p, batch[keep])))(params)
    differs = jax.tree.map(lambda a, g: np.max(np.abs(a - g.mean(0))), plain, grads)
    assert max(jax.tree.leaves(differs)) > 1e-3  # the hazard is real: plain grad is wrong here


@pytest.mark.parametrize("stat", ["mean", "sq_mean", "var", "sq_norms"])
def test_a_gradient_computed_in_float32_agrees_to_float32_rounding(stat: str):
    """A float64 weight cast through float32 on its way to a dense layer: the naive loop's
    g_i are rounded to float32 one by one, outer-product's statistic is formed in float64 and
    rounded once (SPEC section 3): they agree to float32's rounding, and no worse."""
    params = {"w": jax.random.normal(jax.random.key(0), (4, 3), jnp.float64)}
    batch = jax.random.normal(jax.random.key(1), (5, 4), jnp.float64)

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"].astype(jnp.float32).astype(jnp.float64)))

    (plan,) = pegrad.explain(loss, params, batch, stat, choose="first")
    assert plan.route == "outer-product", plan
    _, grads = naive_unit_grads(loss, params, batch)
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, stat, choose="first"))(params, batch)
    assert_tree_close(got[stat], naive_stats(grads, 1.0)[stat], stat, rtol=1e-6)


def test_dropping_nonfinite_examples_does_not_take_plain_grad():
    """With nonfinite="drop" an example whose gradient alone is not finite must not reach the
    mean: plain grad of the mean loss would carry its NaN."""
    params = {"w": jnp.ones(3)}
    batch = jnp.array([[1.0, 2.0, 3.0], [0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    loss = lambda p, x: jnp.sum(jnp.sqrt(jnp.abs(p["w"] * x)))  # noqa: E731  (∞ slope at 0)
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, "mean", nonfinite="drop"))(params, batch)
    kept = jax.grad(loss)(params, batch[0])
    assert_tree_close(got["mean"], kept, "mean over the finite example")
    assert int(got["batch_size"]) == 1


# -- each precondition, broken: the leaf goes elsewhere and the numbers stay exact -----------


def _regression(key, b: int, d_in: int, d_out: int):
    kx, ky = jax.random.split(key)
    return (
        jax.random.normal(kx, (b, d_in), jnp.float64),
        jax.random.normal(ky, (b, d_out), jnp.float64),
    )


def _check(loss, params, batch, granularity: str = "example", tokenwise=None) -> None:
    expected = naive_unit_grads(loss, params, batch, tokenwise)
    check_every_implementation(loss, params, batch, expected, "case", granularity=granularity)


DIVISORS = {
    "literal": lambda p, x: p["w"] / 3.0,
    "sqrt_fan_in": lambda p, x: p["w"] / jnp.sqrt(float(p["w"].shape[1])),
    "parameter": lambda p, x: p["w"] / p["s"],
    "negated": lambda p, x: -p["w"] / p["s"] ** 2,
    "elementwise": lambda p, x: p["w"] / (1.0 + p["w2"] ** 2),
}


@pytest.mark.parametrize("divisor", sorted(DIVISORS))
def test_a_weight_divided_by_a_batch_independent_value_is_a_division_for_every_statistic(
    divisor: str,
):
    """sq_norms and clipped_mean once multiplied by m² where a division needs 1/m²."""
    key = jax.random.key(0)
    params = {
        "w": jax.random.normal(key, (3, 4), jnp.float64),
        "w2": jax.random.normal(jax.random.fold_in(key, 1), (3, 4), jnp.float64),
        "s": jnp.asarray(0.3, jnp.float64),
    }

    def loss(p, ex):
        x, y = ex
        return jnp.sum(jnp.tanh(DIVISORS[divisor](p, x) @ x) * y)

    batch = _regression(jax.random.key(1), 5, 4, 3)
    _check(loss, params, batch)
    plan = _plans(loss, params, batch, ("sq_mean", "sq_norms"))["['w']"]
    assert plan.route == "outer-product"
    assert plan.methods["norms"] == ("chunked" if divisor == "elementwise" else "factorized")


def test_a_gradient_scaled_by_an_example_dependent_value_takes_the_fallback():
    """(W·s(x)) x: the weight's gradient is its core times s(x), a scaling that changes from
    example to example — not a multiplication by a batch-independent value."""
    params = {"w": jax.random.normal(jax.random.key(0), (3, 4), jnp.float64)}

    def loss(p, ex):
        x, y = ex
        return jnp.sum(jnp.tanh((p["w"] * jnp.tanh(jnp.sum(x))) @ x) * y)

    batch = _regression(jax.random.key(1), 5, 4, 3)
    _check(loss, params, batch)
    plan = _plans(loss, params, batch)["['w']"]
    assert plan.route == "fallback"
    assert "not a dot_general" in dict(plan.refused)["outer-product"]


def _window_table(starts: list[int], size: int):
    def loss(p, ex):
        x, y = ex
        rows = jnp.stack([jax.lax.dynamic_slice(p["table"], (s,), (size,)) for s in starts])
        return jnp.sum(jnp.tanh(rows @ x) * y)

    return loss


def _window_table_vmapped(starts: list[int], size: int):
    def loss(p, ex):
        x, y = ex
        take = lambda s: jax.lax.dynamic_slice(p["table"], (s,), (size,))  # noqa: E731
        rows = jax.vmap(take)(jnp.asarray(starts))
        return jnp.sum(jnp.tanh(rows @ x) * y)

    return loss


@pytest.mark.parametrize(
    "starts,route",
    [([0, 4, 8], "row-scatter"), ([0, 2, 4], "fallback"), ([6, 5, 4], "fallback")],
    ids=["disjoint", "overlapping", "relative-position"],
)
def test_windows_take_the_row_route_only_when_proven_disjoint(starts: list[int], route: str):
    params = {"table": jax.random.normal(jax.random.key(0), (12,), jnp.float64)}
    batch = _regression(jax.random.key(1), 5, 4, 3)
    loss = _window_table_vmapped(starts, 4)
    _check(loss, params, batch)
    plan = _plans(loss, params, batch)["['table']"]
    assert plan.route == route
    if route == "fallback":
        assert "overlap" in dict(plan.refused)["row-scatter"]


def test_a_clamped_window_is_checked_where_it_lands():
    """Start 10 of a size-4 window in 12 entries is clamped to 8: it overlaps the one at 8."""
    params = {"table": jax.random.normal(jax.random.key(0), (12,), jnp.float64)}
    batch = _regression(jax.random.key(1), 5, 4, 3)
    loss = _window_table_vmapped([0, 8, 10], 4)
    _check(loss, params, batch)
    assert _plans(loss, params, batch)["['table']"].route == "fallback"


def test_a_scatter_into_a_nonzero_table_is_not_a_row_route():
    params = {"w": jax.random.normal(jax.random.key(0), (3, 4), jnp.float64)}

    def loss(p, ex):
        x, y = ex
        shifted = jax.custom_vjp(lambda w: w)
        # A backward rule that adds a constant to the gradient: g_i = c + rows_i.
        shifted.defvjp(lambda w: (w, None), lambda _, g: (g + 1.0,))
        return jnp.sum(jnp.tanh(shifted(p["w"]) @ x) * y)

    batch = _regression(jax.random.key(1), 5, 4, 3)
    _check(loss, params, batch)
    assert _plans(loss, params, batch)["['w']"].route == "fallback"


@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.05, 0.05),))


@jax.custom_vjp
def clip_gradient_norm(x):
    return x


clip_gradient_norm.defvjp(
    lambda x: (x, None), lambda _, g: (g * jnp.minimum(1.0, 0.1 / jnp.linalg.norm(g)),)
)


@pytest.mark.parametrize("clip", [clip_gradient, clip_gradient_norm], ids=["value", "norm"])
def test_a_non_linear_custom_backward_gives_every_statistic_exactly(clip):
    """The backward pass is never scaled by 1/B: each example's cotangents are its own."""
    key = jax.random.key(0)
    params = [jax.random.normal(k, (4, 4), jnp.float64) for k in jax.random.split(key, 2)]

    def loss(p, ex):
        x, y = ex
        h = clip(jnp.tanh(p[0] @ x))
        return jnp.sum((p[1] @ h - y) ** 2)

    batch = _regression(jax.random.key(1), 5, 4, 4)
    _check(loss, params, batch)


@pytest.mark.parametrize(
    "slices,route",
    [([(0, 1), (1, 2), (2, 3)], "disjoint-parts"), ([(0, 1), (0, 2)], "fallback")],
    ids=["disjoint", "overlapping"],
)
def test_slices_of_one_leaf_take_the_parts_route_only_when_proven_disjoint(slices, route):
    """A stacked weight read slice by slice in a Python loop (w[a:b] as one matrix)."""
    params = {"layers": jax.random.normal(jax.random.key(0), (3, 4, 4), jnp.float64) / 2}

    def loss(p, ex):
        x, y = ex
        total = jnp.zeros((), jnp.float64)
        for lo, hi in slices:
            total = total + jnp.sum(jnp.tanh(p["layers"][lo:hi].reshape(-1, 4) @ x))
        return total * jnp.sum(y)

    batch = _regression(jax.random.key(1), 5, 4, 4)
    _check(loss, params, batch)
    plan = _plans(loss, params, batch)["['layers']"]
    assert plan.route == route
    if route == "fallback":
        assert "overlap" in dict(plan.refused)["disjoint-parts"]


def _scan_case(seq: int, width: int):
    key = jax.random.key(0)
    params = {
        "layers": jax.random.normal(key, (3, width, width), jnp.float64) / width,
        "cell": jax.random.normal(jax.random.fold_in(key, 1), (width, width), jnp.float64) / width,
        "context": jax.random.normal(jax.random.fold_in(key, 2), (width, width), jnp.float64),
    }

    def loss(p, ex):
        xs, y = ex  # [seq, width]
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), xs, p["layers"])
        c = jnp.mean(xs, 0)  # the same at every step: a constant of the recurrence

        def step(s, x):
            s = jnp.tanh(s @ p["cell"] + x + c @ p["context"])
            return s, s

        _, states = jax.lax.scan(step, jnp.zeros(width, jnp.float64), h)
        return jnp.mean((states - y) ** 2)

    kx, ky = jax.random.split(jax.random.key(1))
    batch = (
        jax.random.normal(kx, (5, seq, width), jnp.float64),
        jax.random.normal(ky, (5, seq, width), jnp.float64),
    )
    return params, loss, batch


@pytest.mark.parametrize("seq,width", [(2, 5), (6, 3)], ids=["short", "long"])
def test_scanned_weight_gradients_are_hoisted_out_of_the_backward_scan(seq: int, width: int):
    """Stacked layers: one dot per layer after the scan, when its operands are smaller than
    the stacked weight gradients (seq < width) — else the scan keeps them. A weight shared
    by all steps: the accumulated Σ_t becomes one contraction, or, with a factor the same at
    every step, (Σ_t δ_t) ⊗ c: rank one."""
    params, loss, batch = _scan_case(seq, width)
    _check(loss, params, batch)
    plans = _plans(loss, params, batch, pegrad.STATISTICS, clip_norm=1.0)
    assert plans["['layers']"].route == ("contraction" if seq < width else "fallback")
    assert plans["['cell']"].route == "contraction"
    assert plans["['context']"].route == "outer-product"  # (Σ_t δ_t) ⊗ c: rank one


def _token_batch(key, b: int, d: int):
    kx, ky = jax.random.split(key)
    return (
        jax.random.normal(kx, (b, T, d), jnp.float64),
        jax.random.normal(ky, (b, T, d), jnp.float64),
    )


def test_token_mixing_over_an_axis_of_length_t_is_not_a_position():
    """d == T: the token-mixing weight contracts positions, the channel weight a feature axis
    of the same length. Per-token statistics of the first are undefined: both impls refuse,
    naming it; the second is a per-token outer product; example granularity is exact."""
    key = jax.random.key(0)
    params = {
        "mix": jax.random.normal(key, (T, T), jnp.float64) / T,
        "chan": jax.random.normal(jax.random.fold_in(key, 1), (T, T), jnp.float64) / T,
    }

    def loss(p, ex):
        x, y = ex  # [T, d = T]
        h = jnp.tanh(p["mix"] @ x)  # mixes positions
        return jnp.mean((jnp.tanh(h @ p["chan"]) - y) ** 2)  # mixes channels

    batch = _token_batch(jax.random.key(1), 3, T)
    _check(loss, params, batch)
    for impl in ("vmap", "factorized"):
        fn = pegrad.value_and_grad_stats(loss, ("sq_mean",), impl=impl, granularity="token")
        with pytest.raises(ValueError, match=r"params\['mix'\].*position-wise"):
            fn(params, batch)

    def chan_only(p, ex):
        x, y = ex
        return jnp.mean((jnp.tanh(x @ p["chan"]) - y) ** 2)

    def chan_tokenwise(copies, ex):
        x, y = ex
        out = jnp.stack([jnp.tanh(x[t] @ copies["chan"][t]) for t in range(T)])
        return jnp.mean((out - y) ** 2)

    chan = {"chan": params["chan"]}
    _check(chan_only, chan, batch, "token", chan_tokenwise)
    assert _plans(chan_only, chan, batch, granularity="token")["['chan']"].route == "outer-product"


def test_a_token_weight_whose_cotangent_is_not_traced_takes_the_untied_fallback():
    """The read-out is scaled by a per-example number: the cotangent of x @ w is that number
    broadcast over positions, which carries no position axis. The contraction is then
    unproven, and the untied fallback gives the same numbers."""
    params = {"w": jax.random.normal(jax.random.key(0), (3, 2), jnp.float64)}

    def loss(p, ex):
        x, _ = ex
        return jnp.mean(x @ p["w"]) * jnp.sum(x)

    def tokenwise(copies, ex):
        x, _ = ex
        return jnp.mean(jnp.stack([x[t] @ copies["w"][t] for t in range(T)])) * jnp.sum(x)

    batch = _token_batch(jax.random.key(1), 3, 3)
    _check(loss, params, batch, "token", tokenwise)
    plan = _plans(loss, params, batch, granularity="token")["['w']"]
    assert plan.route == "fallback"
    assert "not both traced" in dict(plan.refused)["outer-product"]


def test_a_parameter_inside_a_custom_derivative_is_not_split_over_positions():
    params = {"w": jax.random.normal(jax.random.key(0), (3, 3), jnp.float64)}

    @jax.custom_vjp
    def dense(x, w):
        return x @ w

    dense.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

    def loss(p, ex):
        x, y = ex
        return jnp.mean((jnp.tanh(dense(x, p["w"])) - y) ** 2)

    batch = _token_batch(jax.random.key(1), 3, 3)
    _check(loss, params, batch)  # example granularity: exact
    for impl in ("vmap", "factorized"):
        fn = pegrad.value_and_grad_stats(loss, ("mean",), impl=impl, granularity="token")
        with pytest.raises(ValueError, match=r"params\['w'\] meets the example at 'custom_vjp"):
            fn(params, batch)


LOOKUPS = {
    "index": lambda table, ids: table[ids],  # promises in-range ids
    "take-fill": lambda table, ids: jnp.take(table, ids, axis=0),
    "take-clip": lambda table, ids: jnp.take(table, ids, axis=0, mode="clip"),
}


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_out_of_range_token_rows_count_as_their_scatter_mode_says(lookup: str):
    """Out-of-range ids: the backward scatter drops those rows (promise, fill) or clamps them
    (clip); the per-unit gradients, and so their norms, follow the same rule."""
    params = {"emb": jax.random.normal(jax.random.key(0), (5, 3), jnp.float64)}
    take = LOOKUPS[lookup]

    def loss(p, ex):
        tokens, y = ex
        return jnp.mean((jnp.tanh(take(p["emb"], tokens)) - y) ** 2)

    def tokenwise(copies, ex):
        tokens, y = ex
        # A one-element index array: the same gather (a scalar index would be a clamping slice).
        rows = [take(copies["emb"][t], tokens[t : t + 1])[0] for t in range(T)]
        return jnp.mean((jnp.tanh(jnp.stack(rows)) - y) ** 2)

    tokens = jnp.asarray([[0, 1, 7, 2], [4, 9, 3, 3], [1, 1, 1, 5]])  # 7, 9, 5 are out of range
    batch = (tokens, jax.random.normal(jax.random.key(1), (3, T, 3), jnp.float64))
    _check(loss, params, batch, "token", tokenwise)
    assert _plans(loss, params, batch, granularity="token")["['emb']"].route == "row-scatter"


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_zero_size_and_scalar_leaves(batch_size: int):
    key = jax.random.key(0)
    params = {
        "w": jax.random.normal(key, (3, 4), jnp.float64),
        "empty": jnp.zeros((0, 4), jnp.float64),
        "empty_vector": jnp.zeros((0,), jnp.float64),
        "temperature": jnp.asarray(0.7, jnp.float64),
    }

    def loss(p, ex):
        x, y = ex
        h = p["w"] @ x + jnp.sum(p["empty"] @ x) + jnp.sum(p["empty_vector"])
        return jnp.sum(jnp.tanh(p["temperature"] * h) * y)

    batch = _regression(jax.random.key(1), batch_size, 4, 3)
    _check(loss, params, batch)
    plans = _plans(loss, params, batch)
    assert plans["['empty']"].route == "empty" and plans["['empty_vector']"].route == "empty"


# -- numerics -------------------------------------------------------------------------------------


def _snr_batch(ratio: float, n: int, d: int, dtype):
    """Inputs x_i = μ + σ ε_i with μ²/σ² = ratio and the same targets y for every example, so
    that the weight gradients x_i ⊗ (a function of y) have that signal-to-noise ratio."""
    rng = np.random.default_rng(0)
    mu = 1.0 + rng.uniform(size=d)
    x = mu + mu * rng.normal(size=(n, d)) / np.sqrt(ratio)
    y = np.broadcast_to(1.0 + rng.uniform(size=(T, 2)), (n, T, 2))
    return jnp.asarray(x, dtype), jnp.asarray(y, dtype)


def _snr_loss(p, ex):
    x, y = ex  # the same input at every position, so that sequence routes see it too
    h = jnp.broadcast_to(x, (T, x.shape[0])) @ p["w"]
    return jnp.sum(h * y) + jnp.sum(x @ p["v"] * y[0])


@pytest.mark.parametrize("ratio", [1e2, 1e4, 1e6])
@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_float32_variance_stays_accurate_at_high_signal_to_noise(impl: pegrad.Impl, ratio: float):
    """var = 1/(B−1) Σ (g_i − ḡ)² from centred factors or per-chunk merges, never q − ḡ²:
    within 1e-3 of the float64 truth up to mean²/var = 1e6."""
    d = 8
    params64 = {
        "w": jnp.asarray(np.random.default_rng(1).normal(size=(d, 2))),
        "v": jnp.asarray(np.random.default_rng(2).normal(size=(d, 2))),
    }
    batch64 = _snr_batch(ratio, 64, d, jnp.float64)
    fn = pegrad.value_and_grad_stats(_snr_loss, ("mean", "var"), impl="vmap")
    truth = fn(params64, batch64)[1]
    for name in ("w", "v"):  # the data really has that signal-to-noise ratio
        snr = np.asarray(truth["mean"][name]) ** 2 / np.asarray(truth["var"][name])
        assert np.min(snr) > ratio / 2
    params32, batch32 = jax.tree.map(lambda x: x.astype(jnp.float32), (params64, batch64))
    fn = pegrad.value_and_grad_stats(_snr_loss, ("var",), impl=impl, chunk_size=16)
    got = jax.jit(fn)(params32, batch32)[1]
    for name in ("w", "v"):
        want = np.asarray(truth["var"][name])
        err = np.max(np.abs(np.asarray(got["var"][name], np.float64) - want) / want)
        assert err < 1e-3, f"{name}: relative error {err:.1e} at SNR {ratio:.0e}"


@pytest.mark.parametrize("granularity", ["example", "token"])
@pytest.mark.parametrize("spread", [1e-4, 1e-6])
def test_the_variance_of_equal_outer_products_with_unequal_factors_does_not_cancel(
    spread: float, granularity: pegrad.Granularity
):
    """A scale-invariant use of a weight: loss −½ log((w·x)²) has the gradient −x/(w·x), the
    same for x and c·x (c of either sign). With x_u = c_u x₀ + spread·noise the gradients nearly
    agree while the factors δ_u = −1/(w·x_u) and x_u do not: the rank-one factors must be
    rescaled before centring, or the variance (O(spread²)) is a difference of O(1) terms
    (relative error 3e-4 at spread 1e-6 before the rescaling)."""
    rng = np.random.default_rng(0)
    x0, w = np.array([1.0, 2.0, 0.5]), jnp.asarray(rng.normal(size=3))
    scales = np.array([0.5, -1.0, 2.0, -3.0, 4.0])
    x = scales[:, None] * x0 + spread * rng.normal(size=(5, 3))

    def loss(p, example):
        return -0.5 * jnp.log(jnp.dot(example, p["w"]) ** 2)

    # The same five units either way: five examples, or five positions of one example whose
    # loss is the sum of the positions' (a position's gradient is then loss's at that x_u).
    _, units = naive_unit_grads(loss, {"w": w}, jnp.asarray(x))
    if granularity == "token":
        batch = jnp.asarray(x)[None]
        per_example = lambda p, ex: jnp.sum(jax.vmap(loss, (None, 0))(p, ex))  # noqa: E731
    else:
        batch, per_example = jnp.asarray(x), loss
    want = np.var(units["w"], axis=0, ddof=1)
    assert np.max(units["w"].mean(0) ** 2 / want) > 1e6  # the regime named above
    fn = pegrad.value_and_grad_stats(
        per_example, ("mean", "var"), granularity=granularity, choose="first"
    )
    assert [
        p.route
        for p in pegrad.explain(per_example, {"w": w}, batch, ("var",), granularity=granularity)
    ] == ["outer-product"]
    got = np.asarray(jax.jit(fn)({"w": w}, batch)[1]["var"]["w"])
    assert np.max(np.abs(got - want) / want) < 1e-8


@pytest.mark.parametrize("spread", [1e-2, 1e-6])
def test_gram_norms_of_cancelling_terms_are_exact_to_the_stated_bound(spread: float):
    """SPEC §3: a positive pair through one weight, h = X Wᵀ on X = [x₁; x₂] with x₂ = x₁ +
    spread·d. g = Σ_k a_k ⊗ b_k with a_k = ±2(h₀ − h₁), b_k = x_k: the Gram form's error is
    within ~ε·K·(Σ_k ‖a_k‖‖b_k‖)², which exceeds 1e-10 of ‖g‖² as spread → 0 (it is stated,
    not hidden)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(0.4 * rng.normal(size=(6, 8)))
    x1, d = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
    batch = jnp.asarray(np.stack([x1, x1 + spread * d], axis=1))  # [B, K = 2, 8]

    def loss(p, example):
        h = example @ p["w"].T
        return jnp.sum((h[0] - h[1]) ** 2)

    (plan,) = pegrad.explain(loss, {"w": w}, batch, ("sq_norms",), choose="first")
    assert plan.route == "contraction" and plan.methods["norms"] == "factorized"  # the Gram form
    _, grads = naive_unit_grads(loss, {"w": w}, batch)
    want = np.sum(grads["w"].reshape(3, -1) ** 2, axis=1)
    h = np.einsum("bkf,of->bko", np.asarray(batch), np.asarray(w))
    a = 2 * np.linalg.norm(h[:, 0] - h[:, 1], axis=-1)  # ‖a_k‖, both k
    bound = (a * np.linalg.norm(np.asarray(batch), axis=-1).sum(-1)) ** 2
    fn = pegrad.value_and_grad_stats(loss, ("sq_norms",), choose="first")
    got = np.asarray(jax.jit(fn)({"w": w}, batch)[1]["sq_norms"])
    assert np.all(np.abs(got - want) <= 2 * 2 * np.finfo(np.float64).eps * bound)
    if spread == 1e-2:  # no near-cancellation: exact to ~1e-10 of itself, like every statistic
        assert np.max(np.abs(got - want) / want) < 1e-10


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_statistics_are_no_worse_than_the_reference(dtype):
    """At B = 2048 the backward pass is never seeded with 1/B (which pushes float16 cotangents
    into subnormals): against a float32 loop, the rewrite's error is within 2× the reference's."""
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(16, 8)) / 4, "w2": rng.normal(size=(8, 4)) / 3}
    batch = (rng.normal(size=(2048, 16)), rng.normal(size=(2048, 4)))

    def loss(p, ex):
        x, y = ex
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    stats = ("mean", "sq_mean", "var")
    as_type = lambda t, dt: jax.tree.map(lambda x: jnp.asarray(x, dt), t)  # noqa: E731
    truth = jax.jit(pegrad.value_and_grad_stats(loss, stats, impl="vmap"))(
        as_type(params, jnp.float32), as_type(batch, jnp.float32)
    )[1]
    low = as_type(params, dtype), as_type(batch, dtype)
    errors = {}
    for impl in ("vmap", "factorized"):
        got = jax.jit(pegrad.value_and_grad_stats(loss, stats, impl=impl))(*low)[1]
        errors[impl] = {
            (s, k): float(
                np.max(np.abs(np.asarray(got[s][k], np.float64) - np.asarray(truth[s][k])))
                / np.max(np.abs(np.asarray(truth[s][k])))
            )
            for s in stats
            for k in params
        }
    for key, err in errors["factorized"].items():
        assert err <= 2 * errors["vmap"][key] + 1e-6, (
            f"{key}: {err:.2e} vs {errors['vmap'][key]:.2e}"
        )


# -- properties -----------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(
    piece=st.sampled_from(PIECES),
    batch_size=st.integers(2, 6),
    chunk=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_statistics_obey_their_invariants(piece: Piece, batch_size: int, chunk: int, seed: int):
    key = jax.random.key(seed)
    params = piece.init(key)
    batch = piece.example(jax.random.fold_in(key, 1), batch_size)
    stats = pegrad.STATISTICS
    loss = lambda p, ex: piece.loss(p, ex, False)  # noqa: E731

    v = probe_like(params)

    def run(chunk_size):
        fn = pegrad.value_and_grad_stats(loss, stats, chunk_size=chunk_size, clip_norm=CLIP)
        return jax.jit(fn)(params, batch, dot_with=v)[1]

    whole, chunked = run(None), run(chunk)
    for name in stats:  # results do not depend on chunk_size
        assert_tree_close(chunked[name], whole[name], f"chunk {chunk} {name}", rtol=1e-12)
    # gram: symmetric, positive semi-definite, its diagonal sq_norms, its mean ‖ḡ‖²; dot's
    # mean ⟨ḡ, v⟩ (both linear in g)
    gram, n = np.asarray(whole["gram"]), int(whole["batch_size"])
    scale = float(np.max(np.abs(gram)))
    np.testing.assert_allclose(gram, gram.T, rtol=0, atol=1e-12 * scale)
    assert float(np.min(np.linalg.eigvalsh(gram))) >= -1e-12 * scale * n
    np.testing.assert_allclose(np.diag(gram), whole["sq_norms"], rtol=1e-10)
    mean_sq = sum(float(jnp.sum(m * m)) for m in jax.tree.leaves(whole["mean"]))
    np.testing.assert_allclose(gram.sum() / n**2, mean_sq, rtol=1e-9, atol=1e-12 * scale)
    means, probes = jax.tree.leaves(whole["mean"]), jax.tree.leaves(v)
    along = sum(float(jnp.sum(m * x)) for m, x in zip(means, probes, strict=True))
    np.testing.assert_allclose(float(jnp.mean(whole["dot"])), along, rtol=1e-9, atol=1e-12)
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


# -- bad input (SPEC §6) --------------------------------------------------------------------------


def _dense_piece():
    piece = _piece("dense_bias")
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
def test_variance_of_one_example_is_an_error(impl: str):
    piece, params, batch = _dense_piece()
    fn = pegrad.value_and_grad_stats(piece.loss, ("mean", "var"), impl=impl)  # type: ignore[arg-type]
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


@pytest.mark.parametrize("impl", ["vmap", "factorized"])
def test_token_granularity_refuses_a_weight_used_once_per_example(impl: str):
    piece, params, (x, _) = _dense_piece()
    batch = (jnp.broadcast_to(x[:, None], (3, T, x.shape[1])), jnp.zeros((3, T, 2)))

    def loss(p, ex):  # the weight sees the mean over positions: no per-position terms
        xs, ys = ex
        return piece.loss(p, (xs.mean(0), ys.mean(0)))

    fn = pegrad.value_and_grad_stats(loss, ("sq_mean",), impl=impl, granularity="token")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"params\['[bw]'\].*position-wise"):
        fn(params, batch)


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
    piece = _piece("equinox_jit_remat")
    model = piece.init(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    batch = piece.example(jax.random.key(1), 3)

    def loss(p, ex):
        return piece.loss(eqx.combine(p, static), ex)

    _check(loss, params, batch)
    plans = _plans(loss, params, batch, ("sq_mean",))
    assert [p.status for k, p in plans.items() if k.endswith(".weight")] == ["factorized"] * 2


def test_explain_says_for_each_leaf_why_every_earlier_route_of_its_kind_lost():
    """The "not taken" list is decided by the routes' refusals, not by text: every route before
    the one taken refused (the planner takes the first that proves its case), and is named with
    its failed proof unless the leaf is not of its kind (another core operation, no entries, a
    gradient that depends on the example). Before, a string filter and a skip of the first two
    entries dropped the wrong one when mean-loss's refusal came first (the custom_vjp loss
    below: its fallback leaf lost 'constant' instead)."""

    def loss(p, x):  # w: a dense weight at 4 positions; mean-loss refused by the custom_vjp
        h = _clip_cotangent(jnp.tanh(x @ p["w"]))
        return jnp.sum(h * p["v"]) ** 2

    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "v": jnp.linspace(0.5, 2.0, 2)}
    batch = jax.random.normal(jax.random.key(0), (5, 4, 3), jnp.float64)
    every = ("mean", "sq_mean", "sign_mean", "var")
    for stats, choose in [
        ("mean", "cheapest"),
        (every, "cheapest"),
        (("mean", "sq_mean"), "first"),
    ]:
        for p in pegrad.explain(loss, params, batch, stats, choose=choose):
            text = " ".join(str(p).split())
            assert "last operation is not" not in text, text
            taken = [r.name for r in pegrad.ROUTES].index(p.route)
            earlier = {r.name for r in pegrad.ROUTES[:taken]} | {"mean-loss"}
            assert [r for r, _ in p.refused if r != "mean-loss"] == [
                r.name for r in pegrad.ROUTES[:taken]
            ]
            for route, why in p.refused:
                shown = f"{route}: {' '.join(why.split())}" in text
                assert shown == (route in earlier and route not in p.other_kind), (route, text)
            if stats == "mean":
                assert "mean-loss: the loss calls a custom_vjp" in text, text


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize(
    "stats",
    [
        ("mean", "sq_mean", "var"),
        ("sq_mean", "sign_mean"),  # (a cost model sent these to the fallback: 1.2x slower)
        ("mean", "sq_mean", "sign_mean", "var", "sq_norms", "clipped_mean"),
    ],
)
def test_the_variance_of_a_weight_used_at_every_position_takes_the_route_of_its_mean_square(
    n: int, stats: tuple[str, ...]
):
    """A dense weight applied at T positions (a transformer's projections): asked for the
    variance, the sign or every statistic, it stays on `contraction` (per-example gradients
    formed in the head, each chunk centred, Chan-merged), not the fallback, and equals the
    naive loop at float64."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(24, 24))), "v": jnp.asarray(rng.normal(size=24))}

    def loss(p, x):  # x [T, d]: the weight at every position
        return jnp.mean(jnp.tanh(x @ p["w"]) @ p["v"]) ** 2

    batch = jnp.asarray(rng.normal(size=(n, 6, 24)))
    stats = stats if n > 1 else tuple(s for s in stats if s != "var")
    clip = 0.5 if "clipped_mean" in stats else None
    plans = pegrad.explain(loss, params, batch, stats, clip_norm=clip)
    routes = [p.route for p in plans if "w" in p.leaf]
    assert routes == ["contraction"], routes
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "pos")


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize(
    "stats, formed",
    [
        (("mean", "sq_norms"), True),  # formed in the head: the sum comes with the norms
        (("sq_norms",), False),  # alone: by the Gram identity, nothing formed
        (("clipped_mean", "sq_norms"), False),  # the clipping weights wait for every norm
        (("mean", "sq_mean", "sq_norms"), True),
    ],
)
def test_norms_of_a_weight_used_at_every_position_take_its_route(n: int, stats, formed: bool):
    """A dense weight applied at T positions: its per-example norms are formed in the head
    beside the sum (one pass gives both), or from Grams where nothing else needs the
    per-example gradients — never the fallback — and equal the naive loop at float64."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(24, 24))), "v": jnp.asarray(rng.normal(size=24))}

    def loss(p, x):  # x [T, d]: the weight at every position
        return jnp.mean(jnp.tanh(x @ p["w"]) @ p["v"]) ** 2

    batch = jnp.asarray(rng.normal(size=(n, 6, 24)))
    clip = 0.5 if "clipped_mean" in stats else None
    plans = pegrad.explain(loss, params, batch, stats, clip_norm=clip)
    (plan,) = [p for p in plans if "w" in p.leaf]
    assert (plan.route, plan.status) == ("contraction", "factorized"), str(plan)
    assert [where for where, *_ in plan.formed] == (["head"] if formed else []), str(plan)
    want = naive_stats(naive_unit_grads(loss, params, batch)[1], 0.5)
    for choose in ("cheapest", "first"):
        fn = pegrad.value_and_grad_stats(loss, stats, choose=choose, clip_norm=clip)
        got = jax.jit(fn)(params, batch)[1]
        assert_tree_close({s: got[s] for s in stats}, {s: want[s] for s in stats}, choose)


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize(
    "seq, d, gram",
    [
        (6, 24, True),  # K(a + b) = 288 < ab = 576: the Grams take fewer products
        (12, 24, False),  # K(a + b) = ab = 576: as many products is not fewer
        (16, 8, False),  # 256 > 64: a long sequence of a narrow weight forms its gradients
    ],
)
def test_norms_alone_take_the_gram_identity_only_where_it_takes_fewer_products(
    n: int, seq: int, d: int, gram: bool
):
    """A dense weight [d, d] at `seq` positions asked for its norms alone: the Grams AAᵀ, BBᵀ
    (K² (a + b) products per example) where they take fewer products than forming the
    gradient (K a b), else each example's gradient formed in the head; both equal the naive
    loop at float64."""
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(size=(d, d))), "v": jnp.asarray(rng.normal(size=d))}

    def loss(p, x):  # x [T, d]: the weight at every position
        return jnp.mean(jnp.tanh(x @ p["w"]) @ p["v"]) ** 2

    batch = jnp.asarray(rng.normal(size=(n, seq, d)))
    (plan,) = [p for p in pegrad.explain(loss, params, batch, ("sq_norms",)) if "w" in p.leaf]
    assert (plan.route, plan.status) == ("contraction", "factorized"), str(plan)
    assert [where for where, *_ in plan.formed] == ([] if gram else ["head"]), str(plan)
    want = naive_stats(naive_unit_grads(loss, params, batch)[1], 0.5)["sq_norms"]
    got = jax.jit(pegrad.value_and_grad_stats(loss, ("sq_norms",)))(params, batch)[1]
    assert_tree_close(got["sq_norms"], want, f"T {seq}, d {d}")


CLIPPED = ("mean", "var", "sq_norms", "clipped_mean")


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_clipping_keeps_the_gradients_formed_for_the_norms_where_the_batch_fits(batch_size: int):
    """Weights used at 16 positions, whose per-example gradients (d² + 3d numbers) the norms
    form anyway and the head's values outnumber: formed once for the whole batch and kept for
    the clip factors, not formed (or the weight-gradient matmul run) again; every statistic
    equals the naive loop, kept or not (choose="first" and chunks keep nothing)."""
    loss, params, batch = _wide_over_positions(batch_size, seq=16, d=4)
    stats = CLIPPED if batch_size > 1 else CLIPPED[::2] + CLIPPED[3:]  # (no var of one)
    plans = pegrad.explain(loss, params, batch, stats, clip_norm=0.5)
    assert [p.kept for p in plans] == [True, True], str(plans)
    for p in plans:  # (explain wraps its lines)
        assert p.status == "chunked" and "kept for the clip factors" in " ".join(str(p).split())
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "kept")


@pytest.mark.parametrize(
    "broken, seq, d, options",
    [
        ("the batch's gradients outnumber the head's values", 2, 12, {}),
        ("the caller's chunk", 16, 4, {"chunk_size": 2}),
        ("the caller's memory budget", 16, 4, {"memory_budget": 200}),
        ("choose='first'", 16, 4, {"choose": "first"}),
    ],
)
def test_formed_gradients_are_not_kept_where_the_batch_would_not_be_formed_at_once(
    broken: str, seq: int, d: int, options: dict
):
    """Broken preconditions: keeping needs every example's gradient at once (the clip factors
    wait for every norm), so a batch that does not fit in one chunk, or the caller's bound,
    keeps nothing (two passes, as before); choose="first" takes each route's own clipping.
    The statistics still equal the naive loop."""
    loss, params, batch = _wide_over_positions(5, seq, d)
    plans = pegrad.explain(loss, params, batch, CLIPPED, clip_norm=0.5, **options)
    assert not any(p.kept for p in plans), f"{broken}: {plans}"
    want = naive_stats(naive_unit_grads(loss, params, batch)[1], 0.5)
    fn = pegrad.value_and_grad_stats(loss, CLIPPED, clip_norm=0.5, **options)
    got = jax.jit(fn)(params, batch)[1]
    assert_tree_close({s: got[s] for s in CLIPPED}, {s: want[s] for s in CLIPPED}, broken)


def test_without_the_clipped_mean_nothing_is_kept():
    loss, params, batch = _wide_over_positions(5, seq=16, d=4)
    plans = pegrad.explain(loss, params, batch, ("mean", "var", "sq_norms"))
    assert not any(p.kept for p in plans), str(plans)


def test_norms_after_a_scaling_by_a_vector_are_not_formed_in_the_head():
    """Broken precondition: g = m ⊙ core with m a batch-independent vector, so ‖g‖² is not
    Π φ(m)²·‖core‖²: the norms go to the chunk loop, and still equal the naive loop."""
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(size=(8, 8))), "m": jnp.asarray(rng.normal(size=8))}

    def loss(p, x):
        w = p["w"] * jax.lax.stop_gradient(p["m"])  # the gradient of w is m ⊙ (x^T δ)
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    batch = jnp.asarray(rng.normal(size=(3, 5, 8)))
    (plan,) = [
        p for p in pegrad.explain(loss, params, batch, ("mean", "sq_norms")) if "w" in p.leaf
    ]
    assert plan.methods["norms"] == "chunked", str(plan)
    want = naive_stats(naive_unit_grads(loss, params, batch)[1], 0.5)
    got = jax.jit(pegrad.value_and_grad_stats(loss, ("mean", "sq_norms")))(params, batch)[1]
    assert_tree_close(got["sq_norms"], want["sq_norms"], "sq_norms")


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("stats", [("mean", "sq_mean"), ("mean", "var"), ("mean", "sq_norms")])
def test_stacked_weights_read_by_a_static_index_take_the_unstacked_routes(n: int, stats):
    """Weights stacked over layers and read as W[l], b[l] in a Python loop, each applied at
    every position: each layer's part takes the route an unstacked layer takes (contraction,
    unit-sum) inside disjoint-parts — never the fallback — and every statistic equals the naive
    loop at float64."""
    rng = np.random.default_rng(3)
    layers, width = 3, 8
    params = {
        "W": jnp.asarray(rng.normal(size=(layers, width, width)) / 3),
        "b": jnp.asarray(rng.normal(size=(layers, width))),
    }

    def loss(p, x):  # x [T, width]
        for layer in range(layers):
            x = jnp.tanh(x @ p["W"][layer] + p["b"][layer])
        return jnp.sum(x**2)

    batch = jnp.asarray(rng.normal(size=(n, 5, width)))
    stats = ("mean", "sq_mean") if n == 1 and "var" in stats else stats  # var needs B ≥ 2
    plans = pegrad.explain(loss, params, batch, stats)
    assert [(p.route, p.status) for p in plans] == [("disjoint-parts", "factorized")] * 2, str(
        plans
    )
    check_every_implementation(loss, params, batch, naive_unit_grads(loss, params, batch), "W[l]")
