"""experiments.py: one command per finding of Roulet & Agarwala (arXiv 2510.00236), with plots.

    python experiments.py sign --scale tiny --out runs/sign          # sign placement + SNR model
    python experiments.py precond --scale tiny --out runs/precond    # Adam-family preconditioners
    python experiments.py batch-scaling --scale tiny --out runs/bs   # lr ∝ √B (Adam) vs ∝ B (Micro)
    python experiments.py overhead --scale tiny --out runs/overhead  # bench.py's cost table
    python experiments.py all --scale tiny --out runs/all            # the four, one after another

In Python: `experiments.run(name, scale=..., out=..., seed=0) -> summary dict`.

Every sweep runs `train.main(cfg)` in-process, one run after another, each with a
`dataclasses.replace` of a base `train.Config` and its own directory OUT/runs/<tag>/ (config.json,
metrics.jsonl, checkpoint, log.txt: train.py's console output, result.json). A run that already
holds result.json is reused, so an interrupted sweep continues where it stopped. Each experiment
writes OUT/summary.csv (one row per run), OUT/summary.json (rows, best learning rates, the
experiment's own tables) and OUT/*.png (with matplotlib: `pip install -e ".[plots]"`).

Scales (SCALES below): `smoke` (a few steps on tiny models: tests), `tiny` (each experiment in
about 10 minutes on a 2-core CPU, compiles included), `small` (an hour or so on a CPU), `paper`
(the paper's GPT-2-small transformer shape, `TransformerConfig.paper()`: for accelerators).

Definitions used in the summaries:

* final loss: the held-out (eval) loss at the end of the run; a run whose loss or parameters
  became NaN/Inf (train.Diverged) is recorded with status "diverged", its step, and no loss.
* spike: after warmup, a logged training loss above SPIKE_FACTOR (2) times the running minimum
  of the logged training losses so far; consecutive spiking records count as one spike.
* SNR model (SPEC §4, `snr_prediction`): per coordinate g_i ~ N(μ, σ²). The expected update
  direction of each sign rule is E[sign(g_i)] = erf(μ/(√2σ)) (MicroSignSGD: sign before the
  average; its EMA does not change the expectation), E[sign(ḡ)] = erf(√B μ/(√2σ)) (SignSGD) and
  ≈ erf(√(B(1+β)/(1−β)) μ/(√2σ)) (SignEMA: the EMA averages (1+β)/(1−β) times more steps). The
  predicted alignment of a rule is the expected descent per step relative to sign(μ):
  Σ_j |μ_j|·erf(k|μ_j|/(√2σ_j)) / Σ_j |μ_j|, in [0, 1], higher is better. μ and σ are measured
  with pegrad ("mean", "sq_mean") on `snr_batches` fresh batches of `snr_batch_size` examples
  (N in all) at two kinds of points: the shared initialisation, and the final parameters of each
  rule's best run. Estimators: μ² ≈ max(0, (N·ḡ² − q)/(N − 1)) (unbiased, clamped),
  σ² = N/(N − 1)·(q − ḡ²). train.py's metrics.jsonl also carries, at every logged step, the
  fraction of coordinates with μ̂² > σ̂²/B from the training batch itself; it is plotted too.
"""

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pegrad
import train

EXPERIMENTS = ("sign", "precond", "batch-scaling", "overhead")
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
PLOTS_NOTE = (
    'matplotlib not installed: wrote the CSV/JSON only; pip install -e ".[plots]" for plots'
)

# fmt: off
CSV_COLUMNS = (
    "experiment", "task", "method", "optimizer", "lr", "max_grad_norm", "eps", "momentum",
    "batch_size", "steps", "examples", "status", "diverged_step", "final_loss",
    "final_train_loss", "first_eval_loss", "spikes", "seconds", "run",
)
# fmt: on


# --------------------------------------------------------------------------------------------
# Scales: the base configs of the two tasks and the sweep grids of each experiment.


@dataclasses.dataclass(frozen=True)
class Scale:
    mlp: train.Config  # teacher-student regression (label noise sets the gradient SNR)
    lm: train.Config  # byte-level transformer LM on CPython's English text
    sign_tasks: tuple[str, ...]
    sign_lrs: dict[str, tuple[float, ...]]  # per task
    sign_momentum: float  # β of the EMA, the same for the three sign rules
    precond_tasks: tuple[str, ...]
    precond_lrs: dict[str, tuple[float, ...]]
    precond_clips: tuple[float | None, ...]  # max_grad_norm values (None: no clipping)
    msq_eps: tuple[float, ...]  # extra ε values for MicroAdamMSQ (unclipped), beyond 1e-8
    batch_task: str
    batch_sizes: tuple[int, ...]
    batch_base: int  # B₀ of lr = lr₀·(B/B₀)^p
    batch_examples: int  # examples seen by every run: steps = examples // B
    batch_lr0: dict[str, float]  # lr₀ per method at B₀
    batch_lr_mults: tuple[float, ...]  # sweep: lr = mult·lr₀·(B/B₀)^p
    snr_batches: int
    snr_batch_size: int
    bench: dict[str, Any]  # bench.Config overrides ("quick": True for bench's --quick)


