"""experiments.py and sweep.py. The selection protocol is checked on synthetic losses with
known answers (sweep.run replaced by a table): lrs are chosen on the selection seeds only and
scored on the evaluation seeds; a grid grows until its best lr is interior; an lr left at an edge
marks its verdicts; choosing on the evaluation seeds themselves gives another verdict than the
held-out choice where the data say so. Every study runs end to end at --scale smoke and writes
its summary files with its provenance; a committed summary's command parses with today's CLI,
its commit is in this branch's history and its rows use the seeds it records. A vectorized
sweep equals the same runs trained one by one by train.main (float64, to ~1e-12). No function
of experiments.py and studies/ is longer than FUNCTION_LINES (issue 51: a study is read in
pieces), no file of them longer than FILE_LINES, and every module of studies/ registers one study
with its usage, its settings at every scale and a test that runs it (issue 58)."""

import ast
import csv
import dataclasses
import importlib.util
import json
import math
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
import pytest

import experiments
import plots
import studies
import studies.protocol
import sweep
import train

HAVE_PLOTS = importlib.util.find_spec("matplotlib") is not None
ROOT = Path(__file__).resolve().parent.parent
SELECT, EVALUATE = (0, 1), (2, 3)  # the smoke scale's defaults


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------------------------
# The protocol on synthetic losses: sweep.run replaced by a table of final losses.

Table = Callable[[train.Config], float | None]  # a run's config -> its final loss (None: NaN)


def fake_sweep(
    monkeypatch: pytest.MonkeyPatch, table: Table, max_steps: int | None = None
) -> list[train.Config]:
    """sweep.run returns traces whose final held-out loss is table(config) (None: diverged),
    at most `max_steps` long; returns the list of every config it was asked to train."""
    asked: list[train.Config] = []

    def run(configs: Sequence[train.Config], **_: Any) -> list[sweep.Trace]:
        asked.extend(configs)
        out = []
        for c in configs:
            final = table(c)
            length = c.steps if max_steps is None else min(c.steps, max_steps)
            steps = np.full(length, 1.0 if final is None else final)
            out.append(
                sweep.Trace(
                    cfg=c,
                    loss=steps,
                    diagnostics={k: np.zeros(length) for k in sweep.DIAGNOSTICS},
                    eval_steps=np.array([0, c.steps]),
                    eval_loss=np.array([10.0, np.nan if final is None else final]),
                    diverged_step=0 if final is None else None,
                    params=None,
                    seconds=0.0,
                )
            )
        return out

    monkeypatch.setattr(sweep, "run", run)
    return asked


def variant(label: str, optimizer: str, lrs: Sequence[float]) -> experiments.Variant:
    cfg = dataclasses.replace(experiments.SCALES["smoke"]["shared"].mlp, optimizer=optimizer)
    return experiments.Variant(label, cfg, tuple(lrs))


def bowl(best_lr: float, floor: float = 1.0) -> Callable[[float, int], float]:
    """A loss minimal at best_lr, quadratic in log10(lr), with a small seed offset."""
    return lambda lr, seed: floor + (math.log10(lr) - math.log10(best_lr)) ** 2 + 0.001 * seed


def test_grid_grows_until_the_best_lr_is_interior(monkeypatch: pytest.MonkeyPatch, tmp_path):
    loss = bowl(0.027)
    asked = fake_sweep(monkeypatch, lambda c: loss(c.lr, c.seed))
    proto = experiments.Protocol(SELECT, EVALUATE)
    study = experiments.tune_and_score(
        "t", [variant("A", "adam", (1e-3, 3e-3))], {"A": ["A"]}, proto, tmp_path, max_extensions=3
    )
    rec = study.variants["A"]
    assert rec["extended_with"] == [0.009, 0.027, 0.081]  # the grid's own step, 3×
    assert rec["edge"] is None and rec["chosen"]["lr"] == 0.027
    # Selection ran on the selection seeds only; the evaluation seeds at the chosen lr only.
    select = [c for c in asked if c.seed in SELECT]
    assert {c.lr for c in select} == {1e-3, 3e-3, 0.009, 0.027, 0.081}
    assert sorted((c.lr, c.seed) for c in asked if c.seed not in SELECT) == [(0.027, 2), (0.027, 3)]
    assert study.held["A"]["per_seed"] == {2: pytest.approx(1.002), 3: pytest.approx(1.003)}
    assert {r["phase"] for r in study.runs.rows if r["seed"] in EVALUATE} == {"evaluate"}


def test_a_best_lr_left_at_an_edge_marks_its_verdicts(monkeypatch: pytest.MonkeyPatch, tmp_path):
    fake_sweep(monkeypatch, lambda c: bowl(1.0 if c.optimizer == "adam" else 3e-3)(c.lr, c.seed))
    proto = experiments.Protocol(SELECT, EVALUATE)
    variants = [variant("A", "adam", (1e-3, 3e-3)), variant("B", "micro_adam", (1e-3, 3e-3, 1e-2))]
    study = experiments.tune_and_score(
        "t", variants, {"A": ["A"], "B": ["B"]}, proto, tmp_path, max_extensions=1
    )
    assert study.variants["A"]["extended_with"] == [0.009]
    assert study.variants["A"]["edge"] == "top"  # still the best, one extension allowed
    assert study.variants["B"]["edge"] is None and study.variants["B"]["extended_with"] == []
    (v,) = experiments.verdicts_of(study, [("A", "B")])
    assert v["edge"] and experiments.EDGE in v["verdict"]


def test_no_finished_lr_grows_the_grid_downwards(monkeypatch: pytest.MonkeyPatch, tmp_path):
    fake_sweep(monkeypatch, lambda c: None if c.lr > 2e-3 else bowl(1e-4)(c.lr, c.seed))
    study = experiments.tune_and_score(
        "t",
        [variant("A", "adam", (3e-3, 1e-2))],
        {"A": ["A"]},
        experiments.Protocol(SELECT, EVALUATE),
        tmp_path,
        3,
    )
    rec = study.variants["A"]
    assert rec["extended_with"][0] == 0.0009  # nothing finished: one step down
    assert rec["chosen"] is not None and rec["chosen"]["lr"] < 2e-3


# Choosing on the evaluation seeds flatters A (its lr 1e-3 is lucky on seeds 3..5); the lr
# chosen on seeds 0..2 (1e-2) is what A is worth on seeds it was not tuned on: B is better.
LUCKY = {  # (optimizer, lr) -> final loss per seed 0..5
    ("adam", 1e-3): (2.0, 2.01, 2.02, 1.0, 1.01, 1.03),
    ("adam", 1e-2): (1.2, 1.21, 1.22, 1.6, 1.62, 1.61),
    ("micro_adam", 1e-3): (1.5, 1.51, 1.52, 1.5, 1.51, 1.505),
}


def lucky(c: train.Config) -> float | None:
    key = (c.optimizer, c.lr)
    return LUCKY[key][c.seed] if key in LUCKY else 9.0  # 9: an lr worse than any


def test_held_out_selection_gives_another_verdict_than_choosing_on_the_evaluation_seeds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    fake_sweep(monkeypatch, lucky)
    variants = [
        variant("A", "adam", (1e-4, 1e-3, 1e-2, 1e-1)),
        variant("B", "micro_adam", (1e-4, 1e-3, 1e-2)),
    ]
    families = {"A": ["A"], "B": ["B"]}
    # The old protocol: lrs chosen and scored on the same seeds (3, 4, 5).
    same = experiments.tune_and_score(
        "t", variants, families, experiments.Protocol((3, 4, 5), ()), tmp_path, 0
    )
    (old,) = [experiments.compare(same.same_seed["A"], same.same_seed["B"], "A", "B")]
    assert old["verdict"].startswith("consistent: A better than B")
    # Held out: chosen on 0, 1, 2, scored on 3, 4, 5.
    held = experiments.tune_and_score(
        "t", variants, families, experiments.Protocol((0, 1, 2), (3, 4, 5)), tmp_path, 0
    )
    assert held.held["A"]["lr"] == 1e-2 and held.held["B"]["lr"] == 1e-3
    (v,) = experiments.verdicts_of(held, [("A", "B")])
    assert v["verdict"].startswith("consistent: B better than A"), v["verdict"]
    assert v["same_seed_verdict"].startswith("consistent: A better than B")  # on 0, 1, 2 A wins
    lo, hi = v["ci95"]
    assert 0 < lo < v["mean_diff"] < hi


