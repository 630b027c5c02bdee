"""experiments.py: one command per finding of Roulet & Agarwala (arXiv 2510.00236), with plots.

    python experiments.py sign --scale tiny --out runs/sign          # sign placement, SNR model
    python experiments.py precond --scale tiny --out runs/precond    # Adam-family preconditioners
    python experiments.py batch-scaling --scale tiny --out runs/bs   # lr ∝ √B (Adam), ∝ B (Micro)
    python experiments.py overhead --scale tiny --out runs/overhead  # bench.py's cost table
    python experiments.py vectorize --scale tiny --out runs/vec      # runs/hour: vmap vs one by one
    python experiments.py all --scale tiny --out runs/all            # every one of them
    python experiments.py sign --seeds 5 ...                         # seeds 0..4 (default: 3)

This is the studies' one entry point (train.py trains one run). In Python:
`experiments.run(name, scale=..., out=..., seeds=3) -> summary dict`.

Every training study is a grid of `train.Config`s, each repeated for seeds 0..N-1, trained by
sweep.py: runs that differ only in the optimizer's numbers (lr, β, ε, clipping threshold) and
the seed are one vectorized program (vmap over a leading run axis), one program per optimizer
and batch size. Traces are cached in OUT/cache/ per program, so an interrupted study continues
and a re-run only redraws. Each study writes OUT/summary.csv (one row per run and seed),
OUT/summary.json (the grid, per-setting statistics over seeds, best settings, the verdicts) and
OUT/<name>.png (with matplotlib).

Scales (SCALES): `smoke` (tiny MLP, a few steps, 2 seeds: tests), `tiny` (the default "mini"
byte-level transformer LM of train.py at 32 tokens a window, 1000 steps, 3 seeds: a CPU study;
README's results), `small` and `paper` (larger, longer: for accelerators; not run here).

Definitions used in the summaries:

* final loss: the held-out loss at the end (train.py's eval: cfg.eval_batches batches drawn from
  the run's seed). A run whose loss or update became NaN/Inf is "diverged" at that step (sweep.py
  freezes it there; it has no final loss); a finished run whose final loss is above its initial
  one "blew up" (a finite explosion). Both count as unstable.
* spike: after warmup, a training loss (of one step's batch) above SPIKE_FACTOR (2) times the
  running minimum of the training losses so far; consecutive spiking steps are one spike.
* per setting (an optimizer variant at one lr): mean, sd, min and max of the final loss over
  the seeds; a setting with an unstable seed has no mean. The best lr of a variant is the
  setting with the lowest mean.
* verdict of "A vs B": both at their best lr, the per-seed differences d_s = loss_A − loss_B
  (paired: one seed is one initialisation, batch order and held-out set for both). "consistent"
  when every seed agrees on the sign of d and |mean d| > 2·sd(d)/√n; "no difference" when
  |mean d| ≤ sd(d)/√n; otherwise "weak". The best lr is chosen on the same seeds, which favours
  each method a little; a few seeds make every verdict provisional.
* mean-dominated coordinates (train.diagnostics, every step, from the training batch): the
  fraction of coordinates with μ̂² > σ̂²/B, i.e. where the squared mean outweighs the noise of
  ḡ in Adam's ν = μ² + σ²/B.
* SNR model (SPEC §4, `snr_prediction`): per coordinate g_i ~ N(μ, σ²). The expected update
  direction of each sign rule is E[sign(g_i)] = erf(μ/(√2σ)) (MicroSignSGD: sign before the
  average), E[sign(ḡ)] = erf(√B μ/(√2σ)) (SignSGD) and ≈ erf(√(B(1+β)/(1−β)) μ/(√2σ)) (SignEMA:
  the EMA averages (1+β)/(1−β) times more steps). The predicted alignment of a rule is the
  expected descent per step relative to sign(μ): Σ_j |μ_j|·erf(k|μ_j|/(√2σ_j)) / Σ_j |μ_j|, in
  [0, 1], higher is better. μ and σ are measured with pegrad ("mean", "sq_mean") on
  `snr_batches` fresh batches of `snr_batch_size` examples (N in all) at each seed's
  initialisation and at the final parameters of each rule's best run of that seed. Estimators:
  μ² ≈ max(0, (N·ḡ² − q)/(N − 1)) (unbiased, clamped), σ² = N/(N − 1)·(q − ḡ²).
"""

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pegrad
import plots
import sweep
import train

EXPERIMENTS = ("sign", "precond", "batch-scaling", "overhead", "vectorize")
TASK_NAMES = {"mlp": "MLP teacher-student", "lm": "byte-level LM"}  # in figure titles
SIGN_METHODS = ("micro_sign_sgd", "sign_sgd", "sign_ema")
ADAM_METHODS = ("adam", "micro_adam", "micro_adam_var", "micro_adam_msq")
LABELS = {
    "micro_sign_sgd": "MicroSignSGD",
    "sign_sgd": "SignSGD",
    "sign_ema": "SignEMA",
    "adam": "Adam",
    "micro_adam": "MicroAdam",
    "micro_adam_var": "MicroAdamVar",
    "micro_adam_msq": "MicroAdamMSQ",
}
SPIKE_FACTOR = 2.0
PAPER_CLIP = 1e-2  # the paper's clipping threshold for MicroAdam's spikes

# fmt: off
CSV_COLUMNS = (
    "experiment", "task", "method", "optimizer", "lr", "lr_mult", "momentum", "eps",
    "max_grad_norm", "msq_block", "batch_size", "steps", "examples", "seed", "status",
    "diverged_step", "first_eval_loss", "final_loss", "final_train_loss", "spikes",
    "final_frac_mean_dominated", "seconds",
)
# fmt: on


# --------------------------------------------------------------------------------------------
# Scales: the base configs of the two tasks and the grids of each experiment.


@dataclasses.dataclass(frozen=True)
class Scale:
    task: str  # "lm" or "mlp": the task of every training study at this scale
    lm: train.Config  # byte-level transformer LM on CPython's English text
    mlp: train.Config  # teacher-student regression (label noise sets the gradient SNR)
    seeds: int  # default --seeds
    sign_lrs: dict[str, tuple[float, ...]]  # per sign rule
    sign_momenta: tuple[float, ...]  # β of SignSGD and SignEMA; MicroSignSGD runs the first
    precond_lrs: tuple[float, ...]
    var_batch_size: int  # MicroAdamVar (and Adam, the control) again at this larger batch...
    var_steps: int  # ...for this many steps, where its instability should show
    var_lrs: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    batch_base: int  # B₀ of lr = mult·lr₀·(B/B₀)^p
    batch_examples: int  # examples seen by every run: steps = examples // B
    batch_lr0: dict[str, float]  # lr₀ per method at B₀
    batch_lr_mults: tuple[float, ...]
    snr_batches: int
    snr_batch_size: int
    vectorize_runs: int  # runs of the timed group (lrs × seeds); the sequential side times...
    vectorize_sequential: int  # ...this many of them one by one with train.main
    bench: dict[str, Any]  # bench.Config overrides ("quick": True for bench's --quick)


def _mlp(size: str, **kw: Any) -> train.Config:
    base = dict(model="mlp", size=size, noise=1.0, schedule="cosine", checkpoint_interval=10**9)
    return train.Config(**{**base, **kw})


