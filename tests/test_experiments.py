"""experiments.py and sweep.py. Every study runs end to end at --scale smoke with 2 seeds and
writes its summary files (and plots, where matplotlib is installed). A vectorized sweep equals
the same runs trained one by one by train.main (float64, to ~1e-12), with a run that diverges
in the same program recorded at train.main's step and harming none of the others. The helpers
are checked on small inputs with known answers (grouping, spike counting, paired verdicts, the
SNR model's prediction)."""

import csv
import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import experiments
import sweep
import train

HAVE_PLOTS = importlib.util.find_spec("matplotlib") is not None
SEEDS = 2


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_summary(out: Path, n_settings: int) -> list[dict[str, str]]:
    rows = read_csv(out / "summary.csv")
    assert len(rows) == n_settings * SEEDS
    assert set(rows[0]) == set(experiments.CSV_COLUMNS)
    assert sorted({r["seed"] for r in rows}) == [str(s) for s in range(SEEDS)]
    for r in rows:
        assert r["status"] in ("ok", "diverged", "blew_up")
        if r["status"] != "diverged":
            assert math.isfinite(float(r["first_eval_loss"]))
        if r["status"] == "ok":
            assert math.isfinite(float(r["final_loss"]))
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == len(rows) and summary["scale"] == "smoke"
    assert "Verdicts" in (out / "summary.md").read_text()  # the tables for people
    assert summary["seeds"] == SEEDS
    return rows


def smoke(name: str, out: Path) -> dict[str, Any]:
    return experiments.run(name, scale="smoke", out=str(out), seeds=SEEDS)


# --------------------------------------------------------------------------------------------
# The studies at --scale smoke.


def test_sign(tmp_path: Path):
    scale = experiments.SCALES["smoke"]
    summary = smoke("sign", tmp_path)
    momenta = {m: 1 if m == "micro_sign_sgd" else len(scale.sign_momenta)
               for m in experiments.SIGN_METHODS}  # fmt: skip
    n = sum(momenta[m] * len(scale.sign_lrs[m]) for m in experiments.SIGN_METHODS)
    rows = check_summary(tmp_path, n)
    assert {r["optimizer"] for r in rows} == set(experiments.SIGN_METHODS)
    # The SNR model's prediction next to the outcome, per seed: at init and at each best run.
    snr = read_csv(tmp_path / "snr.csv")
    assert [s["point"] for s in snr if s["seed"] == "0"][0] == "init"
    assert {s["seed"] for s in snr} == {"0", "1"}
    for s in summary["snr"]:  # the later the sign, the larger k: a monotone order
        assert 0 <= s["micro_sign_sgd"] <= s["sign_sgd"] <= s["sign_ema"] <= 1
        assert s["observed_order"].count(">") == 2
    assert len(summary["verdicts"]) >= 3
    assert all("verdict" in v for v in summary["verdicts"])
    assert (tmp_path / "sign.png").exists() == HAVE_PLOTS


def test_precond(tmp_path: Path):
    scale = experiments.SCALES["smoke"]
    summary = smoke("precond", tmp_path)
    n = len(experiments.PRECOND_VARIANTS) * len(scale.precond_lrs)
    n += len(experiments.LARGE_B_METHODS) * len(scale.var_lrs)
    rows = check_summary(tmp_path, n)
    assert {r["msq_block"] for r in rows if r["optimizer"] == "micro_adam_msq"} == {
        "none", "tensor", "row",
    }  # fmt: skip
    assert {r["max_grad_norm"] for r in rows} == {"", str(experiments.PAPER_CLIP)}
    assert {c["method"] for c in summary["instability"]} == {r["method"] for r in rows}
    for r in rows:  # every run logs the fraction of mean-dominated coordinates
        if r["status"] == "ok":
            assert 0.0 <= float(r["final_frac_mean_dominated"]) <= 1.0
    assert (tmp_path / "precond.png").exists() == HAVE_PLOTS


def test_batch_scaling_and_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    scale = experiments.SCALES["smoke"]
    summary = smoke("batch-scaling", tmp_path)
    n = len(experiments.BATCH_POWER) * len(scale.batch_sizes) * len(scale.batch_lr_mults)
    rows = check_summary(tmp_path, n)
    for r in rows:  # a fixed number of examples: steps = examples / B
        assert int(r["examples"]) == scale.batch_examples
        b, lr, mult = int(r["batch_size"]), float(r["lr"]), float(r["lr_mult"])
        power = experiments.BATCH_POWER[r["optimizer"]]
        lr0 = scale.batch_lr0[r["optimizer"]]
        assert lr == pytest.approx(mult * lr0 * (b / scale.batch_base) ** power)
    table = summary["best_lr_per_batch"]
    assert len(table) == len(experiments.BATCH_POWER) * len(scale.batch_sizes)
    assert all(len(t["best_lr_mult_per_seed"]) == SEEDS for t in table)
    assert (tmp_path / "batch_scaling.png").exists() == HAVE_PLOTS

    # Re-running loads every program's traces from OUT/cache instead of training again.
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("trained again instead of reading the cache")

    monkeypatch.setattr(sweep, "run_group", refuse)
    again = smoke("batch-scaling", tmp_path)
    assert again["best_lr_per_batch"] == table
    assert read_csv(tmp_path / "summary.csv") == rows