def test_leave_one_seed_out_scores_each_seed_at_the_others_choice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    table = {
        (1e-3, 0): 1.0,
        (1e-3, 1): 3.0,
        (1e-3, 2): 3.0,
        (1e-2, 0): 2.0,
        (1e-2, 1): 1.9,
        (1e-2, 2): 1.9,
    }
    fake_sweep(monkeypatch, lambda c: table.get((c.lr, c.seed), 9.0))
    variants = [variant("A", "adam", (1e-4, 1e-3, 1e-2, 1e-1))]
    study = experiments.tune_and_score(
        "t", variants, {"A": ["A"]}, experiments.Protocol((0, 1, 2), ()), tmp_path, 0
    )
    # Seed 0 is scored at the lr seeds 1, 2 prefer (1e-2: 2.0), not at its own best (1e-3: 1.0).
    assert study.held["A"]["lr_per_seed"] == {0: 1e-2, 1: 1e-2, 2: 1e-2}
    assert study.held["A"]["per_seed"] == {0: 2.0, 1: 1.9, 2: 1.9}
    assert experiments.leave_one_out(study.runs.rows, ["A"], (0, 1, 2))[0] == ("A", 1e-2, 2.0)


def test_a_family_chooses_its_member_on_the_selection_seeds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """MicroAdamMSQ at two ε is one family: the member and lr best on the selection seeds are
    scored, although the other member would have won on the evaluation seeds."""

    def table(c: train.Config) -> float:  # ε 1e-8: good on 0, 1, bad on 2, 3; ε 1e-2: middling
        floor = (1.0 if c.seed in SELECT else 2.0) if c.eps == 1e-8 else 1.5
        return bowl(3e-3, floor)(c.lr, c.seed)

    fake_sweep(monkeypatch, table)
    base = experiments.SCALES["smoke"]["shared"].mlp
    msq = [
        experiments.Variant(
            f"e{e:g}",
            dataclasses.replace(base, optimizer="micro_adam_msq", eps=e),
            (1e-3, 3e-3, 1e-2),
        )
        for e in (1e-8, 1e-2)
    ]
    study = experiments.tune_and_score(
        "t", msq, {"msq": ["e1e-08", "e0.01"]}, experiments.Protocol(SELECT, EVALUATE), tmp_path, 0
    )
    assert study.held["msq"]["member"] == "e1e-08" and study.held["msq"]["lr"] == 3e-3
    assert study.held["msq"]["per_seed"] == {2: pytest.approx(2.002), 3: pytest.approx(2.003)}


@pytest.mark.parametrize(
    "text, seeds",
    [
        ("3,4,5", (3, 4, 5)),
        ("3-7", (3, 4, 5, 6, 7)),
        ("0,2,5-6", (0, 2, 5, 6)),
        ("7,", (7,)),
        ("1,1,2", (1, 2)),
    ],
)
def test_parse_seeds(text: str, seeds: tuple[int, ...]):
    assert experiments.parse_seeds(text) == seeds


@pytest.mark.parametrize(
    "text, match",
    [
        ("5", "give the seeds themselves"),
        ("a,b", "cannot read"),
        ("5-3", "empty range"),
        ("", "one or more"),
    ],
)
def test_parse_seeds_refuses(text: str, match: str):
    with pytest.raises(ValueError, match=match):
        experiments.parse_seeds(text)


def test_protocols(tmp_path: Path):
    scale = experiments.SCALES["smoke"]["shared"]
    default = experiments.make_protocol(None, None, None, scale)
    assert (default.name, default.select, default.evaluate) == ("held-out", SELECT, EVALUATE)
    assert experiments.make_protocol((4, 5, 6), None, None, scale).name == "leave-one-seed-out"
    with pytest.raises(ValueError, match="disjoint"):
        experiments.make_protocol((1, 2), (0, 1), None, scale)
    with pytest.raises(ValueError, match="two or more"):
        experiments.make_protocol((4,), None, None, scale)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"chosen": [{"family": "A", "method": "A", "lr": 0.01}]}))
    fixed = experiments.make_protocol((8, 9), None, str(summary), scale)
    assert (fixed.name, fixed.fixed, fixed.evaluate) == ("fixed", (("A", "A", 0.01),), (8, 9))
    with pytest.raises(ValueError, match="no --select-seeds"):
        experiments.make_protocol((8, 9), (0,), str(summary), scale)


# --------------------------------------------------------------------------------------------
# The studies at --scale smoke: their files, seeds and provenance.


def check_files(out: Path, name: str) -> tuple[list[dict[str, str]], dict[str, Any]]:
    rows = read_csv(out / "summary.csv")
    assert rows and set(rows[0]) == set(experiments.CSV_COLUMNS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == name and summary["scale"] == "smoke"
    assert len(summary["runs"]) == len(rows)
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{summary['git_commit']}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
    )
    assert known.returncode == 0  # the commit it names is in this repository (HEAD at the run)
    assert summary["command"].startswith(f"python experiments.py {name} --scale smoke")
    text = (out / "summary.md").read_text()
    assert summary["command"] in text and "Protocol:" in text
    for r in rows:  # each phase on its own seeds
        assert r["status"] in ("ok", "diverged", "blew_up")
        seeds = (
            summary["selection_seeds"] if r["phase"] == "select" else summary["evaluation_seeds"]
        )
        assert int(r["seed"]) in seeds
    curves = __import__("plots").read_traces(out / "traces.csv.gz")
    assert {(r["method"], float(r["lr"]), int(r["seed"])) for r in rows} == set(curves)
    assert (out / f"{name}.png").exists() == HAVE_PLOTS
    return rows, summary


def smoke(name: str, out: Path, **kw: Any) -> dict[str, Any]:
    return experiments.run(name, scale="smoke", out=str(out), cache=str(out.parent / "cache"), **kw)


def test_sign_and_its_recheck_on_unseen_seeds(tmp_path: Path):
    summary = smoke("sign", tmp_path / "sign")
    rows, data = check_files(tmp_path / "sign", "sign")
    assert {r["optimizer"] for r in rows} == set(experiments.SIGN_METHODS)
    assert {int(r["seed"]) for r in rows if r["phase"] == "evaluate"} <= set(EVALUATE)
    assert data["protocol"] == "held-out" and summary["selection_seeds"] == list(SELECT)
    for s in data["snr"]:  # the later the sign, the larger k: a monotone order
        assert 0 <= s["micro_sign_sgd"] <= s["sign_sgd"] <= s["sign_ema"] <= 1
    assert len(data["verdicts"]) == 3 and all("same_seed_verdict" in v for v in data["verdicts"])
    # The re-check: the committed lrs on seeds never seen, no selection.
    again = smoke(
        "sign", tmp_path / "recheck", seeds=(7, 8), lrs_from=str(tmp_path / "sign" / "summary.json")
    )
    rows, data = check_files(tmp_path / "recheck", "sign")
    assert data["protocol"] == "fixed" and {int(r["seed"]) for r in rows} == {7, 8}
    chosen = {c["family"]: c["lr"] for c in summary["chosen"]}
    assert {c["family"]: c["lr"] for c in again["chosen"]} == chosen
    assert "--lrs-from" in data["command"] and "--seeds 7,8" in data["command"]


def test_precond_measures_the_mean_to_noise_ratio_per_regime(tmp_path: Path):
    precond = experiments.SCALES["smoke"]["precond"]
    smoke("precond", tmp_path / "p")
    rows, data = check_files(tmp_path / "p", "precond")
    regimes = {r for r, _, _ in precond.regimes}
    assert {r["regime"] for r in rows} == regimes
    assert {r["regime"] for r in data["mu2_over_sigma2"]} == regimes
    for r in data["mu2_over_sigma2"]:
        assert r["median_mu2_over_sigma2"] >= 0 and 0 <= r["frac_mu2_gt_sigma2"] <= 1
        assert r["per_leaf_median"]
    assert len(data["verdicts"]) == 3 * len(regimes)


