"""The noise floor (issue 39): the spread of a final loss under a perturbation that should not
matter. It has no settings of its own: its optimizers are those of sign and precond.

`python experiments.py noise-floor` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import sweep
import train
from studies import register
from studies.protocol import (
    LABELS,
    PLAIN_SIGN,
    PRECOND_METHODS,
    SIGN_METHODS,
    TASK_NAMES,
    ULP,
    Z975,
    Context,
    NoiseFloor,
    Point,
    Runs,
    Study,
    compare,
    fmt_lr,
    fmt_num,
    optimizer_of,
    say,
    scored,
    task_of,
    write_study,
)
from studies.sign import sign_variant

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py noise-floor --task lm --seeds 3-10 --lrs-from \
    results/precond-lm/summary.json,results/clipping-lm/summary.json,results/sign/summary.json \
    --out results/noise-floor-lm                        # the spread a null perturbation gives
"""


def noise_floor_config(ctx: Context, family: str) -> train.Config | None:
    """The config of a family a summary chose, by its optimizer (`optimizer_of`), or None
    where the noise floor does not measure it: a clipped variant, MSQ, another regime. A sign
    rule has the scale's sign β, a regime of precond its overrides."""
    name, shared = optimizer_of(family), ctx.shared
    if name == PLAIN_SIGN or name in (LABELS[m] for m in SIGN_METHODS):
        return (
            sign_variant(shared.config(), ctx.scale["sign"].momentum, name)
            if family == name
            else None
        )
    method = next((m for m in PRECOND_METHODS if LABELS[m] == name), None)
    if method is None:
        return None
    if family == name:
        return dataclasses.replace(shared.config(), optimizer=method)
    regimes = [
        o
        for r, t, o in ctx.scale["precond"].regimes
        if family == f"{name} [{r}]" and t == shared.task
    ]
    if not regimes:
        return None  # "MicroAdam, clip 0.01", or a regime of the other task
    return dataclasses.replace(shared.config(), optimizer=method, **regimes[0])


def ulp_up(lr: float) -> float:
    """lr moved up by one float32 ulp (the optimizer reads its lr in float32)."""
    return float(np.nextafter(np.float32(lr), np.float32(np.inf)))


