"""pegrad.gradient_noise_scale: B_simple = tr Σ / |G|² from "mean", "sq_mean" (or "var") and N.

Checked at float64: tr Σ and |G|² (global and per leaf) equal their definitions on the
per-example gradients a naive loop materializes (tests/helpers.py), from pegrad's "sq_mean" and
from its "var", with and without a mask; each is unbiased, shown exactly: averaged over every
ordered batch of N drawn with replacement from a population of 3 examples (3^N batches, each
equally likely) they equal the population's trace and squared mean gradient, while the ratio's
average is not the population's ratio. plots.py's smoothed series (the ratio of two EMAs) on a
metrics.jsonl with known numbers.
"""

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import naive_unit_grads
from hypothesis import given, settings
from hypothesis import strategies as st
from pieces import PIECES

import pegrad
import plots


def mlp() -> tuple[Callable, dict[str, Any], Callable[[Any, int], Any]]:
    """A two-layer tanh network, squared error."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    params = {
        "w1": jax.random.normal(k1, (4, 3)),
        "b1": 0.1 * jax.random.normal(k2, (4,)),
        "w2": jax.random.normal(k3, (2, 4)),
    }

    def loss(p: dict[str, Any], example: Any) -> jax.Array:
        x, y = example
        return jnp.sum((p["w2"] @ jnp.tanh(p["w1"] @ x + p["b1"]) - y) ** 2)

    def batch(key: Any, n: int) -> Any:
        kx, ky = jax.random.split(key)
        return jax.random.normal(kx, (n, 3)), 1.0 + jax.random.normal(ky, (n, 2))

    return loss, params, batch


def shared_weight() -> tuple[Callable, dict[str, Any], Callable[[Any, int], Any]]:
    """One weight used at each of 5 positions of an example (a sum of rank-one terms)."""
    k1, k2 = jax.random.split(jax.random.key(2))
    params = {"w": jax.random.normal(k1, (3, 3)), "v": jax.random.normal(k2, (3,))}

    def loss(p: dict[str, Any], example: Any) -> jax.Array:
        x, y = example  # [5, 3], [5]
        return jnp.mean((jnp.tanh(x @ p["w"].T) @ p["v"] - y) ** 2)

    def batch(key: Any, n: int) -> Any:
        kx, ky = jax.random.split(key)
        return jax.random.normal(kx, (n, 5, 3)), 0.5 + jax.random.normal(ky, (n, 5))

    return loss, params, batch


MODELS = {"mlp": mlp, "shared_weight": shared_weight}


def definitions(grads: dict[str, np.ndarray]) -> dict[str, Any]:
    """tr Σ and |G|² per leaf and in all, from materialized per-unit gradients [N, ...]."""
    n = next(iter(grads.values())).shape[0]
    trace = {k: float(np.sum((g - g.mean(0)) ** 2) / (n - 1)) for k, g in grads.items()}
    norm = {k: float(np.sum(g.mean(0) ** 2)) for k, g in grads.items()}
    grad_sq = {k: norm[k] - trace[k] / n for k in grads}
    return {"trace": trace, "grad_sq": grad_sq, "norm": norm, "n": n}


def close(actual: Any, expected: float, scale: float, what: str) -> None:
    """Equal to 1e-10 of `scale`: |G|² = ‖ḡ‖² − tr Σ / N is a difference, whose rounding is
    relative to the terms it subtracts, not to itself."""
    assert abs(float(actual) - expected) <= 1e-10 * scale, (what, float(actual), expected)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("n", [2, 3, 7])
def test_equals_its_definition_on_the_naive_loop(model: str, n: int):
    loss, params, make_batch = MODELS[model]()
    batch = make_batch(jax.random.key(n), n)
    mask = None if n == 2 else np.arange(n) != 1  # the second example counts nowhere
    kept = batch if mask is None else jax.tree.map(lambda x: x[mask], batch)
    _, grads = naive_unit_grads(loss, params, kept)
    want = definitions(grads)
    fn = jax.jit(pegrad.value_and_grad_stats(loss, ("mean", "sq_mean", "var")))
    _, both = fn(params, batch, mask=mask)
    assert int(both["batch_size"]) == want["n"]
    for stats in (("mean", "sq_mean"), ("mean", "var")):  # σ̂² from q − ḡ², and pegrad's own
        noise = pegrad.gradient_noise_scale({k: both[k] for k in (*stats, "batch_size")})
        leaf = noise["per_leaf"]
        for k in params:
            scale = want["norm"][k] + want["trace"][k]
            close(leaf["trace_cov"][k], want["trace"][k], scale, f"trace {k} {stats}")
            close(leaf["grad_sq"][k], want["grad_sq"][k], scale, f"|G|² {k} {stats}")
            assert leaf["b_simple"][k] == leaf["trace_cov"][k] / leaf["grad_sq"][k]
        scale = sum(want["norm"].values()) + sum(want["trace"].values())
        trace, grad_sq = sum(want["trace"].values()), sum(want["grad_sq"].values())
        close(noise["trace_cov"], trace, scale, f"trace {stats}")
        close(noise["grad_sq"], grad_sq, scale, f"|G|² {stats}")
        # the ratio, to the rounding of its denominator relative to itself
        cond = scale / abs(grad_sq)
        b = trace / grad_sq
        assert abs(float(noise["b_simple"]) - b) <= 1e-9 * cond * abs(b), (noise, b)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_numerator_and_denominator_are_unbiased_exactly(n: int):
    """Over every ordered batch of n draws with replacement from 3 examples (3^n batches, all
    equally likely) the averages of tr Σ and |G|² equal the population's trace of the covariance
    (1/3 Σ_j ‖g_j − G‖²) and ‖G‖², G = 1/3 Σ_j g_j: an identity, checked to 1e-10."""
    loss, params, make_batch = mlp()
    _, pop = naive_unit_grads(loss, params, make_batch(jax.random.key(0), 3))
    g = {k: np.asarray(v) for k, v in pop.items()}
    draws = np.array(list(itertools.product(range(3), repeat=n)))  # [3^n, n]
    mean = {k: v[draws].mean(1) for k, v in g.items()}
    sq_mean = {k: (v[draws] ** 2).mean(1) for k, v in g.items()}
    var = {k: v[draws].var(1, ddof=1) for k, v in g.items()}
    count = jnp.full(len(draws), n)
    true_trace = sum(float(np.sum((v - v.mean(0)) ** 2)) / 3 for v in g.values())
    true_g2 = sum(float(np.sum(v.mean(0) ** 2)) for v in g.values())
    fn = jax.jit(jax.vmap(pegrad.gradient_noise_scale))
    for stats in (
        {"mean": mean, "sq_mean": sq_mean, "batch_size": count},
        {"mean": mean, "var": var, "batch_size": count},
    ):
        noise = fn(jax.tree.map(jnp.asarray, stats))
        np.testing.assert_allclose(np.mean(noise["trace_cov"]), true_trace, rtol=1e-10)
        np.testing.assert_allclose(np.mean(noise["grad_sq"]), true_g2, rtol=1e-10)
        for k, v in g.items():  # per leaf as well
            np.testing.assert_allclose(
                np.mean(noise["per_leaf"]["grad_sq"][k]), np.sum(v.mean(0) ** 2), rtol=1e-10
            )
        # ...and the ratio is not: its average over the batches misses the population's ratio
        ratio = np.mean(noise["b_simple"])
        assert abs(ratio - true_trace / true_g2) > 1e-3 * true_trace / true_g2


def test_asks_for_what_it_needs():
    with pytest.raises(ValueError, match="no sq_mean in the statistics; ask value_and_grad_stats"):
        pegrad.gradient_noise_scale({"mean": {"w": jnp.ones(2)}, "batch_size": jnp.array(4)})


def test_plots_smooths_numerator_and_denominator_before_dividing(tmp_path: Path):
    records = [
        {"step": 0, "eval_loss": 3.0},
        {"step": 0, "loss": 2.0, "trace_cov": 4.0, "grad_sq": 2.0, "noise_scale": 2.0},
        {"step": 10, "loss": 1.9, "trace_cov": 8.0, "grad_sq": -1.0, "noise_scale": -8.0},
        {"step": 20, "loss": 1.8, "trace_cov": 6.0, "grad_sq": 1.0, "noise_scale": 6.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = plots.noise_scale_series(tmp_path, decay=0.5)
    np.testing.assert_array_equal(s["step"], [0, 10, 20])
    np.testing.assert_array_equal(s["noise_scale_batch"], [2.0, -8.0, 6.0])
    # EMAs (from 0, decay 0.5): tr Σ 2, 5, 5.5; |G|² 1, 0, 0.5 -> 2, none (≤ 0), 11
    np.testing.assert_array_equal(s["smoothed"], [2.0, np.nan, 11.0])
    plots.draw(tmp_path)  # a run directory: its figure (or the one-line note)
    assert (tmp_path / "run.png").exists() == (plots.pyplot() is not None)
    losses = plots.loss_series(tmp_path)  # the loss panel's curves: train and eval
    np.testing.assert_array_equal(losses["loss"], [2.0, 1.9, 1.8])
    np.testing.assert_array_equal(losses["eval_step"], [0])
    np.testing.assert_array_equal(losses["eval_loss"], [3.0])


# -- the preconditioned noise scale B_P = tr(PΣ) / |G|²_P --------------------------------------


def _precondition(params: dict[str, Any], seed: int) -> dict[str, Any]:
    """A diagonal P > 0 of the parameters' shapes, fixed (independent of any batch)."""
    keys = jax.random.split(jax.random.key(seed), len(params))
    return {
        k: jnp.exp(jax.random.normal(kk, v.shape))
        for kk, (k, v) in zip(keys, params.items(), strict=True)
    }