def test_msq_sweeps_eps_and_clipping_has_an_adam_control(tmp_path: Path):
    eps, clipping = experiments.SCALES["smoke"]["msq"].eps, experiments.SCALES["smoke"]["clipping"]
    smoke("msq", tmp_path / "msq")
    rows, data = check_files(tmp_path / "msq", "msq")
    msq = [r for r in rows if r["optimizer"] == "micro_adam_msq"]
    # ε outside the root (the paper's √ReLU(v̂) + ε) and inside it (√(ReLU(v̂) + ε)), same grid.
    # ...and v̂ averaged over the leaf or a row before the ReLU, ε outside.
    unblocked = [r for r in msq if r["msq_block"] == "none"]
    outside = {float(r["eps"]) for r in unblocked if r["eps_root"] == ""}  # None: no ε_root
    inside = {float(r["eps_root"]) for r in unblocked if float(r["eps"]) == 0.0}
    assert outside == inside == set(eps)
    for block in ("tensor", "row"):
        blocked = [r for r in msq if r["msq_block"] == block]
        assert {float(r["eps"]) for r in blocked} == set(eps)
        assert all(r["eps_root"] == "" for r in blocked)
    arms = ("outside", "inside", "tensor", "row")
    assert [(p["placement"], p["eps"]) for p in data["per_eps"]] == [
        (arm, e) for arm in arms for e in eps
    ]
    outside_family, *others = (arm.family for arm in experiments.MSQ_ARMS)
    assert [(v["a"], v["b"]) for v in data["verdicts"]] == [
        (family, "Adam") for family in (outside_family, *others)
    ] + [(family, outside_family) for family in others]
    assert all(0 <= f <= 1 for f in data["frac_mu2_nonpositive_at_step_1"])
    smoke("clipping", tmp_path / "clipping")
    rows, data = check_files(tmp_path / "clipping", "clipping")
    clipped = {(r["optimizer"], r["max_grad_norm"]) for r in rows}
    for c in clipping.thresholds:
        assert ("adam", str(c)) in clipped and ("micro_adam", str(c)) in clipped
    assert any(v["b"] == "MicroAdam − Adam, unclipped" for v in data["verdicts"])


def test_batch_scaling_arms_and_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bs = experiments.SCALES["smoke"]["batch-scaling"][0]  # the default task's
    summary = smoke("batch-scaling", tmp_path / "bs")
    rows, _ = check_files(tmp_path / "bs", "batch-scaling")
    for r in rows:  # a fixed number of examples; β₂'s half-life fixed in examples in one arm
        assert int(r["examples"]) == bs.examples
        b = int(r["batch_size"])
        ref = 0.999 ** (b / bs.base) if "half-life" in r["arm"] else 0.999
        assert float(r["b2"]) == pytest.approx(ref)
    assert len(summary["fits"]) == len(experiments.BATCH_POWER) * len(experiments.ARMS)
    for f in summary["fits"]:
        assert f["exponent"] is None or f["ci95"][0] <= f["ci95"][1]
        assert f["seeds"] == list(EVALUATE)  # the fit comes from the evaluation seeds
    for t in summary["best_lr_per_batch"]:  # each chosen lr and its neighbours, evaluated
        if t["best_lr"] is not None:
            assert t["best_lr"] in t["eval_lrs"] and set(t["eval_lrs"]) <= set(t["grid"])
            ran = {
                (float(r["lr"]), int(r["seed"]))
                for r in rows
                if r["phase"] == "evaluate" and r["method"].endswith(f"B={t['batch_size']}")
            }
            assert {(lr, s) for lr in t["eval_lrs"] for s in EVALUATE} <= ran

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("trained again instead of reading the cache")

    monkeypatch.setattr(sweep, "run_group", refuse)
    again = smoke("batch-scaling", tmp_path / "bs")
    assert again["best_lr_per_batch"] == summary["best_lr_per_batch"]


def test_batch_scaling_exponent_from_evaluation_seeds_on_constructed_losses():
    # Losses quadratic in log lr with the optimum at lr* = 0.01·(B/4)^0.75 plus per-seed noise:
    # the vertex recovers lr* between grid points, the fit 0.75 (not a multiple of the 2×
    # grid's step), and the seed bootstrap gives an interval around it.
    rng = np.random.default_rng(1)
    brackets = []
    for b in (4, 8, 16, 32):
        star = 0.01 * (b / 4) ** 0.75
        c = 0.01 * 2.0 ** round(math.log2(star / 0.01))  # the grid point nearest lr*
        lrs = (c / 2, c, 2 * c)
        noise = rng.normal(0, 0.002, (1, 5))
        losses = np.array([[(math.log(x / star)) ** 2 for x in lrs]]).T + noise
        brackets.append(experiments.Bracket(b, lrs, losses))
        v = experiments.lr_vertex(lrs, losses.mean(axis=1).tolist())
        assert v is not None and v[0] == pytest.approx(star, rel=1e-9) and not v[1]
    point, found = experiments.eval_exponent(brackets, range(5))
    assert point == pytest.approx(0.75) and not any(end for _, end in found.values())
    # An end of the bracket is flagged; a seed that did not finish drops its lr.
    assert experiments.lr_vertex((1.0, 2.0, 4.0), (3.0, 2.0, 1.0)) == (4.0, True)
    assert experiments.lr_vertex((1.0, 2.0, 4.0), (2.0, 1.0, math.nan)) == (2.0, True)
    assert experiments.lr_vertex((1.0, 2.0), (math.nan, math.nan)) is None
    # Symmetric neighbours: the vertex is the middle point.
    assert experiments.lr_vertex((1.0, 2.0, 4.0), (2.0, 1.0, 2.0)) == (pytest.approx(2.0), False)
    noisy = [
        experiments.Bracket(b, (b / 2, b, 2 * b), np.array([[1.0] * 3, [0.0] * 3, [1.0] * 3]))
        for b in (4, 8)
    ]
    noisy[1].losses[0, 0] = 2.0  # seed 0 alone pulls B 8's vertex up
    boot = [
        experiments.eval_exponent(noisy, r)[0] or 0.0 for r in ([0, 0, 0], [1, 2, 1], [0, 1, 2])
    ]
    assert boot[0] > boot[2] > boot[1] == pytest.approx(1.0)


def test_batch_scaling_runs_on_the_task_asked_for(tmp_path: Path):
    # --task lm: the LM with the scale's LM settings, and the summary names the task.
    summary = smoke("batch-scaling", tmp_path / "bs-lm", task="lm")
    rows, data = check_files(tmp_path / "bs-lm", "batch-scaling")
    (lm,) = [s for s in experiments.SCALES["smoke"]["batch-scaling"] if s.task == "lm"]
    assert data["task"] == "lm" and "--task lm" in summary["command"]
    assert {r["task"] for r in rows} == {"lm"}
    assert {int(r["batch_size"]) for r in rows} == set(lm.batch_sizes)
    # A scale without settings for the other task refuses before it trains or writes anything.
    with pytest.raises(ValueError, match="no batch-scaling settings for task 'mlp'"):
        experiments.run("batch-scaling", scale="small", out=str(tmp_path / "x"), task="mlp")
    assert not (tmp_path / "x").exists()


def test_vectorize(tmp_path: Path):
    summary = smoke("vectorize", tmp_path / "v")
    settings = experiments.SCALES["smoke"]["vectorize"]
    assert summary["runs"] == settings.runs
    assert summary["sequential_runs_timed"] == settings.sequential
    assert summary["max_final_loss_difference"] < 1e-4  # float32 here
    assert "runs/hour" in (tmp_path / "v" / "summary.md").read_text()


def test_overhead(tmp_path: Path):
    smoke("overhead", tmp_path / "o")
    rows = read_csv(tmp_path / "o" / "summary.csv")
    assert rows and {"impl", "stats", "time_ratio", "memory_ratio"} <= set(rows[0])
    assert "factorized" in (tmp_path / "o" / "overhead.md").read_text()


