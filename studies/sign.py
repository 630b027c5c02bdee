"""Sign placement: MicroSignSGD, SignSGD and SignEMA, with the SNR model's prediction.

`python experiments.py sign` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import dataclasses
from typing import Any

import train
from studies import register
from studies.protocol import (
    GRID3,
    LABELS,
    PLAIN_SIGN,
    SIGN_METHODS,
    TASK_NAMES,
    Context,
    Variant,
    measure_mu_sigma,
    measured_points,
    say,
    scored_seeds,
    snr_prediction,
    task_of,
    tune_and_score,
    verdicts_of,
    write_study,
)

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py sign --out results/sign           # sign placement, with the SNR model
"""


@dataclasses.dataclass(frozen=True)
class Sign:
    """sign's settings: each rule's starting lr grid, and β of every rule's EMA."""

    lrs: dict[str, tuple[float, ...]]  # per method of SIGN_METHODS
    momentum: float


# fmt: off
SIGN = {
    "smoke": Sign(lrs={m: (1e-3, 1e-2) for m in SIGN_METHODS}, momentum=0.9),
    "tiny": Sign(lrs={"micro_sign_sgd": (3e-4, 1e-3, 3e-3), "sign_sgd": GRID3,
                      "sign_ema": (3e-4, 1e-3, 3e-3)}, momentum=0.9),
    "small": Sign(lrs={"micro_sign_sgd": (3e-3, 1e-2, 3e-2), "sign_sgd": (3e-4, 1e-3, 3e-3),
                       "sign_ema": (3e-4, 1e-3, 3e-3)}, momentum=0.9),
    "paper": Sign(lrs={"micro_sign_sgd": (1e-3, 3e-3, 1e-2), "sign_sgd": (3e-5, 1e-4, 3e-4),
                       "sign_ema": (3e-5, 1e-4, 3e-4)}, momentum=0.9),
}
# fmt: on


def run_sign(ctx: Context) -> dict[str, Any]:
    """Where the sign goes: per example (MicroSignSGD), of the batch mean (SignSGD) or of its EMA
    (SignEMA), each rule's lr chosen by the selection protocol, the three pairs' verdicts; beside
    them the SNR model (`snr_prediction`) on μ̂²/σ̂² measured at initialisation and at each
    rule's scored run, per scored seed, and whether its predicted order is the observed one."""
    sign: Sign = ctx.settings
    shared, beta = ctx.shared, sign.momentum
    base = shared.config()
    variants = [
        Variant(LABELS[m], dataclasses.replace(base, optimizer=m, momentum=beta), sign.lrs[m])
        for m in SIGN_METHODS
    ]
    variants, families = ctx.families(variants, {v.label: [v.label] for v in variants})
    study = tune_and_score(
        "sign",
        variants,
        families,
        ctx.proto,
        ctx.cache,
        shared.max_extensions,
    )
    verdicts = verdicts_of(
        study,
        [("SignEMA", "SignSGD"), ("SignSGD", "MicroSignSGD"), ("SignEMA", "MicroSignSGD")],
        ctx.floor,
    )
    say(verdicts)
    # The SNR model per scored seed: at init and at each rule's scored run.
    named = measured_points(base, study, scored_seeds(ctx.proto))
    measured = measure_mu_sigma(
        base,
        [(s, p) for s, _, p in named],
        n_batches=shared.snr_batches,
        batch_size=shared.snr_batch_size,
    )
    snr: list[dict[str, Any]] = []
    for (seed, point, _), (mu2, sigma2, n, _names) in zip(named, measured, strict=True):
        outcome = {
            m: h["per_seed"].get(seed)
            for m in SIGN_METHODS
            if (h := study.held.get(LABELS[m])) is not None
        }
        outcome = {m: v for m, v in outcome.items() if v is not None}
        observed = sorted(outcome, key=lambda m: outcome[m])  # best first
        pred = snr_prediction(mu2, sigma2, base.batch_size, beta)
        predicted = sorted(SIGN_METHODS, key=lambda m: -pred[m])
        snr.append(
            {
                "seed": seed,
                "point": point,
                "examples": n,
                **pred,
                "predicted_order": " > ".join(LABELS[m] for m in predicted),
                "observed_order": " > ".join(LABELS[m] for m in observed),
                "order_agrees": [m for m in predicted if m in outcome] == observed,
            }
        )
    table = [
        f"SNR model (predicted alignment, higher is better; β = {beta:g}) against the outcome "
        "on each scored seed:",
        "",
        "| seed | point | MicroSignSGD | SignSGD | SignEMA | observed (best first) | agrees |",
        "|---|---|---|---|---|---|---|",
    ] + [
        f"| {e['seed']} | {e['point']} | {e['micro_sign_sgd']:.3f} | {e['sign_sgd']:.3f} | "
        f"{e['sign_ema']:.3f} | {e['observed_order']} | {e['order_agrees']} |"
        for e in snr
        if e["point"] == "init"
    ]
    return write_study(
        ctx.out,
        "sign",
        f"Sign placement ({TASK_NAMES[task_of(base)]}, β = "
        f"{beta:g}, B = {base.batch_size}, {base.steps} steps)",
        study,
        verdicts,
        ctx.prov,
        table,
        {"snr": snr, "momentum": beta},
    )


def sign_variant(base: train.Config, momentum: float, label: str) -> train.Config:
    """The config of a sign rule by its label: SignEMA and SignSGD with β = `momentum`, the
    paper's plain SignSGD with β = 0 (the sign of the batch-mean gradient, no EMA)."""
    if label == PLAIN_SIGN:
        return dataclasses.replace(base, optimizer="sign_sgd", momentum=0.0)
    method = next(m for m in SIGN_METHODS if LABELS[m] == label)
    return dataclasses.replace(base, optimizer=method, momentum=momentum)


register("sign", run_sign, order=10, usage=USAGE, presets=SIGN)
