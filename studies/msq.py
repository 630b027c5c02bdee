"""MicroAdamMSQ: ε swept in both placements (and v̂ averaged over blocks), Adam the control.

`python experiments.py msq` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import pegrad
import train
from studies import register
from studies.precond import PRECOND
from studies.protocol import (
    EDGE,
    GRID3,
    TASK_NAMES,
    Context,
    Variant,
    _leaves,
    fmt_lr,
    say,
    scored_seeds,
    task_of,
    tune_and_score,
    verdicts_of,
    write_study,
)

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py msq --out results/msq             # MicroAdamMSQ's ε, both placements;
                                                        #   Adam the control
"""


@dataclasses.dataclass(frozen=True)
class Msq:
    """msq's settings: MicroAdamMSQ's ε (outside the root, inside it, and outside with v̂
    block-averaged), each with the starting grid `lrs`; Adam's (the control) grid; and the
    extensions per variant, more than the scale's: where ε dominates √ReLU(v̂) the step is
    about lr·m̂/ε (or lr·m̂/√ε inside the root), so the best lr moves with ε."""

    eps: tuple[float, ...]
    lrs: tuple[float, ...]
    adam_lrs: tuple[float, ...]
    max_extensions: int


# Adam's grid is precond's at the same scale.
# fmt: off
MSQ = {
    "smoke": Msq(eps=(1e-8, 1e-2), lrs=(1e-3, 1e-2), adam_lrs=PRECOND["smoke"].lrs["adam"],
                 max_extensions=1),
    "tiny": Msq(eps=(1e-8, 1e-6, 1e-4, 1e-3, 1e-2, 1e-1), lrs=GRID3,
                adam_lrs=PRECOND["tiny"].lrs["adam"], max_extensions=6),
    "small": Msq(eps=(1e-8, 1e-6, 1e-4, 1e-2), lrs=(3e-4, 1e-3, 3e-3),
                 adam_lrs=PRECOND["small"].lrs["adam"], max_extensions=6),
    "paper": Msq(eps=(1e-8, 1e-6, 1e-4, 1e-2), lrs=(1e-4, 3e-4, 1e-3),
                 adam_lrs=PRECOND["paper"].lrs["adam"], max_extensions=6),
}
# fmt: on


def frac_mu2_nonpositive(cfg: train.Config, seeds: Sequence[int]) -> list[float]:
    """Per seed: the fraction of coordinates with μ̂² = (B·ḡ² − q)/(B − 1) ≤ 0 on the first
    training batch at initialisation, the quantity MicroAdamMSQ's first step takes the root
    of (a coordinate at ≤ 0 gets the step m̂/ε)."""
    out = []
    for s in seeds:
        r = train.build(dataclasses.replace(cfg, seed=s))
        stats_fn = pegrad.value_and_grad_stats(r.task.loss_fn, ("mean", "sq_mean"), impl=cfg.impl)
        batch = r.task.sample(r.task.train_data, key=jax.random.fold_in(r.train_key, 0))
        _, st = jax.jit(stats_fn)(r.task.params, batch)
        g = np.concatenate([x for _, x in _leaves(st["mean"])])
        q = np.concatenate([x for _, x in _leaves(st["sq_mean"])])
        out.append(float(np.mean(cfg.batch_size * g * g - q <= 0)))
    return out


@dataclasses.dataclass(frozen=True)
class MsqArm:
    """One arm of the msq study: MicroAdamMSQ with each ε of the scale's grid put in `eps_field`,
    the other config fields `extra`."""

    name: str  # "placement" in summary.json
    prefix: str  # of each member's label, before its ε
    family: str
    root: str  # the preconditioner, in the summary's table
    eps_field: str  # "eps" (outside the root) or "eps_root" (inside it)
    extra: dict[str, Any]


# The two placements of ε, and v̂ averaged over blocks before the ReLU (the paper's open
# question; ε outside, as the paper places it). The first arm is the one the others are
# compared with.
MSQ_ARMS = (
    MsqArm("outside", "MicroAdamMSQ ε=", "MicroAdamMSQ √ReLU(v̂)+ε (ε and lr chosen)",
           "√ReLU(v̂) + ε", "eps", {}),
    MsqArm("inside", "MicroAdamMSQ ε_root=", "MicroAdamMSQ √(ReLU(v̂)+ε) (ε and lr chosen)",
           "√(ReLU(v̂) + ε)", "eps_root", {"eps": 0.0}),
    MsqArm("tensor", "MicroAdamMSQ ⟨v̂⟩tensor ε=",
           "MicroAdamMSQ √ReLU(⟨v̂⟩tensor)+ε (ε and lr chosen)", "√ReLU(⟨v̂⟩ over the leaf) + ε",
           "eps", {"msq_block": "tensor"}),
    MsqArm("row", "MicroAdamMSQ ⟨v̂⟩row ε=", "MicroAdamMSQ √ReLU(⟨v̂⟩row)+ε (ε and lr chosen)",
           "√ReLU(⟨v̂⟩ over a row) + ε", "eps", {"msq_block": "row"}),
)  # fmt: skip


