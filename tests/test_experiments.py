"""experiments.py at --scale smoke: every experiment runs end to end in seconds and writes its
summary files (and plots, where matplotlib is installed); the helpers are checked on small
inputs with known answers (spike counting, the SNR model's prediction)."""

import csv
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

import experiments

HAVE_PLOTS = importlib.util.find_spec("matplotlib") is not None


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_summary(out: Path, n_runs: int) -> list[dict[str, str]]:
    rows = read_csv(out / "summary.csv")
    assert len(rows) == n_runs
    assert set(rows[0]) == set(experiments.CSV_COLUMNS)
    for r in rows:
        assert r["status"] in ("ok", "diverged", "blew_up")
        if r["status"] != "diverged":
            assert math.isfinite(float(r["final_loss"]))
        assert (Path(r["run"]) / "metrics.jsonl").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == n_runs and summary["scale"] == "smoke"
    return rows


def test_sign(tmp_path: Path):
    scale = experiments.SCALES["smoke"]
    summary = experiments.run("sign", scale="smoke", out=str(tmp_path), seed=0)
    n = len(experiments.SIGN_METHODS) * len(scale.sign_lrs["mlp"])
    rows = check_summary(tmp_path, n)
    assert {r["method"] for r in rows} == set(experiments.SIGN_METHODS)
    snr = read_csv(tmp_path / "snr.csv")
    assert snr[0]["point"] == "init" and len(snr) >= 2
    for s in summary["snr_prediction"]:  # the later the sign, the larger k: a monotone order
        assert 0 <= s["micro_sign_sgd"] <= s["sign_sgd"] <= s["sign_ema"] <= 1
    assert (tmp_path / "sign.png").exists() == HAVE_PLOTS


def test_precond(tmp_path: Path):
    scale = experiments.SCALES["smoke"]
    summary = experiments.run("precond", scale="smoke", out=str(tmp_path), seed=0)
    n = len(experiments.ADAM_METHODS) * len(scale.precond_clips) * len(scale.precond_lrs["mlp"])
    rows = check_summary(tmp_path, n)
    assert {r["max_grad_norm"] for r in rows} == {"", str(experiments.PAPER_CLIP)}
    assert {c["method"] for c in summary["instability"]} == set(experiments.ADAM_METHODS)
    assert (tmp_path / "precond.png").exists() == HAVE_PLOTS


def test_batch_scaling(tmp_path: Path):
    scale = experiments.SCALES["smoke"]
    summary = experiments.run("batch-scaling", scale="smoke", out=str(tmp_path), seed=0)
    n = len(experiments.BATCH_POWER) * len(scale.batch_sizes) * len(scale.batch_lr_mults)
    rows = check_summary(tmp_path, n)
    for r in rows:  # a fixed number of examples: steps = examples / B
        assert int(r["examples"]) == scale.batch_examples
        b, lr = int(r["batch_size"]), float(r["lr"])
        power = experiments.BATCH_POWER[r["method"]]
        lr0 = scale.batch_lr0[r["method"]]
        assert lr == pytest.approx(lr0 * (b / scale.batch_base) ** power)
    assert len(summary["best_lr_per_batch"]) == len(rows)
    assert (tmp_path / "batch_scaling.png").exists() == HAVE_PLOTS

    # Re-running reuses the finished runs (their result.json) instead of training again.
    again = experiments.run("batch-scaling", scale="smoke", out=str(tmp_path), seed=0)
    assert again["best_lr_per_batch"] == summary["best_lr_per_batch"]
    assert read_csv(tmp_path / "summary.csv") == rows


def test_overhead(tmp_path: Path):
    experiments.run("overhead", scale="smoke", out=str(tmp_path), seed=0)
    rows = read_csv(tmp_path / "summary.csv")
    assert rows and {"impl", "stats", "time_ratio", "memory_ratio"} <= set(rows[0])
    assert "factorized" in (tmp_path / "overhead.md").read_text()
    assert (tmp_path / "overhead.png").exists() == HAVE_PLOTS


def test_bad_names(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown experiment"):
        experiments.run("nope", scale="smoke", out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown scale"):
        experiments.run("sign", scale="huge", out=str(tmp_path))


def test_count_spikes():
    losses = [5.0, 1.0, 3.0, 2.5, 1.0, 0.5, 0.9, 1.2, 1.1]
    records = [{"step": i, "loss": v} for i, v in enumerate(losses)]
    # warmup 1: running min 1.0, then 3.0 and 2.5 (one spike), 0.5 -> 1.2 and 1.1 (another)
    assert experiments.count_spikes(records, warmup=1) == 2
    assert experiments.count_spikes(records[:2], warmup=0) == 0


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
