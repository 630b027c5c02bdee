"""Means of φ, the variance and norms formed inside the scan that stacks a weight's layers
(DESIGN: InScan): the scan body reduces g over the batch one layer per iteration (Σ φ(g), a
layer's centred variance, its part of each ‖g_i‖²), so no stacked operand outlives the loop.
Equal to the naive loop (float64, B 1/2/5, with a mask; granularity="token" refuses a scan over
layers, SPEC §3); taken
only where its proof holds — each precondition is broken once below and the leaf then computes
its statistics after the scan, as before."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, naive_stats, naive_unit_grads
from test_pegrad import _scan_case
from zoo import residual_layer

import pegrad

F64 = jnp.float64
L, T, D = 3, 4, 5
# the sum alone, the sum formed with sq, sign alone; then the variance, alone and with the sum
PHI_STATS = [("mean",), ("mean", "sq_mean"), ("sign_mean",)]
INSIDE = [*PHI_STATS, ("var",), ("mean", "var")]
# (statistics, batch size): the variance of one example is not defined
CASES = [(s, n) for s in INSIDE for n in (1, 2, 5) if n > 1 or "var" not in s]
# norms: alone (the Gram identity), beside the mean and the variance (per-example gradients)
NORMS = [("sq_norms",), ("mean", "sq_norms"), ("mean", "var", "sq_norms")]


def _case_id(case: tuple) -> str:
    return f"{'+'.join(case[0])}-B{case[1]}"


def _sequence_stack(key: jax.Array) -> tuple[Any, Any]:
    """Stacked layers [L, D, D] applied by lax.scan to every position of [T, D]: each layer's
    dot contracts the positions (contraction)."""
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "layers": jax.random.normal(k1, (L, D, D), F64) / D,
        "gains": 1.0 + 0.1 * jax.random.normal(k2, (L, D), F64),
        "out": jnp.eye(D, dtype=F64) + 0.1 * jax.random.normal(k3, (D, D), F64),
    }

    def loss(p: Any, ex: Any) -> jax.Array:
        x, y = ex
        h, _ = jax.lax.scan(residual_layer, x, (p["layers"], p["gains"]))
        return jnp.mean((h @ p["out"] - y) ** 2)  # its leaf is ready between the two scans

    return params, loss


def _vector_stack(key: jax.Array) -> tuple[Any, Any]:
    """The same stack on one vector per example: each layer's dot is rank one (outer-product)."""
    params, loss = _sequence_stack(key)
    return params, lambda p, ex: loss(p, (ex[0][None], ex[1][None]))


def _batch(key: jax.Array, n: int, sequence: bool) -> tuple[jax.Array, jax.Array]:
    shape = (n, T, D) if sequence else (n, D)
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, shape, F64), jax.random.normal(ky, shape, F64)


MODELS = {"sequence": (_sequence_stack, True), "vector": (_vector_stack, False)}


def _case(name: str, n: int) -> tuple[Any, Any, Any]:
    build, sequence = MODELS[name]
    params, loss = build(jax.random.key(0))
    return params, loss, _batch(jax.random.key(1), n, sequence)


def _in_scan(loss, params, batch, stats, **options) -> dict[str, bool]:
    plans = pegrad.explain(loss, params, batch, stats, choose="first", **options)
    taken = {p.leaf: p.in_scan is not None for p in plans}
    for p in plans:  # explain says it exactly where it is done
        assert ("formed inside the scan" in " ".join(str(p).split())) == taken[p.leaf], str(p)
    return taken


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("name", list(MODELS))
def test_means_and_variance_formed_inside_the_scan_equal_the_naive_loop(name: str, case: tuple):
    """Both routes: a layer's contraction (sequence) and its outer product (vector), whose
    variance is the centred-factor identity applied to one layer's slice at a time."""
    stats, n = case
    params, loss, batch = _case(name, n)
    assert _in_scan(loss, params, batch, stats)["['layers']"]
    _, unit_grads = naive_unit_grads(loss, params, batch)
    want = naive_stats(unit_grads, clip_norm=1.0)
    plans = {
        c: [p.route for p in pegrad.explain(loss, params, batch, stats, choose=c)]
        for c in ("first", "cheapest")
    }
    distinct: list[pegrad.Choose] = ["first"]
    if plans["cheapest"] != plans["first"]:
        distinct.append("cheapest")
    for choose in distinct:  # "cheapest" where it runs a program of its own
        fn = pegrad.value_and_grad_stats(loss, stats, choose=choose)
        _, got = jax.jit(fn)(params, batch)
        for s in stats:
            assert_tree_close(got[s], want[s], f"{name}/{choose}/{s}")