def _mlp(size: str, **kw: Any) -> train.Config:
    base = dict(model="mlp", size=size, noise=1.0, schedule="cosine", checkpoint_interval=10**9)
    return train.Config(**{**base, **kw})


def _lm(size: str, **kw: Any) -> train.Config:
    base = dict(model="transformer", size=size, schedule="cosine", checkpoint_interval=10**9)
    return train.Config(**{**base, **kw})


SIGN_LRS_MLP = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
SIGN_LRS_LM = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
ADAM_LRS_LM = (1e-3, 3e-3, 1e-2, 3e-2)

# fmt: off
SCALES: dict[str, Scale] = {
    "smoke": Scale(  # seconds per run, MLP only: for tests
        mlp=_mlp("tiny", steps=3, warmup=1, batch_size=8, eval_interval=2, eval_batches=1,
                 log_interval=1),
        lm=_lm("tiny", n_layers=1, seq_len=8, steps=3, warmup=1, batch_size=4, eval_interval=2,
               eval_batches=1, log_interval=1),
        sign_tasks=("mlp",), sign_lrs={"mlp": (1e-3, 1e-2), "lm": (1e-3, 1e-2)},
        sign_momentum=0.9,
        precond_tasks=("mlp",), precond_lrs={"mlp": (1e-2,), "lm": (1e-2,)},
        precond_clips=(None, PAPER_CLIP), msq_eps=(),
        batch_task="mlp", batch_sizes=(8, 16), batch_base=8, batch_examples=32,
        batch_lr0={"adam": 1e-2, "micro_adam": 1e-2}, batch_lr_mults=(1.0,),
        snr_batches=1, snr_batch_size=8,
        bench=dict(quick=True, sections=("mlp",), stat_sets=("mean+sq_mean",), reps=1,
                   min_time_s=0.0, mlp_in=16, mlp_width=32, mlp_depth=2, mlp_batch=8,
                   mlp_batch_sizes=(8,)),
    ),
    "tiny": Scale(  # about 10 minutes per experiment on a 2-core CPU
        mlp=_mlp("mini", steps=400, warmup=40, batch_size=32, eval_interval=100,
                 eval_batches=32, log_interval=4),
        lm=_lm("mini", seq_len=32, steps=150, warmup=15, batch_size=16, eval_interval=50,
               eval_batches=8, log_interval=2),
        sign_tasks=("mlp", "lm"), sign_lrs={"mlp": SIGN_LRS_MLP, "lm": SIGN_LRS_LM},
        sign_momentum=0.9,
        precond_tasks=("lm",), precond_lrs={"mlp": ADAM_LRS_LM, "lm": ADAM_LRS_LM[1:]},
        precond_clips=(None, PAPER_CLIP), msq_eps=(1e-6, 1e-4, 1e-2),
        batch_task="mlp", batch_sizes=(8, 16, 32, 64, 128, 256), batch_base=32,
        batch_examples=8192, batch_lr0={"adam": 3e-3, "micro_adam": 3e-3},
        batch_lr_mults=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
        snr_batches=8, snr_batch_size=128,
        bench=dict(quick=True),
    ),
    "small": Scale(  # an hour or more per experiment on a CPU
        mlp=_mlp("small", steps=2000, warmup=100, batch_size=32, eval_interval=250,
                 eval_batches=32, log_interval=5),
        lm=_lm("small", seq_len=64, steps=1000, warmup=50, batch_size=32, eval_interval=100,
               eval_batches=16, log_interval=5),
        sign_tasks=("mlp", "lm"), sign_lrs={"mlp": SIGN_LRS_MLP, "lm": (1e-4, *SIGN_LRS_LM)},
        sign_momentum=0.9,
        precond_tasks=("mlp", "lm"),
        precond_lrs={"mlp": (3e-4, *ADAM_LRS_LM), "lm": (3e-4, *ADAM_LRS_LM)},
        precond_clips=(None, PAPER_CLIP), msq_eps=(1e-6,),
        batch_task="lm", batch_sizes=(8, 16, 32, 64, 128, 256), batch_base=32,
        batch_examples=32 * 1000, batch_lr0={"adam": 3e-3, "micro_adam": 3e-3},
        batch_lr_mults=(0.25, 0.5, 1.0, 2.0, 4.0),
        snr_batches=16, snr_batch_size=128,
        bench=dict(),
    ),
    "paper": Scale(  # the paper's transformer shape (TransformerConfig.paper()): accelerators
        mlp=_mlp("paper", steps=5000, warmup=250, batch_size=64, eval_interval=500,
                 eval_batches=32, log_interval=10),
        lm=_lm("paper", seq_len=512, steps=5000, warmup=250, batch_size=64, eval_interval=250,
               eval_batches=16, log_interval=10, checkpoint_interval=1000),
        sign_tasks=("mlp", "lm"),
        sign_lrs={"mlp": SIGN_LRS_MLP, "lm": (3e-5, 1e-4, 3e-4, 1e-3, 3e-3)},
        sign_momentum=0.9,
        precond_tasks=("lm",),
        precond_lrs={"mlp": (1e-4, 3e-4, *ADAM_LRS_LM), "lm": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)},
        precond_clips=(None, PAPER_CLIP), msq_eps=(1e-6, 1e-4),
        batch_task="lm", batch_sizes=(8, 16, 32, 64, 128, 256), batch_base=32,
        batch_examples=64 * 5000, batch_lr0={"adam": 6e-4, "micro_adam": 6e-4},
        batch_lr_mults=(0.25, 0.5, 1.0, 2.0, 4.0),
        snr_batches=16, snr_batch_size=32,
        bench=dict(),
    ),
}
# fmt: on