def _lm(size: str, **kw: Any) -> train.Config:
    base = dict(model="transformer", size=size, schedule="cosine", checkpoint_interval=10**9)
    return train.Config(**{**base, **kw})


# fmt: off
SCALES: dict[str, Scale] = {
    "smoke": Scale(  # seconds per program, MLP: for tests
        task="mlp",
        mlp=_mlp("tiny", steps=4, warmup=1, batch_size=8, eval_interval=2, eval_batches=1),
        lm=_lm("tiny", n_layers=1, seq_len=8, steps=4, warmup=1, batch_size=4, eval_interval=2,
               eval_batches=1),
        seeds=2,
        sign_lrs={m: (1e-3, 1e-2) for m in SIGN_METHODS}, sign_momenta=(0.9, 0.99),
        # The larger-B runs at the base's B and steps: one program with the main grid's.
        precond_lrs=(1e-2,), var_batch_size=8, var_steps=4, var_lrs=(1e-2,),
        batch_sizes=(8, 16), batch_base=8, batch_examples=32,
        batch_lr0={"adam": 1e-2, "micro_adam": 1e-2}, batch_lr_mults=(1.0, 2.0),
        snr_batches=1, snr_batch_size=8, vectorize_runs=4, vectorize_sequential=2,
        bench=dict(quick=True, sections=("mlp",), stat_sets=("mean+sq_mean",), reps=1,
                   min_time_s=0.0, mlp_in=16, mlp_width=32, mlp_depth=2, mlp_batch=8,
                   mlp_batch_sizes=(8,)),
    ),
    "tiny": Scale(  # the default "mini" LM (120k parameters), 32-token windows, on a 2-core CPU
        task="lm",
        mlp=_mlp("mini", steps=1000, warmup=50, batch_size=32, eval_interval=200,
                 eval_batches=32),
        lm=_lm("mini", seq_len=32, steps=1000, warmup=50, batch_size=16, eval_interval=200,
               eval_batches=16),
        seeds=3,
        # Grown (twice) where a pass found a best lr at the grid's lower edge.
        sign_lrs={"micro_sign_sgd": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
                  "sign_sgd": (3e-4, 1e-3, 3e-3, 1e-2),
                  "sign_ema": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)},
        sign_momenta=(0.9, 0.99),
        precond_lrs=(1e-3, 3e-3, 1e-2), var_batch_size=64, var_steps=500, var_lrs=(1e-3, 3e-3),
        batch_sizes=(8, 16, 32, 64, 128, 256), batch_base=32, batch_examples=8192,
        batch_lr0={"adam": 2e-3, "micro_adam": 4e-3},
        batch_lr_mults=(0.25, 0.5, 1.0, 2.0, 4.0),
        snr_batches=8, snr_batch_size=128, vectorize_runs=9, vectorize_sequential=3,
        bench=dict(quick=True),
    ),
    "small": Scale(  # an hour or more per study on a CPU
        task="lm",
        mlp=_mlp("small", steps=2000, warmup=100, batch_size=32, eval_interval=250,
                 eval_batches=32),
        lm=_lm("small", seq_len=64, steps=2000, warmup=100, batch_size=32, eval_interval=250,
               eval_batches=16),
        seeds=3,
        sign_lrs={"micro_sign_sgd": (3e-3, 1e-2, 3e-2, 1e-1), "sign_sgd": (3e-4, 1e-3, 3e-3, 1e-2),
                  "sign_ema": (3e-4, 1e-3, 3e-3, 1e-2)},
        sign_momenta=(0.9, 0.99),
        precond_lrs=(3e-4, 1e-3, 3e-3, 1e-2), var_batch_size=128, var_steps=2000,
        var_lrs=(3e-4, 1e-3, 3e-3),
        batch_sizes=(8, 16, 32, 64, 128, 256), batch_base=32, batch_examples=32 * 2000,
        batch_lr0={"adam": 2e-3, "micro_adam": 8e-3}, batch_lr_mults=(0.25, 0.5, 1.0, 2.0, 4.0),
        snr_batches=16, snr_batch_size=128, vectorize_runs=12, vectorize_sequential=2,
        bench=dict(),
    ),
    "paper": Scale(  # the paper's transformer shape (TransformerConfig.paper()): accelerators
        task="lm",
        mlp=_mlp("paper", steps=5000, warmup=250, batch_size=64, eval_interval=500,
                 eval_batches=32),
        lm=_lm("paper", seq_len=512, steps=5000, warmup=250, batch_size=64, eval_interval=250,
               eval_batches=16),
        seeds=3,
        sign_lrs={"micro_sign_sgd": (1e-3, 3e-3, 1e-2, 3e-2), "sign_sgd": (3e-5, 1e-4, 3e-4, 1e-3),
                  "sign_ema": (3e-5, 1e-4, 3e-4, 1e-3)},
        sign_momenta=(0.9, 0.99),
        precond_lrs=(1e-4, 3e-4, 1e-3, 3e-3), var_batch_size=256, var_steps=5000,
        var_lrs=(1e-4, 3e-4, 1e-3),
        batch_sizes=(8, 16, 32, 64, 128, 256), batch_base=64, batch_examples=64 * 5000,
        batch_lr0={"adam": 6e-4, "micro_adam": 2.4e-3}, batch_lr_mults=(0.25, 0.5, 1.0, 2.0, 4.0),
        snr_batches=16, snr_batch_size=32, vectorize_runs=8, vectorize_sequential=1,
        bench=dict(),
    ),
}
# fmt: on


def base_config(scale: Scale) -> train.Config:
    return scale.lm if scale.task == "lm" else scale.mlp


# --------------------------------------------------------------------------------------------
# Runs: a grid of (labels, config) points, each for every seed, trained by sweep.py.


@dataclasses.dataclass(frozen=True)
class Point:
    """One setting of a grid: its labels (method, and what varies) and its config (seed 0)."""

    method: str  # a variant's label, e.g. "MicroAdamMSQ (row)"
    cfg: train.Config
    extra: tuple[tuple[str, Any], ...] = ()  # further labels, e.g. (("lr_mult", 2.0),)


def count_spikes(losses: Sequence[float], warmup: int) -> int:
    """Spikes in per-step training losses (index = step): after warmup, a loss above
    SPIKE_FACTOR × the running minimum; consecutive spiking steps are one spike. NaN (a diverged
    run's steps after divergence) is skipped."""
    spikes, low, inside = 0, math.inf, False
    for step, loss in enumerate(losses):
        if step < warmup or not math.isfinite(loss):
            continue
        spiking = loss > SPIKE_FACTOR * low
        spikes += spiking and not inside
        inside, low = spiking, min(low, loss)
    return spikes