@pytest.mark.parametrize("stats", [("mean", "var"), ("mean", "sq_mean")], ids="+".join)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_users_vmap_over_parameter_sets_gives_each_sets_statistics(name: str, stats: tuple):
    """jax.vmap over parameter sets (an ensemble) around pegrad's function: the head's own vmap
    over the examples, inside it, gathers a leaf's values and each scan iteration's operands
    (`pegrad_examples`, a rule for that vmap alone); each set's statistics equal its naive
    loop."""
    build, _ = MODELS[name]
    params, loss, batch = _case(name, 5)
    other, _ = build(jax.random.key(7))
    assert _in_scan(loss, params, batch, stats)["['layers']"]
    sets = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)
    fn = jax.vmap(pegrad.value_and_grad_stats(loss, stats), in_axes=(0, None))
    _, got = jax.jit(fn)(sets, batch)
    for k, p in enumerate((params, other)):
        want = naive_stats(naive_unit_grads(loss, p, batch)[1], clip_norm=1.0)
        for s in stats:
            mine = jax.tree.map(lambda x, k=k: x[k], got[s])
            assert_tree_close(mine, want[s], f"{name}/set {k}/{s}")


@pytest.mark.parametrize("n", [2, 5], ids=lambda n: f"B{n}")
@pytest.mark.parametrize("stats", NORMS, ids="+".join)
@pytest.mark.parametrize("name", list(MODELS))
def test_norms_formed_inside_the_scan_equal_the_naive_loop(name: str, stats: tuple, n: int):
    """A layer's contraction adds its part of each ‖g_i‖² per iteration (formed, or by the
    Gram identity when the norms come alone); an outer product's norms are no sum of its core
    (‖a‖²‖b‖² per unit): they are formed after the scan, as before."""
    params, loss, batch = _case(name, n)
    assert _in_scan(loss, params, batch, stats)["['layers']"] == (name == "sequence")
    _, unit_grads = naive_unit_grads(loss, params, batch)
    want = naive_stats(unit_grads, clip_norm=1.0)
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, stats))(params, batch)
    for s in stats:
        assert_tree_close(got[s], want[s], f"{name}/{s}")


_STATS_MASKED = [("mean", "sq_mean"), ("mean", "var"), ("mean", "sq_norms")]


@pytest.mark.parametrize("stats", _STATS_MASKED, ids="+".join)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_masked_example_counts_in_no_statistic_of_a_scanned_layer(name: str, stats: tuple):
    """The gathered operands of an example not kept are replaced by 0 (NaN there included) for
    the means formed inside; the variance of kept examples merges chunks (Chan) after the scan,
    and the norms are formed there too (a masked example's norm is 0)."""
    params, loss, batch = _case(name, 5)
    keep = np.array([True, False, True, True, False])
    x, y = batch
    batch = (x.at[1].set(jnp.nan), y)
    kept = jax.tree.map(lambda v: v[keep], batch)
    _, unit_grads = naive_unit_grads(loss, params, kept)
    want = naive_stats(unit_grads, clip_norm=1.0)
    fn = pegrad.value_and_grad_stats(loss, stats)
    _, got = jax.jit(fn)(params, batch, mask=jnp.asarray(keep))
    for s in stats:
        if s == "sq_norms":  # per example: the kept ones', 0 elsewhere
            want[s] = _scatter(want[s], keep)
        assert_tree_close(got[s], want[s], f"{name}/masked/{s}")


def _scatter(values: Any, keep: np.ndarray) -> np.ndarray:
    out = np.zeros(keep.shape)
    out[keep] = np.asarray(values)
    return out


@pytest.mark.parametrize("stats", _STATS_MASKED, ids="+".join)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_dropped_example_counts_in_no_statistic_of_a_scanned_layer(name: str, stats: tuple):
    """nonfinite="drop" knows which examples count only once every norm is: the norms of a
    scanned layer are then not formed inside the scan (its means would be summed before the
    NaN example is known), and the statistics are those of the finite examples."""
    params, loss, batch = _case(name, 5)
    x, y = batch
    batch = (x.at[1].set(jnp.nan), y)
    finite = np.array([True, False, True, True, True])
    _, unit_grads = naive_unit_grads(loss, params, jax.tree.map(lambda v: v[finite], batch))
    want = naive_stats(unit_grads, clip_norm=1.0)
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, stats, nonfinite="drop"))(params, batch)
    for s in stats:
        if s == "sq_norms":
            want[s] = _scatter(want[s], finite)
        assert_tree_close(got[s], want[s], f"{name}/dropped/{s}")