# --------------------------------------------------------------------------------------------
# One run: train.main in-process, its console output in log.txt, NaN/Inf recorded as diverged.


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def count_spikes(records: Sequence[dict[str, Any]], warmup: int) -> int:
    """Spikes: logged training losses after warmup above SPIKE_FACTOR × their running minimum;
    consecutive spiking records are one spike."""
    spikes, low, inside = 0, math.inf, False
    for r in records:
        if "loss" not in r or r["step"] < warmup:
            continue
        loss = r["loss"]
        spiking = loss > SPIKE_FACTOR * low
        spikes += spiking and not inside
        inside, low = spiking, min(low, loss)
    return spikes


def classify(row: dict[str, Any]) -> dict[str, Any]:
    """A finished run whose final loss is worse than its initial one "blew up" (a finite
    explosion, e.g. MicroAdamMSQ dividing by ε where ReLU(v̂) = 0)."""
    first, final = row["first_eval_loss"], row["final_loss"]
    if row["status"] == "ok" and first is not None and final is not None and final > first:
        return {**row, "status": "blew_up"}
    return row


def run_one(cfg: train.Config, *, experiment: str, task: str, method: str) -> dict[str, Any]:
    """Train `cfg` (cfg.out is the run's directory) and return its summary row."""
    run_dir = Path(str(cfg.out))
    done = run_dir / "result.json"
    if done.exists():
        return classify(json.loads(done.read_text()))
    if run_dir.exists():  # an interrupted run: start it over
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    status, diverged_step, result = "ok", None, {}
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log, contextlib.redirect_stdout(log):
        try:
            result = train.main(cfg)
        except train.Diverged as err:
            status = "diverged"
            print(f"diverged: {err}")
            steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
            diverged_step = steps[-1] + 1 if steps else 0
    records = read_metrics(run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    row = {
        "experiment": experiment,
        "task": task,
        "method": method,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "max_grad_norm": cfg.max_grad_norm,
        "eps": cfg.eps,
        "momentum": cfg.momentum,
        "batch_size": cfg.batch_size,
        "steps": cfg.steps,
        "examples": cfg.steps * cfg.batch_size,
        "status": status,
        "diverged_step": diverged_step,
        "final_loss": result.get("eval_loss") if status == "ok" else None,
        "final_train_loss": losses[-1] if losses and status == "ok" else None,
        "first_eval_loss": evals[0] if evals else None,
        "spikes": count_spikes(records, cfg.warmup),
        "seconds": round(time.perf_counter() - t0, 2),
        "run": str(run_dir),
    }
    row = classify(row)
    done.write_text(json.dumps(row, indent=1))
    loss = "diverged" if row["final_loss"] is None else f"{row['final_loss']:.4g}"
    print(
        f"  {experiment}/{task} {method:<22} lr {cfg.lr:<8.2g} B {cfg.batch_size:<4} "
        f"-> {loss:<9} spikes {row['spikes']}  ({row['seconds']:.0f}s)",
        flush=True,
    )
    return row


def base_config(scale: Scale, task: str, seed: int) -> train.Config:
    if task not in ("mlp", "lm"):
        raise ValueError(f"unknown task {task!r}: choose 'mlp' or 'lm'")
    return dataclasses.replace(scale.mlp if task == "mlp" else scale.lm, seed=seed)


def fmt_lr(lr: float) -> str:
    return f"{lr:.3g}"


def best_rows(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """For each group of `keys`, the finished run with the lowest final loss."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["final_loss"] is None or not math.isfinite(r["final_loss"]):
            continue
        group = "/".join(str(r[k]) for k in keys)
        if group not in best or r["final_loss"] < best[group]["final_loss"]:
            best[group] = r
    return best


# --------------------------------------------------------------------------------------------
# Writing: summary.csv, summary.json, plots.


def write_summary(out: Path, rows: Sequence[dict[str, Any]], extra: dict[str, Any]) -> None:
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in CSV_COLUMNS})
    (out / "summary.json").write_text(json.dumps({**extra, "runs": list(rows)}, indent=1))


def pyplot() -> Any:
    """matplotlib.pyplot (headless), or None with a one-line note."""
    try:
        import matplotlib  # pyright: ignore[reportMissingImports]  (the optional "plots" extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]
    except ImportError:
        print(PLOTS_NOTE)
        return None
    return plt


def smooth(values: Sequence[float], weight: float = 0.8) -> list[float]:
    """Bias-corrected EMA, for readable training-loss curves."""
    out, ema = [], 0.0
    for t, v in enumerate(values, 1):
        ema = weight * ema + (1 - weight) * v
        out.append(ema / (1 - weight**t))
    return out


def curve(run: str, key: str = "loss") -> tuple[list[int], list[float]]:
    records = [r for r in read_metrics(Path(run)) if key in r]
    return [r["step"] for r in records], [r[key] for r in records]


def plot_lr_sweep(ax: Any, rows: Sequence[dict[str, Any]], methods: Sequence[str], title: str):
    """Final loss against lr, log-x; diverged (NaN/Inf) runs as x and blown-up runs (final loss
    above the initial one) as ^ at the top of the axes."""
    from matplotlib.ticker import NullFormatter  # pyright: ignore[reportMissingImports]

    finite = [r["final_loss"] for r in rows if r["status"] == "ok"]
    top = max(finite) if finite else 1.0
    for i, m in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["lr"])
        ok = [r for r in mine if r["status"] == "ok"]
        color = f"C{i}"
        ax.plot(
            [r["lr"] for r in ok],
            [r["final_loss"] for r in ok],
            "o-",
            color=color,
            label=LABELS.get(m, m),
        )
        for status, marker in (("diverged", "x"), ("blew_up", "^")):
            bad = [r["lr"] for r in mine if r["status"] == status]
            if bad:
                ax.plot(bad, [top * 1.02] * len(bad), marker, color=color, markersize=9, mew=2)
    ax.set_xscale("log")
    lrs = sorted({r["lr"] for r in rows})
    ax.set_xticks(lrs, [fmt_lr(lr) for lr in lrs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final eval loss")
    notes = [
        f"{m}: {s}"
        for s, m in (("diverged", "x"), ("blew_up", "^"))
        if any(r["status"] == s for r in rows)
    ]
    ax.set_title(
        title + (f"\n({', '.join(notes).replace('_', ' ')}, drawn at the top)" if notes else "")
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_curves(ax: Any, best: dict[str, dict[str, Any]], title: str, *, x: str = "step"):
    for i, (label, r) in enumerate(best.items()):
        steps, losses = curve(r["run"])
        if not steps:
            continue
        xs = [s * r["batch_size"] for s in steps] if x == "examples" else steps
        ax.plot(xs, smooth(losses), color=f"C{i}", label=f"{label} (lr {fmt_lr(r['lr'])})")
    ax.set_xlabel("examples seen" if x == "examples" else "step")
    ax.set_ylabel("training loss (smoothed)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save(fig: Any, path: Path, plt: Any) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# 1. Sign placement, with the SNR model's prediction.


def _flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def measure_mu_sigma(
    cfg: train.Config, points: Sequence[Any], *, n_batches: int, batch_size: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """For each parameter pytree in `points`: per-coordinate μ̂² (unbiased, clamped at 0) and
    σ̂² over the same n_batches·batch_size fresh training examples, from pegrad's "mean" and
    "sq_mean" (one compile for all points)."""
    cfg = dataclasses.replace(cfg, batch_size=batch_size)
    model_key, train_key, _ = jax.random.split(jax.random.key(cfg.seed), 3)
    task = (train.lm_task if cfg.model == "transformer" else train.mlp_task)(cfg, key=model_key)
    stats_fn = jax.jit(
        pegrad.value_and_grad_stats(task.loss_fn, ("mean", "sq_mean"), impl=cfg.impl)
    )
    sample = jax.jit(task.sample)
    keys = [jax.random.fold_in(train_key, 10**8 + seed + k) for k in range(n_batches)]
    batches = [sample(task.train_data, key=k) for k in keys]
    n = n_batches * batch_size
    results = []
    for params in points:
        g = q = np.zeros(())
        for batch in batches:
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


def load_params(cfg: train.Config) -> Any:
    """The parameters of a finished run (its final checkpoint)."""
    model_key = jax.random.split(jax.random.key(cfg.seed), 3)[0]
    task = (train.lm_task if cfg.model == "transformer" else train.mlp_task)(cfg, key=model_key)
    opt = train.make_optimizer(cfg)
    tree, _ = train.load_checkpoint(
        Path(str(cfg.out)), {"params": task.params, "opt_state": opt.init(task.params)}
    )
    return tree["params"]


def init_params(cfg: train.Config) -> Any:
    model_key = jax.random.split(jax.random.key(cfg.seed), 3)[0]
    return (train.lm_task if cfg.model == "transformer" else train.mlp_task)(
        cfg, key=model_key
    ).params


def run_sign(scale: Scale, out: Path, seed: int, tasks: Sequence[str] | None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    configs: dict[str, train.Config] = {}
    for task in tasks or scale.sign_tasks:
        base = base_config(scale, task, seed)
        for method in SIGN_METHODS:
            for lr in scale.sign_lrs[task]:
                tag = f"{task}-{method}-lr{fmt_lr(lr)}"
                cfg = dataclasses.replace(
                    base,
                    optimizer=method,
                    lr=lr,
                    momentum=scale.sign_momentum,
                    out=str(out / "runs" / tag),
                )
                configs[tag] = cfg
                rows.append(run_one(cfg, experiment="sign", task=task, method=method))
    best = best_rows(rows, ("task", "method"))

    # The SNR model at the shared initialisation and at each rule's best final parameters.
    snr: list[dict[str, Any]] = []
    for task in tasks or scale.sign_tasks:
        base = base_config(scale, task, seed)
        points: list[tuple[str, Any]] = [("init", init_params(base))]
        for method in SIGN_METHODS:
            r = best.get(f"{task}/{method}")
            if r is not None:
                cfg = dataclasses.replace(
                    base, optimizer=method, lr=r["lr"], momentum=scale.sign_momentum, out=r["run"]
                )
                points.append((f"final of {LABELS[method]}", load_params(cfg)))
        measured = measure_mu_sigma(
            base,
            [params for _, params in points],
            n_batches=scale.snr_batches,
            batch_size=scale.snr_batch_size,
            seed=seed,
        )
        for (point, _), (mu2, sigma2, n) in zip(points, measured, strict=True):
            pred = snr_prediction(mu2, sigma2, base.batch_size, scale.sign_momentum)
            snr.append({"task": task, "point": point, "examples": n, **pred})
            print(
                f"  SNR {task} at {point}: "
                + "  ".join(f"{LABELS.get(k, k)} {v:.3f}" for k, v in pred.items()),
                flush=True,
            )

    summary = {
        "experiment": "sign",
        "best": {k: {"lr": v["lr"], "final_loss": v["final_loss"]} for k, v in best.items()},
        "snr_prediction": snr,
        "snr_note": "predicted alignment = Σ|μ|·erf(k|μ|/(√2σ))/Σ|μ| (higher is better), "
        "k = 1 (MicroSignSGD), √B (SignSGD), √(B(1+β)/(1−β)) (SignEMA); μ, σ from pegrad "
        "mean/sq_mean on snr_batches × snr_batch_size fresh examples",
        "momentum": scale.sign_momentum,
    }
    write_summary(out, rows, summary)
    with open(out / "snr.csv", "w", newline="") as f:
        fields = ["task", "point", "examples", *SIGN_METHODS, "frac_snr_gt_1_over_B"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(snr)
    if plt := pyplot():
        task_list = list(tasks or scale.sign_tasks)
        fig, axes = plt.subplots(
            len(task_list), 4, figsize=(20, 4.3 * len(task_list)), squeeze=False
        )
        for row_axes, task in zip(axes, task_list, strict=True):
            name = TASK_NAMES[task]
            mine = [r for r in rows if r["task"] == task]
            plot_lr_sweep(row_axes[0], mine, SIGN_METHODS, f"{name}: final loss vs lr")
            chosen = {LABELS[m]: best[f"{task}/{m}"] for m in SIGN_METHODS if f"{task}/{m}" in best}
            plot_curves(row_axes[1], chosen, f"{name}: training loss at each best lr")
            ax = row_axes[2]
            for i, (label, r) in enumerate(chosen.items()):
                steps, frac = curve(r["run"], "frac_snr_gt_1_over_B")
                ax.plot(steps, smooth(frac), color=f"C{i}", label=label)
            ax.set_xlabel("step")
            ax.set_ylabel("fraction of coordinates")
            ax.set_title(f"{name}: measured μ̂² > σ̂²/B on the training batch")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            ax = row_axes[3]
            entries = [s for s in snr if s["task"] == task]
            width = 0.8 / len(SIGN_METHODS)
            for i, m in enumerate(SIGN_METHODS):
                xs = [j + (i - 1) * width for j in range(len(entries))]
                ax.bar(xs, [s[m] for s in entries], width, color=f"C{i}", label=LABELS[m])
            ax.set_xticks(
                range(len(entries)), [s["point"] for s in entries], fontsize=8, rotation=15
            )
            ax.set_ylabel("predicted alignment (higher: better)")
            ax.set_ylim(0, 1)
            ax.set_title(
                f"{name}: SNR-model prediction at B={base_config(scale, task, seed).batch_size}"
            )  # noqa: E501
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        fig.suptitle(
            f"Sign placement: later sign is better? (seed {seed}, β = {scale.sign_momentum})"
        )
        save(fig, out / "sign.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# 2. Preconditioners: mean-square vs variance dominated, spikes, clipping.


def run_precond(scale: Scale, out: Path, seed: int, tasks: Sequence[str] | None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    variants: list[tuple[str, str, float, float | None]] = [  # (method label, optimizer, ε, C)
        (m, m, 1e-8, clip) for clip in scale.precond_clips for m in ADAM_METHODS
    ]
    variants += [(f"micro_adam_msq eps={e:g}", "micro_adam_msq", e, None) for e in scale.msq_eps]
    for task in tasks or scale.precond_tasks:
        base = base_config(scale, task, seed)
        for method, optimizer, eps, clip in variants:
            for lr in scale.precond_lrs[task]:
                tag = f"{task}-{method.replace(' ', '-')}-clip{clip}-lr{fmt_lr(lr)}"
                cfg = dataclasses.replace(
                    base,
                    optimizer=optimizer,
                    lr=lr,
                    eps=eps,
                    max_grad_norm=clip,
                    out=str(out / "runs" / tag),
                )
                rows.append(run_one(cfg, experiment="precond", task=task, method=method))
    best = best_rows(rows, ("task", "method", "max_grad_norm"))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    counts = []
    for task in tasks or scale.precond_tasks:
        for m in methods:
            for clip in (*scale.precond_clips, *([None] if scale.msq_eps else [])):
                mine = [
                    r
                    for r in rows
                    if r["task"] == task and r["method"] == m and r["max_grad_norm"] == clip
                ]
                if mine and not any(
                    c["task"] == task and c["method"] == m and c["max_grad_norm"] == clip
                    for c in counts
                ):
                    counts.append(
                        {
                            "task": task,
                            "method": m,
                            "max_grad_norm": clip,
                            "runs": len(mine),
                            "diverged": sum(r["status"] == "diverged" for r in mine),
                            "spikes": sum(r["spikes"] for r in mine),
                            "runs_with_spikes": sum(r["spikes"] > 0 for r in mine),
                            "blew_up": sum(r["status"] == "blew_up" for r in mine),
                        }
                    )
    summary = {
        "experiment": "precond",
        "spike_definition": f"after warmup, logged train loss > {SPIKE_FACTOR:g} x running min",
        "best": {k: {"lr": v["lr"], "final_loss": v["final_loss"]} for k, v in best.items()},
        "instability": counts,
    }
    write_summary(out, rows, summary)
    if plt := pyplot():
        task_list = list(tasks or scale.precond_tasks)
        fig, axes = plt.subplots(
            len(task_list), 4, figsize=(20, 4.3 * len(task_list)), squeeze=False
        )
        for row_axes, task in zip(axes, task_list, strict=True):
            name = TASK_NAMES[task]
            for ax, clip in zip(row_axes[:2], scale.precond_clips, strict=False):
                mine = [r for r in rows if r["task"] == task and r["max_grad_norm"] == clip]
                title = "no clipping" if clip is None else f"clipped at ‖ḡ‖ ≤ {clip:g}"
                plot_lr_sweep(
                    ax,
                    mine,
                    [m for m in methods if any(r["method"] == m for r in mine)],
                    f"{name}: final loss vs lr, {title}",
                )
            ax = row_axes[2]
            for i, m in enumerate(methods):
                for clip, style in zip(scale.precond_clips, ("-", "--"), strict=False):
                    r = best.get(f"{task}/{m}/{clip}")
                    if r is None:
                        continue
                    steps, losses = curve(r["run"])
                    tag = "" if clip is None else f", clip {clip:g}"
                    ax.plot(
                        steps,
                        smooth(losses, 0.5),
                        style,
                        color=f"C{i}",
                        label=f"{LABELS.get(m, m)}{tag} (lr {fmt_lr(r['lr'])})",
                    )
            ax.set_xlabel("step")
            ax.set_ylabel("training loss (lightly smoothed)")
            firsts = [r["first_eval_loss"] for r in rows if r["first_eval_loss"] is not None]
            if firsts:  # blown-up runs leave the axes at the top: keep the others readable
                kept = [r["final_train_loss"] for r in rows if r["status"] == "ok"]
                ax.set_ylim(0.9 * min(kept or firsts), 1.1 * max(firsts))
            ax.set_title(f"{name}: curves at best lr (dashed: clipped)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            ax = row_axes[3]
            mine = [c for c in counts if c["task"] == task]
            labels = [
                f"{LABELS.get(c['method'], c['method'])}"
                + ("" if c["max_grad_norm"] is None else f"\nclip {c['max_grad_norm']:g}")
                for c in mine
            ]
            xs = np.arange(len(mine))
            ax.bar(xs - 0.27, [c["runs_with_spikes"] for c in mine], 0.27, label="with spikes")
            ax.bar(xs, [c["blew_up"] for c in mine], 0.27, label="blew up (final > initial)")
            ax.bar(xs + 0.27, [c["diverged"] for c in mine], 0.27, label="diverged (NaN/Inf)")
            ax.set_xticks(xs, labels, fontsize=7, rotation=45, ha="right")
            ax.set_ylabel(f"runs, of {len(scale.precond_lrs[task])} learning rates")
            ax.set_title(f"{name}: instability (spike: loss > {SPIKE_FACTOR:g}× running min)")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        fig.suptitle(
            f"Preconditioners: Adam vs MicroAdam vs MicroAdamVar vs MicroAdamMSQ (seed {seed})"
        )
        save(fig, out / "precond.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# 3. Batch-size scaling: lr ∝ √B for Adam, lr ∝ B for MicroAdam, against examples seen.

BATCH_POWER = {"adam": 0.5, "micro_adam": 1.0}


def run_batch_scaling(
    scale: Scale, out: Path, seed: int, tasks: Sequence[str] | None
) -> dict[str, Any]:
    task = (tasks or (scale.batch_task,))[0]
    base = base_config(scale, task, seed)
    rows: list[dict[str, Any]] = []
    for method, power in BATCH_POWER.items():
        for b in scale.batch_sizes:
            steps = max(1, scale.batch_examples // b)
            for mult in scale.batch_lr_mults:
                lr = mult * scale.batch_lr0[method] * (b / scale.batch_base) ** power
                tag = f"{task}-{method}-B{b}-x{mult:g}"
                cfg = dataclasses.replace(
                    base,
                    optimizer=method,
                    lr=lr,
                    batch_size=b,
                    steps=steps,
                    warmup=max(1, steps // 10),
                    log_interval=max(1, steps // 100),
                    eval_interval=max(1, steps // 4),
                    eval_batches=max(
                        base.eval_batches, -(-base.eval_batches * base.batch_size // b)
                    ),
                    out=str(out / "runs" / tag),
                )
                row = run_one(cfg, experiment="batch-scaling", task=task, method=method)
                rows.append({**row, "lr_mult": mult, "lr_power": power})
    # Best multiplier per (method, B): flat across B if the scaling rule holds.
    best = best_rows(rows, ("method", "batch_size"))
    best_mult = {}
    for method in BATCH_POWER:
        at_base = best.get(f"{method}/{scale.batch_base}")
        best_mult[method] = at_base["lr_mult"] if at_base else 1.0
    table = [
        {
            "method": m,
            "batch_size": b,
            "best_lr": r["lr"],
            "best_lr_mult": r["lr_mult"],
            "final_loss": r["final_loss"],
        }
        for m in BATCH_POWER
        for b in scale.batch_sizes
        if (r := best.get(f"{m}/{b}")) is not None
    ]
    slopes = {}
    for m in BATCH_POWER:
        pts = [
            (math.log(t["batch_size"]), math.log(t["best_lr"])) for t in table if t["method"] == m
        ]
        if len(pts) >= 2:
            slopes[m] = float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0])
    summary = {
        "experiment": "batch-scaling",
        "task": task,
        "examples": scale.batch_examples,
        "batch_base": scale.batch_base,
        "lr0": scale.batch_lr0,
        "rule": "lr = mult * lr0 * (B / B0) ** p, p = 0.5 (adam), 1 (micro_adam)",
        "curves_at_mult": best_mult,
        "best_lr_per_batch": table,
        "fitted_exponent_of_best_lr_vs_B": slopes,
    }
    write_summary(out, rows, summary)
    if plt := pyplot():
        fig, axes = plt.subplots(1, 4, figsize=(21, 4.6))
        cmap = plt.get_cmap("viridis")
        for ax, (method, power) in zip(axes[:2], BATCH_POWER.items(), strict=True):
            for i, b in enumerate(scale.batch_sizes):
                r = next(
                    (
                        r
                        for r in rows
                        if r["method"] == method
                        and r["batch_size"] == b
                        and r["lr_mult"] == best_mult[method]
                    ),
                    None,
                )
                if r is None:
                    continue
                steps, losses = curve(r["run"])
                color = cmap(i / max(1, len(scale.batch_sizes) - 1))
                ax.plot(
                    [s * b for s in steps],
                    smooth(losses, 0.6),
                    color=color,
                    label=f"B={b}" + (" (diverged)" if r["status"] != "ok" else ""),
                )
            rule = "√(B/B₀)" if power == 0.5 else "(B/B₀)"
            lr0 = best_mult[method] * scale.batch_lr0[method]
            ax.set_title(f"{LABELS[method]}: lr = {fmt_lr(lr0)}·{rule}, B₀={scale.batch_base}")
            ax.set_xlabel("examples seen")
            ax.set_ylabel("training loss (smoothed)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        ax = axes[2]
        bs = np.array(scale.batch_sizes, dtype=float)
        for i, (method, power) in enumerate(BATCH_POWER.items()):
            mine = [t for t in table if t["method"] == method]
            ax.plot(
                [t["batch_size"] for t in mine],
                [t["best_lr"] for t in mine],
                "o-",
                color=f"C{i}",
                label=f"{LABELS[method]}: best lr (fit slope "
                f"{slopes.get(method, float('nan')):.2f})",
            )
            ref = best_mult[method] * scale.batch_lr0[method]
            ax.plot(
                bs,
                ref * (bs / scale.batch_base) ** power,
                ":",
                color=f"C{i}",
                label=f"∝ B^{power:g} (predicted)",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel("best peak learning rate")
        ax.set_title(f"Best lr vs B (grid: ×{', ×'.join(f'{m:g}' for m in scale.batch_lr_mults)})")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax = axes[3]
        for i, method in enumerate(BATCH_POWER):
            mine = [t for t in table if t["method"] == method]
            ax.plot(
                [t["batch_size"] for t in mine],
                [t["final_loss"] for t in mine],
                "o-",
                color=f"C{i}",
                label=f"{LABELS[method]} (best lr per B)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("final eval loss")
        ax.set_title(f"Final loss after {scale.batch_examples} examples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        name = TASK_NAMES[task]
        fig.suptitle(
            f"Batch-size scaling on the {name}: do curves collapse against examples "
            f"seen? (seed {seed})"
        )
        save(fig, out / "batch_scaling.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# 4. Overhead: bench.py's table.


def run_overhead(scale: Scale, out: Path, seed: int) -> dict[str, Any]:
    import bench

    overrides = dict(scale.bench)
    base = bench.Config(**bench.QUICK) if overrides.pop("quick", False) else bench.Config()
    config = dataclasses.replace(base, seed=seed, **overrides)
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
        f"# Overhead of per-example statistics (bench.py, {seconds:.0f} s, seed {seed})\n",
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
    if plt := pyplot():
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
            ax.set_ylabel(f"{title} / plain gradient's")
            ax.set_title(f"mean+sq_mean: {title} relative to jax.value_and_grad")
            ax.grid(alpha=0.3, axis="y")
        save(fig, out / "overhead.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# Entry points.

RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "sign": run_sign,
    "precond": run_precond,
    "batch-scaling": run_batch_scaling,
}


def run(
    name: str, *, scale: str, out: str, seed: int = 0, tasks: Sequence[str] | None = None
) -> dict[str, Any]:
    """Run experiment `name` ("sign", "precond", "batch-scaling", "overhead" or "all") at
    `scale` ("smoke", "tiny", "small", "paper") into `out`; returns its summary (for "all": a
    dict of the four). `tasks` ("mlp", "lm") overrides the scale's choice of task."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
    if name == "all":
        return {
            n: run(n, scale=scale, out=str(Path(out) / n), seed=seed, tasks=tasks)
            for n in EXPERIMENTS
        }
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {(*EXPERIMENTS, 'all')}")
    for t in tasks or ():
        if t not in ("mlp", "lm"):
            raise ValueError(f"unknown task {t!r}: choose 'mlp' or 'lm'")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    print(f"experiment {name}, scale {scale}, seed {seed} -> {path}", flush=True)
    t0 = time.perf_counter()
    if name == "overhead":
        summary = run_overhead(SCALES[scale], path, seed)
    else:
        summary = RUNNERS[name](SCALES[scale], path, seed, tasks)
    seconds = time.perf_counter() - t0
    summary = {**summary, "scale": scale, "seed": seed, "total_seconds": round(seconds, 1)}
    data = json.loads((path / "summary.json").read_text())
    (path / "summary.json").write_text(json.dumps({**data, **summary}, indent=1))
    print(f"experiment {name} done in {seconds:.0f}s: {path}/summary.csv, summary.json", flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("name", choices=(*EXPERIMENTS, "all"), help="which experiment")
    parser.add_argument("--scale", choices=tuple(SCALES), default="tiny", help="sizes and steps")
    parser.add_argument("--out", default=None, help="output directory (default runs/exp-NAME)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run")
    parser.add_argument(
        "--tasks", nargs="+", choices=("mlp", "lm"), default=None, help="override the scale's tasks"
    )
    args = parser.parse_args(argv)
    out = args.out or f"runs/exp-{args.name}"
    try:
        run(args.name, scale=args.scale, out=out, seed=args.seed, tasks=args.tasks)
    except train.ConfigError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