def run_msq(ctx: Context) -> dict[str, Any]:
    """MicroAdamMSQ at every ε of each arm (`MSQ_ARMS`), a family per arm whose member (ε) and
    lr are chosen together by the selection protocol, against Adam and against the first arm
    (ε outside the root, as the paper places it); beside them the fraction of coordinates with
    μ̂² ≤ 0 on the first batch, where the first step is m̂/ε, and each ε's selection record."""
    settings: Msq = ctx.settings
    base = ctx.shared.config()
    arms: dict[str, list[Variant]] = {}
    for arm in MSQ_ARMS:
        msq = dataclasses.replace(base, optimizer="micro_adam_msq", **arm.extra)
        arms[arm.family] = [
            Variant(
                f"{arm.prefix}{e:g}", dataclasses.replace(msq, **{arm.eps_field: e}), settings.lrs
            )
            for e in settings.eps
        ]
    adam = Variant("Adam", dataclasses.replace(base, optimizer="adam"), settings.adam_lrs)
    families = {"Adam": ["Adam"], **{f: [v.label for v in vs] for f, vs in arms.items()}}
    variants, families = ctx.families([adam, *(v for vs in arms.values() for v in vs)], families)
    study = tune_and_score("msq", variants, families, ctx.proto, ctx.cache, settings.max_extensions)
    outside, *others = (arm.family for arm in MSQ_ARMS)
    pairs = [(f, "Adam") for f in (outside, *others)] + [(f, outside) for f in others]
    verdicts = verdicts_of(study, pairs, ctx.floor)
    say(verdicts)
    fracs = frac_mu2_nonpositive(base, scored_seeds(ctx.proto))
    per_eps = []
    kept = {v.label for v in variants}
    for arm, vs in zip(MSQ_ARMS, arms.values(), strict=True):
        for v in vs:
            if v.label not in kept:
                continue
            rec = study.variants[v.label]
            mine = [r for r in study.runs.rows if r["method"] == v.label]
            per_eps.append(
                {
                    "placement": arm.name,
                    "family": arm.family,
                    "eps": getattr(v.cfg, arm.eps_field),
                    "runs": len(mine),
                    "unstable": sum(r["final_loss"] is None for r in mine),
                    "grid": rec["grid"],
                    "extended_with": rec["extended_with"],
                    "chosen_lr": None if rec["chosen"] is None else rec["chosen"]["lr"],
                    "selection_mean": None if rec["chosen"] is None else rec["chosen"]["mean"],
                    "edge": rec["edge"],
                }
            )
    roots = {arm.name: arm.root for arm in MSQ_ARMS}
    table = (
        [
            f"At initialisation, on the first training batch (B = {base.batch_size}), μ̂² ≤ 0 on a "
            f"fraction {np.mean(fracs):.3f} of the coordinates (per seed: "
            f"{', '.join(f'{x:.3f}' for x in fracs)}): there the first step is m̂/ε with ε "
            "outside the root, m̂/√ε inside it.",
            "",
            f"Per placement and ε, on the selection seeds (every lr tried; grids grown at an edge "
            f"up to {settings.max_extensions} times):",
            "",
            "| preconditioner | ε | runs | unstable | lrs tried | chosen lr | "
            "selection mean final loss |",
            "|---|---|---|---|---|---|---|",
        ]
        + [
            f"| {roots[p['placement']]} | {p['eps']:g} | {p['runs']} | {p['unstable']} | "
            f"{', '.join(fmt_lr(x) for x in p['grid'])} | {fmt_lr(p['chosen_lr'])}"
            f"{' (' + EDGE + ')' if p['edge'] and p['chosen_lr'] else ''} | "
            f"{'–' if p['selection_mean'] is None else format(p['selection_mean'], '.4f')} |"
            for p in per_eps
        ]
        + [
            "",
            "The two placements are nearly a rescaling of ε: √v̂ + ε and √(v̂ + ε²) are equal "
            "at v̂ = 0 and as v̂ → ∞ and differ by at most √2 (at v̂ = ε²), so ε inside at ε_root "
            "is close to ε outside at √ε_root; a placement verdict at a coarse ε grid can be the "
            "grid's, not the placement's. Block-averaged (ε outside): ⟨v̂⟩ is v̂'s mean over the "
            "whole leaf (tensor) or over its last axis (row: eqx.nn.Linear's weight is [out, in], "
            "so one value per output unit), taken before the ReLU and broadcast back.",
        ]
    )
    return write_study(
        ctx.out,
        "msq",
        f"MicroAdamMSQ: ε swept in both placements, Adam the control ({TASK_NAMES[task_of(base)]})",
        study,
        verdicts,
        ctx.prov,
        table,
        {"frac_mu2_nonpositive_at_step_1": fracs, "per_eps": per_eps},
    )


register("msq", run_msq, order=50, usage=USAGE, presets=MSQ)