@pytest.mark.parametrize(
    "stats", [("clipped_mean",), ("clipped_mean", "sq_norms"), ("mean", "var", "clipped_mean")]
)
def test_clipping_is_not_formed_inside_the_scan(stats: tuple):
    """Its weights wait for every layer's norms, so it reads every layer's operands after the
    scan; whatever the leaf computes beside it is formed there too."""
    params, loss, batch = _case("sequence", 3)
    clip = 1.0 if "clipped_mean" in stats else None
    assert not any(_in_scan(loss, params, batch, stats, clip_norm=clip).values())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_weight_every_iteration_shares_sums_only_its_mean_inside_the_scan(case: tuple):
    """A recurrent cell's gradient sums over iterations (its dot contracts the iteration axis):
    Σ_t is linear, so the mean accumulates inside the scan, but φ of a sum over iterations is
    not a sum over them: sq, sign and the variance are formed after it. A factor the same at
    every step (`context`) is not stacked by the scan; the stacked layers of the same model are.
    Both choices run: "first" is the plan asserted (the mean alone included, whose "cheapest"
    is plain grad of the mean loss)."""
    stats, n = case
    params, loss, batch = _scan_case(2, 5)
    x, y = batch
    batch = (x[:n], y[:n])
    assert _in_scan(loss, params, batch, stats) == {
        "['cell']": stats == ("mean",),
        "['context']": False,
        "['layers']": True,
    }
    _, unit_grads = naive_unit_grads(loss, params, batch)
    want = naive_stats(unit_grads, clip_norm=1.0)
    for choose in ("first", "cheapest"):
        fn = pegrad.value_and_grad_stats(loss, stats, choose=choose)
        _, got = jax.jit(fn)(params, batch)
        for s in stats:
            assert_tree_close(got[s], want[s], f"recurrent/{choose}/{s}")


def _equations(fn, *args):
    """Every equation of fn's program, calls and scans looked into."""

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    yield from visit(inner)

    yield from visit(jax.make_jaxpr(fn)(*args).jaxpr)


def _scan_outputs(fn, *args) -> Counter:
    """Shapes of every scan output in fn's program."""
    scans = (e for e in _equations(fn, *args) if e.primitive.name == "scan")
    return Counter(tuple(v.aval.shape) for e in scans for v in e.outvars)


@pytest.mark.parametrize("stats", INSIDE, ids="+".join)
def test_no_stacked_operand_leaves_the_backward_scan(stats: tuple):
    """Every activation-sized array the factorized program's scans output ([L, B, T, D]), plain
    grad's scans output too: the weight's operands are consumed inside the loop."""
    params, loss, batch = _case("sequence", 5)
    n = 5

    def plain(p, b):
        return jax.value_and_grad(lambda p: jnp.mean(jax.vmap(loss, (None, 0))(p, b)))(p)

    large = lambda shapes: Counter(  # noqa: E731
        {s: k for s, k in shapes.items() if np.prod(s, dtype=int) >= L * n * T * D}
    )
    ours = large(_scan_outputs(pegrad.value_and_grad_stats(loss, stats), params, batch))
    assert not ours - large(_scan_outputs(plain, params, batch)), ours


@pytest.mark.parametrize("stats", [*INSIDE, *NORMS, ("clipped_mean",)], ids="+".join)
def test_operands_larger_than_the_weight_are_hoisted_only_for_statistics_formed_inside(
    stats: tuple,
):
    """Six positions of width 3: a layer's stacked operands hold more numbers than its
    per-example weight gradient. Means of φ, the variance and norms consume them inside the
    scan, so the dot is hoisted for them; clipping would hold them after it, so there it stays
    in the scan (and the leaf takes the fallback)."""
    params, loss, batch = _scan_case(6, 3)
    inside = "clipped_mean" not in stats
    clip = None if inside else 1.0
    taken = _in_scan(loss, params, batch, stats, clip_norm=clip)
    plans = pegrad.explain(loss, params, batch, stats, choose="first", clip_norm=clip)
    assert taken["['layers']"] == inside
    assert {p.leaf: p.route for p in plans}["['layers']"] == (
        "contraction" if inside else "fallback"
    )
    _, unit_grads = naive_unit_grads(loss, params, batch)
    want = naive_stats(unit_grads, clip_norm=1.0)
    _, got = jax.jit(pegrad.value_and_grad_stats(loss, stats, clip_norm=clip))(params, batch)
    for s in stats:
        assert_tree_close(got[s], want[s], f"long/{s}")


