"""Critical batch (issue 39): steps to a target loss against B, and the predictions of B_simple
and (issue 51) B_P, the noise scale of Adam's preconditioned gradient.

`python experiments.py critical-batch` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import plots
import sweep
import train
from studies import register
from studies.protocol import (
    BOOTSTRAP,
    EDGE,
    TASK_NAMES,
    Context,
    Point,
    Protocol,
    Runs,
    Shared,
    Variant,
    aggregate,
    code_lines,
    code_record,
    edge_note,
    extend_grid,
    fmt_lr,
    fmt_num,
    grid_edge,
    instability,
    provenance_lines,
    seeds_text,
    select_lrs,
    t975,
    verdict_text,
    write_runs,
)

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py critical-batch --task mlp --out results/cb   # steps to a target loss
                                                        #   vs B: B_crit, and B_simple's
                                                        #   and B_P's predictions of it
"""


@dataclasses.dataclass(frozen=True)
class CritBatch:
    """critical-batch's settings for one task (`run_critical_batch`): Adam, constant lr after
    a warmup of `warmup` steps, at each B in `batch_sizes` for max(min_steps, examples // B)
    steps; the lr grid (the same at every B, extended at edges up to max_extensions points);
    the centred window (in examples) that smooths the training loss, and the one (in
    examples) over which B_simple's and B_P's numerators and denominators are averaged at the
    target;
    the target is `margin` × the highest loss level of the selection seeds (`crit_target`)."""

    batch_sizes: tuple[int, ...]
    examples: int
    min_steps: int
    lrs: tuple[float, ...]
    window: int
    noise_window: int
    margin: float
    warmup: int = 20
    max_extensions: int = 3