def dense_seq() -> tuple[Callable, dict[str, Any], Callable[[Any, int], Any], Callable]:
    """A dense layer at every position of a sequence, per token (tests/pieces.py): N = B·T."""
    (piece,) = [p for p in PIECES if p.name == "dense_over_sequence"]
    tokenwise = lambda copies, example: piece.loss(copies, example, True)  # noqa: E731
    loss = lambda p, example: piece.loss(p, example, False)  # noqa: E731
    return loss, piece.init(jax.random.key(3)), piece.example, tokenwise


@pytest.mark.parametrize("model", [*sorted(MODELS), "dense_seq per token"])
@pytest.mark.parametrize("n", [2, 5])
def test_preconditioned_parts_equal_their_definition_on_the_naive_loop(model: str, n: int):
    """tr(PΣ) = Σ P σ̂² and |G|²_P = Σ P ḡ² − tr(PΣ)/N on the loop's per-unit gradients, from
    "var" and from "sq_mean", per example and per token, with a mask at n = 5 (the second
    example counts nowhere); one leaf's P is a scalar, broadcast over it."""
    tokenwise = None
    if model == "dense_seq per token":
        loss, params, make_batch, tokenwise = dense_seq()
    else:
        loss, params, make_batch = MODELS[model]()
    batch = make_batch(jax.random.key(n), n)
    mask = None if n == 2 else np.arange(n) != 1
    kept = batch if mask is None else jax.tree.map(lambda x: x[mask], batch)
    _, grads = naive_unit_grads(loss, params, kept, tokenwise)
    p = _precondition(params, n)
    p[min(p)] = jnp.asarray(2.5)  # a scalar for the whole leaf
    g = {k: np.asarray(v) for k, v in grads.items()}
    units = next(iter(g.values())).shape[0]
    trace = {k: float(np.sum(p[k] * g[k].var(0, ddof=1))) for k in g}
    grad_sq = {k: float(np.sum(p[k] * g[k].mean(0) ** 2)) - trace[k] / units for k in g}
    scale = sum(float(np.sum(p[k] * (g[k] ** 2).mean(0))) for k in g)
    granularity = "example" if tokenwise is None else "token"
    fn = pegrad.value_and_grad_stats(loss, ("mean", "sq_mean", "var"), granularity=granularity)
    _, both = jax.jit(fn)(params, batch, mask=mask)
    assert int(both["batch_size"]) == units
    for stats in (("mean", "sq_mean"), ("mean", "var")):  # σ̂² from q − ḡ², and pegrad's own
        noise = pegrad.gradient_noise_scale({k: both[k] for k in (*stats, "batch_size")}, p)
        for k in g:
            close(noise["per_leaf"]["trace_cov_p"][k], trace[k], scale, f"tr(PΣ) {k} {stats}")
            close(noise["per_leaf"]["grad_sq_p"][k], grad_sq[k], scale, f"|G|²_P {k} {stats}")
        close(noise["trace_cov_p"], sum(trace.values()), scale, f"tr(PΣ) {stats}")
        close(noise["grad_sq_p"], sum(grad_sq.values()), scale, f"|G|²_P {stats}")
        assert noise["b_p"] == noise["trace_cov_p"] / noise["grad_sq_p"]