def _large_transposes(fn, size: int, *args) -> int:
    """How many transposes in fn's program output ≥ size entries."""
    return sum(
        e.primitive.name == "transpose" and np.prod(e.outvars[0].aval.shape) >= size
        for e in _equations(fn, *args)
    )


@pytest.mark.parametrize("stats", PHI_STATS, ids="+".join)
def test_stacked_residuals_are_not_copied_by_the_head(stats: tuple):
    """The head is one vmap over the examples, whose leaves' statistics are computed where
    their values exist (here one at `out`'s gradient, between the forward and the backward
    scan): a scan's stacked outputs keep the examples on axis 1 (where vmap leaves them), so no
    [L, B, ...] residual is transposed to [B, L, ...] and back; plain grad transposes none
    either."""
    params, loss, batch = _case("sequence", 5)

    def plain(p, b):
        return jax.value_and_grad(lambda p: jnp.mean(jax.vmap(loss, (None, 0))(p, b)))(p)

    size = L * 5 * T * D
    ours = pegrad.value_and_grad_stats(loss, stats)
    assert _large_transposes(ours, size, params, batch) <= _large_transposes(
        plain, size, params, batch
    )


_LOWER = """
import hashlib, sys
import jax
jax.config.update("jax_enable_x64", True)
import pegrad, zoo
model = next(m for m in zoo.MODELS if m.name == sys.argv[1])
params, loss = model.build(jax.random.key(0))
fn = pegrad.value_and_grad_stats(loss, ("mean", "sq_mean"))
text = jax.jit(fn).lower(params, model.batch(jax.random.key(1), 3)).as_text()
print(hashlib.sha256(text.encode()).hexdigest())
"""


@pytest.mark.parametrize("name", ["eqx_gru_scan", "scanned_stack"])
def test_every_process_lowers_a_scanned_model_to_the_same_program(name: str):
    """The head once moved a scan's stacked outputs to their examples-first layout in the order
    of a set of variables (their addresses): fresh interpreters lowered the same model to
    different programs, so the processes of one multi-host run would compile different steps."""
    tests = Path(__file__).parent
    path = os.pathsep.join([str(tests.parent), str(tests)])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    digests = set()
    for _ in range(4):
        proc = subprocess.run(
            [sys.executable, "-c", _LOWER, name],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests.add(proc.stdout.split()[-1])
    assert len(digests) == 1


class _PackedInputs:
    """A scan's inputs as JAX 0.11 describes them (`ft_in`): constants, carries and scanned
    inputs, each part sized by its leaves; here only what pegrad reads, `unpack()`."""

    def __init__(self, *sizes: int):
        self.parts = [[None] * n for n in sizes]

    def unpack(self) -> list[list[None]]:
        return self.parts


def test_a_scans_constants_and_carries_are_read_in_either_jax_layout() -> None:
    # JAX < 0.11 names the counts (num_consts, num_carry); 0.11 packs the inputs in ft_in.
    def loop(c: Any, xs: Any, w: Any, v: Any, u: Any) -> Any:
        return jax.lax.scan(lambda c, x: ((c[0] * w, c[1] + v), x * c[0] * u), c, xs)

    args = ((1.0, 2.0), jnp.ones(3), 2.0, 3.0, 4.0)
    (scan,) = [e for e in jax.make_jaxpr(loop)(*args).eqns if e.primitive.name == "scan"]
    counts = pegrad._scan_counts(scan.params)
    assert counts == (3, 2)  # w, v and u; both carries
    xs = len(scan.invars) - sum(counts)
    named = {"num_consts", "num_carry", "ft_in"}
    for layout in ({"num_consts": 3, "num_carry": 2}, {"ft_in": _PackedInputs(3, 2, xs)}):
        params = {k: v for k, v in scan.params.items() if k not in named} | layout
        assert pegrad._scan_counts(params) == counts