def floor_table(floors: Mapping[str, dict[str, Any]]) -> list[str]:
    """The noise-floor summary's table: per optimizer its null differences and σ, and the floor
    of each pair of them at 5 and 10 seeds."""
    lines = [
        "Null differences δ = final loss with the lr one float32 ulp up − as chosen, per seed "
        "(the same initialisation, batches and held-out set): σ = RMS(δ)/√2 is the spread chaos "
        "alone gives one run's final loss. The floor of a verdict A vs B on n paired seeds is "
        "1.96·√((σ_A² + σ_B²)/n).",
        "",
        "| optimizer | lr | seeds | mean δ | sd δ | max abs δ | σ (one run) | sd of the loss "
        "over seeds | floor of itself vs itself, n = 5 | n = 10 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in floors.items():
        s = f["sigma"]
        at = {n: "–" if s is None else f"{Z975 * math.sqrt(2 * s**2 / n):.3f}" for n in (5, 10)}
        lines.append(
            f"| {name} | {fmt_lr(f['lr'])} | {f['seeds']} | {fmt_num(f['mean'], '+.4f')} | "
            f"{fmt_num(f['sd'], '.4f')} | {fmt_num(f['max_abs'], '.4f')} | {fmt_num(s, '.4f')} | "
            f"{fmt_num(f['loss_sd_over_seeds'], '.4f')} | {at[5]} | {at[10]} |"
        )
    sig = {k: f["sigma"] for k, f in floors.items() if f["sigma"] is not None}
    if len(sig) > 1:
        nf = NoiseFloor(sig, "")
        names = list(sig)
        lines += ["", "The floor of a pair (A vs B) at n = 5 and n = 10 paired seeds:", ""]
        lines += [
            f"- {a} vs {b}: {nf.floor(a, b, 5):.3f}, {nf.floor(a, b, 10):.3f}"
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        ]
    return lines


def null_floor(
    held: dict[str, Any], perturbed: dict[str, Any], seeds: Sequence[int]
) -> dict[str, Any]:
    """One optimizer's null differences (its scores as chosen, `held`, and one ulp up) and σ."""
    a, b = held["per_seed"], perturbed["per_seed"]
    delta = {s: b[s] - a[s] for s in seeds if a[s] is not None and b[s] is not None}
    d = np.array(list(delta.values()), np.float64)
    rms = float(np.sqrt(np.mean(d**2))) if d.size else None
    return {
        "lr": held["lr"],
        "lr_perturbed": perturbed["lr"],
        "perturbation": "lr + 1 float32 ulp",
        "seeds": len(delta),
        "null_diffs": delta,
        "mean": float(d.mean()) if d.size else None,
        "sd": float(d.std(ddof=1)) if d.size > 1 else None,
        "rms": rms,
        "max_abs": float(np.abs(d).max()) if d.size else None,
        "sigma": None if rms is None else rms / math.sqrt(2),
        "loss_sd_over_seeds": held["sd"],
    }


def run_noise_floor(ctx: Context) -> dict[str, Any]:
    """The noise floor: each optimizer a summary chose (`--lrs-from`), at its chosen lr, on
    each seed trained twice: as chosen, and with its lr moved by one float32 ulp (lr·(1 +
    2⁻²³): a perturbation that should not matter, as a last-bit change of the initial
    parameters would; it applies to every optimizer, where a clipping threshold no step reaches
    would not: the sign rules refuse clipping). The null differences δ_s = loss(perturbed) −
    loss(as chosen) measure how far chaos alone moves one run's final loss: per optimizer σ =
    RMS(δ)/√2 (δ is the difference of two runs, each carrying that noise; the RMS, not the sd,
    because δ's mean is 0 under the null and a bias would be noise too). The floor of a verdict
    A vs B on n paired seeds is then 1.96·√((σ_A² + σ_B²)/n), the 95 % half-width that this
    noise alone gives a mean of n paired differences (a side written "X − Y", the clipping gap,
    counts σ_X² + σ_Y²); a variant's σ is its optimizer's, the label up to its first ", " or
    " [" (clipped MicroAdam: MicroAdam's), and an optimizer not measured gets the largest σ
    measured (`NoiseFloor`). Beside the σ, a verdict of each twin against its original (which
    should be no difference)."""
    if ctx.proto.name != "fixed":
        raise ValueError("noise-floor takes each optimizer's lr from summaries: give --lrs-from")
    picked: dict[str, tuple[train.Config, float]] = {}  # optimizer -> config, lr
    for fam, _member, lr in ctx.proto.fixed:
        cfg = noise_floor_config(ctx, fam)
        if cfg is not None:
            picked[optimizer_of(fam)] = (cfg, lr)
    if ctx.only is not None:
        if unknown := [f for f in ctx.only if f not in picked]:
            raise ValueError(f"--only: {unknown} not among the optimizers found: {list(picked)}")
        picked = {k: v for k, v in picked.items() if k in ctx.only}
    if not picked:
        raise ValueError(f"--lrs-from {ctx.proto.source}: no optimizer the noise floor measures")
    seeds = ctx.proto.evaluate
    twins = {
        name: (
            (name, dataclasses.replace(cfg, lr=lr)),
            (name + ULP, dataclasses.replace(cfg, lr=ulp_up(lr))),
        )
        for name, (cfg, lr) in picked.items()
    }
    runs = Runs("noise-floor", ctx.cache)
    runs.train(
        "evaluate",
        [(Point(lb, c), s) for pair in twins.values() for lb, c in pair for s in seeds],
    )
    held: dict[str, dict[str, Any]] = {}
    held_traces: dict[str, dict[int, sweep.Trace]] = {}
    record: dict[str, dict[str, Any]] = {}
    for pair in twins.values():
        for lb, c in pair:
            per = {
                s: next(
                    r["final_loss"]
                    for r in runs.rows
                    if (r["method"], r["lr"], r["seed"]) == (lb, c.lr, s)
                )
                for s in seeds
            }
            held[lb] = scored(lb, c.lr, per) | {"member": lb}
            held_traces[lb] = {s: t for s in seeds if (t := runs.trace(lb, c.lr, s)) is not None}
            record[lb] = {
                "grid": [c.lr],
                "extended_with": [],
                "chosen": None,
                "edge": None,
                "lr_from": ctx.proto.source,
            }
    floors: dict[str, dict[str, Any]] = {}
    for name in twins:
        floors[name] = null_floor(held[name], held[name + ULP], seeds)
        print(f"  {name}: σ {fmt_num(floors[name]['sigma'], '.4f')}", flush=True)
    study = Study(runs, ctx.proto, record, held, {}, held_traces, tuple(held))
    verdicts = [compare(held[name + ULP], held[name], name + ULP, name) for name in twins]
    say(verdicts)
    task = task_of(ctx.shared.config())
    return write_study(
        ctx.out,
        "noise-floor",
        f"Noise floor ({TASK_NAMES[task]}): the final loss's spread under a last-bit change of "
        "the lr",
        study,
        verdicts,
        ctx.prov,
        floor_table(floors),
        {
            "noise_floor": floors,
            "task": task,
            "floor_rule": "floor(A vs B, n seeds) = 1.96 * sqrt((sigma_A^2 + sigma_B^2) / n), "
            "sigma = RMS(null differences) / sqrt(2); a variant's sigma is its optimizer's (its "
            "label up to ', ' or ' ['), the largest measured where that was not measured",
        },
    )


register("noise-floor", run_noise_floor, order=30, usage=USAGE, presets=None, in_all=False)