def row_of(experiment: str, point: Point, trace: sweep.Trace) -> dict[str, Any]:
    cfg = trace.cfg
    first, final = float(trace.eval_loss[0]), float(trace.eval_loss[-1])
    status = trace.status
    if status == "ok" and final > first:
        status = "blew_up"  # finite but worse than at initialisation
    tail = trace.loss[-max(1, cfg.steps // 20) :]  # the last 5% of the steps
    frac = trace.diagnostics["frac_snr_gt_1_over_B"][-max(1, cfg.steps // 20) :]
    return {
        "experiment": experiment,
        "task": "lm" if cfg.model == "transformer" else "mlp",
        "method": point.method,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "lr_mult": None,
        "momentum": cfg.momentum,
        "eps": cfg.eps,
        "max_grad_norm": cfg.max_grad_norm,
        "msq_block": cfg.msq_block,
        **dict(point.extra),
        "batch_size": cfg.batch_size,
        "steps": cfg.steps,
        "examples": cfg.steps * cfg.batch_size,
        "seed": cfg.seed,
        "status": status,
        "diverged_step": trace.diverged_step,
        "first_eval_loss": first,
        "final_loss": final if status == "ok" else None,
        "final_train_loss": float(np.mean(tail)) if trace.status == "ok" else None,
        "spikes": count_spikes(trace.loss.tolist(), cfg.warmup),
        "final_frac_mean_dominated": float(np.mean(frac)) if trace.status == "ok" else None,
        "seconds": round(trace.seconds, 2),
    }


def execute(
    experiment: str, points: Sequence[Point], seeds: int, out: Path
) -> tuple[list[dict[str, Any]], list[sweep.Trace]]:
    """Every point for seeds 0..seeds−1 (sweep.run, cached in OUT/cache); rows and traces in
    the order point-major, seed-minor."""
    configs = [dataclasses.replace(p.cfg, seed=s) for p in points for s in range(seeds)]
    t0 = time.perf_counter()
    log = lambda message: print(f"  [{time.perf_counter() - t0:6.0f}s] {message}", flush=True)
    traces = sweep.run(configs, cache=out / "cache", log=log)
    rows = [
        row_of(experiment, p, t)
        for p, t in zip([p for p in points for _ in range(seeds)], traces, strict=True)
    ]
    return rows, traces


def aggregate(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Per setting (rows equal in `keys`): the final loss over seeds (see the docstring)."""
    found: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        found.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for values, mine in found.items():
        losses = {r["seed"]: r["final_loss"] for r in mine}
        ok = [v for v in losses.values() if v is not None]
        unstable = len(ok) < len(mine)
        out.append(
            {
                **dict(zip(keys, values, strict=True)),
                "seeds": len(mine),
                "seeds_ok": len(ok),
                "unstable": unstable,
                "mean": None if unstable else float(np.mean(ok)),
                "sd": None if unstable or len(ok) < 2 else float(np.std(ok, ddof=1)),
                "min": min(ok) if ok else None,
                "max": max(ok) if ok else None,
                "spikes": sum(r["spikes"] for r in mine),
                "runs_with_spikes": sum(r["spikes"] > 0 for r in mine),
                "diverged": sum(r["status"] == "diverged" for r in mine),
                "blew_up": sum(r["status"] == "blew_up" for r in mine),
                "per_seed": losses,
            }
        )
    return out


def best(aggs: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, dict[str, Any]]:
    """Per group of `keys`, the stable setting with the lowest mean final loss."""
    out: dict[tuple, dict[str, Any]] = {}
    for a in aggs:
        group = tuple(a[k] for k in keys)
        if a["mean"] is not None and (group not in out or a["mean"] < out[group]["mean"]):
            out[group] = a
    return out


def compare(a: dict[str, Any] | None, b: dict[str, Any] | None, name_a: str, name_b: str):
    """The paired verdict of A vs B (docstring): lower loss is better."""
    if a is None or b is None:
        missing = name_a if a is None else name_b
        return {"a": name_a, "b": name_b, "verdict": f"no verdict: {missing} has no stable lr"}
    seeds = sorted(set(a["per_seed"]) & set(b["per_seed"]))
    d = np.array([a["per_seed"][s] - b["per_seed"][s] for s in seeds])
    n, mean = len(d), float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
    agree = int((d < 0).sum()) if mean < 0 else int((d > 0).sum())
    better, worse = (name_a, name_b) if mean < 0 else (name_b, name_a)
    if abs(mean) <= se:
        verdict = f"no difference: {name_a} − {name_b} = {mean:+.4f}, within its seed error"
    else:
        strength = "consistent" if agree == n and abs(mean) > 2 * se else "weak"
        verdict = (
            f"{strength}: {better} better than {worse} by {abs(mean):.4f} "
            f"({agree}/{n} seeds agree, paired sd {se * math.sqrt(n):.4f})"
        )
    return {
        "a": name_a,
        "b": name_b,
        "lr_a": a.get("lr"),
        "lr_b": b.get("lr"),
        "mean_diff": mean,
        "se": se if n > 1 else None,
        "seeds": n,
        "seeds_agreeing": agree,
        "per_seed_diff": dict(zip(seeds, d.tolist(), strict=True)),
        "verdict": verdict,
    }


def write_summary(out: Path, rows: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in CSV_COLUMNS})
    (out / "summary.json").write_text(json.dumps({**summary, "runs": list(rows)}, indent=1))


def fmt_lr(lr: float) -> str:
    return f"{lr:.3g}"


def fmt_loss(a: dict[str, Any]) -> str:
    """A setting's final loss over seeds: mean ± sd (min–max)."""
    if a["mean"] is None:
        return f"unstable ({a['seeds'] - a['seeds_ok']}/{a['seeds']} seeds)"
    sd = "" if a["sd"] is None else f" ± {a['sd']:.3f}"
    return f"{a['mean']:.3f}{sd} ({a['min']:.3f}–{a['max']:.3f})"


def markdown(
    out: Path,
    title: str,
    best_rows: Sequence[dict[str, Any]],
    verdicts: Sequence[dict[str, Any]],
    *extra: str,
) -> None:
    """OUT/summary.md: the best setting of each variant and the verdicts, for people."""
    lines = [f"# {title}\n", "| variant | best lr | final loss: mean ± sd (min–max) | seeds |",
             "|---|---|---|---|"]  # fmt: skip
    for a in best_rows:
        lines.append(f"| {a['method']} | {fmt_lr(a['lr'])} | {fmt_loss(a)} | {a['seeds']} |")
    lines += ["", "Verdicts (paired over seeds, each at its best lr):", ""]
    lines += [f"- {v['a']} vs {v['b']}: {v['verdict']}" for v in verdicts]
    (out / "summary.md").write_text("\n".join([*lines, "", *extra]) + "\n")


def say(verdicts: Sequence[dict[str, Any]]) -> None:
    for v in verdicts:
        print(f"  {v['a']} vs {v['b']}: {v['verdict']}", flush=True)


def curves_of(
    traces: Sequence[sweep.Trace], key: str = "loss", bins: int = 100
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(steps, per-run binned series) of one setting's seeds."""
    series = [t.loss if key == "loss" else t.diagnostics[key] for t in traces]
    x = plots.binned(series[0], bins)[0]
    return x, [plots.binned(s, bins)[1] for s in series]


def traces_of(
    rows: Sequence[dict[str, Any]], traces: Sequence[sweep.Trace], **match: Any
) -> list[sweep.Trace]:
    return [
        t for r, t in zip(rows, traces, strict=True) if all(r[k] == v for k, v in match.items())
    ]


# --------------------------------------------------------------------------------------------
# 1. Sign placement, with the SNR model's prediction.


def _flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def measure_mu_sigma(
    cfg: train.Config, points: Sequence[tuple[int, Any]], *, n_batches: int, batch_size: int
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """For each (seed, parameter pytree) in `points`: per-coordinate μ̂² (unbiased, clamped at
    0) and σ̂² over n_batches·batch_size fresh training examples of that seed's data stream
    (steps beyond any run's), from pegrad's "mean" and "sq_mean" (one compile for all)."""
    runs = {s: train.build(dataclasses.replace(cfg, seed=s, batch_size=batch_size))
            for s in dict.fromkeys(s for s, _ in points)}  # fmt: skip
    task = next(iter(runs.values())).task  # every seed's model has the same structure
    stats_fn = jax.jit(
        pegrad.value_and_grad_stats(task.loss_fn, ("mean", "sq_mean"), impl=cfg.impl)
    )
    sample = jax.jit(task.sample)
    batches = {
        s: [sample(r.task.train_data, key=jax.random.fold_in(r.train_key, 10**8 + k))
            for k in range(n_batches)]
        for s, r in runs.items()
    }  # fmt: skip
    n = n_batches * batch_size
    results = []
    for seed, params in points:
        g = q = np.zeros(())
        for batch in batches[seed]:
            _, stats = stats_fn(params, batch)
            g = g + _flat(stats["mean"]) / n_batches
            q = q + _flat(stats["sq_mean"]) / n_batches
        mu2 = np.maximum((n * g * g - q) / (n - 1), 0.0)
        sigma2 = np.maximum(n / (n - 1) * (q - g * g), 0.0)
        results.append((mu2, sigma2, n))
    return results


def snr_prediction(
    mu2: np.ndarray, sigma2: np.ndarray, batch_size: int, momentum: float
) -> dict[str, float]:
    """Predicted alignment Σ|μ|·erf(k|μ|/(√2σ))/Σ|μ| of each sign rule (module docstring)."""
    mu, sigma = np.sqrt(mu2), np.sqrt(sigma2)
    ks = {
        "micro_sign_sgd": 1.0,
        "sign_sgd": math.sqrt(batch_size),
        "sign_ema": math.sqrt(batch_size * (1 + momentum) / (1 - momentum)),
    }
    total = float(mu.sum())
    out: dict[str, float] = {}
    for method, k in ks.items():
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(sigma > 0, k * mu / (math.sqrt(2) * sigma), np.inf)
        erf = np.asarray(jax.scipy.special.erf(jnp.asarray(np.minimum(z, 10.0))))
        out[method] = float((mu * erf).sum() / total) if total > 0 else float("nan")
    out["frac_snr_gt_1_over_B"] = float(np.mean(mu2 > sigma2 / batch_size))
    return out


def sign_label(method: str, momentum: float) -> str:
    return f"{LABELS[method]} β={momentum:g}"


def run_sign(scale: Scale, out: Path, seeds: int) -> dict[str, Any]:
    base = base_config(scale)
    task = "lm" if base.model == "transformer" else "mlp"
    same = scale.sign_momenta[0]  # "the same β": every rule at it
    points = [
        Point(sign_label(m, beta), dataclasses.replace(base, optimizer=m, lr=lr, momentum=beta))
        for m in SIGN_METHODS
        for beta in (scale.sign_momenta[:1] if m == "micro_sign_sgd" else scale.sign_momenta)
        for lr in scale.sign_lrs[m]
    ]
    rows, traces = execute("sign", points, seeds, out)
    aggs = aggregate(rows, ("method", "optimizer", "momentum", "lr"))
    best_of = best(aggs, ("optimizer", "momentum"))  # each rule at each β
    preferred = best(aggs, ("optimizer",))  # each rule at the β (and lr) it prefers
    at = lambda m, beta: best_of.get((m, beta))
    verdicts = [
        compare(at("sign_ema", same), at("sign_sgd", same), f"SignEMA β={same:g}",
                f"SignSGD β={same:g}"),
        compare(at("sign_sgd", same), at("micro_sign_sgd", same), f"SignSGD β={same:g}",
                f"MicroSignSGD β={same:g}"),
        compare(at("sign_ema", same), at("micro_sign_sgd", same), f"SignEMA β={same:g}",
                f"MicroSignSGD β={same:g}"),
    ]  # fmt: skip
    pe, ps = preferred.get(("sign_ema",)), preferred.get(("sign_sgd",))
    if pe is not None and ps is not None:
        verdicts.append(
            compare(pe, ps, f"SignEMA β={pe['momentum']:g} (its best β)",
                    f"SignSGD β={ps['momentum']:g} (its best β)")
        )  # fmt: skip
    say(verdicts)

    # The SNR model per seed: at the initialisation and at each rule's best run (same β).
    named: list[tuple[int, str, Any]] = []  # (seed, point, params)
    for seed in range(seeds):
        init = train.build(dataclasses.replace(base, seed=seed)).task.params
        named.append((seed, "init", init))
        for m in SIGN_METHODS:
            if (a := at(m, same)) is not None:
                (t,) = traces_of(rows, traces, optimizer=m, momentum=same, lr=a["lr"], seed=seed)
                named.append((seed, f"final {LABELS[m]}", t.params))
    measured = measure_mu_sigma(
        base,
        [(seed, params) for seed, _, params in named],
        n_batches=scale.snr_batches,
        batch_size=scale.snr_batch_size,
    )
    snr: list[dict[str, Any]] = []
    for (seed, point, _), (mu2, sigma2, n) in zip(named, measured, strict=True):
        outcome = {m: a["per_seed"][seed] for m in SIGN_METHODS if (a := at(m, same)) is not None}
        observed = sorted(outcome, key=lambda m: outcome[m])  # best first
        pred = snr_prediction(mu2, sigma2, base.batch_size, same)
        predicted = sorted(SIGN_METHODS, key=lambda m: -pred[m])
        snr.append(
            {
                "seed": seed,
                "point": point,
                "examples": n,
                **pred,
                "predicted_order": " > ".join(LABELS[m] for m in predicted),
                "observed_order": " > ".join(LABELS[m] for m in observed),
                "order_agrees": predicted == observed,
                **{f"final_loss_{m}": outcome.get(m) for m in SIGN_METHODS},
            }
        )
        print(
            f"  SNR seed {seed} at {point}: "
            + "  ".join(f"{LABELS[m]} {pred[m]:.3f}" for m in SIGN_METHODS)
            + f"; observed {snr[-1]['observed_order']}",
            flush=True,
        )

    summary = {
        "experiment": "sign",
        "task": task,
        "seeds": seeds,
        "same_momentum": same,
        "momenta": scale.sign_momenta,
        "settings": aggs,
        "best_per_rule_and_beta": [dict(a) for a in best_of.values()],
        "best_per_rule": [dict(a) for a in preferred.values()],
        "verdicts": verdicts,
        "snr": snr,
        "snr_note": "predicted alignment = Σ|μ|·erf(k|μ|/(√2σ))/Σ|μ| (higher is better), "
        "k = 1 (MicroSignSGD), √B (SignSGD), √(B(1+β)/(1−β)) (SignEMA), β = the same β; μ, σ "
        "from pegrad mean/sq_mean on snr_batches × snr_batch_size fresh examples",
    }
    write_summary(out, rows, summary)
    snr_table = [
        "SNR model (predicted alignment, higher is better) vs the outcome (final loss at each "
        f"rule's best lr, β = {same:g}), per seed:",
        "",
        "| seed | point | MicroSignSGD | SignSGD | SignEMA | observed (best first) | agrees |",
        "|---|---|---|---|---|---|---|",
    ] + [
        f"| {e['seed']} | {e['point']} | {e['micro_sign_sgd']:.3f} | {e['sign_sgd']:.3f} | "
        f"{e['sign_ema']:.3f} | {e['observed_order']} | {e['order_agrees']} |"
        for e in snr
    ]
    ordered = sorted(best_of.values(), key=lambda a: a["method"])
    markdown(out, f"Sign placement ({TASK_NAMES[task]}, {seeds} seeds)", ordered, verdicts,
             *snr_table)  # fmt: skip
    with open(out / "snr.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(snr[0]) if snr else ["seed"])
        writer.writeheader()
        writer.writerows(snr)
    if plt := plots.pyplot():
        fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
        series: dict[str, list[dict[str, Any]]] = {}
        for a in aggs:
            series.setdefault(a["method"], []).append(a)
        color = plots.colors(list(series))
        plots.lr_sweep(axes[0], series, f"{TASK_NAMES[task]}: final loss vs lr", color=color)
        for ax, key in ((axes[1], "loss"), (axes[2], "frac_snr_gt_1_over_B")):
            for a in sorted(best_of.values(), key=lambda a: list(series).index(a["method"])):
                mine = traces_of(rows, traces, method=a["method"], lr=a["lr"])
                x, runs = curves_of(mine, key)
                label = f"{a['method']} (lr {fmt_lr(a['lr'])})"
                plots.band(ax, x, runs, color[a["method"]], label)
            if key == "loss":
                ax.set_yscale("log")
        plots.finish(axes[1], "training loss at each best lr (band: seeds' min–max)", "step",
                     "training loss (binned)")  # fmt: skip
        plots.finish(axes[2], "mean-dominated coordinates: μ̂² > σ̂²/B on the training batch",
                     "step", "fraction of coordinates")  # fmt: skip
        ax = axes[3]
        width = 0.8 / len(SIGN_METHODS)
        entries = [s for s in snr if s["point"] == "init"]
        for i, m in enumerate(SIGN_METHODS):
            xs = [j + (i - 1) * width for j in range(len(entries))]
            ax.bar(
                xs, [s[m] for s in entries], width, color=f"C{i}", label=f"{LABELS[m]}: predicted"
            )
        twin = ax.twinx()
        for i, m in enumerate(SIGN_METHODS):
            xs = [j + (i - 1) * width for j in range(len(entries))]
            twin.plot(xs, [s[f"final_loss_{m}"] for s in entries], "k_", ms=14, mew=2)
            twin.plot(xs, [s[f"final_loss_{m}"] for s in entries], "o", color=f"C{i}", ms=5,
                      mec="k")  # fmt: skip
        twin.set_ylabel("observed final loss (dots; lower is better)")
        ax.set_xticks(range(len(entries)), [f"seed {s['seed']}" for s in entries])
        ax.set_ylim(0, 1.05)
        plots.finish(ax, f"SNR model at init (bars, β={same:g}) vs outcome per seed (dots)", "",
                     "predicted alignment (higher: better)")  # fmt: skip
        fig.suptitle(f"Sign placement on the {TASK_NAMES[task]}: is a later sign better? "
                     f"({seeds} seeds)")  # fmt: skip
        plots.save(fig, out / "sign.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# 2. Preconditioners: mean-square vs variance dominated, spikes, clipping, MSQ's blocks.

PRECOND_VARIANTS: tuple[tuple[str, str, str, float | None], ...] = (
    # (label, optimizer, msq_block, max_grad_norm)
    ("Adam", "adam", "none", None),
    ("MicroAdam", "micro_adam", "none", None),
    ("MicroAdamVar", "micro_adam_var", "none", None),
    ("MicroAdamMSQ", "micro_adam_msq", "none", None),
    ("MicroAdamMSQ (tensor)", "micro_adam_msq", "tensor", None),
    ("MicroAdamMSQ (row)", "micro_adam_msq", "row", None),
    (f"MicroAdam, clip {PAPER_CLIP:g}", "micro_adam", "none", PAPER_CLIP),
)
LARGE_B_METHODS = ("adam", "micro_adam_var")  # MicroAdamVar at a larger B, Adam its control


def run_precond(scale: Scale, out: Path, seeds: int) -> dict[str, Any]:
    base = base_config(scale)
    task = "lm" if base.model == "transformer" else "mlp"
    points = [
        Point(label, dataclasses.replace(base, optimizer=o, msq_block=blk, max_grad_norm=c, lr=lr))
        for label, o, blk, c in PRECOND_VARIANTS
        for lr in scale.precond_lrs
    ]
    big = scale.var_batch_size
    stretch = lambda n: max(1, n * scale.var_steps // base.steps)  # warmup, evals: in proportion
    large = dataclasses.replace(
        base, batch_size=big, steps=scale.var_steps, warmup=stretch(base.warmup),
        eval_interval=stretch(base.eval_interval),
    )  # fmt: skip
    points += [
        Point(f"{LABELS[m]}, B={big}", dataclasses.replace(large, optimizer=m, lr=lr))
        for m in LARGE_B_METHODS
        for lr in scale.var_lrs
    ]
    rows, traces = execute("precond", points, seeds, out)
    aggs = aggregate(rows, ("method", "lr"))
    best_of = best(aggs, ("method",))
    instability = []
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label]
        instability.append(
            {
                "method": label,
                "runs": len(mine),
                "diverged": sum(r["status"] == "diverged" for r in mine),
                "blew_up": sum(r["status"] == "blew_up" for r in mine),
                "runs_with_spikes": sum(r["spikes"] > 0 for r in mine),
                "spikes": sum(r["spikes"] for r in mine),
            }
        )
    at = lambda label: best_of.get((label,))
    clip = f"MicroAdam, clip {PAPER_CLIP:g}"
    verdicts = [
        compare(at("Adam"), at("MicroAdam"), "Adam", "MicroAdam"),
        compare(at("MicroAdamVar"), at("MicroAdam"), "MicroAdamVar", "MicroAdam"),
        compare(at("MicroAdamVar"), at("Adam"), "MicroAdamVar", "Adam"),
        compare(at(clip), at("MicroAdam"), clip, "MicroAdam"),
        compare(at("MicroAdamMSQ (tensor)"), at("Adam"), "MicroAdamMSQ (tensor)", "Adam"),
        compare(at("MicroAdamMSQ (row)"), at("Adam"), "MicroAdamMSQ (row)", "Adam"),
        compare(at("MicroAdamMSQ (row)"), at("MicroAdamMSQ (tensor)"), "MicroAdamMSQ (row)",
                "MicroAdamMSQ (tensor)"),
        compare(at(f"MicroAdamVar, B={big}"), at(f"Adam, B={big}"), f"MicroAdamVar, B={big}",
                f"Adam, B={big}"),
    ]  # fmt: skip
    say(verdicts)
    for c in instability:
        print(
            f"  {c['method']:<24} of {c['runs']} runs: diverged {c['diverged']}, blew up "
            f"{c['blew_up']}, with spikes {c['runs_with_spikes']}",
            flush=True,
        )
    # The fraction of mean-dominated coordinates over training, at each variant's best lr.
    frac = {}
    for label, a in ((k[0], v) for k, v in best_of.items()):
        mine = traces_of(rows, traces, method=label, lr=a["lr"])
        x, runs = curves_of(mine, "frac_snr_gt_1_over_B", bins=10)
        frac[label] = {"steps": x.tolist(), "mean_over_seeds": np.nanmean(runs, 0).tolist()}
    summary = {
        "experiment": "precond",
        "task": task,
        "seeds": seeds,
        "spike_definition": f"after warmup, a step's loss > {SPIKE_FACTOR:g} x running min",
        "settings": aggs,
        "best": [dict(a) for a in best_of.values()],
        "instability": instability,
        "verdicts": verdicts,
        "frac_mean_dominated_over_training": frac,
    }
    write_summary(out, rows, summary)
    unstable = [
        "Instability over every lr and seed (spike: a step's loss > "
        f"{SPIKE_FACTOR:g}× the running minimum; blew up: final loss > initial):",
        "",
        "| variant | runs | diverged | blew up | with spikes | mean-dominated at the end |",
        "|---|---|---|---|---|---|",
    ] + [
        f"| {c['method']} | {c['runs']} | {c['diverged']} | {c['blew_up']} | "
        f"{c['runs_with_spikes']} | "
        + (f"{frac[c['method']]['mean_over_seeds'][-1]:.3f} |" if c["method"] in frac else "– |")
        for c in instability
    ]
    markdown(out, f"Preconditioners ({TASK_NAMES[task]}, {seeds} seeds)",
             list(best_of.values()), verdicts, *unstable)  # fmt: skip
    if plt := plots.pyplot():
        fig, axes = plt.subplots(1, 4, figsize=(24, 5.2))
        series: dict[str, list[dict[str, Any]]] = {}
        for a in aggs:
            series.setdefault(a["method"], []).append(a)
        color = plots.colors(list(series))
        plots.lr_sweep(axes[0], series, f"{TASK_NAMES[task]}: final loss vs lr", color=color)
        for ax, key, ylabel in (
            (axes[1], "loss", "training loss (binned)"),
            (axes[2], "frac_snr_gt_1_over_B", "fraction of coordinates"),
        ):
            for label, a in ((k[0], v) for k, v in best_of.items()):
                mine = traces_of(rows, traces, method=label, lr=a["lr"])
                x, runs = curves_of(mine, key)
                style = "--" if "B=" in label else "-"
                plots.band(ax, x, runs, color[label], f"{label} (lr {fmt_lr(a['lr'])})", ls=style)
            if key == "loss":
                ax.set_yscale("log")
            plots.finish(ax, "at each best lr (band: seeds' min–max; dashed: larger B)"
                         if key == "loss" else "mean-dominated coordinates: μ̂² > σ̂²/B", "step",
                         ylabel)  # fmt: skip
        ax = axes[3]
        xs = np.arange(len(instability))
        for j, (key, name) in enumerate(
            (("runs_with_spikes", "with spikes"), ("blew_up", "blew up (final > initial)"),
             ("diverged", "diverged (NaN/Inf)"))
        ):  # fmt: skip
            ax.bar(xs + (j - 1) * 0.27, [c[key] for c in instability], 0.27, label=name)
        ax.set_xticks(xs, [c["method"] for c in instability], fontsize=7, rotation=40, ha="right")
        plots.finish(ax, f"instability over all lrs × {seeds} seeds (spike: loss > "
                     f"{SPIKE_FACTOR:g}× running min)", "", "runs")  # fmt: skip
        fig.suptitle(f"Preconditioners on the {TASK_NAMES[task]}: mean-square vs variance "
                     f"dominated, clipping, MSQ's blocks ({seeds} seeds)")  # fmt: skip
        plots.save(fig, out / "precond.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# 3. Batch-size scaling: lr ∝ √B for Adam, lr ∝ B for MicroAdam, against examples seen.

BATCH_POWER = {"adam": 0.5, "micro_adam": 1.0}


def batch_config(scale: Scale, method: str, b: int, mult: float) -> train.Config:
    base = base_config(scale)
    steps = max(1, scale.batch_examples // b)
    return dataclasses.replace(
        base,
        optimizer=method,
        lr=mult * scale.batch_lr0[method] * (b / scale.batch_base) ** BATCH_POWER[method],
        batch_size=b,
        steps=steps,
        warmup=max(1, steps // 20),
        eval_interval=max(1, steps // 4),
        # The same held-out examples at every B: eval_batches·B stays the base's.
        eval_batches=max(1, -(-base.eval_batches * base.batch_size // b)),
    )


def run_batch_scaling(scale: Scale, out: Path, seeds: int) -> dict[str, Any]:
    task = scale.task
    points = [
        Point(LABELS[m], batch_config(scale, m, b, mult), (("lr_mult", mult),))
        for m in BATCH_POWER
        for b in scale.batch_sizes
        for mult in scale.batch_lr_mults
    ]
    rows, traces = execute("batch-scaling", points, seeds, out)
    aggs = aggregate(rows, ("method", "optimizer", "batch_size", "lr_mult", "lr"))
    best_of = best(aggs, ("optimizer", "batch_size"))
    table = []
    for m in BATCH_POWER:
        for b in scale.batch_sizes:
            a = best_of.get((m, b))
            # Per seed: the multiplier that seed alone would pick (do the seeds agree?).
            per_seed = {}
            for s in range(seeds):
                mine = [r for r in rows if r["optimizer"] == m and r["batch_size"] == b
                        and r["seed"] == s and r["final_loss"] is not None]  # fmt: skip
                if mine:
                    per_seed[s] = min(mine, key=lambda r: r["final_loss"])["lr_mult"]
            table.append(
                {
                    "method": m,
                    "batch_size": b,
                    "best_lr_mult": None if a is None else a["lr_mult"],
                    "best_lr": None if a is None else a["lr"],
                    "final_loss": None if a is None else a["mean"],
                    "sd": None if a is None else a["sd"],
                    "best_lr_mult_per_seed": per_seed,
                }
            )
    slopes: dict[str, Any] = {}
    for m in BATCH_POWER:
        mine = [t for t in table if t["method"] == m and t["best_lr"] is not None]
        fit = lambda ts: float(np.polyfit(np.log([t["batch_size"] for t in ts]),
                                          np.log([t["best_lr"] for t in ts]), 1)[0])  # fmt: skip
        slopes[m] = {
            "all": fit(mine) if len(mine) >= 2 else None,
            "B<=64": fit([t for t in mine if t["batch_size"] <= 64])
            if sum(t["batch_size"] <= 64 for t in mine) >= 2
            else None,
            "predicted": BATCH_POWER[m],
        }
    # At the base multiplier of each method's rule: how far the best multiplier drifts over B.
    verdicts = []
    for m, power in BATCH_POWER.items():
        mults = {t["batch_size"]: t["best_lr_mult"] for t in table if t["method"] == m}
        known = {b: v for b, v in mults.items() if v is not None}
        small = [v for b, v in known.items() if b <= 64]
        spread = max(small) / min(small) if small else math.nan
        seeds_agree = sum(
            len(set(t["best_lr_mult_per_seed"].values())) == 1
            for t in table
            if t["method"] == m and t["best_lr_mult_per_seed"]
        )
        verdicts.append(
            {
                "a": LABELS[m],
                "b": f"lr ∝ B^{power:g}",
                "best_mult_per_B": known,
                "spread_B<=64": spread,
                "batch_sizes_where_seeds_pick_the_same_mult": seeds_agree,
                "verdict": (
                    f"best multiplier over B ≤ 64 spans a factor {spread:g} "
                    f"({'flat within one grid step: the rule holds' if spread <= 2 else 'drifts: the rule does not hold'}"  # noqa: E501
                    f"); fitted exponent {slopes[m]['B<=64']} for B ≤ 64, {slopes[m]['all']} "
                    f"for all B (predicted {power:g}); seeds pick the same multiplier at "
                    f"{seeds_agree}/{len(scale.batch_sizes)} batch sizes"
                ),
            }
        )
    say(verdicts)
    summary = {
        "experiment": "batch-scaling",
        "task": task,
        "seeds": seeds,
        "examples": scale.batch_examples,
        "batch_base": scale.batch_base,
        "lr0": scale.batch_lr0,
        "rule": "lr = mult * lr0 * (B / B0) ** p, p = 0.5 (adam), 1 (micro_adam)",
        "settings": aggs,
        "best_lr_per_batch": table,
        "fitted_exponent_of_best_lr_vs_B": slopes,
        "verdicts": verdicts,
    }
    write_summary(out, rows, summary)
    lines = [
        f"# Batch-size scaling ({TASK_NAMES[task]}, {seeds} seeds, {scale.batch_examples} "
        "examples per run)\n",
        f"lr = mult · lr₀ · (B/{scale.batch_base})^p; the best multiplier per B (mean over "
        "seeds), each seed's own pick, and the final loss there:",
        "",
        "| method | B | best mult | per seed | best lr | final loss: mean ± sd (min–max) |",
        "|---|---|---|---|---|---|",
    ]
    for t in table:
        a = best_of.get((t["method"], t["batch_size"]))
        picks = ", ".join(f"{v:g}" for v in t["best_lr_mult_per_seed"].values())
        lines.append(
            f"| {LABELS[t['method']]} | {t['batch_size']} | "
            + ("– | – | – | unstable |" if a is None else
               f"{a['lr_mult']:g} | {picks} | {fmt_lr(a['lr'])} | {fmt_loss(a)} |")
        )  # fmt: skip
    lines += ["", "Verdicts:", ""] + [f"- {v['a']}, {v['b']}: {v['verdict']}" for v in verdicts]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    if plt := plots.pyplot():
        fig, axes = plt.subplots(1, 4, figsize=(24, 4.8))
        cmap = plt.get_cmap("viridis")
        for ax, (m, power) in zip(axes[:2], BATCH_POWER.items(), strict=True):
            at_base = best_of.get((m, scale.batch_base))
            mult = at_base["lr_mult"] if at_base else 1.0
            for i, b in enumerate(scale.batch_sizes):
                mine = traces_of(rows, traces, optimizer=m, batch_size=b, lr_mult=mult)
                x, runs = curves_of(mine, bins=min(100, mine[0].cfg.steps))
                color = cmap(i / max(1, len(scale.batch_sizes) - 1))
                plots.band(ax, x * b, runs, color, f"B={b}")
            ax.set_yscale("log")
            rule = "√(B/B₀)" if power == 0.5 else "(B/B₀)"
            lr0 = mult * scale.batch_lr0[m]
            plots.finish(ax, f"{LABELS[m]}: lr = {fmt_lr(lr0)}·{rule}, B₀={scale.batch_base} "
                         "(band: seeds)", "examples seen", "training loss (binned)")  # fmt: skip
        ax = axes[2]
        bs = np.array(scale.batch_sizes, dtype=float)
        for i, (m, power) in enumerate(BATCH_POWER.items()):
            mine = [t for t in table if t["method"] == m and t["best_lr"] is not None]
            ax.plot([t["batch_size"] for t in mine], [t["best_lr"] for t in mine], "o-",
                    color=f"C{i}", label=f"{LABELS[m]}: best lr (mean over seeds)")  # fmt: skip
            for t in mine:  # each seed's own pick, jittered
                for s, mult in t["best_lr_mult_per_seed"].items():
                    lr = mult * scale.batch_lr0[m] * (t["batch_size"] / scale.batch_base) ** power
                    ax.plot(t["batch_size"] * (1 + 0.06 * (s - 1)), lr, ".", color=f"C{i}",
                            alpha=0.5)  # fmt: skip
            at_base = best_of.get((m, scale.batch_base))
            ref = (at_base["lr_mult"] if at_base else 1.0) * scale.batch_lr0[m]
            ax.plot(bs, ref * (bs / scale.batch_base) ** power, ":", color=f"C{i}",
                    label=f"∝ B^{power:g} (predicted)")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plots.finish(ax, f"best lr vs B (dots: each seed's pick; grid ×"
                     f"{', ×'.join(f'{m:g}' for m in scale.batch_lr_mults)})", "batch size B",
                     "best peak learning rate")  # fmt: skip
        ax = axes[3]
        for i, m in enumerate(BATCH_POWER):
            mine = [t for t in table if t["method"] == m and t["final_loss"] is not None]
            ax.errorbar([t["batch_size"] for t in mine], [t["final_loss"] for t in mine],
                        yerr=[t["sd"] or 0.0 for t in mine], fmt="o-", capsize=3, color=f"C{i}",
                        label=f"{LABELS[m]} (best lr per B; bars: seed sd)")  # fmt: skip
        ax.set_xscale("log", base=2)
        plots.finish(ax, f"final loss after {scale.batch_examples} examples", "batch size B",
                     "final eval loss")  # fmt: skip
        fig.suptitle(f"Batch-size scaling on the {TASK_NAMES[task]}: do curves collapse against "
                     f"examples seen? ({seeds} seeds)")  # fmt: skip
        plots.save(fig, out / "batch_scaling.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# 4. Overhead: bench.py's table.


def run_overhead(scale: Scale, out: Path, seeds: int) -> dict[str, Any]:
    import bench

    overrides = dict(scale.bench)
    base = bench.Config(**bench.QUICK) if overrides.pop("quick", False) else bench.Config()
    config = dataclasses.replace(base, seed=0, **overrides)
    t0 = time.perf_counter()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        records = bench.run(config)
    seconds = time.perf_counter() - t0
    bench.write_json(records, str(out / "bench.json"))
    sections: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in records:
        sections.setdefault((r["section"], r["model"], r["batch_size"]), []).append(r)
    text = [
        f"# Overhead of per-example statistics (bench.py, {seconds:.0f} s)\n",
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}\n",
    ]
    for (section, model, b), rs in sections.items():
        text.append(f"\n## {section}: {model}, B = {b}\n\n{bench.markdown_table(rs)}\n")
    (out / "overhead.md").write_text("".join(text))
    (out / "bench_log.txt").write_text(log.getvalue())
    rows = [
        {
            "section": r["section"],
            "model": r["model"],
            "stats": r["stats"],
            "impl": r["impl"],
            "granularity": r["granularity"],
            "batch_size": r["batch_size"],
            "time_ratio": r["time_ratio"],
            "memory_ratio": r["memory_ratio"],
        }
        for r in records
    ]
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["section"])
        writer.writeheader()
        writer.writerows(rows)
    summary = {
        "experiment": "overhead",
        "seconds": seconds,
        "bench_config": dataclasses.asdict(config),
        "rows": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if plt := plots.pyplot():
        timed = [r for r in rows if r["time_ratio"] is not None and r["stats"] == "mean+sq_mean"]
        mem = [r for r in rows if r["memory_ratio"] is not None and r["stats"] == "mean+sq_mean"]
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
        for ax, data, key, title in (
            (axes[0], timed, "time_ratio", "step time"),
            (axes[1], mem, "memory_ratio", "temporary memory"),
        ):
            labels = [
                f"{r['section']} B={r['batch_size']}\n{r['impl']}"
                + ("" if r["granularity"] == "example" else f" ({r['granularity']})")
                for r in data
            ]
            ax.bar(range(len(data)), [r[key] for r in data], color="C0")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(range(len(data)), labels, fontsize=6, rotation=60, ha="right")
            ax.set_yscale("log")
            plots.finish(ax, f"mean+sq_mean: {title} relative to jax.value_and_grad", "",
                         f"{title} / plain gradient's", legend=False)  # fmt: skip
        plots.save(fig, out / "overhead.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# 5. Vectorize: the same runs as one vectorized program and one by one with train.main.


def run_vectorize(scale: Scale, out: Path, seeds: int) -> dict[str, Any]:
    """Runs/hour of one sweep group (`vectorize_runs` runs: lrs × seeds of MicroAdam on the
    scale's task) trained by sweep.py, against `vectorize_sequential` of the same runs trained
    one after another by train.main (each with its own compile, evaluation and checkpoint, as
    a user would run them). Both wall times include compiling. The final held-out losses of the
    runs done both ways are compared."""
    base = dataclasses.replace(base_config(scale), optimizer="micro_adam")
    lrs = [base.lr * 2.0**k for k in range(-(-scale.vectorize_runs // seeds))]
    configs = [dataclasses.replace(base, lr=lr, seed=s) for lr in lrs for s in range(seeds)]
    configs = configs[: scale.vectorize_runs]
    t0 = time.perf_counter()
    traces = sweep.run_group(configs)  # no cache: this is a timing
    vectorized = time.perf_counter() - t0
    sequential, diffs = [], []
    for i, cfg in enumerate(configs[: scale.vectorize_sequential]):
        run_dir = out / "sequential" / f"run{i}"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            result = train.main(dataclasses.replace(cfg, out=str(run_dir)))
        sequential.append(time.perf_counter() - t0)
        diffs.append(abs(result["eval_loss"] - float(traces[i].eval_loss[-1])))
    per_run_vec = vectorized / len(configs)
    per_run_seq = float(np.mean(sequential))
    summary = {
        "experiment": "vectorize",
        "task": scale.task,
        "runs": len(configs),
        "steps": base.steps,
        "batch_size": base.batch_size,
        "vectorized_seconds": vectorized,
        "vectorized_runs_per_hour": 3600 / per_run_vec,
        "sequential_runs_timed": len(sequential),
        "sequential_seconds_per_run": sequential,
        "sequential_runs_per_hour": 3600 / per_run_seq,
        "speedup": per_run_seq / per_run_vec,
        "max_final_loss_difference": max(diffs),
        "device": jax.devices()[0].device_kind,
    }
    print(
        f"  {len(configs)} runs vectorized in {vectorized:.0f}s: "
        f"{summary['vectorized_runs_per_hour']:.0f} runs/hour; one by one (train.main) "
        f"{per_run_seq:.0f}s a run: {summary['sequential_runs_per_hour']:.0f} runs/hour; speedup "
        f"{summary['speedup']:.2f}×; final losses differ by at most {max(diffs):.2g}",
        flush=True,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(
        f"# Vectorized vs one by one ({TASK_NAMES[scale.task]}, {base.steps} steps of batch "
        f"{base.batch_size}, {summary['device']})\n\n"
        f"| how | runs timed | seconds per run | runs/hour |\n|---|---|---|---|\n"
        f"| sweep.py, one program | {len(configs)} | {per_run_vec:.1f} | "
        f"{summary['vectorized_runs_per_hour']:.0f} |\n"
        f"| train.main, one after another | {len(sequential)} | {per_run_seq:.1f} | "
        f"{summary['sequential_runs_per_hour']:.0f} |\n\n"
        f"Speedup {summary['speedup']:.2f}×, compiles included; the runs done both ways end at "
        f"held-out losses that differ by at most {max(diffs):.2g}.\n"
    )
    return summary


# --------------------------------------------------------------------------------------------
# Entry points.

RUNNERS: dict[str, Callable[[Scale, Path, int], dict[str, Any]]] = {
    "sign": run_sign,
    "precond": run_precond,
    "batch-scaling": run_batch_scaling,
    "overhead": run_overhead,
    "vectorize": run_vectorize,
}


def run(name: str, *, scale: str, out: str, seeds: int | None = None) -> dict[str, Any]:
    """Run study `name` (EXPERIMENTS or "all") at `scale` ("smoke", "tiny", "small", "paper")
    into `out`, each setting for seeds 0..seeds−1 (None: the scale's default); returns its
    summary (for "all": a dict of them)."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
    if name == "all":
        return {n: run(n, scale=scale, out=str(Path(out) / n), seeds=seeds) for n in EXPERIMENTS}
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {(*EXPERIMENTS, 'all')}")
    n_seeds = SCALES[scale].seeds if seeds is None else seeds
    if n_seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {n_seeds}")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    print(f"experiment {name}, scale {scale}, {n_seeds} seeds -> {path}", flush=True)
    t0 = time.perf_counter()
    summary = RUNNERS[name](SCALES[scale], path, n_seeds)
    seconds = time.perf_counter() - t0
    summary = {**summary, "scale": scale, "total_seconds": round(seconds, 1)}
    data = json.loads((path / "summary.json").read_text())
    (path / "summary.json").write_text(json.dumps({**data, **summary}, indent=1))
    print(f"experiment {name} done in {seconds:.0f}s: {path}", flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Every study, its scales and its definitions: see experiments.py's docstring.",
    )
    parser.add_argument("name", choices=(*EXPERIMENTS, "all"), help="which study")
    parser.add_argument("--scale", choices=tuple(SCALES), default="tiny", help="sizes and steps")
    parser.add_argument("--out", default=None, help="output directory (default runs/exp-NAME)")
    parser.add_argument(
        "--seeds", type=int, default=None, help="seeds 0..N-1 per setting (default: the scale's)"
    )
    args = parser.parse_args(argv)
    out = args.out or f"runs/exp-{args.name}"
    try:
        run(args.name, scale=args.scale, out=out, seeds=args.seeds)
    except (train.ConfigError, ValueError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