def test_vectorize(tmp_path: Path):
    summary = smoke("vectorize", tmp_path)
    scale = experiments.SCALES["smoke"]
    assert summary["runs"] == scale.vectorize_runs
    assert summary["sequential_runs_timed"] == scale.vectorize_sequential
    assert summary["vectorized_runs_per_hour"] > 0 and summary["sequential_runs_per_hour"] > 0
    assert summary["max_final_loss_difference"] < 1e-4  # float32 here
    assert "runs/hour" in (tmp_path / "summary.md").read_text()


def test_overhead(tmp_path: Path):
    smoke("overhead", tmp_path)
    rows = read_csv(tmp_path / "summary.csv")
    assert rows and {"impl", "stats", "time_ratio", "memory_ratio"} <= set(rows[0])
    assert "factorized" in (tmp_path / "overhead.md").read_text()
    assert (tmp_path / "overhead.png").exists() == HAVE_PLOTS


def test_bad_names(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown experiment"):
        experiments.run("nope", scale="smoke", out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown scale"):
        experiments.run("sign", scale="huge", out=str(tmp_path))
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        experiments.run("sign", scale="smoke", out=str(tmp_path), seeds=0)


# --------------------------------------------------------------------------------------------
# sweep.py: the vectorized program equals the runs one by one.


def float64_run(out: Path | None = None, **overrides: Any) -> train.Config:
    base: dict[str, Any] = dict(
        model="mlp", size="tiny", batch_size=4, steps=4, warmup=2, eval_interval=2,
        eval_batches=2, log_interval=1, checkpoint_interval=100, dtype="float64",
    )  # fmt: skip
    return train.Config(**{**base, "out": None if out is None else str(out), **overrides})


@pytest.mark.parametrize(
    "optimizer, first, second",
    [  # two runs' own lr, seed and these hyperparameters
        ("micro_adam", {"max_grad_norm": 0.5}, {"max_grad_norm": 0.2, "b2": 0.99}),
        ("sign_ema", {"momentum": 0.8}, {"momentum": 0.5}),
    ],
)
def test_vectorized_sweep_equals_runs_one_by_one(
    tmp_path: Path, optimizer: str, first: dict, second: dict
):
    """One program of three runs, each with its own lr, seed and hyperparameters, one of them
    diverging (lr 1e200), against train.main run by run: losses at every step, held-out losses
    and final parameters to 1e-11 (the vmapped matmuls may sum in another order); the diverged
    run is recorded at the step train.main stops at, and its NaNs reach none of the others."""
    configs = [
        float64_run(optimizer=optimizer, lr=1e-2, seed=0, **first),
        float64_run(optimizer=optimizer, lr=3e-2, seed=1, **second),
        float64_run(optimizer=optimizer, lr=1e200, seed=2, **first),
    ]
    assert len(sweep.groups(configs)) == 1
    traces = sweep.run(configs)
    for i, (cfg, trace) in enumerate(zip(configs, traces, strict=True)):
        out = tmp_path / f"run{i}"
        try:
            train.main(dataclasses.replace(cfg, out=str(out)))
        except train.Diverged as err:
            step = int(re.search(r"(at step|of step) (\d+)", str(err)).group(2))  # pyright: ignore[reportOptionalMemberAccess]
            assert trace.status == "diverged" and trace.diverged_step == step
            assert np.isnan(trace.loss[step + 1 :]).all()
            continue
        assert trace.status == "ok"
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [m["loss"] for m in logged if "loss" in m]
        np.testing.assert_allclose(trace.loss, losses, rtol=1e-11, atol=0)
        evals = [m["eval_loss"] for m in logged if "eval_loss" in m]
        np.testing.assert_allclose(trace.eval_loss, evals, rtol=1e-11, atol=0)
        for key in sweep.DIAGNOSTICS:
            np.testing.assert_allclose(
                trace.diagnostics[key], [m[key] for m in logged if "loss" in m], rtol=1e-6
            )
        with np.load(out / "checkpoint.npz") as saved:
            for path, leaf in jax.tree_util.tree_leaves_with_path(trace.params):
                name = "['params']" + jax.tree_util.keystr(path)
                scale = np.abs(saved[name]).max()
                np.testing.assert_allclose(leaf, saved[name], rtol=0, atol=1e-11 * scale)
    assert [t.status for t in traces] == ["ok", "ok", "diverged"]


def test_groups_split_what_cannot_share_a_program():
    base = float64_run(optimizer="micro_adam")
    same = [
        base,
        dataclasses.replace(base, lr=0.5, seed=3, b1=0.8, b2=0.99, eps=1e-6),
        dataclasses.replace(base, out="elsewhere"),
    ]
    other = [
        dataclasses.replace(base, batch_size=8),  # other shapes
        dataclasses.replace(base, optimizer="adam"),  # another rule
        dataclasses.replace(base, max_grad_norm=1.0),  # clipping on: another program
        dataclasses.replace(base, steps=7),
    ]
    assert sweep.groups(same + other) == [[0, 1, 2], [3], [4], [5], [6]]
    with pytest.raises(ValueError, match="differ in more than"):
        sweep.run_group([base, other[0]])


# --------------------------------------------------------------------------------------------
# Helpers with known answers.


def test_count_spikes():
    losses = [5.0, 1.0, 3.0, 2.5, 1.0, 0.5, 0.9, 1.2, 1.1, float("nan")]
    # warmup 1: running min 1.0, then 3.0 and 2.5 (one spike), 0.5 -> 1.2 and 1.1 (another)
    assert experiments.count_spikes(losses, warmup=1) == 2
    assert experiments.count_spikes(losses[:2], warmup=0) == 0


def agg(per_seed: dict[int, float]) -> dict[str, Any]:
    return {"per_seed": per_seed, "lr": 1e-3}


@pytest.mark.parametrize(
    "a, b, starts",
    [
        ({0: 1.0, 1: 1.1, 2: 1.2}, {0: 1.5, 1: 1.6, 2: 1.7}, "consistent: A better than B"),
        ({0: 1.0, 1: 2.0, 2: 1.0}, {0: 1.1, 1: 1.0, 2: 1.1}, "no difference"),
        ({0: 1.0, 1: 1.0, 2: 1.3}, {0: 1.2, 1: 1.2, 2: 1.25}, "weak: A better than B"),
        ({0: 2.0, 1: 2.1}, {0: 1.0, 1: 1.0}, "consistent: B better than A"),
    ],
)
def test_compare(a: dict, b: dict, starts: str):
    verdict = experiments.compare(agg(a), agg(b), "A", "B")
    assert verdict["verdict"].startswith(starts), verdict["verdict"]
    assert verdict["seeds"] == len(a)
    assert experiments.compare(None, agg(b), "A", "B")["verdict"].startswith("no verdict")


def test_aggregate_and_best():
    rows = [
        {"method": "m", "lr": lr, "seed": s, "final_loss": loss, "spikes": 0,
         "status": "ok" if loss is not None else "diverged"}
        for lr, losses in ((1e-3, (1.0, 1.2)), (1e-2, (0.5, None)), (3e-3, (0.9, 0.9)))
        for s, loss in enumerate(losses)
    ]  # fmt: skip
    aggs = experiments.aggregate(rows, ("method", "lr"))
    by_lr = {a["lr"]: a for a in aggs}
    assert by_lr[1e-3]["mean"] == pytest.approx(1.1)
    assert by_lr[1e-3]["sd"] == pytest.approx(math.sqrt(0.02))
    assert by_lr[1e-2]["unstable"] and by_lr[1e-2]["mean"] is None and by_lr[1e-2]["diverged"] == 1
    assert experiments.best(aggs, ("method",))[("m",)]["lr"] == 3e-3  # 1e-2 had a diverged seed


def test_snr_prediction():
    # μ = 0 everywhere but one coordinate with a huge SNR: every rule aligns perfectly.
    mu2, sigma2 = np.array([0.0, 0.0, 4.0]), np.array([1.0, 1.0, 1e-12])
    pred = experiments.snr_prediction(mu2, sigma2, batch_size=16, momentum=0.9)
    assert all(pred[m] == pytest.approx(1.0) for m in experiments.SIGN_METHODS)
    # One coordinate, μ/σ = 0.1: erf(k·0.1/√2) with k = 1, √B, √(B·19).
    pred = experiments.snr_prediction(np.array([0.01]), np.array([1.0]), 16, 0.9)
    for m, k in (("micro_sign_sgd", 1.0), ("sign_sgd", 4.0), ("sign_ema", math.sqrt(16 * 19))):
        assert pred[m] == pytest.approx(math.erf(k * 0.1 / math.sqrt(2)), rel=1e-6)
    assert pred["frac_snr_gt_1_over_B"] == 0.0  # 0.01 < 1/16
