"""train.py's optimizer, schedule and step: built from optimizers.py and optax, once.

The learning-rate schedule is the peak times optax's warmup-cosine (or linear warmup) schedule
of a unit peak, equal to its formula and unchanged under a traced peak; train.build's step is
`optimizers.make_train_step`'s (the repository's one step) plus the diagnostics; one function,
`train.numeric_policy`, switches JAX to 64 bits.
"""

import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optimizers
import train

REPO = Path(__file__).resolve().parent.parent


def formula(cfg: train.Config, t: int) -> float:
    """Linear warmup from lr/(w+1) to lr at step w, then constant or cosine to lr/10 at the
    last step (numpy, float64)."""
    lr = cfg.lr * min(1.0, (t + 1.0) / (cfg.warmup + 1.0))
    if cfg.schedule == "cosine":
        progress = np.clip((t - cfg.warmup) / max(1, cfg.steps - cfg.warmup), 0.0, 1.0)
        lr *= 0.1 + 0.45 * (1.0 + np.cos(np.pi * progress))
    return lr


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("warmup, steps", [(50, 600), (0, 10), (5, 5), (7, 3), (1, 2)])
def test_schedule_equals_its_formula(schedule: str, warmup: int, steps: int):
    cfg = train.Config(schedule=schedule, warmup=warmup, steps=steps, lr=3e-3)  # pyright: ignore[reportArgumentType]
    lr = train.make_schedule(cfg)
    got = np.array([float(lr(jnp.asarray(t, jnp.int32))) for t in range(steps)])
    want = np.array([formula(cfg, t) for t in range(steps)])
    np.testing.assert_allclose(got, want, rtol=3e-7)  # the schedule is float32


def test_schedule_under_a_traced_peak_equals_the_python_peak():
    """sweep.py passes each run's peak lr as a traced array; train.main a Python float."""
    cfg = train.Config(warmup=10, steps=100, lr=3e-3)
    counts = jnp.arange(100, dtype=jnp.int32)
    python = jax.jit(jax.vmap(train.make_schedule(cfg)))(counts)
    traced = jax.jit(lambda peak: jax.vmap(train.make_schedule(cfg, peak))(counts))(
        jnp.asarray(3e-3)
    )
    assert python.dtype == traced.dtype == jnp.float32
    np.testing.assert_allclose(traced, python, rtol=2e-7)


def tiny(**overrides: Any) -> train.Config:
    base: dict[str, Any] = dict(
        size="tiny", n_layers=1, seq_len=8, batch_size=4, steps=4, warmup=2, lr=1e-2,
        dtype="float64", optimizer="micro_adam_var", weight_decay=0.1,
    )  # fmt: skip
    return train.Config(**{**base, **overrides})


def test_build_takes_its_step_from_optimizers(monkeypatch: pytest.MonkeyPatch):
    calls: list[dict] = []
    make = optimizers.make_train_step

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return make(*args, **kwargs)

    monkeypatch.setattr(optimizers, "make_train_step", spy)
    run = train.build(tiny())
    assert len(calls) == 1 and calls[0]["jit"] is False
    # The same numbers as optimizers.make_train_step's own jitted step on the task.
    batch = run.task.sample(run.task.train_data, key=jax.random.fold_in(run.train_key, 0))
    state = run.opt.init(run.task.params)
    params, _, loss, diag = jax.jit(run.step)(run.task.params, state, batch)
    own = make(run.task.loss_fn, run.opt, impl="factorized")
    want_params, _, want_loss, stats = own(run.task.params, state, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    assert set(diag) == {"grad_norm", "frac_snr_gt_1_over_B", "nu_adam_over_nu_micro",
                         "trace_cov", "grad_sq", "noise_scale_batch", "params_finite",
                         "trace_cov_p", "grad_sq_p", "noise_scale_p_batch"}  # fmt: skip
    norm = np.sqrt(sum(np.sum(np.asarray(g) ** 2) for g in jax.tree.leaves(stats["mean"])))
    np.testing.assert_allclose(diag["grad_norm"], norm, rtol=1e-6)  # diagnostics: float32


def test_the_optimizer_decays_matrices_only():
    """make_optimizer's mask (optax's name): weight decay on leaves with ndim >= 2."""
    run = train.build(tiny(optimizer="adam", lr=0.5, weight_decay=0.1, warmup=0))
    zero = jax.tree.map(jnp.zeros_like, run.task.params)
    updates, _ = run.opt.update(zero, run.opt.init(run.task.params), run.task.params)
    for p, u in zip(jax.tree.leaves(run.task.params), jax.tree.leaves(updates), strict=True):
        want = -0.5 * 0.1 * np.asarray(p) if p.ndim >= 2 else np.zeros(p.shape)
        np.testing.assert_allclose(u, want, rtol=1e-6, atol=1e-12)


def test_one_step_builder_and_one_numeric_policy_in_the_sources():
    """No other step builder beside optimizers.make_train_step, and one place that switches
    JAX to 64 bits (train.numeric_policy)."""
    studies = [str(p.relative_to(REPO)) for p in sorted((REPO / "studies").glob("*.py"))]
    names = ("train.py", "sweep.py", "experiments.py", "optimizers.py", *studies)
    sources = {name: (REPO / name).read_text() for name in names}
    builders = {n: re.findall(r"^def make_train_step\b", s, re.M) for n, s in sources.items()}
    assert {n: len(b) for n, b in builders.items() if b} == {"optimizers.py": 1}
    switches = {n: s.count('"jax_enable_x64"') for n, s in sources.items()}
    assert len(switches) > 5
    assert switches == {n: 1 if n == "train.py" else 0 for n in names}
    assert "def numeric_policy" in sources["train.py"]
