"""Windows: μ̂²/σ̂² of the LM against its window length.

`python experiments.py windows` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import dataclasses
import json
from typing import Any

import numpy as np

import sweep
import train
from studies import register
from studies.protocol import (
    TASK_NAMES,
    UNKNOWN_CODE,
    Context,
    code_lines,
    code_record,
    fmt_lr,
    mu_sigma_records,
    provenance_lines,
    scored_seeds,
    seeds_text,
)

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py windows --out results/windows     # μ̂²/σ̂² of the LM vs its window
"""


@dataclasses.dataclass(frozen=True)
class Windows:
    """windows' settings: the LM window lengths whose μ̂²/σ̂² is measured at initialisation,
    those also measured at the end of training with Adam, and Adam's lr there (precond's
    chosen Adam lr at the scale's own window)."""

    lengths: tuple[int, ...]
    trained: tuple[int, ...]
    lr: float


WINDOWS = {
    "smoke": Windows((4, 8), (8,), 1e-2),
    "tiny": Windows((32, 64, 128, 256), (32, 128), 3e-3),
    "small": Windows((64, 128, 256, 512), (64, 256), 1e-3),
    "paper": Windows((128, 512, 1024), (512,), 3e-4),
}


def window_config(lm: train.Config, window: int) -> train.Config:
    """The LM `lm` on windows of `window` tokens (the context grown to hold them)."""
    cfg = lm
    context = cfg.context_length or train.SIZES[cfg.size]().context_length
    return dataclasses.replace(cfg, seq_len=window, context_length=max(window, context))


def run_windows(ctx: Context) -> dict[str, Any]:
    """Whether a longer window puts the LM where the per-example mean matters (median μ̂²/σ̂²
    ≳ 1), the regime MicroAdamVar's instability claim is about: μ̂²/σ̂² (`measure_mu_sigma`)
    per window length at initialisation, and at the end of an Adam run for `Windows.trained`.
    No lr is chosen here (one lr for every window, stated), so `--select-seeds` is unused: the
    measurement is on the evaluation seeds."""
    windows: Windows = ctx.settings
    shared = ctx.shared
    seeds = scored_seeds(ctx.proto)
    trained = {
        w: [
            dataclasses.replace(
                window_config(shared.lm, w), optimizer="adam", lr=windows.lr, seed=s
            )
            for s in seeds
        ]
        for w in windows.trained
    }
    traces = dict(
        zip(
            [(w, c.seed) for w, cs in trained.items() for c in cs],
            sweep.run([c for cs in trained.values() for c in cs], cache=ctx.cache, log=print),
            strict=True,
        )
    )
    records: list[dict[str, Any]] = []
    for w in windows.lengths:
        cfg = window_config(shared.lm, w)
        points = [
            (s, "init", train.build(dataclasses.replace(cfg, seed=s)).task.params) for s in seeds
        ]
        points += [
            (s, "final Adam", t.params)
            for s in seeds
            if (t := traces.get((w, s))) is not None and t.status == "ok"
        ]
        for r in mu_sigma_records(cfg, points, shared):
            t = traces.get((w, r["seed"])) if r["point"] != "init" else None
            loss = None if t is None else float(t.eval_loss[-1])
            records.append({"window": w, **r, "final_loss": loss})
        print(f"  window {w}: measured {len(points)} points", flush=True)
    runs = [
        {
            "method": "Adam",
            "lr": windows.lr,
            "seed": c.seed,
            "phase": "evaluate",
            "window": w,
            "status": traces[w, c.seed].status,
            "code": traces[w, c.seed].code or UNKNOWN_CODE,
        }
        for w, cs in trained.items()
        for c in cs
    ]
    lines = [
        f"# μ̂²/σ̂² of the {TASK_NAMES['lm']} against its window length (seeds {seeds_text(seeds)})",
        "",
        *provenance_lines(ctx.prov)[:2],
        *code_lines(code_record(runs)),
        f"Protocol: a measurement, no lr chosen and no verdict; seeds {seeds_text(seeds)}.",
        "",
        "Per coordinate μ̂²/σ̂² from "
        f"{shared.snr_batches * shared.snr_batch_size} fresh examples per seed (experiments.py's "
        "docstring); median over coordinates, then median and range over the seeds. "
        f"Trained: Adam at lr {fmt_lr(windows.lr)} for {shared.lm.steps} steps of batch "
        f"{shared.lm.batch_size} (one lr for every window: not tuned per window).",
        "",
        "| window | point | median μ̂²/σ̂² (seed range) | fraction μ̂² > σ̂² | largest leaf median "
        "| held-out loss |",
        "|---|---|---|---|---|---|",
    ]
    for w in windows.lengths:
        for point in dict.fromkeys(r["point"] for r in records if r["window"] == w):
            rs = [r for r in records if r["window"] == w and r["point"] == point]
            med = [r["median_mu2_over_sigma2"] for r in rs]
            leaf = max(max(r["per_leaf_median"].values()) for r in rs)
            losses = [r["final_loss"] for r in rs if r["final_loss"] is not None]
            loss = f"{np.mean(losses):.3f}" if losses else "–"
            lines.append(
                f"| {w} | {point} | {np.median(med):.3g} ({min(med):.3g}–{max(med):.3g}) | "
                f"{np.median([r['frac_mu2_gt_sigma2'] for r in rs]):.3f} | {leaf:.3g} | {loss} |"
            )
    summary = {
        "experiment": "windows",
        **ctx.prov,
        "runs": runs,
        "code": code_record(runs),
        "mu2_over_sigma2": records,
        "configs": {
            str(w): dataclasses.asdict(window_config(shared.lm, w)) for w in windows.lengths
        },
    }
    (ctx.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (ctx.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2 - 2 * len(windows.lengths) :]), flush=True)
    return summary


register("windows", run_windows, order=90, usage=USAGE, presets=WINDOWS)
