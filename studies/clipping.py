"""Clipping: MicroAdam and Adam, unclipped and clipped at each threshold.

`python experiments.py clipping` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from studies import register
from studies.precond import PRECOND
from studies.protocol import (
    LABELS,
    TASK_NAMES,
    Context,
    NoiseFloor,
    Variant,
    compare,
    fmt_num,
    say,
    task_of,
    tune_and_score,
    verdicts_of,
    write_study,
)

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py clipping --out results/clipping   # MicroAdam and Adam, clipped
"""


@dataclasses.dataclass(frozen=True)
class Clipping:
    """clipping's settings: the thresholds (max_grad_norm) of clipped MicroAdam and clipped
    Adam, and each optimizer's starting lr grid (precond's at the same scale)."""

    thresholds: tuple[float, ...]
    lrs: dict[str, tuple[float, ...]]  # "micro_adam", "adam"


def _clipping(scale: str, thresholds: tuple[float, ...]) -> Clipping:
    return Clipping(thresholds, {m: PRECOND[scale].lrs[m] for m in ("micro_adam", "adam")})


CLIPPING = {
    "smoke": _clipping("smoke", (1e-2,)),
    **{s: _clipping(s, (1e-2, 1e-1, 1.0, 10.0)) for s in ("tiny", "small", "paper")},
}


def clip_label(method: str, c: float | None) -> str:
    return LABELS[method] if c is None else f"{LABELS[method]}, clip {c:g}"


def clip_gap(held: Mapping[str, dict[str, Any]], c: float | None) -> dict[str, Any] | None:
    """MicroAdam's final loss minus Adam's per scored seed, both at threshold c (None:
    unclipped; None on a seed where either is unstable), from the families' scores."""
    a, b = held.get(clip_label("micro_adam", c)), held.get(clip_label("adam", c))
    if a is None or b is None:
        return None
    per = {
        s: None
        if a["per_seed"][s] is None or b["per_seed"].get(s) is None
        else a["per_seed"][s] - b["per_seed"][s]
        for s in a["per_seed"]
    }
    return {"per_seed": per, "edge": a["edge"] or b["edge"]}


def clip_gap_verdict(
    held: Mapping[str, dict[str, Any]], c: float, floor: NoiseFloor | None = None
) -> dict[str, Any]:
    """Whether clipping both at c shrinks MicroAdam's gap to Adam: the paired verdict of the
    clipped gap against the unclipped one."""
    return compare(
        clip_gap(held, c),
        clip_gap(held, None),
        f"MicroAdam − Adam, both clipped at {c:g}",
        "MicroAdam − Adam, unclipped",
        lower="smaller",
        floor=floor,
    )


def run_clipping(ctx: Context) -> dict[str, Any]:
    """MicroAdam and Adam, unclipped and clipped at each threshold (the mean gradient's norm),
    each lr chosen by the selection protocol: each clipped variant against its unclipped self,
    MicroAdam against Adam at each threshold, and whether clipping both shrinks MicroAdam's gap
    to Adam (`clip_gap_verdict`); beside them how often each threshold acts."""
    clipping: Clipping = ctx.settings
    base = ctx.shared.config()
    thresholds = (None, *clipping.thresholds)
    variants = [
        Variant(
            clip_label(m, c),
            dataclasses.replace(base, optimizer=m, max_grad_norm=c),
            clipping.lrs[m],
        )
        for m in ("micro_adam", "adam")
        for c in thresholds
    ]
    variants, families = ctx.families(variants, {v.label: [v.label] for v in variants})
    study = tune_and_score(
        "clipping",
        variants,
        families,
        ctx.proto,
        ctx.cache,
        ctx.shared.max_extensions,
    )
    pairs = [("MicroAdam", "Adam")]
    for c in clipping.thresholds:
        pairs += [
            (clip_label("micro_adam", c), "MicroAdam"),
            (clip_label("adam", c), "Adam"),
            (clip_label("micro_adam", c), clip_label("adam", c)),
        ]
    verdicts = verdicts_of(study, pairs, ctx.floor)
    # Does clipping close MicroAdam's gap to Adam? The gap per seed, clipped vs not.
    held = study.held
    verdicts += [clip_gap_verdict(held, c, ctx.floor) for c in clipping.thresholds]
    say(verdicts)
    clipped = []  # how often the threshold acts: steps with ‖ḡ‖ above it, in the scored runs
    for fam, per_seed in study.held_traces.items():
        c = next(v.cfg.max_grad_norm for v in variants if v.label == held[fam]["member"])
        norms = np.concatenate([t.diagnostics["grad_norm"] for t in per_seed.values()])
        norms = norms[np.isfinite(norms)]
        clipped.append(
            {
                "variant": fam,
                "threshold": c,
                "median_grad_norm": float(np.median(norms)) if norms.size else None,
                "frac_steps_clipped": None
                if c is None or not norms.size
                else float(np.mean(norms > c)),
            }
        )
    table = [
        "‖ḡ‖ (the unclipped mean gradient) over the scored runs, and how often each "
        "threshold acts:",
        "",
        "| variant | median ‖ḡ‖ | fraction of steps clipped |",
        "|---|---|---|",
    ] + [
        f"| {x['variant']} | {fmt_num(x['median_grad_norm'], '.3g')} | "
        f"{fmt_num(x['frac_steps_clipped'], '.3f')} |"
        for x in clipped
    ]
    return write_study(
        ctx.out,
        "clipping",
        f"Clipping: MicroAdam and Adam at thresholds "
        f"{', '.join(f'{c:g}' for c in clipping.thresholds)} "
        f"({TASK_NAMES[task_of(base)]})",
        study,
        verdicts,
        ctx.prov,
        table,
        {"clipping": clipped},
    )


register("clipping", run_clipping, order=60, usage=USAGE, presets=CLIPPING)
