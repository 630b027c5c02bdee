"""Preconditioners: Adam, MicroAdam and MicroAdamVar per regime, with μ̂²/σ̂² measured.

`python experiments.py precond` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import dataclasses
from typing import Any

import numpy as np

import train
from studies import register
from studies.protocol import (
    GRID3,
    LABELS,
    PRECOND_METHODS,
    Context,
    Study,
    Variant,
    measured_points,
    mu_sigma_records,
    say,
    scored_seeds,
    tune_and_score,
    verdicts_of,
    write_study,
)

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py precond --out results/precond     # Adam / MicroAdam / MicroAdamVar per
                                                        #   regime, with μ̂²/σ̂² measured
"""


@dataclasses.dataclass(frozen=True)
class Precond:
    """precond's settings: its regimes, each (name, task, config overrides), of which a study
    runs those of its task; each optimizer's starting lr grid (the same in every regime)."""

    regimes: tuple[tuple[str, str, dict[str, Any]], ...]
    lrs: dict[str, tuple[float, ...]]  # per method of PRECOND_METHODS


# fmt: off
PRECOND = {
    "smoke": Precond(regimes=(("MLP", "mlp", {}), ("MLP, noise 0", "mlp", {"noise": 0.0})),
                     lrs={m: (1e-3, 1e-2) for m in PRECOND_METHODS}),
    "tiny": Precond(regimes=(("LM, 32 tokens", "lm", {}), ("MLP, noise 1", "mlp", {"noise": 1.0}),
                             ("MLP, noise 0", "mlp", {"noise": 0.0})),
                    lrs={"adam": GRID3, "micro_adam": (3e-3, 1e-2, 3e-2),
                         "micro_adam_var": (3e-3, 1e-2, 3e-2)}),
    "small": Precond(regimes=(("LM, 64 tokens", "lm", {}),
                              ("LM, 128 tokens", "lm", {"seq_len": 128, "context_length": 128}),
                              ("MLP, noise 0", "mlp", {"noise": 0.0})),
                     lrs={m: (3e-4, 1e-3, 3e-3, 1e-2) for m in PRECOND_METHODS}),
    "paper": Precond(regimes=(("LM, 512 tokens", "lm", {}),),
                     lrs={m: (1e-4, 3e-4, 1e-3) for m in PRECOND_METHODS}),
}
# fmt: on


def run_precond(ctx: Context) -> dict[str, Any]:
    """Adam, MicroAdam and MicroAdamVar in each regime of the study's task (`--task` picks
    them: the LM's and the MLP's are separate studies), each lr chosen by the selection
    protocol; the three pairs' verdicts per regime, and μ̂²/σ̂² (`measure_mu_sigma`) per regime
    at initialisation and at each variant's scored runs: whether the per-example mean matters
    there (where it does not, MicroAdamVar and MicroAdam are nearly one optimizer)."""
    precond: Precond = ctx.settings
    shared = ctx.shared
    variants: list[Variant] = []
    regimes: dict[str, train.Config] = {}
    for regime, task, overrides in precond.regimes:
        if task != shared.task:
            continue  # `--task` picks the regimes: the LM's and the MLP's are separate studies
        cfg = dataclasses.replace(shared.config(task), **overrides)
        regimes[regime] = cfg
        variants += [
            Variant(
                f"{LABELS[m]} [{regime}]",
                dataclasses.replace(cfg, optimizer=m),
                precond.lrs[m],
                (("regime", regime),),
            )
            for m in PRECOND_METHODS
        ]
    variants, families = ctx.families(variants, {v.label: [v.label] for v in variants})
    study = tune_and_score(
        "precond",
        variants,
        families,
        ctx.proto,
        ctx.cache,
        shared.max_extensions,
    )
    pairs = [
        (f"{a} [{r}]", f"{b} [{r}]")
        for r in regimes
        for a, b in (("Adam", "MicroAdam"), ("MicroAdamVar", "MicroAdam"), ("MicroAdamVar", "Adam"))
    ]
    verdicts = verdicts_of(study, pairs, ctx.floor)
    say(verdicts)
    # μ̂²/σ̂² per regime: at init and at the final parameters of each variant's scored runs.
    ratios: list[dict[str, Any]] = []
    for regime, cfg in regimes.items():
        mine = Study(
            study.runs,
            study.proto,
            study.variants,
            study.held,
            study.same_seed,
            {f: t for f, t in study.held_traces.items() if f.endswith(f"[{regime}]")},
        )
        named = measured_points(cfg, mine, scored_seeds(ctx.proto))
        ratios += [{"regime": regime, **r} for r in mu_sigma_records(cfg, named, shared)]
    table = [
        "μ̂²/σ̂² per coordinate (median over coordinates; then median over the scored "
        "seeds), per regime, at init and at each variant's final parameters; per-leaf "
        "medians in summary.json:",
        "",
        "| regime | point | median μ̂²/σ̂² | fraction with μ̂² > σ̂² | leaf medians (min–max) |",
        "|---|---|---|---|---|",
    ]
    for regime in regimes:
        for point in dict.fromkeys(r["point"] for r in ratios if r["regime"] == regime):
            rs = [r for r in ratios if r["regime"] == regime and r["point"] == point]
            leaf = [v for r in rs for v in r["per_leaf_median"].values()]
            table.append(
                f"| {regime} | {point.replace(f' [{regime}]', '')} | "
                f"{np.median([r['median_mu2_over_sigma2'] for r in rs]):.3g} | "
                f"{np.median([r['frac_mu2_gt_sigma2'] for r in rs]):.3f} | "
                f"{min(leaf):.3g}–{max(leaf):.3g} |"
            )
    return write_study(
        ctx.out,
        "precond",
        "Preconditioners per regime (Adam, MicroAdam, MicroAdamVar)",
        study,
        verdicts,
        ctx.prov,
        table,
        {
            "mu2_over_sigma2": ratios,
            "regimes": {r: dataclasses.asdict(c) for r, c in regimes.items()},
        },
    )


register("precond", run_precond, order=40, usage=USAGE, presets=PRECOND)