def test_bad_names(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown experiment"):
        experiments.run("nope", scale="smoke", out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown scale"):
        experiments.run("sign", scale="huge", out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown task"):
        experiments.run("sign", scale="smoke", out=str(tmp_path), task="cnn")


# --------------------------------------------------------------------------------------------
# The committed results: each regenerates from the command and commit recorded beside it.

COMMITTED = sorted((ROOT / "results").rglob("summary.json"))  # re-checks (results/recheck) too


@pytest.mark.parametrize(
    "path", COMMITTED, ids=lambda p: str(p.parent.relative_to(ROOT / "results"))
)
def test_a_committed_summary_records_what_regenerates_it(
    path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(ROOT)  # a command's paths (--lrs-from) are relative to the repository
    data = json.loads(path.read_text())
    if "command" not in data:  # bench's and overhead's tables, not seeded studies
        assert data["experiment"] not in experiments.TRAINING
        return
    argv = shlex.split(data["command"])
    assert argv[:2] == ["python", "experiments.py"]
    args = experiments.cli().parse_args(argv[2:])
    assert args.name == data["experiment"] and args.scale == data["scale"]
    assert not data["code_differs_from_commit"]
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{data['git_commit']}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    assert known.returncode == 0, f"{data['git_commit']} is not in this repository's history"
    proto = experiments.make_protocol(
        None if args.seeds is None else experiments.parse_seeds(args.seeds),
        None if args.select_seeds is None else experiments.parse_seeds(args.select_seeds),
        args.lrs_from,
        experiments.SCALES[args.scale]["shared"],
    )
    assert list(proto.select) == data["selection_seeds"]
    assert list(proto.evaluate) == data["evaluation_seeds"]
    for r in data["runs"]:
        seeds = proto.select if r["phase"] == "select" else proto.evaluate
        assert r["seed"] in seeds
    if (path.parent / "traces.csv.gz").exists():
        curves = __import__("plots").read_traces(path.parent / "traces.csv.gz")
        assert {(r["method"], r["lr"], r["seed"]) for r in data["runs"]} == set(curves)


# --------------------------------------------------------------------------------------------
# sweep.py: the vectorized program equals the runs one by one.


def float64_run(out: Path | None = None, **overrides: Any) -> train.Config:
    base: dict[str, Any] = dict(
        model="mlp",
        size="tiny",
        batch_size=4,
        steps=4,
        warmup=2,
        eval_interval=2,
        eval_batches=2,
        log_interval=1,
        checkpoint_interval=100,
        dtype="float64",
    )
    return train.Config(**{**base, "out": None if out is None else str(out), **overrides})


@pytest.mark.parametrize(
    "optimizer, first, second",
    [  # two runs' own lr, seed and these hyperparameters
        ("micro_adam", {"max_grad_norm": 0.5}, {"max_grad_norm": 0.2, "b2": 0.99}),
        ("sign_ema", {"momentum": 0.8}, {"momentum": 0.5}),
        ("micro_adam_msq", {"eps": 0.0, "eps_root": 1e-2}, {"eps": 1e-3, "eps_root": 1e-4}),
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
        for key in sweep.DIAGNOSTICS:  # B_P's parts: the Adam family's, null at step 0 (NaN)
            want = [np.nan if m.get(key) is None else m[key] for m in logged if "loss" in m]
            np.testing.assert_allclose(trace.diagnostics[key], want, rtol=1e-6)
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
    rng = np.random.default_rng(0)
    calm = list(1.0 + 0.1 * rng.standard_normal(200))  # noise alone: its minimum is ~0.7
    assert experiments.count_spikes(calm, warmup=10) == 0
    burst = calm[:100] + [3.0, 3.2, 2.9] + calm[103:150] + [5.0] + calm[151:]
    assert experiments.count_spikes(burst, warmup=10) == 2  # 3 steps in a row are one
    stays_up = calm[:100] + [4.0] * 100  # a jump that stays: one long spike
    assert experiments.count_spikes(stays_up, warmup=10) == 1
    assert experiments.count_spikes(burst[:101], warmup=101) == 0  # in warmup: not counted
    assert experiments.count_spikes([*calm[:50], float("nan"), 3.0], warmup=0) == 1


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


def t_ratio(d: Sequence[float]) -> float:
    """|mean| / se of paired differences."""
    x = np.asarray(d)
    return abs(x.mean()) / (x.std(ddof=1) / math.sqrt(len(x)))


def test_consistent_means_the_interval_excludes_zero_and_every_seed_agrees():
    """The one verdict rule on constructed differences: consistent iff the 95 % t-interval
    excludes 0 (t with n − 1 degrees of freedom) and all seeds agree. The old rule (all agree,
    |mean| > 2·se) called more consistent below n = 62 and fewer from there on."""
    passes_old_only = [0.1, 0.1, 0.1, 0.1, 0.5]  # 5/5 agree, mean/se 2.25: 2 < 2.25 < 2.78
    assert 2 < t_ratio(passes_old_only) < experiments.t975(4)
    assert experiments.strength(passes_old_only) == "weak"
    verdict = experiments.compare(
        {"per_seed": dict(enumerate(passes_old_only))},
        {"per_seed": dict.fromkeys(range(5), 0.0)},
        "A",
        "B",
    )
    assert verdict["verdict"].startswith("weak: B better than A by 0.1800 (5/5 seeds agree")
    lo, hi = verdict["ci95"]
    assert lo < 0 < hi  # ...because its interval holds 0
    passes_new_only = [0.00414] * 97 + [1.0] * 3  # 100/100 agree, mean/se 1.992: t(99) = 1.984
    assert experiments.t975(99) < t_ratio(passes_new_only) < 2
    assert experiments.strength(passes_new_only) == "consistent"
    four_of_five = [1.0, 1.0, 1.0, 1.0, -0.1]  # the interval excludes 0; one seed disagrees
    assert t_ratio(four_of_five) > experiments.t975(4)
    assert experiments.strength(four_of_five) == "weak"
    assert experiments.strength([0.5, 0.4, 0.6]) == "consistent"
    assert experiments.strength([0.5, -0.5, 0.1]) == "no difference"
    assert experiments.strength([0.3]) == "no difference"  # one seed: no interval


# --------------------------------------------------------------------------------------------
# The run cache: keyed by config and by the version of the code that trains it.


def fake_group(configs: Sequence[train.Config], **_: Any) -> list[sweep.Trace]:
    """run_group without training: real parameters (the cache's template), made-up curves."""
    return [
        sweep.Trace(
            cfg=c,
            loss=np.full(c.steps, 0.5),
            diagnostics={k: np.zeros(c.steps) for k in sweep.DIAGNOSTICS},
            eval_steps=np.array([0, c.steps]),
            eval_loss=np.array([1.0, 0.5]),
            diverged_step=None,
            params=train.build(c).task.params,
            seconds=0.0,
            code=sweep.code_version(c),
        )
        for c in configs
    ]


def test_a_cached_run_is_reused_only_by_the_code_that_trained_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    trained: list[train.Config] = []
    monkeypatch.setattr(sweep, "run_group", lambda cs, **kw: trained.extend(cs) or fake_group(cs))
    configs = [float64_run(lr=1e-2, seed=0), float64_run(lr=1e-2, seed=1)]
    version = "aaaa"
    monkeypatch.setattr(sweep, "code_version", lambda cfg: version)
    assert [t.code for t in sweep.run(configs, cache=tmp_path)] == ["aaaa", "aaaa"]
    assert len(trained) == 2
    assert [t.code for t in sweep.run(configs, cache=tmp_path)] == ["aaaa", "aaaa"]
    assert len(trained) == 2  # the same code: read from the cache
    version = "bbbb"
    assert [t.code for t in sweep.run(configs, cache=tmp_path)] == ["bbbb", "bbbb"]
    assert len(trained) == 4  # other code: trained again, never reused
    # An entry from before code versions were recorded is read, and labelled unknown (None)...
    old = tmp_path / "old"
    sweep.save(old / "x.npz", fake_group([float64_run(lr=3e-2)]))
    with np.load(old / "x.npz") as z:
        np.savez(old / "x.npz", **{k: z[k] for k in z.files if k != "code"})
    version = "cccc"
    assert sweep.run([float64_run(lr=3e-2)], cache=old)[0].code is None
    assert len(trained) == 4
    # ...and this code's entry, once there is one, is preferred to it.
    sweep.save(old / "y.npz", fake_group([float64_run(lr=3e-2)]))
    assert sweep.run([float64_run(lr=3e-2)], cache=old)[0].code == "cccc"


def test_a_summary_says_when_it_mixes_runs_from_different_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """Selection runs from an old cache entry (unknown version), evaluation runs by this code:
    summary.md says it mixes them and counts each version's runs per variant."""
    loss = bowl(0.01)
    fake_sweep(monkeypatch, lambda c: loss(c.lr, c.seed))
    unlabelled = sweep.run

    def labelled(configs: Sequence[train.Config], **kw: Any) -> list[sweep.Trace]:
        traces = unlabelled(configs, **kw)
        for t in traces:
            t.code = None if t.cfg.seed in SELECT else "new5678"
        return traces

    monkeypatch.setattr(sweep, "run", labelled)
    monkeypatch.setattr(sweep, "code_version", lambda cfg: "new5678")
    proto = experiments.Protocol(SELECT, EVALUATE)
    study = experiments.tune_and_score(
        "t", [variant("A", "adam", (3e-3, 1e-2, 3e-2))], {"A": ["A"]}, proto, tmp_path, 0
    )
    prov = experiments.provenance("t", "smoke", tmp_path, proto, tmp_path / "cache")
    summary = experiments.write_study(tmp_path, "t", "T", study, [], prov)
    assert summary["code"]["mixed"]
    assert summary["code"]["runs_by_code"] == {"unknown": 6, "new5678": 2}
    text = (tmp_path / "summary.md").read_text()
    assert "**Mixes runs from different code**" in text
    assert "2 by this code (new5678); 6 by an unknown version" in text and ": A 6" in text
    assert {r["code"] for r in read_csv(tmp_path / "summary.csv")} == {"unknown", "new5678"}
    # One version throughout: one line that says which.
    for r in study.runs.rows:
        r["code"] = "new5678"
    summary = experiments.write_study(tmp_path, "t", "T", study, [], prov)
    assert not summary["code"]["mixed"]
    assert (
        "every run trained by this code, version new5678" in (tmp_path / "summary.md").read_text()
    )


def test_aggregate_and_best():
    rows = [
        {
            "method": "m",
            "lr": lr,
            "seed": s,
            "final_loss": loss,
            "spikes": 0,
            "status": "ok" if loss is not None else "diverged",
        }
        for lr, losses in ((1e-3, (1.0, 1.2)), (1e-2, (0.5, None)), (3e-3, (0.9, 0.9)))
        for s, loss in enumerate(losses)
    ]
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


def test_only_keeps_the_named_variants(tmp_path: Path):
    summary = smoke("sign", tmp_path / "s", only=("SignSGD", "SignEMA"))
    rows, data = check_files(tmp_path / "s", "sign")
    assert {r["method"] for r in rows} == {"SignSGD", "SignEMA"}
    assert [(v["a"], v["b"]) for v in data["verdicts"]] == [("SignEMA", "SignSGD")]
    assert "--only SignSGD --only SignEMA" in summary["command"]
    assert experiments.cli().parse_args(shlex.split(summary["command"])[2:]).only == [
        "SignSGD",
        "SignEMA",
    ]
    with pytest.raises(ValueError, match="not among"):
        smoke("sign", tmp_path / "t", only=("Adam",))


def test_windows_measures_the_mean_to_noise_ratio_per_window_length(tmp_path: Path):
    windows = experiments.SCALES["smoke"]["windows"]
    smoke("windows", tmp_path / "w")
    data = json.loads((tmp_path / "w" / "summary.json").read_text())
    points = {(r["window"], r["point"], r["seed"]) for r in data["mu2_over_sigma2"]}
    expected = {(w, "init", s) for w in windows.lengths for s in EVALUATE}
    expected |= {(w, "final Adam", s) for w in windows.trained for s in EVALUATE}
    assert points == expected
    for r in data["mu2_over_sigma2"]:
        assert r["median_mu2_over_sigma2"] >= 0 and 0 <= r["frac_mu2_gt_sigma2"] <= 1
        assert (r["final_loss"] is None) == (r["point"] == "init")
    for w in windows.lengths:  # the context grows to hold the window
        cfg = data["configs"][str(w)]
        assert cfg["seq_len"] == w and cfg["context_length"] >= w
    assert {(r["window"], r["seed"]) for r in data["runs"]} == {
        (w, s) for w in windows.trained for s in EVALUATE
    }
    assert data["command"].startswith("python experiments.py windows")
    assert "| window | point |" in (tmp_path / "w" / "summary.md").read_text()


# --------------------------------------------------------------------------------------------
# The scales no CPU runs: every config a study would train there is valid, and its step traces.

READY_STUDIES = ("sign", "precond", "msq", "clipping", "batch-scaling")


def study_modules() -> list[ModuleType]:
    """studies/protocol.py and every registered study's module."""
    return [studies.protocol, *(sys.modules[e.module] for e in experiments.REGISTRY.values())]


def patch_studies(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    """Replace `name` in every module of studies/ that holds it (each study imports the names
    it uses from protocol, so each holds its own reference)."""
    holders = [m for m in study_modules() if hasattr(m, name)]
    assert holders, name
    for m in holders:
        monkeypatch.setattr(m, name, value)


def abstract_step(cfg: train.Config) -> Any:
    """The shapes of one training step of `cfg`: the model built, the optimizer initialised and
    the step traced (pegrad's plan included), nothing computed."""

    def step() -> Any:
        run = train.build(cfg)
        batch = run.task.sample(run.task.train_data, key=run.train_key)
        return run.step(run.task.params, run.opt.init(run.task.params), batch)

    return jax.eval_shape(step)


@pytest.mark.parametrize("scale", ["small", "paper"])
def test_the_accelerator_scales_are_ready_to_run(
    scale: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    # Each study at this scale runs end to end with training and the μ/σ measurements replaced
    # (both need an accelerator); every config it asks for passes train.check, and each model
    # shape it would train traces one full step.
    asked = fake_sweep(monkeypatch, lambda c: bowl(3e-3)(c.lr, c.seed), max_steps=64)
    monkeypatch.setattr(plots, "draw", lambda *_, **__: None)
    patch_studies(
        monkeypatch,
        "measure_mu_sigma",
        lambda cfg, points, **_: [(np.ones(2), np.full(2, 2.0), 8, [("w", 2)]) for _ in points],
    )
    patch_studies(
        monkeypatch, "measured_points", lambda cfg, study, seeds: [(s, "init", None) for s in seeds]
    )
    patch_studies(monkeypatch, "frac_mu2_nonpositive", lambda cfg, seeds: [0.5] * len(seeds))
    for name in READY_STUDIES:
        summary = experiments.run(name, scale=scale, out=str(tmp_path / name))
        assert summary["scale"] == scale and (tmp_path / name / "summary.md").exists()
    # critical-batch smooths the loss over hundreds of steps: its fake runs are full length.
    whole = fake_sweep(monkeypatch, lambda c: bowl(3e-3)(c.lr, c.seed))
    summary = experiments.run("critical-batch", scale=scale, out=str(tmp_path / "cb"))
    assert summary["scale"] == scale and (tmp_path / "cb" / "summary.md").exists()
    asked += whole
    (batch_scaling,) = experiments.SCALES[scale]["batch-scaling"]
    assert {c.batch_size for c in asked} >= set(batch_scaling.batch_sizes)
    for c in asked:
        train.check(dataclasses.replace(c, out=None))
    # One step per model shape (task, window), at the study's base batch size: the step's
    # structure does not depend on B, the lr or the seed.
    shapes = {(c.model, c.size, c.seq_len, c.context_length): c for c in asked}
    assert shapes
    for c in shapes.values():
        _, _, loss, diagnostics = abstract_step(c)  # (params, state, loss, diagnostics)
        assert loss.shape == () and diagnostics["grad_norm"].shape == ()


# --------------------------------------------------------------------------------------------
# The noise floor (issue 39): a difference within it is undecided, whatever the interval says.

AGREE = {3: 0.05, 4: 0.06, 5: 0.04, 6: 0.05, 7: 0.05}  # A − B: 5/5 agree, CI far from 0


@pytest.mark.parametrize(
    "sigma, starts, above",
    [
        (0.001, "consistent: B better than A by 0.0500", True),  # floor 0.0012: unchanged
        (0.03, "consistent: B better than A by 0.0500", True),  # floor 0.037 < 0.05
        (0.05, "undecided: A − B = +0.0500, within the noise floor", False),  # floor 0.062
    ],
)
def test_a_verdict_within_the_noise_floor_is_undecided(sigma: float, starts: str, above: bool):
    a = {"per_seed": {s: 1.0 + d for s, d in AGREE.items()}}
    b = {"per_seed": dict.fromkeys(AGREE, 1.0)}
    plain = experiments.compare(a, b, "A", "B")
    assert plain["verdict"].startswith("consistent: B better than A by 0.0500")
    floor = experiments.NoiseFloor({"A": sigma, "B": sigma}, "constructed")
    v = experiments.compare(a, b, "A", "B", floor=floor)
    assert v["noise_floor"] == pytest.approx(1.959964 * math.sqrt(2 * sigma**2 / 5))
    assert v["verdict"].startswith(starts), v["verdict"]
    assert v["above_noise_floor"] is above and v["strength_without_floor"] == "consistent"
    assert (v["mean_diff"], v["ci95"]) == (plain["mean_diff"], plain["ci95"])  # numbers unchanged


def test_the_noise_floor_of_variants_differences_and_unmeasured_optimizers():
    floor = experiments.NoiseFloor({"Adam": 0.1, "MicroAdam": 0.2, "SignSGD": 0.05}, "x")
    assert floor.sigma_of("MicroAdam, clip 0.01") == (0.2, "MicroAdam")  # its optimizer's
    assert floor.sigma_of("Adam [LM, 32 tokens]") == (0.1, "Adam")
    assert floor.sigma_of("MicroAdamVar [LM, 32 tokens]")[0] == 0.2  # not measured: the largest
    assert floor.sigma_of(experiments.PLAIN_SIGN)[0] == 0.2  # not SignSGD's (β 0.9)
    gap = floor.variance("MicroAdam − Adam, both clipped at 0.01")  # a side that is a difference
    assert gap == pytest.approx(0.2**2 + 0.1**2)
    assert floor.floor("SignSGD", "Adam", 4) == pytest.approx(1.959964 * math.sqrt(0.0125 / 4))
    # A no-difference verdict within the floor is undecided too.
    a, b = {"per_seed": {0: 1.0, 1: 1.2}}, {"per_seed": {0: 1.1, 1: 1.1}}
    v = experiments.compare(a, b, "Adam", "SignSGD", floor=floor)
    assert v["verdict"].startswith("undecided") and v["strength_without_floor"] == "no difference"


def test_noise_floor_study_and_a_study_against_it(tmp_path: Path):
    """noise-floor at --scale smoke: each optimizer the summaries chose, at its lr and one
    float32 ulp above, on every seed; a clipped variant and MSQ are not measured. Its summary is
    then a floor for the verdicts of a study on its task, and refused on the other task."""
    chosen = [
        {"family": "Adam [MLP]", "method": "Adam [MLP]", "lr": 0.01},
        {"family": "MicroAdam, clip 0.01", "method": "MicroAdam, clip 0.01", "lr": 0.01},
        {"family": "MicroAdamMSQ ε=0.001", "method": "MicroAdamMSQ ε=0.001", "lr": 0.01},
    ]
    (tmp_path / "a.json").write_text(json.dumps({"chosen": chosen}))
    (tmp_path / "b.json").write_text(json.dumps({"chosen": [chosen[0] | {"lr": 0.003}]}))
    lrs_from = f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}"  # the later summary's lr wins
    smoke("noise-floor", tmp_path / "nf", seeds=(2, 3), lrs_from=lrs_from)
    rows, data = check_files(tmp_path / "nf", "noise-floor")
    assert {r["method"] for r in rows} == {"Adam", "Adam" + experiments.ULP}
    (f,) = data["noise_floor"].values()
    assert f["lr"] == 0.003 and np.float32(f["lr_perturbed"]) == np.nextafter(
        np.float32(0.003), np.float32(1)
    )
    assert f["seeds"] == 2 and f["sigma"] == pytest.approx(f["rms"] / math.sqrt(2))
    assert f"--lrs-from {lrs_from}" in data["command"]
    floor = experiments.read_noise_floor(tmp_path / "nf" / "summary.json")
    assert floor.task == "mlp" and set(floor.sigma) == {"Adam"}
    with pytest.raises(ValueError, match="measured on the mlp task"):
        smoke("sign", tmp_path / "x", task="lm", noise_floor=str(tmp_path / "nf" / "summary.json"))
    with pytest.raises(ValueError, match="give --lrs-from"):
        smoke("noise-floor", tmp_path / "y", seeds=(2, 3))


@pytest.mark.parametrize("sigma, kind", [(1e-4, "consistent"), (0.1, "undecided")])
def test_sign_decided_states_its_verdicts_against_the_floor(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sigma: float, kind: str
):
    """sign-decided's three rules (plain SignSGD: sign_sgd at β 0) on synthetic losses: SignEMA
    ahead of SignSGD by 0.05 on every seed is consistent above a small floor, undecided within
    a large one; the command records the floor it was given."""
    gap = {"sign_ema": 0.0, "sign_sgd": 0.05}
    fake_sweep(
        monkeypatch,
        lambda c: (
            1.0
            + gap.get(c.optimizer, 0.2) * (c.momentum != 0)
            + 0.01 * (c.seed % 3)
            + (math.log10(c.lr) + 2.5) ** 2
        ),
    )
    floor = tmp_path / "floor.json"
    floor.write_text(
        json.dumps(
            {
                "experiment": "noise-floor",
                "task": "mlp",
                "noise_floor": {"SignEMA": {"sigma": sigma}, "SignSGD": {"sigma": sigma}},
            }
        )
    )
    out = tmp_path / "sd"
    experiments.run("sign-decided", scale="smoke", out=str(out), noise_floor=str(floor))
    data = json.loads((out / "summary.json").read_text())
    assert {v["method"]: v["optimizer"] for v in data["runs"]}[experiments.PLAIN_SIGN] == "sign_sgd"
    assert {r["momentum"] for r in data["runs"] if r["method"] == experiments.PLAIN_SIGN} == {0.0}
    ema_sgd = data["verdicts"][0]
    assert (ema_sgd["a"], ema_sgd["b"]) == ("SignEMA", "SignSGD")
    assert ema_sgd["verdict"].startswith(kind) and ema_sgd["strength_without_floor"] == "consistent"
    assert f"--noise-floor {floor}" in data["command"]


# --------------------------------------------------------------------------------------------
# The critical batch (issue 39): steps to a target loss against B, and B_simple's prediction.


@pytest.mark.parametrize("s_min, b_crit", [(100.0, 16.0), (37.0, 3.0), (5.0, 400.0)])
@pytest.mark.parametrize("bs", [(4, 8, 16, 32, 64, 128), (2, 1000)])
def test_critical_batch_fit_recovers_s_min_e_min_and_b_crit(
    s_min: float, b_crit: float, bs: tuple[int, ...]
):
    # S(B) = S_min (1 + B_crit/B), i.e. S/S_min − 1 = (E/E_min − 1)⁻¹ with E_min = S_min·B_crit.
    steps = [s_min * (1 + b_crit / b) for b in bs]
    fit = experiments.fit_critical(bs, steps)
    assert fit["s_min"] == pytest.approx(s_min, rel=1e-9)
    assert fit["e_min"] == pytest.approx(s_min * b_crit, rel=1e-9)
    assert fit["b_crit"] == pytest.approx(b_crit, rel=1e-9)
    # From per-seed steps: the mean per B is fitted (a seed that missed is left out), and a
    # resample that picks seeds whose means are exact recovers it too.
    per_seed = {b: [s - 1.0, s + 1.0, None] for b, s in zip(bs, steps, strict=True)}
    again = experiments.crit_fit(per_seed, [0, 1, 2])
    assert again["b_crit"] == pytest.approx(b_crit, rel=1e-9)
    assert experiments.crit_fit(per_seed, [0, 1, 1, 0])["b_crit"] == pytest.approx(b_crit)


def test_critical_batch_fit_at_the_edges_of_its_model():
    # S falling like 1/B with no floor in range (S_min < 0): B_crit unbounded; S not falling
    # with B (E_min ≤ 0): every B is past the critical batch, B_crit 0; one B: no fit.
    assert experiments.fit_critical([4, 8, 16], [-5 + 1000 / b for b in (4, 8, 16)])["b_crit"] == (
        math.inf
    )
    assert experiments.fit_critical([4, 8], [100.0, 110.0])["b_crit"] == 0.0
    assert experiments.fit_critical([4], [100.0])["b_crit"] is None
    # The bootstrap interval keeps an unbounded end instead of interpolating it.
    assert experiments.percentile_interval([1.0] * 10 + [math.inf] * 90) == [1.0, math.inf]
    assert experiments.percentile_interval([None, math.nan]) == [None, None]


@pytest.mark.parametrize("half", [0, 3, 10])
def test_steps_to_target_on_a_constructed_trace(half: int):
    # A straight line 1 − s/1000: its centred average is the line itself (no lag), so the
    # first step at or below 0.5 is 500 whatever the window; a target below the lowest
    # smoothed value is never reached (None), and neither is one after the run diverged.
    loss = 1.0 - np.arange(1000) / 1000
    assert experiments.steps_to_target(loss, 0.5, half) == 500
    assert experiments.loss_level(loss, half) == pytest.approx(1.0 - (999 - half) / 1000)
    assert experiments.steps_to_target(loss, 0.0, half) is None
    diverged = loss.copy()
    diverged[400:] = np.nan
    assert experiments.steps_to_target(diverged, 0.5, half) is None
    # Noise around the line averages out over the window: the smoothed first crossing sits
    # near 500 (an alternating ±0.05 leaves at most 0.05/(2h + 1), i.e. 50/(2h + 1) steps of
    # the line), where the raw per-step loss crosses at the first lucky batch (451).
    noisy = loss + np.where(np.arange(1000) % 2 == 0, 0.05, -0.05)
    assert experiments.steps_to_target(noisy, 0.5, 0) == 451
    if half:
        got = experiments.steps_to_target(noisy, 0.5, half)
        assert got is not None and abs(got - 500) <= 50 / (2 * half + 1) + 1
    assert experiments.half_window(512, 4) == 64 and experiments.half_window(512, 1024) == 0


def test_critical_batch_target_is_reached_by_every_batch_size():
    # Per B, per lr: each selection seed's level (lowest smoothed loss). The level of a B is its
    # best lr's worst seed; an lr where a seed has no level is left out; the target is the
    # margin times the highest B's level, and None where some B has none.
    levels = {
        4: {1e-3: [0.30, 0.32], 1e-2: [0.20, 0.25]},
        8: {1e-3: [0.10, None], 1e-2: [0.4, 0.5]},
    }
    target, per_b = experiments.crit_target(levels, 1.2)
    assert per_b == {4: 0.25, 8: 0.5} and target == pytest.approx(0.6)
    assert experiments.crit_target({4: {1e-3: [None, 0.1]}}, 1.2)[0] is None


@pytest.mark.parametrize(
    "b_simple, b_crit, ci, starts, says",
    [
        (20.0, 16.0, (10.0, 30.0), "B_simple 20", "inside the interval"),
        (64.0, 16.0, (12.0, 20.0), "B_simple 64", "4× above it, within an order of magnitude"),
        (1.0, 16.0, (12.0, 20.0), "B_simple 1 ", "16× below it, not within an order"),
        (20.0, math.inf, (10.0, math.inf), "B_simple 20", "inside the interval of the measured "
         "B_crit, unbounded"),
    ],
)  # fmt: skip
def test_critical_batch_verdict(
    b_simple: float, b_crit: float, ci: tuple[float, float], starts: str, says: str
):
    verdict = experiments.crit_verdict(b_simple, (b_simple - 1, b_simple + 1), b_crit, ci)
    assert verdict.startswith(starts) and says in verdict
    assert experiments.crit_verdict(None, (None, None), b_crit, ci).startswith("no verdict")


CRIT = dict(s_min=40.0, b_crit=8.0, b_simple=32.0, b_p=10.0, best_lr=1e-2)  # the constructed study


def crit_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """sweep.run returns loss curves 1/(1 + r·s) with r ∝ g(lr)/S(B), S(B) = S_min(1 +
    B_crit/B), g peaked at best_lr: at the best lr the steps to any target are proportional to
    S(B), so the fit gives B_crit; tr Σ/|G|² is B_simple and tr(PΣ)/|G|²_P is B_P at every
    step but the first (NaN there, as a run logs it: no v̂ yet)."""

    def run(configs: Sequence[train.Config], **_: Any) -> list[sweep.Trace]:
        out = []
        for c in configs:
            rate = math.exp(-(math.log(c.lr / CRIT["best_lr"]) ** 2)) / (
                CRIT["s_min"] * (1 + CRIT["b_crit"] / c.batch_size)
            )
            loss = 1.0 / (1.0 + 10 * rate * np.arange(c.steps))
            diags = {k: np.ones(c.steps) for k in sweep.DIAGNOSTICS}
            diags["trace_cov"] = np.full(c.steps, CRIT["b_simple"] * 0.01)
            diags["grad_sq"] = np.full(c.steps, 0.01)
            diags["trace_cov_p"] = np.full(c.steps, CRIT["b_p"] * 0.02)
            diags["grad_sq_p"] = np.full(c.steps, 0.02)
            diags["trace_cov_p"][0] = diags["grad_sq_p"][0] = np.nan
            out.append(
                sweep.Trace(
                    cfg=c,
                    loss=loss,
                    diagnostics=diags,
                    eval_steps=np.array([0, c.steps]),
                    eval_loss=np.array([1.0, float(loss[-1])]),
                    diverged_step=None,
                    params=None,
                    seconds=0.0,
                )
            )
        return out

    monkeypatch.setattr(sweep, "run", run)


def test_critical_batch_study_on_constructed_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    crit_sweep(monkeypatch)
    settings = experiments.CritBatch(
        batch_sizes=(2, 4, 8, 16, 32), examples=600, min_steps=100, lrs=(1e-3, 1e-2, 1e-1),
        window=1, noise_window=8, margin=1.1, warmup=1,
    )  # fmt: skip
    monkeypatch.setitem(experiments.SCALES["smoke"], "critical-batch", {"mlp": settings})
    smoke("critical-batch", tmp_path / "cb", task="mlp")
    rows, data = check_files(tmp_path / "cb", "critical-batch")
    assert data["task"] == "mlp" and "--task mlp" in data["command"]
    assert {r["optimizer"] for r in rows} == {"adam"}
    per_b = {t["batch_size"]: t for t in data["per_batch"]}
    for b, t in per_b.items():  # every B: the best lr, reached by every evaluation seed in budget
        assert t["lr"] == CRIT["best_lr"] and t["edge"] is None and t["missed"] == 0
        assert t["steps"] < t["budget_steps"] == max(100, 600 // b)
        assert t["b_simple"] == pytest.approx(CRIT["b_simple"])
        assert t["b_p"] == pytest.approx(CRIT["b_p"])
        assert {(float(r["lr"]), int(r["seed"])) for r in rows if r["phase"] == "evaluate"
                and int(r["batch_size"]) == b} == {(t["lr"], s) for s in EVALUATE}  # fmt: skip
    measured = data["measured"]
    assert measured["b_crit"] == pytest.approx(CRIT["b_crit"], rel=0.05)  # steps are integers
    lo, hi = measured["ci95"]
    assert lo == hi == pytest.approx(measured["b_crit"])  # identical seeds: no spread
    assert data["predicted"]["mean"] == pytest.approx(CRIT["b_simple"])
    assert "4× above it, within an order of magnitude" in data["verdict"]
    # B_P (10, 1.25× B_crit 8) beside B_simple (32, 4×): read, reported, and named the better.
    assert data["predicted_p"]["mean"] == pytest.approx(CRIT["b_p"])
    assert data["verdict_p"].startswith("B_P 10 ") and "1.2× above it" in data["verdict_p"]
    comparison = data["comparison"]
    assert comparison["better"] == "B_P" and comparison["seeds_nearer"] == [len(EVALUATE)] * 2
    ratios = {k: v["ratio_to_b_crit"] for k, v in comparison["per_estimator"].items()}
    assert ratios == pytest.approx(
        {"B_simple": 32 / measured["b_crit"], "B_P": 10 / measured["b_crit"]}
    )
    assert comparison["verdict"].startswith("B_P predicts the measured B_crit")
    md = (tmp_path / "cb" / "summary.md").read_text()
    for said in (data["verdict"], data["verdict_p"], comparison["verdict"], "B_P at the target"):
        assert said in md
    # Only the held-out protocol, and only a task the scale has settings for.
    with pytest.raises(ValueError, match="evaluation seeds"):
        smoke("critical-batch", tmp_path / "loo", task="mlp", seeds=(0, 1))
    with pytest.raises(ValueError, match="no critical-batch settings for task 'lm'"):
        smoke("critical-batch", tmp_path / "lm", task="lm")


# --------------------------------------------------------------------------------------------
# The layout (issue 51): a study reads as select → bracket → fit → verdict → render, each piece
# short enough to read whole.

FUNCTION_LINES = 120


def long_functions(source: str, limit: int = FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method of `source`, nested ones too, longer than
    `limit` lines from its `def` (decorators excluded) to its last line."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize("lines, flagged", [(FUNCTION_LINES, False), (FUNCTION_LINES + 1, True)])
def test_the_length_check_flags_a_function_one_line_too_long(lines: int, flagged: bool):
    # A method (nested in a class) of `lines` lines: its def and lines - 1 statements.
    body = "".join(f"        x{i} = {i}\n" for i in range(lines - 1))
    source = "class A:\n    def f(self):\n" + body
    assert long_functions(source) == ([("f", lines)] if flagged else [])


def sources() -> list[Path]:
    """experiments.py and every module of studies/."""
    return [ROOT / "experiments.py", *sorted((ROOT / "studies").glob("*.py"))]


def test_no_function_of_experiments_py_is_longer_than_the_limit():
    assert len(sources()) > 2
    for path in sources():
        assert long_functions(path.read_text()) == [], path


# --------------------------------------------------------------------------------------------
# One file per study (issue 58): studies/NAME.py registers itself, no file is long.

FILE_LINES = 1500


def long_files(paths: Sequence[Path], limit: int = FILE_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every file of `paths` longer than `limit` lines."""
    counts = [(p.name, len(p.read_text().splitlines())) for p in paths]
    return [(name, n) for name, n in counts if n > limit]


@pytest.mark.parametrize("lines, flagged", [(FILE_LINES, False), (FILE_LINES + 1, True)])
def test_the_file_length_check_flags_a_file_one_line_too_long(
    lines: int, flagged: bool, tmp_path: Path
):
    path = tmp_path / "study.py"
    path.write_text("".join(f"x{i} = {i}\n" for i in range(lines)))
    assert long_files([path]) == ([("study.py", lines)] if flagged else [])


def test_no_study_file_is_longer_than_the_limit():
    # The protocol module and the entry point included.
    assert long_files(sources()) == []


def test_every_study_is_one_registered_module_with_its_usage_settings_and_test():
    """Each module of studies/ (but protocol) registers one study; each study has its usage
    lines (they start with its command), its settings at every scale (or none of its own: it
    registers presets=None, as noise-floor does), a command line and a test that runs it."""
    registry = experiments.REGISTRY
    assert sorted(e.module for e in registry.values()) == [
        f"studies.{m}" for m in studies.modules()
    ]
    assert tuple(registry) == experiments.EXPERIMENTS and set(experiments.RUNNERS) == set(registry)
    choices = next(a.choices for a in experiments.cli()._actions if a.dest == "name")
    assert choices is not None and list(choices) == [*registry, "all"]
    tests = (ROOT / "tests" / "test_experiments.py").read_text()
    helped = experiments.cli().format_help()
    for name, entry in registry.items():
        assert entry.module == f"studies.{name.replace('-', '_')}", name
        assert entry.usage.startswith(f"python experiments.py {name} "), name
        assert textwrap.indent(entry.usage, "    ") in helped, name
        if entry.presets is not None:
            assert set(entry.presets) == set(experiments.SCALES), name
        for scale in experiments.SCALES:
            shared, settings = experiments.study_settings(name, scale, None)
            assert shared == experiments.SCALES[scale]["shared"]
            assert (settings is None) == (entry.presets is None), (name, scale)
        assert re.search(rf'(smoke|experiments\.run)\(\s*"{name}"', tests), f"no test runs {name}"


@pytest.mark.parametrize(
    "b_simple, b_p, better, nearer",
    [  # B_crit 16, interval [12, 20]; per seed the two estimates of that seed
        ((64.0, 60.0, 68.0), (20.0, 14.0, 70.0), "B_P", "2/3"),  # 4× vs 1.25× above; seed 5: 4.4×
        ((20.0, 18.0, 22.0), (2.0, 1.0, 3.0), "B_simple", "3/3"),  # 1.25× vs 8× below
        ((8.0, 7.0, 9.0), (32.0, 30.0, 34.0), None, ""),  # 2× below and 2× above: a tie
        ((20.0, 18.0, 22.0), (None, None, None), None, "B_P not measured"),
    ],
)  # fmt: skip
def test_the_better_predictor_of_b_crit_is_the_nearer_by_factor(
    b_simple: tuple, b_p: tuple, better: str | None, nearer: str
):
    def pred(mean: float | None, *per: float | None) -> dict[str, Any]:
        ci = (
            [None, None]
            if mean is None
            else [min(p or 0.0 for p in per), max(p or 0.0 for p in per)]
        )
        return {"mean": mean, "ci95": ci, "per_seed": dict(zip((3, 4, 5), per, strict=True))}

    preds = {"B_simple": pred(b_simple[0], *b_simple), "B_P": pred(b_p[0], *b_p)}
    got = experiments.crit_compare(preds, 16.0, (12.0, 20.0))
    assert got["better"] == better
    if better is None:
        assert got["verdict"].startswith("no comparison") and nearer in got["verdict"]
    else:
        worse = "B_P" if better == "B_simple" else "B_simple"
        assert got["verdict"].startswith(
            f"{better} predicts the measured B_crit 16 better than {worse}"
        )
        assert f"nearer on {nearer} evaluation seeds" in got["verdict"]
        row = got["per_estimator"][better]
        assert row["ratio_to_b_crit"] == pytest.approx(preds[better]["mean"] / 16.0)
        assert row["in_b_crit_interval"] == (12.0 <= preds[better]["mean"] <= 20.0)
    # An unbounded B_crit, or one whose interval is unbounded above, leaves nothing to be
    # nearer to.
    for b_crit, ci in ((math.inf, (12.0, None)), (1e16, (8.0, math.inf))):
        unbounded = experiments.crit_compare(preds, b_crit, ci)
        why = nearer if better is None and nearer else "B_crit or its interval unbounded above"
        assert unbounded["better"] is None and unbounded["verdict"] == f"no comparison: {why}"


def test_critical_batch_rechecks_committed_lrs_and_target_on_unseen_seeds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """critical-batch --lrs-from at --scale smoke: each B at the lr a committed summary chose
    and against its target, on unseen seeds, nothing selected. The summary's lrs are off the
    study's grid, and its target is one every run reaches as soon as its smoothing window fits,
    so a study that re-selected lrs or re-derived the target would differ. The noise scales'
    window is widened to every step (B_P has no v̂ at step 0, and one step's |G|²_P soon after
    is noisy enough to be negative), so B_P is read from real runs."""
    cb = experiments.SCALES["smoke"]["critical-batch"]["mlp"]
    cb = dataclasses.replace(cb, noise_window=128)
    monkeypatch.setitem(experiments.SCALES["smoke"], "critical-batch", {"mlp": cb})
    moved = {f"Adam B={b}": lr for b, lr in zip(cb.batch_sizes, (0.0037, 0.0061), strict=True)}
    assert not set(moved.values()) & set(cb.lrs)
    committed = {
        "experiment": "critical-batch",
        "task": "mlp",
        "target_loss": 1e9,
        "target_rule": "constructed",
        "settings_per_task": dataclasses.asdict(cb),
        "chosen": [{"family": f, "method": f, "lr": lr, "edge": None} for f, lr in moved.items()],
    }
    committed = json.loads(json.dumps(committed))
    path = tmp_path / "committed.json"
    path.write_text(json.dumps(committed))
    again = smoke("critical-batch", tmp_path / "recheck", seeds=(7, 8), lrs_from=str(path))
    rows, data = check_files(tmp_path / "recheck", "critical-batch")
    assert data["protocol"] == "fixed" and data["selection_seeds"] == []
    assert {(r["phase"], int(r["seed"])) for r in rows} == {("evaluate", 7), ("evaluate", 8)}
    ran = {(r["method"], float(r["lr"])) for r in rows}
    assert ran == set(moved.items())
    assert {c["family"]: c["lr"] for c in again["chosen"]} == moved
    assert data["target_loss"] == 1e9 and str(path) in data["target_rule"]
    for t in data["per_batch"]:  # the target is met where the centred window first fits
        half = (t["smoothing_steps"] - 1) // 2
        assert t["steps_per_seed"] == {"7": half, "8": half} and t["grid"] == [t["lr"]]
    assert f"--lrs-from {path} --seeds 7,8" in data["command"]
    # B_P read from the real Adam runs' traces, beside B_simple (P reweights: they differ).
    for t in data["per_batch"]:
        assert t["b_p"] is not None and t["b_simple"] is not None and t["b_p"] != t["b_simple"]
    assert data["predicted_p"]["mean"] is not None and data["verdict_p"].startswith("B_P ")
    assert "no selection here" in (tmp_path / "recheck" / "summary.md").read_text()
    # Refused: another study's summary, other settings, leave-one-seed-out.
    other = tmp_path / "other.json"
    other.write_text(json.dumps(committed | {"experiment": "sign"}))
    with pytest.raises(ValueError, match="not a critical-batch summary"):
        smoke("critical-batch", tmp_path / "x", seeds=(7, 8), lrs_from=str(other))
    settings = committed["settings_per_task"] | {"margin": 2.0}
    other.write_text(json.dumps(committed | {"settings_per_task": settings}))
    with pytest.raises(ValueError, match="settings differ from this scale's: margin 2.0 there"):
        smoke("critical-batch", tmp_path / "y", seeds=(7, 8), lrs_from=str(other))
    with pytest.raises(ValueError, match="or --lrs-from a critical-batch summary"):
        smoke("critical-batch", tmp_path / "z", seeds=(7, 8))