# Per scale, the settings of each task (the study runs the scale's task, or --task's); a task
# missing here is refused.
# fmt: off
CRITICAL_BATCH = {
    "smoke": {t: CritBatch(batch_sizes=(4, 8), examples=64, min_steps=8, lrs=(1e-3, 1e-2),
                           window=8, noise_window=8, margin=1.05, warmup=1, max_extensions=1)
              for t in ("mlp", "lm")},
    # The MLP is cheap: B up to 1024, 32000 examples at small B (~8 minutes of runs). The LM
    # (~1 ms per example and step here): B 4-64, 8000 windows at small B (~25 minutes).
    "tiny": {
        "mlp": CritBatch(batch_sizes=(4, 8, 16, 32, 64, 128, 256, 512, 1024), examples=32000,
                         min_steps=1000, lrs=(5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2),
                         window=512, noise_window=2048, margin=1.2),
        "lm": CritBatch(batch_sizes=(4, 8, 16, 32, 64), examples=8000, min_steps=250,
                        lrs=(1e-3, 2e-3, 4e-3, 8e-3), window=256, noise_window=1024, margin=1.02),
    },
    # tiny's protocol with 2-8x the examples; the lr grids centred on batch-scaling's.
    "small": {
        "mlp": CritBatch(batch_sizes=(4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
                         examples=128000, min_steps=2000,
                         lrs=(5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2), window=1024,
                         noise_window=4096, margin=1.2),
        "lm": CritBatch(batch_sizes=(4, 8, 16, 32, 64, 128, 256), examples=64000, min_steps=500,
                        lrs=(2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3), window=1024,
                        noise_window=4096, margin=1.02),
    },
    "paper": {
        "lm": CritBatch(batch_sizes=(8, 16, 32, 64, 128, 256, 512), examples=64 * 5000,
                        min_steps=1000, lrs=(1.5e-4, 3e-4, 6e-4, 1.2e-3, 2.4e-3), window=4096,
                        noise_window=16384, margin=1.02),
    },
}
# fmt: on


def crit_config(base: train.Config, cb: CritBatch, b: int) -> train.Config:
    """The task's config (`base`) at batch size b: Adam, constant lr after cb.warmup steps, the
    step budget max(min_steps, examples // b), the same number of held-out examples at every B."""
    steps = max(cb.min_steps, cb.examples // b)
    return dataclasses.replace(
        base,
        optimizer="adam",
        batch_size=b,
        steps=steps,
        schedule="constant",
        warmup=cb.warmup,
        eval_interval=max(1, steps // 4),
        eval_batches=max(1, -(-base.eval_batches * base.batch_size // b)),
    )


def half_window(examples: int, b: int) -> int:
    """h such that a centred window of 2h + 1 steps of b examples holds about `examples`."""
    return max(0, round((examples / b - 1) / 2))


def smoothed_loss(loss: np.ndarray, half: int) -> np.ndarray:
    """The centred moving average of a per-step loss over 2·half + 1 steps; NaN where the
    window does not fit inside the run (its ends) or holds a NaN (a diverged run)."""
    loss = np.asarray(loss, np.float64)
    out = np.full(len(loss), np.nan)
    width = 2 * half + 1
    if len(loss) >= width:
        out[half : len(loss) - half] = np.convolve(loss, np.ones(width) / width, "valid")
    return out


def steps_to_target(loss: np.ndarray, target: float, half: int) -> int | None:
    """The first step s whose smoothed loss (`smoothed_loss`, centred on s) is ≤ target: the
    updates taken before it (the loss of step s is measured before step s's update); None
    when the run never gets there."""
    hit = np.flatnonzero(smoothed_loss(loss, half) <= target)
    return int(hit[0]) if len(hit) else None


def loss_level(loss: np.ndarray, half: int) -> float | None:
    """The lowest smoothed loss a run reaches (None: none finite)."""
    sm = smoothed_loss(loss, half)
    return float(np.nanmin(sm)) if np.isfinite(sm).any() else None


def crit_target(levels: Mapping[int, Mapping[float, Sequence[float | None]]], margin: float):
    """The target loss: per B, the level every selection seed reached at the best lr (per lr
    the highest of its seeds' `loss_level`s; an lr where one did not get a level is left out;
    per B the lowest over lrs); the target is `margin` × the highest of those over B, so
    every B can reach it (and, by the margin, the evaluation seeds too). Returns (target, the
    per-B levels); None where some B has no level."""
    per_b: dict[int, float] = {}
    for b, per_lr in levels.items():
        full = [[x for x in v if x is not None] for v in per_lr.values()]
        ok = [max(v) for v, w in zip(full, per_lr.values(), strict=True) if v and len(v) == len(w)]
        if not ok:
            return None, per_b
        per_b[b] = min(ok)
    return margin * max(per_b.values()), per_b


def fit_critical(bs: Sequence[float], steps: Sequence[float]) -> dict[str, float | None]:
    """S(B) = S_min + E_min/B (McCandlish et al. 2018: S/S_min − 1 = (E/E_min − 1)⁻¹) fitted by
    least squares in relative residuals ((S − S_min − E_min/B)/max(S, 1), linear in S_min and
    E_min; exact on exact data) over the B given; B_crit = E_min/S_min. S_min ≤ 0 (no saturation in
    the range of B): B_crit is +inf (unbounded above); E_min ≤ 0: 0."""
    b = np.asarray(bs, np.float64)
    s = np.asarray(steps, np.float64)
    if len(b) < 2:
        return {"s_min": None, "e_min": None, "b_crit": None}
    design = np.stack([np.ones_like(b), 1.0 / b], axis=1) / np.maximum(s, 1.0)[:, None]
    (s_min, e_min), *_ = np.linalg.lstsq(design, s / np.maximum(s, 1.0), rcond=None)
    s_min, e_min = float(s_min), float(e_min)
    b_crit = 0.0 if e_min <= 0 else math.inf if s_min <= 0 else e_min / s_min
    return {"s_min": s_min, "e_min": e_min, "b_crit": b_crit}


def crit_fit(
    steps: Mapping[int, Sequence[int | None]], pick: Sequence[int] | np.ndarray
) -> dict[str, float | None]:
    """`fit_critical` of the mean steps per B over the evaluation seeds at column indices
    `pick` (repeats count: a bootstrap resample); a B none of whose picked seeds reached the
    target is left out."""
    bs, means = [], []
    for b, per_seed in sorted(steps.items()):
        got = [x for j in pick if (x := per_seed[j]) is not None]
        if got:
            bs.append(b)
            means.append(float(np.mean(got)))
    return fit_critical(bs, means)


def percentile_interval(values: Sequence[float | None]) -> list[float | None]:
    """The 95 % percentile interval (2.5 %, 97.5 %) of bootstrap values; inverted-CDF
    percentiles, so +inf (an unbounded B_crit) is kept, not interpolated."""
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], np.float64)
    if not len(x):
        return [None, None]
    lo, hi = np.percentile(x, [2.5, 97.5], method="inverted_cdf").tolist()
    return [float(lo), float(hi)]


def json_number(x: float | None) -> float | None:
    """JSON has no infinity: an unbounded value is written as None (the text says which)."""
    return None if x is None or not math.isfinite(x) else x


def ratio_of_means(pairs: Sequence[tuple[float, float] | None]) -> float | None:
    """A noise scale from (numerator, denominator) pairs, e.g. (tr Σ, |G|²), None ones left out:
    the mean numerator over the mean denominator (each unbiased; their ratio is not, so average
    first), None without pairs, where the mean denominator is ≤ 0, or where a part is NaN (not
    logged)."""
    got = [g for g in pairs if g is not None]
    den = float(np.mean([g[1] for g in got])) if got else math.nan
    num = float(np.mean([g[0] for g in got])) if got else math.nan
    return num / den if got and den > 0 and math.isfinite(num) else None


# The noise scales critical-batch holds against the measured B_crit: (summary key, name, the
# suffix of their parts in train.diagnostics): B_simple = tr Σ/|G|², plain SGD's (McCandlish et
# al. 2018), and B_P = tr(PΣ)/|G|²_P, P = 1/(√v̂ + ε) the Adam run's own preconditioner
# (`pegrad.gradient_noise_scale(stats, P)`), that of the optimizer actually trained.
CRIT_ESTIMATORS = (("b_simple", "B_simple", ""), ("b_p", "B_P", "_p"))


def noise_scale_at(
    trace: sweep.Trace, step: int, half: int, suffix: str = ""
) -> tuple[float, float]:
    """A noise scale's numerator and denominator (train.diagnostics' trace_cov and grad_sq, each
    unbiased; with `suffix` "_p" B_P's, tr(PΣ) and |G|²_P), each the plain mean over the steps
    step − half … step + half of the run (clipped to it), NaN steps left out (B_P's step 0,
    before Adam has a v̂); NaN where every step is NaN (a trace without B_P's parts)."""
    lo, hi = max(0, step - half), min(trace.cfg.steps, step + half + 1)
    tc = trace.diagnostics[f"trace_cov{suffix}"][lo:hi]
    gs = trace.diagnostics[f"grad_sq{suffix}"][lo:hi]
    mean = lambda x: float(np.nanmean(x)) if np.isfinite(x).any() else math.nan
    return mean(tc), mean(gs)


def crit_verdict(
    b_simple: float | None,
    b_simple_ci: Sequence[float | None],
    b_crit: float | None,
    b_crit_ci: Sequence[float | None],
    edges: Sequence[int] = (),
    name: str = "B_simple",
) -> str:
    """A noise scale `name` (B_simple, or B_P; its t-interval) against the measured B_crit (its
    bootstrap interval; +inf: unbounded): inside that interval, or the factor between the two;
    `edges`: the B whose lr is at its grid's edge (the verdict is then not a result)."""
    notes = [edge_note(f"the lr of B {', '.join(map(str, edges))} at its grid's edge")] * bool(
        edges
    )
    claim = crit_claim(b_simple, b_simple_ci, b_crit, b_crit_ci, name)
    return verdict_text(claim, notes=notes)


def crit_claim(
    b_simple: float | None,
    b_simple_ci: Sequence[float | None],
    b_crit: float | None,
    b_crit_ci: Sequence[float | None],
    name: str = "B_simple",
) -> str:
    """`crit_verdict`'s claim: where the noise scale `name` lies against B_crit's interval."""
    if b_simple is None or b_crit is None:
        return "no verdict: " + (name if b_simple is None else "B_crit") + " not measured"
    lo, hi = b_crit_ci
    inf = lambda x: "∞" if x is None or math.isinf(x) else format(x, ".3g")
    span = (
        f"measured B_crit {b_crit:.3g} (95% bootstrap interval [{fmt_num(lo, '.3g')}, {inf(hi)}])"
        if math.isfinite(b_crit)
        else f"measured B_crit, unbounded (S still falls like 1/B at the largest B; interval "
        f"[{fmt_num(lo, '.3g')}, {inf(hi)}])"
    )
    pl, ph = b_simple_ci
    said = f"{name} {b_simple:.3g} (95% t-interval [{fmt_num(pl, '.3g')}, {fmt_num(ph, '.3g')}])"
    if lo is not None and lo <= b_simple <= (math.inf if hi is None else hi):
        return f"{said} is inside the interval of the {span}: the prediction holds"
    if not math.isfinite(b_crit) or b_crit <= 0:
        return f"{said} is outside the interval of the {span}"
    factor = b_simple / b_crit
    within = "within" if 0.1 <= factor <= 10 else "not within"
    side = "above" if factor > 1 else "below"
    return (
        f"{said} is outside the interval of the {span}: {max(factor, 1 / factor):.2g}× {side} "
        f"it, {within} an order of magnitude (McCandlish et al. report B_simple predicting "
        "B_crit to within one)"
    )


@dataclasses.dataclass(frozen=True)
class CritChoice:
    """Where critical-batch's selection (`crit_select`), or a committed summary's
    (`crit_committed`), leaves each B: the target loss and how it was set, each B's grid and
    the points added to it, its lr (None: none reached the target on every selection seed)
    with its mean selection steps, the lr of its best final loss, its level, its edge."""

    target: float
    target_rule: str
    grids: dict[int, list[float]]
    added: dict[int, list[float]]
    chosen: dict[int, tuple[float | None, float | None]]  # B -> (lr, mean selection steps)
    final_loss_lr: dict[int, float | None]
    levels: dict[int, float]
    edges: dict[int, str | None]


def crit_loss(runs: Runs, label: str, lr: float, s: int) -> np.ndarray | None:
    """The per-step training loss of a run so far (None: not trained)."""
    t = runs.trace(label, lr, s)
    return None if t is None else t.loss


def crit_steps(
    runs: Runs, label: str, lr: float, seeds: Sequence[int], target: float, half: int
) -> list[int | None]:
    """Per seed, the steps its run at lr took to the target (`steps_to_target`)."""
    return [
        None if (x := crit_loss(runs, label, lr, s)) is None else steps_to_target(x, target, half)
        for s in seeds
    ]


def crit_fastest(
    runs: Runs, label: str, grid: Sequence[float], seeds: Sequence[int], target: float, half: int
) -> tuple[float | None, float | None]:
    """The lr of `grid` with the fewest mean steps to the target over `seeds`, among those
    where every seed reached it, and that mean; (None, None) where none did."""
    found = {}
    for lr in grid:
        got = crit_steps(runs, label, lr, seeds, target, half)
        if all(x is not None for x in got):
            found[lr] = float(np.mean([x for x in got if x is not None]))
    if not found:
        return None, None
    lr = min(found, key=lambda k: found[k])
    return lr, found[lr]


def crit_select(
    runs: Runs,
    cb: CritBatch,
    variants: Mapping[int, Variant],
    halves: Mapping[int, int],
    seeds: Sequence[int],
) -> CritChoice:
    """Select, on the selection seeds: 1. each B's grid, grown until its best final loss is
    interior; 2. the target (`crit_target`), reached by every selection seed at some lr of
    every B (then × margin); 3. each B's lr, the fewest mean steps to the target (among the
    lrs where every one reached it), the grid grown past an edge where that lr sits."""
    labels = {b: v.label for b, v in variants.items()}
    record = select_lrs(runs, list(variants.values()), seeds, cb.max_extensions)
    levels = {
        b: {
            lr: [
                None
                if (x := crit_loss(runs, labels[b], lr, s)) is None
                else loss_level(x, halves[b])
                for s in seeds
            ]
            for lr in record[labels[b]]["grid"]
        }
        for b in cb.batch_sizes
    }
    target, level_per_b = crit_target(levels, cb.margin)
    if target is None:
        raise ValueError("critical-batch: some B reached no finite loss on the selection seeds")
    grids = {b: sorted(record[labels[b]]["grid"]) for b in cb.batch_sizes}
    added = {b: list(record[labels[b]]["extended_with"]) for b in cb.batch_sizes}
    fastest = lambda b: crit_fastest(runs, labels[b], grids[b], seeds, target, halves[b])
    while True:
        grew = False
        for b in cb.batch_sizes:
            lr, _ = fastest(b)
            side = grid_edge(grids[b], lr)
            if side is not None and len(added[b]) < 2 * cb.max_extensions:
                new = extend_grid(grids[b], side)
                grids[b] = sorted({*grids[b], new})
                added[b].append(new)
                grew = True
        if not grew:
            break
        runs.train(
            "select",
            [
                (Point(labels[b], dataclasses.replace(variants[b].cfg, lr=lr)), s)
                for b in cb.batch_sizes
                for lr in grids[b]
                for s in seeds
            ],
        )
    chosen = {b: fastest(b) for b in cb.batch_sizes}
    return CritChoice(
        target=target,
        target_rule=f"{cb.margin:g} × the highest over B of the level every selection seed "
        "reached at B's best lr (a run's level: its lowest smoothed training loss)",
        grids=grids,
        added=added,
        chosen=chosen,
        final_loss_lr={
            b: None if (c := record[labels[b]]["chosen"]) is None else c["lr"]
            for b in cb.batch_sizes
        },
        levels=level_per_b,
        edges={b: grid_edge(grids[b], chosen[b][0]) for b in cb.batch_sizes},
    )


def crit_committed(
    proto: Protocol, cb: CritBatch, task: str, labels: Mapping[int, str]
) -> CritChoice:
    """The fixed protocol's choice: each B's lr and the target loss from one committed
    critical-batch summary.json (`--lrs-from`) of this task at these settings (a target means
    nothing at another window, margin or budget); each lr's edge as that summary marked it."""
    path = str(proto.source)
    if "," in path:
        raise ValueError(f"--lrs-from {path}: critical-batch reads one summary, not several")
    data = json.loads(Path(path).read_text())
    if data.get("experiment") != "critical-batch" or "target_loss" not in data:
        raise ValueError(f"--lrs-from {path}: not a critical-batch summary.json")
    if data.get("task") != task:
        raise ValueError(f"--lrs-from {path}: measured on the {data.get('task')} task, not {task}")
    mine = json.loads(json.dumps(dataclasses.asdict(cb)))
    theirs = data.get("settings_per_task", {})
    if differ := sorted(k for k, v in mine.items() if theirs.get(k) != v):
        said = ", ".join(f"{k} {theirs.get(k)} there, {mine[k]} here" for k in differ)
        raise ValueError(f"--lrs-from {path}: its settings differ from this scale's: {said}")
    committed = {c["family"]: c for c in data["chosen"]}
    if unknown := sorted(set(committed) - set(labels.values())):
        raise ValueError(f"--lrs-from {path}: {unknown} are not batch sizes of this study")
    got = {b: committed.get(lb, {}) for b, lb in labels.items()}
    lrs = {b: c.get("lr") for b, c in got.items()}
    return CritChoice(
        target=float(data["target_loss"]),
        target_rule=f"the target of {path} ({data['target_rule']})",
        grids={b: [] if lr is None else [lr] for b, lr in lrs.items()},
        added={b: [] for b in labels},
        chosen={b: (lr, None) for b, lr in lrs.items()},
        final_loss_lr=dict.fromkeys(labels),
        levels={},
        edges={b: c.get("edge") if c else "bottom" for b, c in got.items()},
    )


def crit_evaluate(
    runs: Runs,
    cb: CritBatch,
    variants: Mapping[int, Variant],
    halves: Mapping[int, int],
    choice: CritChoice,
    evaluate: Sequence[int],
) -> tuple[dict[int, list[int | None]], dict[str, dict[int, list[tuple[float, float] | None]]]]:
    """Bracket (here: the chosen lr alone) on the evaluation seeds: per B, each seed's steps to
    the target, and per noise scale of CRIT_ESTIMATORS (by its key) its numerator and
    denominator there (`noise_scale_at`)."""
    runs.train(
        "evaluate",
        [
            (Point(variants[b].label, dataclasses.replace(variants[b].cfg, lr=lr)), s)
            for b, (lr, _) in choice.chosen.items()
            if lr is not None
            for s in evaluate
        ],
    )
    steps: dict[int, list[int | None]] = {}
    noise: dict[str, dict[int, list[tuple[float, float] | None]]] = {
        key: {} for key, _, _ in CRIT_ESTIMATORS
    }
    for b, (lr, _) in choice.chosen.items():
        if lr is None:
            continue
        label = variants[b].label
        steps[b] = crit_steps(runs, label, lr, evaluate, choice.target, halves[b])
        traces = [runs.trace(label, lr, s) for s in evaluate]
        for key, _, suffix in CRIT_ESTIMATORS:
            noise[key][b] = [
                None
                if t is None or n_steps is None
                else noise_scale_at(t, n_steps, half_window(cb.noise_window, b), suffix)
                for t, n_steps in zip(traces, steps[b], strict=True)
            ]
    return steps, noise


def crit_measure(
    steps: Mapping[int, Sequence[int | None]], seeds: int
) -> tuple[dict[str, Any], dict[str, float | None], dict[str, list[float | None]]]:
    """Fit: S = S_min + E_min/B on the evaluation seeds' mean steps (`crit_fit`), its interval
    a bootstrap of the `seeds` evaluation seeds. Returns the summary's "measured", the point
    fit and the intervals (unbounded values as inf)."""
    point = crit_fit(steps, range(seeds))
    rng = np.random.default_rng(0)
    boot = [crit_fit(steps, rng.integers(0, seeds, seeds)) for _ in range(BOOTSTRAP)]
    measured: dict[str, Any] = {k: json_number(point[k]) for k in ("s_min", "e_min", "b_crit")}
    ci = {k: percentile_interval([f[k] for f in boot if f[k] is not None]) for k in point}
    measured |= {
        "b_crit_unbounded": point["b_crit"] is not None and math.isinf(point["b_crit"]),
        "ci95": [json_number(ci["b_crit"][0]), json_number(ci["b_crit"][1])],
        "ci95_upper_unbounded": ci["b_crit"][1] is not None and math.isinf(ci["b_crit"][1]),
        "s_min_ci95": ci["s_min"],
        "e_min_ci95": ci["e_min"],
        "batch_sizes_fitted": sorted(b for b, v in steps.items() if any(x is not None for x in v)),
        "fit": "least squares of S = S_min + E_min/B in relative residuals, over the mean steps "
        "per B on the evaluation seeds; interval: the evaluation seeds resampled",
    }
    return measured, point, ci


def crit_predict(
    noise: Mapping[int, Sequence[tuple[float, float] | None]],
    evaluate: Sequence[int],
    cb: CritBatch,
    name: str = "B_simple",
) -> dict[str, Any]:
    """The prediction of the noise scale `name` (B_simple or B_P, its parts `noise`): per
    evaluation seed, the ratio of its numerator and denominator, each averaged over every B's
    run of that seed (each at its target step); mean and t-interval over seeds."""
    per_seed_bs = {s: ratio_of_means([noise[b][j] for b in noise]) for j, s in enumerate(evaluate)}
    vals = [v for v in per_seed_bs.values() if v is not None]
    n = len(vals)
    mean_bs = float(np.mean(vals)) if vals else None
    half_ci = t975(n - 1) * float(np.std(vals, ddof=1)) / math.sqrt(n) if n > 1 else None
    return {
        "mean": mean_bs,
        "ci95": [None, None]
        if mean_bs is None or half_ci is None
        else [mean_bs - half_ci, mean_bs + half_ci],
        "per_seed": per_seed_bs,
        "estimator": (
            "B_simple = tr Σ / |G|² (pegrad.gradient_noise_scale, logged every step as trace_cov "
            "and grad_sq)"
            if name == "B_simple"
            else "B_P = tr(PΣ) / |G|²_P, P = 1/(√v̂ + ε) of the Adam state before the step "
            "(pegrad.gradient_noise_scale(stats, P), logged every step but the first as "
            "trace_cov_p and grad_sq_p)"
        )
        + ": per run, the plain mean of each over a centred window of "
        f"about {cb.noise_window} examples at the step the run reached the target; per "
        "evaluation seed, the ratio of their means over its runs (every B); mean over seeds, "
        "95% t-interval (n − 1 df)",
    }


def log_distance(estimate: float | None, b_crit: float) -> float | None:
    """|ln(estimate / B_crit)|: how far a prediction is from B_crit, by factor, either side
    alike (2× above and 2× below are equally far); +inf for an estimate ≤ 0, None for none."""
    if estimate is None:
        return None
    return math.inf if estimate <= 0 else abs(math.log(estimate / b_crit))


def crit_compare(
    predictions: Mapping[str, dict[str, Any]],
    b_crit: float | None,
    b_crit_ci: Sequence[float | None],
) -> dict[str, Any]:
    """Which of B_simple and B_P (`predictions` by CRIT_ESTIMATORS' names, each
    `crit_predict`'s) predicts the measured B_crit better: the one whose mean over seeds is
    nearer it by factor (`log_distance`); beside it, per noise scale its ratio to B_crit,
    whether B_crit lies in its t-interval and it in B_crit's bootstrap interval, and on how many
    evaluation seeds (both measured) the better one is the nearer. No comparison where B_crit
    or its interval is unbounded (a point estimate then says nothing of how far a prediction
    is), where B_crit is 0, or where a noise scale was not measured."""
    lo, hi = b_crit_ci
    rows: dict[str, dict[str, Any]] = {}
    for name, pred in predictions.items():
        mean, (pl, ph) = pred["mean"], pred["ci95"]
        finite = b_crit is not None and math.isfinite(b_crit) and b_crit > 0
        rows[name] = {
            "ratio_to_b_crit": None if mean is None or not finite else mean / b_crit,
            "b_crit_in_its_interval": None
            if pl is None or ph is None or b_crit is None
            else pl <= b_crit <= ph,
            "in_b_crit_interval": None
            if mean is None or lo is None
            else lo <= mean <= (math.inf if hi is None else hi),
        }
    out: dict[str, Any] = {"better": None, "per_estimator": rows, "seeds_nearer": None}
    missing = [n for n, p in predictions.items() if p["mean"] is None]
    unbounded = b_crit is not None and (math.isinf(b_crit) or hi is None or math.isinf(hi))
    if b_crit is None or unbounded or b_crit <= 0 or missing:
        why = (
            f"{' and '.join(missing)} not measured"
            if missing
            else "B_crit not measured"
            if b_crit is None
            else "B_crit or its interval unbounded above"
            if unbounded
            else "B_crit 0: every B past it"
        )
        return out | {"verdict": f"no comparison: {why}"}
    near = {n: log_distance(p["mean"], b_crit) for n, p in predictions.items()}
    (a, da), (b, db) = sorted(near.items(), key=lambda kv: kv[1] or 0.0)
    if da == db:
        return out | {"verdict": f"no comparison: {a} and {b} equally far from B_crit"}
    seeds = [
        s
        for s in predictions[a]["per_seed"]
        if predictions[a]["per_seed"][s] is not None
        and predictions[b]["per_seed"].get(s) is not None
    ]
    nearer = sum(
        (log_distance(predictions[a]["per_seed"][s], b_crit) or 0.0)
        < (log_distance(predictions[b]["per_seed"][s], b_crit) or 0.0)
        for s in seeds
    )
    said = lambda n: (
        f"{n}/B_crit {rows[n]['ratio_to_b_crit']:.3g} (B_crit "
        + ("inside" if rows[n]["b_crit_in_its_interval"] else "outside")
        + " its 95% interval)"
    )
    claim = f"{a} predicts the measured B_crit {b_crit:.3g} better than {b}"
    evidence = f"{said(a)}, {said(b)}; nearer on {nearer}/{len(seeds)} evaluation seeds"
    return out | {
        "better": a,
        "seeds_nearer": [nearer, len(seeds)],
        "verdict": verdict_text(claim, evidence),
    }


def crit_rows(
    cb: CritBatch,
    variants: Mapping[int, Variant],
    halves: Mapping[int, int],
    choice: CritChoice,
    steps: Mapping[int, Sequence[int | None]],
    noise: Mapping[str, Mapping[int, Sequence[tuple[float, float] | None]]],
    evaluate: Sequence[int],
) -> list[dict[str, Any]]:
    """The per-B table: budget, grid, lrs, steps to the target per evaluation seed, S, E,
    B_simple and B_P at the target."""
    per_b = []
    for b in cb.batch_sizes:
        lr, sel_steps = choice.chosen[b]
        st = steps.get(b, [])
        ok = [x for x in st if x is not None]
        per_b.append(
            {
                "batch_size": b,
                "budget_steps": variants[b].cfg.steps,
                "grid": choice.grids[b],
                "extended_with": choice.added[b],
                "final_loss_lr": choice.final_loss_lr[b],
                "level": choice.levels.get(b),
                "lr": lr,
                "edge": choice.edges[b],
                "selection_steps": sel_steps,
                "steps_per_seed": dict(zip(evaluate, st, strict=True)) if st else {},
                "steps": float(np.mean(ok)) if ok else None,
                "steps_sd": float(np.std(ok, ddof=1)) if len(ok) > 1 else None,
                "examples": float(b * np.mean(ok)) if ok else None,
                "missed": len(st) - len(ok),
                "b_simple": ratio_of_means(noise["b_simple"].get(b, [])),
                "smoothing_steps": 2 * halves[b] + 1,
                "b_p": ratio_of_means(noise["b_p"].get(b, [])),
            }
        )
    return per_b


def crit_markdown(
    ctx: Context, cb: CritBatch, summary: dict[str, Any], choice: CritChoice
) -> list[str]:
    """Render: summary.md of critical-batch (the target, the per-B table, the fit, the
    prediction, the verdict)."""
    proto, task = ctx.proto, summary["task"]
    per_b, measured, predicted = summary["per_batch"], summary["measured"], summary["predicted"]
    if proto.name == "fixed":
        seeds = f"lrs and target from {proto.source}"
        how = f"Each B's lr: the one {proto.source} chose (no selection here), on the evaluation "
        how += "seeds."
    else:
        seeds = f"selection seeds {seeds_text(proto.select)}"
        how = (
            "Each B's lr: the fewest mean steps "
            "to the target on the selection seeds (grid grown past an edge); then on the "
            "evaluation seeds."
        )
    lines = [
        f"# Critical batch ({TASK_NAMES[task]}, Adam, constant lr; {seeds}, evaluation seeds "
        f"{seeds_text(proto.evaluate)})\n",
        *provenance_lines(ctx.prov),
        *code_lines(summary["code"]),
        f"Target loss {choice.target:.4g}: {summary['target_rule']}. Steps to the target: the "
        f"first step whose {summary['smoothing']} is ≤ the target. {how} Warmup "
        f"{cb.warmup} steps at every B; budget max({cb.min_steps}, {cb.examples} // B) steps.",
        "",
        "| B | budget (steps) | lr grid (added) | chosen lr | steps to target per evaluation "
        "seed | S: mean ± sd | E = B·S | B_simple at the target | B_P at the target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in per_b:
        grid = ", ".join(fmt_lr(x) for x in t["grid"])
        if t["extended_with"]:
            grid += f" (added {', '.join(fmt_lr(x) for x in t['extended_with'])})"
        flag = f" **{EDGE}**" if t["edge"] else ""
        per = ", ".join("–" if x is None else str(x) for x in t["steps_per_seed"].values())
        sd = "" if t["steps_sd"] is None else f" ± {t['steps_sd']:.0f}"
        lines.append(
            f"| {t['batch_size']} | {t['budget_steps']} | {grid} | {fmt_lr(t['lr'])}{flag} | "
            f"{per} | {fmt_num(t['steps'], '.0f')}{sd} | {fmt_num(t['examples'], '.0f')} | "
            f"{fmt_num(t['b_simple'], '.3g')} | {fmt_num(t.get('b_p'), '.3g')} |"
        )
    sl, sh = measured["s_min_ci95"]
    el, eh = measured["e_min_ci95"]
    lines += [
        "",
        f"Fit ({measured['fit']}): S_min = {fmt_num(measured['s_min'], '.4g')} "
        f"[{fmt_num(sl, '.4g')}, {fmt_num(sh, '.4g')}], E_min = "
        f"{fmt_num(measured['e_min'], '.4g')} [{fmt_num(el, '.4g')}, {fmt_num(eh, '.4g')}], "
        f"B_crit = E_min/S_min = "
        + ("unbounded" if measured["b_crit_unbounded"] else fmt_num(measured["b_crit"], ".3g"))
        + f" [{fmt_num(measured['ci95'][0], '.3g')}, "
        + ("∞" if measured["ci95_upper_unbounded"] else fmt_num(measured["ci95"][1], ".3g"))
        + "].",
        "",
        *crit_prediction_lines("B_simple", predicted),
        *crit_prediction_lines("B_P", summary["predicted_p"]),
        f"**Verdict**: {summary['verdict']}",
        "",
        f"**Verdict (B_P)**: {summary['verdict_p']}",
        "",
        f"**Which predicts better**: {summary['comparison']['verdict']}",
    ]
    return lines


def crit_prediction_lines(name: str, predicted: dict[str, Any]) -> list[str]:
    """summary.md's line on one noise scale's prediction: its estimator, mean, interval, seeds."""
    return [
        f"Prediction ({predicted['estimator']}): {name} = {fmt_num(predicted['mean'], '.3g')} "
        f"[{fmt_num(predicted['ci95'][0], '.3g')}, {fmt_num(predicted['ci95'][1], '.3g')}]; "
        "per seed "
        + ", ".join(f"{s}: {fmt_num(v, '.3g')}" for s, v in predicted["per_seed"].items())
        + ".",
        "",
    ]


def run_critical_batch(ctx: Context) -> dict[str, Any]:
    """Steps to a target loss against B, the critical batch B_crit fitted to them, and the
    gradient noise scale B_simple's prediction of it. Adam at a constant lr (after a short
    warmup fixed in steps) at each B of `CritBatch.batch_sizes`, max(min_steps, examples // B)
    steps. A run's loss curve: its training loss (each step's fresh batch, before the update)
    averaged over a centred window of about `window` examples (2h + 1 steps: the same noise at
    every B, no lag); its steps to a target: the first step whose smoothed loss is ≤ the target
    (None: never).

    Select (`crit_select`, held-out): on the selection seeds each B's grid is grown until its
    best final loss is interior; the target is `margin` × the highest over B of the level every
    selection seed reached at B's best lr (a level: the lowest smoothed loss), so every B
    reaches it; each B's lr is then the one with the fewest mean steps to the target over the
    selection seeds (the grid grown past an edge where it sits). Fixed (`--lrs-from` one
    critical-batch summary of this task and settings: `crit_committed`): its lrs and its
    target, no selection: the re-check on unseen seeds. Evaluate (`crit_evaluate`): the
    chosen lrs on the evaluation seeds. Fit (`crit_measure`): S(B) = the mean steps over
    seeds, E = B·S, and S = S_min + E_min/B (McCandlish et al. 2018: S/S_min − 1 = (E/E_min −
    1)⁻¹) fitted by least squares in relative residuals; B_crit = E_min/S_min, its 95 %
    interval the percentile interval of BOOTSTRAP resamples of the evaluation seeds (S_min ≤ 0
    in a resample: unbounded). The prediction (`crit_predict`): B_simple = tr Σ/|G|²
    (train.diagnostics' trace_cov and grad_sq, each unbiased) of the same evaluation runs, each
    averaged plainly over a centred window of about `noise_window` examples at the step the
    run reached the target, the ratio taken per seed of the means over its runs (every B), then
    the mean over seeds with its t-interval; the same for B_P = tr(PΣ)/|G|²_P (trace_cov_p and
    grad_sq_p: P = 1/(√v̂ + ε), the trained Adam's own preconditioner; McCandlish et al.'s
    argument run on the preconditioned gradient): the intervals of both are over the same
    evaluation seeds that B_crit's bootstrap resamples. Verdicts (`crit_verdict`): whether
    each lies in B_crit's interval, else by what factor it misses; which predicts better
    (`crit_compare`): the nearer by factor, with both ratios, whether B_crit lies in each
    interval, and on how many seeds the nearer one is. Render: `crit_markdown`."""
    proto, task = ctx.proto, ctx.shared.task
    if proto.name == "leave-one-seed-out":
        raise ValueError(
            "critical-batch measures steps on evaluation seeds at lrs chosen on others: give "
            "--select-seeds and --seeds (or neither: the scale's), or --lrs-from a "
            "critical-batch summary and --seeds"
        )
    cb: CritBatch = ctx.settings
    seeds, evaluate = proto.select, proto.evaluate
    base = ctx.shared.config()
    variants = {b: Variant(f"Adam B={b}", crit_config(base, cb, b), cb.lrs) for b in cb.batch_sizes}
    labels = {b: v.label for b, v in variants.items()}
    halves = {b: half_window(cb.window, b) for b in cb.batch_sizes}
    runs = Runs("critical-batch", ctx.cache)
    if proto.name == "fixed":
        choice = crit_committed(proto, cb, task, labels)
    else:
        choice = crit_select(runs, cb, variants, halves, seeds)
    steps, noise = crit_evaluate(runs, cb, variants, halves, choice, evaluate)
    measured, point, ci = crit_measure(steps, len(evaluate))
    preds = {name: crit_predict(noise[key], evaluate, cb, name) for key, name, _ in CRIT_ESTIMATORS}
    per_b = crit_rows(cb, variants, halves, choice, steps, noise, evaluate)
    edges = [t["batch_size"] for t in per_b if t["edge"]]
    verdicts = {
        name: crit_verdict(p["mean"], p["ci95"], point["b_crit"], ci["b_crit"], edges, name)
        for name, p in preds.items()
    }
    predicted, verdict = preds["B_simple"], verdicts["B_simple"]
    comparison = crit_compare(preds, point["b_crit"], ci["b_crit"])
    print(f"  critical batch: {verdict}\n  B_P: {verdicts['B_P']}", flush=True)
    print(f"  better predictor: {comparison['verdict']}", flush=True)
    rows = runs.rows
    summary = {
        "experiment": "critical-batch",
        **ctx.prov,
        "task": task,
        "target_loss": choice.target,
        "target_rule": choice.target_rule,
        "smoothing": f"training loss (each step's batch, before its update) averaged over a "
        f"centred window of about {cb.window} examples (2h + 1 steps at B)",
        "settings_per_task": dataclasses.asdict(cb),
        "per_batch": per_b,
        "measured": measured,
        "predicted": predicted,
        "verdict": verdict,
        "predicted_p": preds["B_P"],
        "verdict_p": verdicts["B_P"],
        "comparison": comparison,
        "variants": [
            {
                "method": labels[b],
                "grid": choice.grids[b],
                "extended_with": choice.added[b],
                "lr": choice.chosen[b][0],
            }
            for b in cb.batch_sizes
        ],
        "chosen": [
            {
                "family": labels[b],
                "method": labels[b],
                "lr": choice.chosen[b][0],
                "edge": choice.edges[b],
            }
            for b in cb.batch_sizes
        ],
        "settings": aggregate(rows, ("method", "lr")),
        "instability": instability(rows),
        "code": code_record(rows),
    }
    write_runs(ctx.out, summary, runs)
    (ctx.out / "summary.md").write_text("\n".join(crit_markdown(ctx, cb, summary, choice)) + "\n")
    plots.draw(ctx.out)
    return summary


def pick_settings(
    settings: Mapping[str, CritBatch], shared: Shared, task: str | None, scale: str
) -> CritBatch:
    """The settings of the study's task (the scale's, or --task)."""
    if shared.task not in settings:
        raise ValueError(f"scale {scale!r} has no critical-batch settings for task {shared.task!r}")
    return settings[shared.task]


register(
    "critical-batch",
    run_critical_batch,
    order=80,
    usage=USAGE,
    presets=CRITICAL_BATCH,
    pick=pick_settings,
)