@settings(deadline=None, max_examples=20)
@given(c=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_b_p_is_b_simple_at_p_one_and_blind_to_the_scale_of_p(c: float, seed: int):
    loss, params, make_batch = mlp()
    _, stats = pegrad.value_and_grad_stats(loss, ("mean", "sq_mean"))(
        params, make_batch(jax.random.key(seed), 4)
    )
    ones = jax.tree.map(jnp.ones_like, params)
    at_one = pegrad.gradient_noise_scale(stats, ones)
    for a, b in (("trace_cov", "trace_cov_p"), ("grad_sq", "grad_sq_p"), ("b_simple", "b_p")):
        assert at_one[a] == at_one[b]  # multiplied by exact ones, op by op: bitwise
    # under jit XLA may fuse the weighting into a differently ordered sum: to the last bits
    jitted = jax.jit(pegrad.gradient_noise_scale)(stats, ones)
    np.testing.assert_allclose(jitted["b_p"], at_one["b_simple"], rtol=1e-15)
    p = _precondition(params, seed)
    base = pegrad.gradient_noise_scale(stats, p)
    scaled = pegrad.gradient_noise_scale(stats, jax.tree.map(lambda x: c * x, p))
    np.testing.assert_allclose(scaled["b_p"], base["b_p"], rtol=1e-10)
    np.testing.assert_allclose(scaled["trace_cov_p"], c * base["trace_cov_p"], rtol=1e-12)


@pytest.mark.parametrize("n", [2, 4])
def test_preconditioned_parts_are_unbiased_exactly(n: int):
    """Over all 3^n ordered batches from a population of 3 examples: the averages of tr(PΣ) and
    |G|²_P are the population's Σ P·Var and Σ P·G², for a P fixed before the batch."""
    loss, params, make_batch = mlp()
    _, pop = naive_unit_grads(loss, params, make_batch(jax.random.key(0), 3))
    g = {k: np.asarray(v) for k, v in pop.items()}
    p = {k: np.asarray(v) for k, v in _precondition(params, 7).items()}
    draws = np.array(list(itertools.product(range(3), repeat=n)))
    stats = {
        "mean": {k: v[draws].mean(1) for k, v in g.items()},
        "var": {k: v[draws].var(1, ddof=1) for k, v in g.items()},
        "batch_size": jnp.full(len(draws), n),
    }
    fn = jax.jit(jax.vmap(pegrad.gradient_noise_scale, in_axes=(0, None)))
    noise = fn(jax.tree.map(jnp.asarray, stats), p)
    true_trace = sum(float(np.sum(p[k] * v.var(0))) for k, v in g.items())
    true_g2 = sum(float(np.sum(p[k] * v.mean(0) ** 2)) for k, v in g.items())
    np.testing.assert_allclose(np.mean(noise["trace_cov_p"]), true_trace, rtol=1e-10)
    np.testing.assert_allclose(np.mean(noise["grad_sq_p"]), true_g2, rtol=1e-10)


def test_a_preconditioner_not_like_the_statistics_is_refused_by_leaf():
    stats = {"mean": {"w": jnp.ones((2, 3))}, "var": {"w": jnp.ones((2, 3))}, "batch_size": 4}
    with pytest.raises(ValueError, match=r"preconditioner\['w'\] of shape \(2,\) does not"):
        pegrad.gradient_noise_scale(stats, {"w": jnp.ones(2)})
    for bad in (-1.0, np.nan, np.inf):  # a PSD diagonal: finite, ≥ 0
        with pytest.raises(ValueError, match=rf"preconditioner\['w'\] holds {bad}: P must be"):
            pegrad.gradient_noise_scale(stats, {"w": jnp.array([1.0, bad, 1.0])})
    with pytest.raises(
        ValueError, match=r"no leaf at \[\"\['w'\]\"\] and extra leaves at \['\[0\]'\]"
    ):
        pegrad.gradient_noise_scale(stats, [jnp.ones(3)])
    with pytest.raises(ValueError, match=r"no leaf at \[\] and extra leaves at \[\"\['v'\]\"\]"):
        pegrad.gradient_noise_scale(stats, {"w": jnp.ones(3), "v": jnp.ones(3)})
    found = pegrad.gradient_noise_scale(stats, {"w": jnp.full((3,), 2.0)})  # broadcasts
    assert float(found["trace_cov_p"]) == 2.0 * float(found["trace_cov"])
