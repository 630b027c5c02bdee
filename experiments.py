"""experiments.py: one command per finding of Roulet & Agarwala (arXiv 2510.00236), each verdict
computed on seeds its learning rates were not chosen on.

    python experiments.py sign --out results/sign           # sign placement, with the SNR model
    python experiments.py precond --out results/precond     # Adam / MicroAdam / MicroAdamVar per
                                                            #   regime, with μ̂²/σ̂² measured
    python experiments.py msq --out results/msq             # MicroAdamMSQ's ε, both placements;
                                                            #   Adam the control
    python experiments.py clipping --out results/clipping   # MicroAdam and Adam, clipped
    python experiments.py batch-scaling --out results/bs    # best lr vs B, two β₂ arms
    python experiments.py windows --out results/windows     # μ̂²/σ̂² of the LM vs its window
    python experiments.py critical-batch --task mlp --out results/cb   # steps to a target loss
                                                            #   vs B: B_crit, and B_simple's
                                                            #   and B_P's predictions of it
    python experiments.py overhead --out runs/overhead      # bench.py's cost table
    python experiments.py vectorize --out runs/vec          # runs/hour: vmap vs one by one
    python experiments.py sign --select-seeds 0,1,2 --seeds 3-7    # the protocol, explicitly
    python experiments.py sign --seeds 0-4                  # leave-one-seed-out on seeds 0..4
    python experiments.py sign --seeds 20-24 --lrs-from results/sign/summary.json
                                                            # re-check committed settings, new seeds
    python experiments.py critical-batch --task mlp --seeds 20-24 \
        --lrs-from results/critical-batch-mlp/summary.json --out results/recheck/cb-mlp
                                                            # its lrs and target, new seeds
    python experiments.py noise-floor --task lm --seeds 3-10 --lrs-from \
        results/precond-lm/summary.json,results/clipping-lm/summary.json,results/sign/summary.json \
        --out results/noise-floor-lm                        # the spread a null perturbation gives
    python experiments.py sign-decided --select-seeds 0-2 --seeds 3-12 \
        --noise-floor results/noise-floor-lm/summary.json --out results/sign-lm-decided
                                                            # SignEMA, SignSGD β 0.9 and β 0 on
                                                            #   √2-step grids, against the floor

This is the studies' one entry point (train.py trains one run). In Python: `experiments.run(name,
scale=..., out=..., seeds=(3, 4, 5), select_seeds=(0, 1, 2)) -> summary dict`.

Selection protocol (every training study but batch-scaling and critical-batch, whose own
protocols, built on it, are in their docstrings):

* held-out (the default: `--select-seeds` and `--seeds` disjoint): each variant's lr grid is
  trained on the selection seeds; its lr is the one with the lowest mean final loss over them
  among the lrs at which every selection seed finished. While that lr is at an edge of the grid
  (or no lr finished), the grid is extended by one of its own steps past that edge and the new
  point trained, up to `Shared.max_extensions` times per variant (`Msq.max_extensions` in msq,
  whose best lr moves with ε). The chosen lr is then trained on the evaluation seeds, and every
  verdict is computed on those alone.
* leave-one-seed-out (`--seeds` only): the whole grid on every seed; seed s is scored at the lr
  chosen on the other seeds.
* fixed (`--lrs-from SUMMARY --seeds ...`): no selection; each variant at the lr a committed
  summary chose, on the given (unseen) seeds. This is the independent re-check. SUMMARY may be
  several summaries, comma-separated (noise-floor reads each optimizer's lr from its own study);
  where two name the same family, the later one's lr is used. critical-batch takes each B's lr
  and the target loss from one critical-batch summary of its task.
A family of variants (e.g. MicroAdamMSQ at every ε) is chosen the same way: the member and its
lr with the lowest selection mean. Summaries record the protocol, the real seed numbers, every
grid tried and its extensions, the command line and the git commit; a chosen lr still at an edge
of its grid after the extensions is marked "edge: not a result", and so is any verdict using it.

Each study writes OUT/summary.csv (one row per run and seed, with its phase), OUT/summary.json,
OUT/summary.md (for people), OUT/traces.csv.gz (every run's binned training loss and diagnostic
and its held-out losses: `python plots.py OUT` redraws OUT/<name>.png from it and summary.json).
Runs that differ only in the optimizer's numbers (lr, β, ε, clipping threshold) and the seed are
one vectorized program (sweep.py); their traces are cached in `--cache` (default OUT/cache), so an
interrupted study continues and studies sharing a cache share their common runs.

Scales (SCALES, `{scale: {study: settings}}`): what every study at a scale shares (`Shared`: the
two tasks' base configs, the default task, the seeds, the grid extensions, the μ̂²/σ̂² sample) and
each study's own settings dataclass, whose presets per scale sit beside its `run_*`. `smoke`
(tiny MLP, a few steps: tests), `tiny` (the default "mini" byte-level LM of train.py on 32-token
windows, 1000 steps of batch 16, and the "mini" teacher-student MLP: a CPU study), `small` and
`paper` (larger, longer: for accelerators; not run here).

Definitions shared by the studies (each study's own methods are in its `run_*`'s docstring):

* final loss: the held-out loss at the end (train.py's eval: cfg.eval_batches batches drawn from
  the run's seed). A run whose loss or update became NaN/Inf is "diverged" at that step (sweep.py
  freezes it there; it has no final loss); a finished run whose final loss is above its initial
  one "blew up" (a finite explosion). Both count as unstable.
* spike: after warmup, a training loss (of one step's batch) above SPIKE_FACTOR (2) times the
  median of the last SPIKE_WINDOW (50) non-spiking ones; consecutive spiking steps are one.
* verdict of "A vs B" (each at its chosen lr), on the evaluation seeds (or the held-out seeds of
  leave-one-seed-out): per-seed differences d_s = loss_A − loss_B (paired: one seed is one
  initialisation, batch order and held-out set for both); mean, standard error se and the 95 %
  t-interval mean ± t·se (t: Student's 97.5 % quantile with n − 1 degrees of freedom, 2.78 at
  n = 5). The one rule (`strength`): "consistent" when that interval excludes 0 and every seed
  agrees on the sign of d (the sign condition is additional: at n = 5 a 4/5 split can exclude
  0); "no difference" when |mean d| ≤ se; otherwise "weak". (Until issue 39 "consistent" took
  |mean d| > 2·se, looser than the interval at n < 62; the committed summaries were restated
  from their own per-seed numbers, results/restate.py.) A seed on which either diverged or blew
  up is left out of d and named. Beside it, the "same-seed" verdict of the old protocol (lr
  chosen and scored on the selection seeds) shows what held-out selection changed. With
  `--noise-floor SUMMARY` (a noise-floor summary.json of the study's task: `run_noise_floor`)
  every verdict is "undecided" where |mean d| ≤ its floor, whatever the interval says (an
  interval narrower than the floor comes from a few seeds agreeing by chance), and states the
  floor where it is above it. Every study's verdict, of whatever kind, is written by one
  formatter (`verdict_text`): the claim, its evidence in parentheses, then its notes.
* code: every run records the code version that trained it (sweep.code_version, a hash of the
  files it depends on; the cache reuses a run only at the same version, or from before versions
  were recorded: "unknown"); a summary that holds runs of more than one version says so and
  counts them per version and variant.
* mean-dominated coordinates (train.diagnostics, every step, from the training batch): the
  fraction of coordinates with μ̂² > σ̂²/B, i.e. where the squared mean outweighs the noise of
  ḡ in Adam's ν = μ² + σ²/B (μ̂², σ̂²: `measure_mu_sigma`).
"""

import argparse
import contextlib
import csv
import dataclasses
import datetime
import gzip
import io
import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pegrad
import plots
import sweep
import train

# seeded studies
TRAINING = (
    "sign",
    "sign-decided",
    "noise-floor",
    "precond",
    "msq",
    "clipping",
    "batch-scaling",
    "critical-batch",
    "windows",
)
EXPERIMENTS = (*TRAINING, "overhead", "vectorize")
TASK_NAMES = {"mlp": "MLP teacher-student", "lm": "byte-level LM"}  # in figure titles
SIGN_METHODS = ("micro_sign_sgd", "sign_sgd", "sign_ema")
PRECOND_METHODS = ("adam", "micro_adam", "micro_adam_var")
LABELS = {
    "micro_sign_sgd": "MicroSignSGD",
    "sign_sgd": "SignSGD",
    "sign_ema": "SignEMA",
    "adam": "Adam",
    "micro_adam": "MicroAdam",
    "micro_adam_var": "MicroAdamVar",
    "micro_adam_msq": "MicroAdamMSQ",
}
PLAIN_SIGN = "plain SignSGD (β 0)"  # the paper's SignSGD: sign(ḡ), no EMA (sign_sgd at β = 0)
ULP = " lr +1 ulp"  # the noise floor's perturbed twin of a variant: its label plus this
UNKNOWN_CODE = "unknown"  # a run's code version, where its cache entry predates versions
SPIKE_FACTOR = 2.0
SPIKE_WINDOW = 50  # steps of the median a spike is measured against
EDGE = "edge: not a result"
BOOTSTRAP = 1000  # seed resamples of the batch-scaling exponent's interval


def t975(df: int) -> float:
    """Student's t 97.5 % quantile with `df` degrees of freedom: a two-sided 95 % interval."""
    import scipy.stats  # a dependency of jax

    return float(scipy.stats.t.ppf(0.975, df))


# fmt: off
CSV_COLUMNS = (
    "experiment", "phase", "task", "regime", "arm", "method", "optimizer", "lr", "momentum",
    "b2", "eps", "eps_root", "max_grad_norm", "msq_block", "noise", "seq_len", "batch_size",
    "steps", "examples", "seed", "status", "diverged_step", "first_eval_loss", "final_loss",
    "final_train_loss", "spikes", "final_frac_mean_dominated", "seconds", "code",
)
# fmt: on


# --------------------------------------------------------------------------------------------
# Scales: what every study shares (the tasks, the seeds); each study's settings sit beside it.


@dataclasses.dataclass(frozen=True)
class Shared:
    """What every study at a scale shares: the two tasks' base configs, the default task, the
    protocol's seeds and grid extensions, and the fresh sample μ̂²/σ̂² is measured on."""

    task: str  # "lm" or "mlp": the default task of sign, precond, msq, clipping, critical-batch
    lm: train.Config  # byte-level transformer LM on CPython's English text
    mlp: train.Config  # teacher-student regression (label noise sets the gradient SNR)
    select_seeds: tuple[int, ...]  # default --select-seeds: each lr is chosen on these...
    eval_seeds: tuple[int, ...]  # ...and each verdict computed on these (default --seeds)
    max_extensions: int  # per variant: grid points added past an edge before giving up
    snr_batches: int  # μ̂²/σ̂² (`measure_mu_sigma`) on snr_batches fresh batches...
    snr_batch_size: int  # ...of this many examples

    def config(self, task: str | None = None) -> train.Config:
        """The base config of `task` (None: the scale's task)."""
        return self.lm if (task or self.task) == "lm" else self.mlp


def _mlp(size: str, **kw: Any) -> train.Config:
    base = dict(model="mlp", size=size, noise=1.0, schedule="cosine", checkpoint_interval=10**9)
    return train.Config(**{**base, **kw})


def _lm(size: str, **kw: Any) -> train.Config:
    base = dict(model="transformer", size=size, schedule="cosine", checkpoint_interval=10**9)
    return train.Config(**{**base, **kw})


# fmt: off
SHARED = {
    "smoke": Shared(  # seconds per program, MLP: for tests
        task="mlp",
        mlp=_mlp("tiny", steps=4, warmup=1, batch_size=8, eval_interval=2, eval_batches=1),
        lm=_lm("tiny", n_layers=1, seq_len=8, steps=4, warmup=1, batch_size=4, eval_interval=2,
               eval_batches=1),
        select_seeds=(0, 1), eval_seeds=(2, 3), max_extensions=1, snr_batches=1, snr_batch_size=8,
    ),
    "tiny": Shared(  # the "mini" LM (120k parameters) on 32-token windows and the "mini" MLP: CPU
        task="lm",
        # Noise-free labels: at noise 1 every optimizer ends at the noise floor within 0.3 %.
        mlp=_mlp("mini", noise=0.0, steps=1000, warmup=50, batch_size=16, eval_interval=200,
                 eval_batches=16),
        lm=_lm("mini", seq_len=32, steps=1000, warmup=50, batch_size=16, eval_interval=200,
               eval_batches=16),
        select_seeds=(0, 1, 2), eval_seeds=(3, 4, 5, 6, 7), max_extensions=3, snr_batches=8,
        snr_batch_size=128,
    ),
    "small": Shared(  # an hour or more per study on a CPU
        task="lm",
        mlp=_mlp("small", steps=2000, warmup=100, batch_size=32, eval_interval=250,
                 eval_batches=32),
        lm=_lm("small", seq_len=64, steps=2000, warmup=100, batch_size=32, eval_interval=250,
               eval_batches=16),
        select_seeds=(0, 1, 2), eval_seeds=(3, 4, 5, 6, 7), max_extensions=3, snr_batches=16,
        snr_batch_size=128,
    ),
    "paper": Shared(  # the paper's transformer shape (TransformerConfig.paper()): accelerators
        task="lm",
        mlp=_mlp("paper", steps=5000, warmup=250, batch_size=64, eval_interval=500,
                 eval_batches=32),
        lm=_lm("paper", seq_len=512, steps=5000, warmup=250, batch_size=64, eval_interval=250,
               eval_batches=16),
        select_seeds=(0, 1, 2), eval_seeds=(3, 4, 5, 6, 7), max_extensions=3, snr_batches=16,
        snr_batch_size=32,
    ),
}
# fmt: on
GRID3 = (1e-3, 3e-3, 1e-2)


def task_of(cfg: train.Config) -> str:
    return "lm" if cfg.model == "transformer" else "mlp"


# --------------------------------------------------------------------------------------------
# Seeds, protocol and provenance.


def parse_seeds(text: str) -> tuple[int, ...]:
    """ "3,4,5", "3-7" or a mix ("0,2,5-7"): the seeds in the order given, each once. A bare
    number is refused: it once meant "seeds 0..N-1", and reading it as one seed would silently
    change an old command's meaning."""
    text = text.strip()
    if text.isdigit():
        n = int(text)
        raise ValueError(
            f"--seeds {text}: give the seeds themselves, e.g. 0-{max(n - 1, 0)} "
            f"for 0..{max(n - 1, 0)} or {text}, for seed {text} alone"
        )
    seeds: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            span = range(int(lo), int(hi) + 1) if sep else [int(part)]
        except ValueError:
            raise ValueError(f"seeds: cannot read {part!r} in {text!r}") from None
        if sep and int(hi) < int(lo):
            raise ValueError(f"seeds: empty range {part!r}")
        seeds += [s for s in span if s not in seeds]
    if not seeds or any(s < 0 for s in seeds):
        raise ValueError(f"seeds: need one or more seeds >= 0, got {text!r}")
    return tuple(seeds)


def seeds_text(seeds: Sequence[int]) -> str:
    return ",".join(str(s) for s in seeds)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """Which seeds choose the lrs and which decide the verdicts (the module docstring's
    selection protocol)."""

    select: tuple[int, ...]  # the lr grid runs on these (empty with fixed lrs)
    evaluate: tuple[int, ...]  # the verdicts use these; empty: leave-one-seed-out on select
    fixed: tuple[tuple[str, str, float], ...] = ()  # (family, variant, lr) from a summary
    source: str | None = None  # the summary `fixed` was read from

    @property
    def name(self) -> str:
        if self.fixed:
            return "fixed"
        return "held-out" if self.evaluate else "leave-one-seed-out"

    def describe(self) -> str:
        if self.name == "fixed":
            return (
                f"fixed: each variant at the lr chosen in {self.source}, on seeds "
                f"{seeds_text(self.evaluate)} (no selection here)"
            )
        if self.name == "held-out":
            return (
                f"held-out: lr chosen on seeds {seeds_text(self.select)}, verdicts on "
                f"seeds {seeds_text(self.evaluate)}"
            )
        return (
            f"leave-one-seed-out over seeds {seeds_text(self.select)}: each seed scored at "
            "the lr chosen on the others"
        )


def make_protocol(
    seeds: Sequence[int] | None,
    select_seeds: Sequence[int] | None,
    lrs_from: str | None,
    shared: Shared,
) -> Protocol:
    """The protocol the arguments name (None: the scale's defaults), checked."""
    if lrs_from is not None:
        if select_seeds:
            raise ValueError("--lrs-from takes the lrs from a summary: no --select-seeds")
        if not seeds or len(seeds) < 2:
            raise ValueError("--lrs-from needs --seeds with two or more (unseen) seeds")
        found: dict[str, tuple[str, str, float]] = {}  # family -> choice; a later file wins
        for path in filter(None, (p.strip() for p in lrs_from.split(","))):
            data = json.loads(Path(path).read_text())
            chosen = [
                (c["family"], c["method"], float(c["lr"]))
                for c in data.get("chosen", ())
                if c.get("lr") is not None
            ]
            if not chosen:
                raise ValueError(f"--lrs-from {path}: no chosen lrs in it (is it a summary.json?)")
            found |= {c[0]: c for c in chosen}
        return Protocol((), tuple(seeds), tuple(found.values()), lrs_from)
    if select_seeds is None and seeds is None:
        select, evaluate = shared.select_seeds, shared.eval_seeds
    elif select_seeds is None:
        select, evaluate = tuple(seeds or ()), ()  # leave-one-seed-out
    else:
        select, evaluate = tuple(select_seeds), tuple(seeds or ())
    if overlap := sorted(set(select) & set(evaluate)):
        raise ValueError(
            f"seeds {overlap} are both selection and evaluation seeds: the "
            "held-out protocol needs them disjoint"
        )
    if not evaluate and len(select) < 2:
        raise ValueError("leave-one-seed-out needs two or more seeds")
    if not select:
        raise ValueError("need one or more selection seeds")
    return Protocol(select, evaluate)


def provenance(
    name: str,
    scale: str,
    out: Path,
    proto: Protocol,
    cache: Path,
    task: str | None = None,
    only: Sequence[str] | None = None,
    noise_floor: str | None = None,
) -> dict[str, Any]:
    """What regenerates this summary: the command and the commit (with whether the code
    differed from it), the seeds, the machine."""
    here = Path(__file__).resolve().parent
    git = lambda *args: subprocess.run(["git", *args], cwd=here, capture_output=True, text=True)
    commit = git("rev-parse", "HEAD").stdout.strip() or None
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "*.py", "*.toml")
    command = ["python", "experiments.py", name, "--scale", scale, "--out", str(out)]
    if proto.name == "fixed":
        command += ["--lrs-from", str(proto.source), "--seeds", seeds_text(proto.evaluate)]
    elif proto.name == "held-out":
        command += [
            "--select-seeds",
            seeds_text(proto.select),
            "--seeds",
            seeds_text(proto.evaluate),
        ]
    else:
        command += ["--seeds", seeds_text(proto.select)]
    if task is not None:
        command += ["--task", task]
    for name_ in only or ():
        command += ["--only", shlex.quote(name_)]
    if noise_floor is not None:
        command += ["--noise-floor", noise_floor]
    if cache != out / "cache":
        command += ["--cache", str(cache)]
    return {
        "command": " ".join(command),
        "git_commit": commit,
        "code_differs_from_commit": bool(changed.stdout.strip()),
        "protocol": proto.name,
        "protocol_text": proto.describe(),
        "selection_seeds": list(proto.select),
        "evaluation_seeds": list(proto.evaluate),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
    }


def provenance_lines(prov: dict[str, Any]) -> list[str]:
    dirty = (
        " (with uncommitted changes: not reproducible)" if prov["code_differs_from_commit"] else ""
    )
    return [
        f"Command: `{prov['command']}`  ",
        f"Commit: {prov['git_commit']}{dirty}; jax {prov['jax']} on {prov['device']}; "
        f"{prov['date_utc']} UTC  ",
        f"Protocol: {prov['protocol_text']}",
        "",
    ]


def code_record(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Which code trained a study's runs (each row's "code": sweep.code_version, or
    UNKNOWN_CODE): this checkout's version, the runs per version, per version and variant, and
    whether they are mixed (more than one version, "unknown" counting as one)."""
    current = sweep.code_version(train.Config())
    per: dict[str, dict[str, int]] = {}
    for r in rows:
        mine = per.setdefault(r.get("code") or UNKNOWN_CODE, {})
        mine[r["method"]] = mine.get(r["method"], 0) + 1
    return {
        "current": current,
        "runs_by_code": {v: sum(m.values()) for v, m in per.items()},
        "runs_by_code_and_variant": per,
        "mixed": len(per) > 1,
    }


def code_lines(record: dict[str, Any]) -> list[str]:
    """The summary's sentence on the code that trained its runs: one line where one version
    trained them all; where they mix, each other version with its runs per variant."""
    current, per = record["current"], record["runs_by_code_and_variant"]
    if not per:
        return []
    what = "(`sweep.code_version`: train.py, models.py, optimizers.py, pegrad.py, sweep.py)"
    if set(per) == {current}:
        return [f"Code: every run trained by this code, version {current} {what}.", ""]

    def name(v: str) -> str:
        if v == current:
            return f"this code ({v})"
        if v == UNKNOWN_CODE:
            return "an unknown version (cache entries from before versions were recorded)"
        return f"another version ({v})"

    counts = "; ".join(
        f"{sum(m.values())} by {name(v)}"
        + ("" if v == current else ": " + ", ".join(f"{k} {n}" for k, n in m.items()))
        for v, m in sorted(per.items(), key=lambda vm: vm[0] != current)  # this code first
    )
    head = "**Mixes runs from different code**" if record["mixed"] else "**Not this code**"
    return [
        f"{head} {what}: {counts}. A run's version is its row's `code` in summary.csv; a "
        "fresh --cache trains every run at one version.",
        "",
    ]


# --------------------------------------------------------------------------------------------
# Runs: a list of (labels, config) points, each for some seeds, trained by sweep.py.


@dataclasses.dataclass(frozen=True)
class Point:
    """One setting: its labels (variant, and what else varies) and its config (any seed)."""

    method: str  # a variant's label, e.g. "MicroAdam, clip 0.01"
    cfg: train.Config
    extra: tuple[tuple[str, Any], ...] = ()  # further labels, e.g. (("regime", "MLP"),)


@dataclasses.dataclass(frozen=True)
class Variant:
    """An optimizer setting whose lr is chosen: its starting grid (ascending), grown at edges."""

    label: str
    cfg: train.Config  # lr and seed are set per run
    lrs: tuple[float, ...]
    extra: tuple[tuple[str, Any], ...] = ()


def count_spikes(losses: Sequence[float], warmup: int) -> int:
    """Spikes in per-step training losses (index = step): after warmup, a loss above
    SPIKE_FACTOR × the median of the last SPIKE_WINDOW non-spiking losses (at least 5 of them);
    consecutive spiking steps are one spike, and a spiking step does not enter the median, so
    a loss that jumps and stays up is one long spike. NaN (a diverged run's steps after its
    divergence) is skipped. A median, not a running minimum: the minimum of many noisy batch
    losses sits far below their typical value, and noise alone would cross twice it."""
    spikes, inside, calm = 0, False, []
    for step, loss in enumerate(losses):
        if not math.isfinite(loss):
            continue
        spiking = step >= warmup and len(calm) >= 5
        spiking = spiking and loss > SPIKE_FACTOR * float(np.median(calm[-SPIKE_WINDOW:]))
        spikes += spiking and not inside
        inside = spiking
        if not spiking:
            calm.append(loss)
    return spikes


def row_of(experiment: str, phase: str, point: Point, trace: sweep.Trace) -> dict[str, Any]:
    cfg = trace.cfg
    first, final = float(trace.eval_loss[0]), float(trace.eval_loss[-1])
    status = trace.status
    if status == "ok" and final > first:
        status = "blew_up"  # finite but worse than at initialisation
    tail = trace.loss[-max(1, cfg.steps // 20) :]  # the last 5% of the steps
    frac = trace.diagnostics["frac_snr_gt_1_over_B"][-max(1, cfg.steps // 20) :]
    return {
        "experiment": experiment,
        "phase": phase,
        "task": task_of(cfg),
        "regime": None,
        "arm": None,
        "method": point.method,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "b2": cfg.b2,
        "eps": cfg.eps,
        "eps_root": cfg.eps_root,
        "max_grad_norm": cfg.max_grad_norm,
        "msq_block": cfg.msq_block,
        "noise": cfg.noise if cfg.model == "mlp" else None,
        "seq_len": cfg.seq_len if cfg.model == "transformer" else None,
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
        "code": trace.code or UNKNOWN_CODE,
    }


@dataclasses.dataclass
class Runs:
    """Every run of a study so far: rows (summary.csv) and traces, in the same order."""

    experiment: str
    cache: Path
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    traces: list[sweep.Trace] = dataclasses.field(default_factory=list)
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def train(self, phase: str, points: Sequence[tuple[Point, int]]) -> None:
        """Train (or load from the cache) each (point, seed) not yet here."""
        have = {(r["method"], r["lr"], r["seed"]) for r in self.rows}
        todo = [(p, s) for p, s in dict.fromkeys(points) if (p.method, p.cfg.lr, s) not in have]
        if not todo:
            return
        log = lambda m: print(f"  [{time.perf_counter() - self.t0:6.0f}s] {m}", flush=True)
        configs = [dataclasses.replace(p.cfg, seed=s) for p, s in todo]
        traces = sweep.run(configs, cache=self.cache, log=log)
        self.rows += [
            row_of(self.experiment, phase, p, t) for (p, _), t in zip(todo, traces, strict=True)
        ]
        self.traces += traces

    def trace(self, method: str, lr: float, seed: int) -> sweep.Trace | None:
        for r, t in zip(self.rows, self.traces, strict=True):
            if (r["method"], r["lr"], r["seed"]) == (method, lr, seed):
                return t
        return None


def aggregate(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Per setting (rows equal in `keys`): the final loss over its seeds; a setting with an
    unstable seed has no mean."""
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


# --------------------------------------------------------------------------------------------
# Choosing lrs: on some seeds, at interior points of the grid, scored on other seeds.


def choose(
    rows: Sequence[dict[str, Any]], labels: Sequence[str], seeds: Sequence[int]
) -> dict[str, Any] | None:
    """Among the variants `labels` and their lrs at which every one of `seeds` finished, the
    (variant, lr) with the lowest mean final loss over `seeds`: its setting restricted to those
    seeds ("method", "lr", "mean", "per_seed", ...), or None if none finished everywhere."""
    wanted = set(seeds)
    mine = [r for r in rows if r["method"] in labels and r["seed"] in wanted]
    complete = [a for a in aggregate(mine, ("method", "lr")) if set(a["per_seed"]) == wanted]
    found = best(complete, ())
    return found.get(())


def grid_edge(lrs: Sequence[float], lr: float | None) -> str | None:
    """ "top" or "bottom" when `lr` is the largest or smallest of the grid `lrs` (None: no lr
    finished, so the grid must grow downwards); None when it has a neighbour on each side."""
    grid = sorted(set(lrs))
    if lr is None or lr == grid[0]:
        return "bottom"
    return "top" if lr == grid[-1] else None


def extend_grid(lrs: Sequence[float], side: str) -> float:
    """The next lr past `side` of the grid, one of the grid's own end steps away (3
    significant digits, so the same point gets the same number every time)."""
    grid = sorted(set(lrs))
    if len(grid) < 2:
        new = grid[0] * (2.0 if side == "top" else 0.5)
    elif side == "top":
        new = grid[-1] * grid[-1] / grid[-2]
    else:
        new = grid[0] * grid[0] / grid[1]
    return float(f"{new:.3g}")


def select_lrs(
    runs: Runs, variants: Sequence[Variant], seeds: Sequence[int], max_extensions: int
) -> dict[str, dict[str, Any]]:
    """Each variant's grid on `seeds`, extended past an edge while its best lr sits there (up
    to max_extensions points per variant). Per variant: the grid, the points added, the chosen
    setting on `seeds` (or None) and the edge it still sits at (or None)."""
    grids = {v.label: sorted(v.lrs) for v in variants}
    added: dict[str, list[float]] = {v.label: [] for v in variants}
    while True:
        points = [
            (Point(v.label, dataclasses.replace(v.cfg, lr=lr), v.extra), s)
            for v in variants
            for lr in grids[v.label]
            for s in seeds
        ]
        runs.train("select", points)
        grew = False
        for v in variants:
            chosen = choose(runs.rows, [v.label], seeds)
            side = grid_edge(grids[v.label], None if chosen is None else chosen["lr"])
            if side is not None and len(added[v.label]) < max_extensions:
                new = extend_grid(grids[v.label], side)
                grids[v.label] = sorted({*grids[v.label], new})
                added[v.label].append(new)
                grew = True
        if not grew:
            break
    out = {}
    for v in variants:
        chosen = choose(runs.rows, [v.label], seeds)
        out[v.label] = {
            "grid": grids[v.label],
            "extended_with": added[v.label],
            "chosen": chosen,
            "edge": grid_edge(grids[v.label], None if chosen is None else chosen["lr"]),
        }
    return out


def leave_one_out(
    rows: Sequence[dict[str, Any]], labels: Sequence[str], seeds: Sequence[int]
) -> dict[int, tuple[str, float, float | None] | None]:
    """Per seed s: the (variant, lr) chosen among `labels` on the other seeds, and s's final
    loss there (None: s diverged or blew up there); None when nothing finished on the others."""
    out: dict[int, tuple[str, float, float | None] | None] = {}
    for s in seeds:
        chosen = choose(rows, labels, [t for t in seeds if t != s])
        if chosen is None:
            out[s] = None
            continue
        mine = [
            r
            for r in rows
            if (r["method"], r["lr"], r["seed"]) == (chosen["method"], chosen["lr"], s)
        ]
        out[s] = (chosen["method"], chosen["lr"], mine[0]["final_loss"] if mine else None)
    return out


def strength(d: Sequence[float] | np.ndarray) -> str:
    """The verdict rule (module docstring) on paired differences d: "consistent" when the 95 %
    t-interval of their mean excludes 0 and every one has the mean's sign; "no difference" when
    |mean| ≤ se; else "weak". One difference alone is "no difference" (no interval)."""
    d = np.asarray(d, np.float64)
    n, mean = len(d), float(np.mean(d))
    if n < 2:
        return "no difference"
    se = float(np.std(d, ddof=1)) / math.sqrt(n)
    if abs(mean) <= se:
        return "no difference"
    agree = int((d < 0).sum()) if mean < 0 else int((d > 0).sum())
    return "consistent" if agree == n and abs(mean) > t975(n - 1) * se else "weak"


Z975 = 1.959964  # the normal 97.5 % quantile: the noise floor's σ are measured, not estimated here


def optimizer_of(label: str) -> str:
    """A variant's optimizer for the noise floor: its label up to the first ", " or " ["
    ("MicroAdam, clip 0.01" and "MicroAdam [LM, 32 tokens]" -> "MicroAdam")."""
    for sep in (", ", " ["):
        label = label.split(sep)[0]
    return label.strip()


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """The spread chaos alone gives one run's final loss, per optimizer (a noise-floor study's
    "noise_floor"), and the floor it sets each verdict (`run_noise_floor`)."""

    sigma: dict[str, float]  # optimizer label -> σ = RMS(δ)/√2 of one run's final loss
    source: str  # the summary it was read from
    task: str | None = None  # the task it was measured on

    def sigma_of(self, label: str) -> tuple[float, str]:
        """σ of a variant (its optimizer's; the largest measured where that was not measured)
        and the optimizer it was taken from."""
        name = optimizer_of(label)
        if name in self.sigma:
            return self.sigma[name], name
        top = max(self.sigma, key=lambda k: self.sigma[k])
        return self.sigma[top], f"{top} (largest measured; {name} not measured)"

    def variance(self, side: str) -> float:
        """σ² of one side of a verdict: a variant, or a difference "X − Y" of two (σ_X² + σ_Y²)."""
        return sum(self.sigma_of(part)[0] ** 2 for part in side.split(" − "))

    def floor(self, a: str, b: str, n: int) -> float:
        """The floor of A vs B on n paired seeds: 1.96·√((σ_A² + σ_B²)/n)."""
        return Z975 * math.sqrt((self.variance(a) + self.variance(b)) / n)


def read_noise_floor(path: str | Path) -> NoiseFloor:
    """The NoiseFloor of a committed noise-floor summary.json."""
    data = json.loads(Path(path).read_text())
    if data.get("experiment") != "noise-floor" or "noise_floor" not in data:
        raise ValueError(f"--noise-floor {path}: not a noise-floor summary.json")
    sigma = {k: float(v["sigma"]) for k, v in data["noise_floor"].items() if v["sigma"] is not None}
    if not sigma:
        raise ValueError(f"--noise-floor {path}: no optimizer's floor was measured")
    return NoiseFloor(sigma, str(path), data.get("task"))


def verdict_text(claim: str, evidence: str = "", notes: Sequence[str] = ()) -> str:
    """Every study's verdict in one form: the claim (its strength or kind first, e.g.
    "consistent: A better than B by 0.0100", "exponent 0.52", "no verdict: ..."), its evidence
    in parentheses (the interval, the seeds agreeing), then each note after "; " (a seed left
    out, an lr at the edge of its grid (`edge_note`), what a prediction says of the interval)."""
    text = f"{claim} ({evidence})" if evidence else claim
    return "; ".join([text, *notes])


def edge_note(what: str) -> str:
    """The note a verdict carries where a chosen lr is still at an edge of its grid."""
    return f"{EDGE} ({what})"


def compare(
    a: dict[str, Any] | None,
    b: dict[str, Any] | None,
    name_a: str,
    name_b: str,
    lower: str = "better",
    floor: NoiseFloor | None = None,
) -> dict[str, Any]:
    """The paired verdict of A vs B (the module docstring's verdict): lower loss is better
    (`lower`: the word for it). `a` and `b` carry "per_seed" ({seed: final loss or None}),
    optionally "lr", "edge". With a noise floor, a difference within it is "undecided" (and the
    verdict records the floor, whether it is above it, and the strength the interval alone
    gives)."""
    if a is None or b is None:
        missing = name_a if a is None else name_b
        return {"a": name_a, "b": name_b, "verdict": f"no verdict: {missing} has no stable lr"}
    both = sorted(set(a["per_seed"]) & set(b["per_seed"]))
    lost = {
        name: [s for s in both if x["per_seed"][s] is None]
        for name, x in ((name_a, a), (name_b, b))
    }
    seeds = [s for s in both if a["per_seed"][s] is not None and b["per_seed"][s] is not None]
    notes = [
        f"{name} unstable on seed(s) {seeds_text(ss)} (left out)" for name, ss in lost.items() if ss
    ]
    edges = [n for n, x in ((name_a, a), (name_b, b)) if x.get("edge")]
    if edges:
        notes.append(edge_note(f"{' and '.join(edges)} at the edge of the lr grid"))
    if not seeds:
        return {
            "a": name_a,
            "b": name_b,
            "verdict": verdict_text("no verdict: no seed where both finished", notes=notes),
            "edge": bool(edges),
        }
    d = np.array([a["per_seed"][s] - b["per_seed"][s] for s in seeds])
    n, mean = len(d), float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else math.inf
    half = t975(n - 1) * se if n > 1 else math.inf
    agree = int((d < 0).sum()) if mean < 0 else int((d > 0).sum())
    better, worse = (name_a, name_b) if mean < 0 else (name_b, name_a)
    interval = f"95% CI of {name_a} − {name_b}: [{mean - half:+.3f}, {mean + half:+.3f}]"
    kind = strength(d)
    floor_info: dict[str, Any] = {}
    if floor is not None:
        f = floor.floor(name_a, name_b, n)
        above = abs(mean) > f
        floor_info = {
            "noise_floor": f,
            "above_noise_floor": above,
            "strength_without_floor": kind,
            "noise_floor_from": floor.source,
        }
        interval += f"; noise floor {f:.3f}"
        if not above:
            kind = "undecided"
    if kind == "undecided":
        claim = f"undecided: {name_a} − {name_b} = {mean:+.4f}, within the noise floor"
        evidence = f"{agree}/{n} seeds agree; {interval}"
    elif kind == "no difference":
        claim = f"no difference: {name_a} − {name_b} = {mean:+.4f}"
        evidence = f"{interval}, n={n}"
    else:
        claim = f"{kind}: {better} {lower} than {worse} by {abs(mean):.4f}"
        evidence = f"{agree}/{n} seeds agree; {interval}"
    return {
        "a": name_a,
        "b": name_b,
        "lr_a": a.get("lr"),
        "lr_b": b.get("lr"),
        "mean_diff": mean,
        "se": se if n > 1 else None,
        "ci95": [mean - half, mean + half] if n > 1 else None,
        "seeds": n,
        "seeds_agreeing": agree,
        "per_seed_diff": dict(zip(seeds, d.tolist(), strict=True)),
        "edge": bool(edges),
        **floor_info,
        "verdict": verdict_text(claim, evidence, notes),
    }


def held_out(
    runs: "Runs", proto: "Protocol", label: str, lr: float, edge: str | None = None
) -> tuple[dict[str, Any], dict[int, Any]]:
    """One member's score on the evaluation seeds at its lr (`scored`) and its traces."""
    per = {
        s: next(
            r["final_loss"]
            for r in runs.rows
            if (r["method"], r["lr"], r["seed"]) == (label, lr, s)
        )
        for s in proto.evaluate
    }
    traces = {s: t for s in proto.evaluate if (t := runs.trace(label, lr, s)) is not None}
    return scored(label, lr, per, edge) | {"member": label}, traces


def scored(
    label: str,
    lr: float | None,
    per_seed: dict[int, float | None],
    edge: str | None = None,
    lr_per_seed: dict[int, float] | None = None,
) -> dict[str, Any]:
    """A variant's held-out score: its final loss per evaluation seed, summarised."""
    ok = [v for v in per_seed.values() if v is not None]
    return {
        "method": label,
        "lr": lr,
        "edge": edge,
        "per_seed": per_seed,
        "lr_per_seed": lr_per_seed,
        "seeds": len(per_seed),
        "seeds_ok": len(ok),
        "mean": float(np.mean(ok)) if ok else None,
        "sd": float(np.std(ok, ddof=1)) if len(ok) > 1 else None,
        "min": min(ok) if ok else None,
        "max": max(ok) if ok else None,
        "unstable": len(ok) < len(per_seed),
    }


@dataclasses.dataclass
class Study:
    """The outcome of `tune_and_score`: per family, its held-out score (and the runs behind
    it), the selection record of every variant, the same-seed scores of the old protocol."""

    runs: Runs
    proto: Protocol
    variants: dict[str, dict[str, Any]]  # label -> grid, extended_with, chosen, edge
    held: dict[str, dict[str, Any]]  # family -> `scored` on the evaluation seeds
    same_seed: dict[str, dict[str, Any] | None]  # family -> chosen and scored on select seeds
    held_traces: dict[str, dict[int, sweep.Trace]]  # family -> seed -> the scored run
    families: tuple[str, ...] = ()  # every family of the study, scored or not


def score_fixed(
    runs: Runs, variants: Sequence[Variant], families: Mapping[str, Sequence[str]], proto: Protocol
) -> Study:
    """`tune_and_score` under the fixed protocol: each family at the member and lr a committed
    summary chose (`proto.fixed`), on the evaluation seeds; no selection."""
    by_label = {v.label: v for v in variants}
    held: dict[str, dict[str, Any]] = {}
    held_traces: dict[str, dict[int, sweep.Trace]] = {}
    fixed = {fam: (member, lr) for fam, member, lr in proto.fixed}
    record = {
        v.label: {
            "grid": [],
            "extended_with": [],
            "chosen": None,
            "edge": None,
            "lr_from": proto.source,
        }
        for v in variants
    }
    for fam in families:
        if fam in fixed and fixed[fam][0] not in by_label:
            raise ValueError(
                f"--lrs-from {proto.source}: {fam!r} chose {fixed[fam][0]!r}, "
                "which is not a variant of this study at this scale"
            )
    mine = [(fam, *fixed[fam]) for fam in families if fam in fixed]
    runs.train(
        "evaluate",
        [
            (Point(lb, dataclasses.replace(by_label[lb].cfg, lr=lr), by_label[lb].extra), s)
            for _, lb, lr in mine
            for s in proto.evaluate
        ],
    )
    for fam, lb, lr in mine:
        record[lb]["grid"] = [lr]
        held[fam], held_traces[fam] = held_out(runs, proto, lb, lr)
    return Study(runs, proto, record, held, {}, held_traces, tuple(families))


def tune_and_score(
    experiment: str,
    variants: Sequence[Variant],
    families: Mapping[str, Sequence[str]],
    proto: Protocol,
    cache: Path,
    max_extensions: int,
) -> Study:
    """The protocol (module docstring) over `variants`; `families` names the groups whose best
    member is chosen and scored (a variant alone is a family of one)."""
    runs = Runs(experiment, cache)
    if proto.name == "fixed":
        return score_fixed(runs, variants, families, proto)
    by_label = {v.label: v for v in variants}
    held: dict[str, dict[str, Any]] = {}
    held_traces: dict[str, dict[int, sweep.Trace]] = {}
    same_seed: dict[str, dict[str, Any] | None] = {}
    record = select_lrs(runs, variants, proto.select, max_extensions)
    picks: dict[str, Any] = {}  # family -> chosen on all selection seeds; LOO: per seed
    for fam, labels in families.items():
        chosen = choose(runs.rows, labels, proto.select)
        edge = None if chosen is None else record[chosen["method"]]["edge"]
        same_seed[fam] = (
            None
            if chosen is None
            else (
                scored(chosen["method"], chosen["lr"], chosen["per_seed"], edge)
                | {"member": chosen["method"]}
            )
        )
        picks[fam] = (chosen, edge)
    if proto.name == "held-out":  # every family's pick on the evaluation seeds: one pass
        todo = [
            (
                Point(
                    c["method"],
                    dataclasses.replace(by_label[c["method"]].cfg, lr=c["lr"]),
                    by_label[c["method"]].extra,
                ),
                s,
            )
            for c, _ in picks.values()
            if c is not None
            for s in proto.evaluate
        ]
        runs.train("evaluate", todo)
        for fam, (c, edge) in picks.items():
            if c is None:
                continue
            lb, lr = c["method"], c["lr"]
            held[fam], held_traces[fam] = held_out(runs, proto, lb, lr, edge)
        return Study(runs, proto, record, held, same_seed, held_traces, tuple(families))
    for fam, labels in families.items():  # leave-one-seed-out
        loo = leave_one_out(runs.rows, labels, proto.select)
        if any(c is None for c in loo.values()):
            continue
        chosen, edge = picks[fam]
        per = {s: c[2] for s, c in loo.items() if c is not None}
        edges = [record[c[0]]["edge"] for c in loo.values() if c is not None]
        held[fam] = scored(
            chosen["method"] if chosen else labels[0],
            None if chosen is None else chosen["lr"],
            per,
            edge or next((e for e in edges if e), None),
            lr_per_seed={s: c[1] for s, c in loo.items() if c is not None},
        ) | {"member": None if chosen is None else chosen["method"]}
        held_traces[fam] = {
            s: t
            for s, c in loo.items()
            if c is not None
            if (t := runs.trace(c[0], c[1], s)) is not None
        }
    return Study(runs, proto, record, held, same_seed, held_traces, tuple(families))


def verdicts_of(
    study: Study, pairs: Sequence[tuple[str, str]], floor: NoiseFloor | None = None
) -> list[dict[str, Any]]:
    """Each pair's held-out verdict, with the same-seed verdict of the old protocol beside it
    (both against `floor` where one is given)."""
    out = []
    for a, b in pairs:
        if a not in study.families or b not in study.families:
            continue  # left out of this run (`--only`)
        v = compare(study.held.get(a), study.held.get(b), a, b, floor=floor)
        old = compare(study.same_seed.get(a), study.same_seed.get(b), a, b, floor=floor)
        out.append(v | {"same_seed_verdict": old["verdict"]})
    return out


# --------------------------------------------------------------------------------------------
# Writing a study: summary.csv, traces.csv.gz, summary.json, summary.md, the figure.

TRACE_BINS = 100  # training-loss points per run in traces.csv.gz
TRACE_COLUMNS = ("phase", "method", "lr", "seed", "batch_size", "kind", "step", "value")


def write_traces(path: Path, runs: Runs) -> None:
    """Every run's curves, compact: the training loss and the mean-dominated fraction binned
    (plots.binned) to TRACE_BINS points, the held-out losses at their steps, the gradient norm's
    binned median (for the clipping study). gzip, 5 significant digits."""
    with gzip.open(path, "wt", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(TRACE_COLUMNS)
        for r, t in zip(runs.rows, runs.traces, strict=True):
            head = [r["phase"], r["method"], r["lr"], r["seed"], r["batch_size"]]
            series = {
                "train_loss": plots.binned(t.loss, TRACE_BINS),
                "frac_mean_dominated": plots.binned(
                    t.diagnostics["frac_snr_gt_1_over_B"], TRACE_BINS
                ),
                "grad_norm": plots.binned(t.diagnostics["grad_norm"], TRACE_BINS),
                "eval_loss": (t.eval_steps, t.eval_loss),
            }
            for kind, (x, y) in series.items():
                for step, value in zip(x, y, strict=True):
                    writer.writerow([*head, kind, f"{float(step):g}", f"{float(value):.5g}"])


def write_runs(out: Path, summary: dict[str, Any], runs: Runs) -> None:
    """A study's runs: OUT/summary.csv (a row per run), traces.csv.gz, and summary.json (the
    summary with the rows under "runs")."""
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in runs.rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in CSV_COLUMNS})
    write_traces(out / "traces.csv.gz", runs)
    (out / "summary.json").write_text(json.dumps({**summary, "runs": runs.rows}, indent=1))


def instability(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant, over every run (every lr, both phases)."""
    out = []
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label]
        out.append(
            {
                "method": label,
                "runs": len(mine),
                "diverged": sum(r["status"] == "diverged" for r in mine),
                "blew_up": sum(r["status"] == "blew_up" for r in mine),
                "runs_with_spikes": sum(r["spikes"] > 0 for r in mine),
                "spikes": sum(r["spikes"] for r in mine),
                "diverged_steps": sorted(
                    {r["diverged_step"] for r in mine if r["diverged_step"] is not None}
                ),
            }
        )
    return out


def fmt_lr(lr: float | None) -> str:
    return "–" if lr is None else f"{lr:.3g}"


def fmt_num(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def fmt_loss(a: dict[str, Any] | None) -> str:
    """A setting's final loss over seeds: mean ± sd (min–max)."""
    if a is None:
        return "–"
    if a["mean"] is None or a.get("unstable"):
        bad = a["seeds"] - a["seeds_ok"]
        mean = "" if a["mean"] is None else f"{a['mean']:.3f} on the others; "
        return f"{mean}unstable on {bad}/{a['seeds']} seeds"
    sd = "" if a["sd"] is None else f" ± {a['sd']:.3f}"
    return f"{a['mean']:.3f}{sd} ({a['min']:.3f}–{a['max']:.3f})"


def write_study(
    out: Path,
    experiment: str,
    title: str,
    study: Study,
    verdicts: Sequence[dict[str, Any]],
    prov: dict[str, Any],
    extra_md: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rows = study.runs.rows
    sel = [r for r in rows if r["phase"] == "select"]
    unstable = instability(rows)
    summary = {
        "experiment": experiment,
        **prov,
        "variants": [
            {
                "method": lb,
                **{k: v for k, v in rec.items() if k != "chosen"},
                "lr": None if rec["chosen"] is None else rec["chosen"]["lr"],
                "selection": rec["chosen"],
            }
            for lb, rec in study.variants.items()
        ],
        "chosen": [
            {"family": fam, "method": h["member"], "lr": h["lr"], "edge": h["edge"]}
            for fam, h in study.held.items()
        ],
        "held_out": study.held,
        "same_seed": study.same_seed,
        "settings": aggregate(sel, ("method", "lr")),
        "instability": unstable,
        "verdicts": list(verdicts),
        "code": code_record(rows),
        **(extra or {}),
    }
    write_runs(out, summary, study.runs)
    where = "leave-one-seed-out" if study.proto.name == "leave-one-seed-out" else "evaluation"
    lines = [
        f"# {title}\n",
        *provenance_lines(prov),
        *code_lines(summary["code"]),
        f"| variant | lr grid tried (added at an edge) | chosen lr | final loss on the "
        f"{where} seeds: mean ± sd (min–max) | seeds |",
        "|---|---|---|---|---|",
    ]
    for fam, h in study.held.items():
        rec = study.variants.get(h["member"] or "", {})
        grid = ", ".join(fmt_lr(x) for x in rec.get("grid", []))
        added = rec.get("extended_with") or []
        grid += f" (added {', '.join(fmt_lr(x) for x in added)})" if added else ""
        lr = (
            fmt_lr(h["lr"])
            if h["lr_per_seed"] is None
            else (
                f"{fmt_lr(h['lr'])} (per held-out seed: "
                f"{', '.join(fmt_lr(x) for x in h['lr_per_seed'].values())})"
            )
        )
        member = "" if h["member"] in (None, fam) else f" → {h['member']}"
        flag = f" **{EDGE}** (at the {h['edge']})" if h["edge"] else ""
        lines.append(
            f"| {fam}{member} | {grid} | {lr}{flag} | {fmt_loss(h)} | {seeds_text(h['per_seed'])} |"
        )
    missing = [f for f in study.same_seed if f not in study.held]
    lines += [f"| {f} | – | no lr finished on every selection seed | – | – |" for f in missing]
    lines += [
        "",
        "Verdicts (paired over the scored seeds, each at its chosen lr); beside each, "
        "the verdict the old protocol (lr chosen and scored on the same seeds) gives:",
        "",
    ]
    for v in verdicts:
        lines.append(f"- **{v['a']} vs {v['b']}**: {v['verdict']}")
        if v.get("same_seed_verdict"):
            lines.append(f"  - same seeds as the selection: {v['same_seed_verdict']}")
    lines += [
        "",
        "Instability over every run (every lr, both phases; spike: a step's loss > "
        f"{SPIKE_FACTOR:g}× the median of the last {SPIKE_WINDOW}; blew up: final loss > initial):",
        "",
        "| variant | runs | diverged (at steps) | blew up | with spikes |",
        "|---|---|---|---|---|",
    ]
    for c in unstable:
        at = f" ({', '.join(map(str, c['diverged_steps'][:6]))})" if c["diverged_steps"] else ""
        lines.append(
            f"| {c['method']} | {c['runs']} | {c['diverged']}{at} | {c['blew_up']} | "
            f"{c['runs_with_spikes']} |"
        )
    (out / "summary.md").write_text("\n".join([*lines, "", *extra_md]) + "\n")
    plots.draw(out)
    return summary


def say(verdicts: Sequence[dict[str, Any]]) -> None:
    for v in verdicts:
        print(f"  {v['a']} vs {v['b']}: {v['verdict']}", flush=True)


def scored_seeds(proto: Protocol) -> tuple[int, ...]:
    return proto.evaluate if proto.evaluate else proto.select


# --------------------------------------------------------------------------------------------
# μ and σ per coordinate, and the SNR model.


def _leaves(tree: Any) -> list[tuple[str, np.ndarray]]:
    return [
        (jax.tree_util.keystr(p), np.asarray(x, np.float64).ravel())
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def measure_mu_sigma(
    cfg: train.Config, points: Sequence[tuple[int, Any]], *, n_batches: int, batch_size: int
) -> list[tuple[np.ndarray, np.ndarray, int, list[tuple[str, int]]]]:
    """For each (seed, parameter pytree) in `points`: per-coordinate μ̂² (unbiased, clamped at
    0) and σ̂² over n_batches·batch_size fresh training examples of that seed's data stream
    (steps beyond any run's), from pegrad's "mean" and "sq_mean" (one compile for all); and
    the (leaf path, size) of each leaf, in the order of the flat arrays.

    Per coordinate, with ḡ the mean and q the mean square over the N examples: μ̂² = max(0,
    (N·ḡ² − q)/(N − 1)) (unbiased, clamped), σ̂² = N/(N − 1)·(q − ḡ²), the per-example variance.
    Its median over coordinates says whether the mean matters per example (≳ 1: MicroAdamVar's
    σ̂² and MicroAdam's q = μ² + σ² differ) or not (≪ 1: they are nearly the same optimizer)."""
    runs = {
        s: train.build(dataclasses.replace(cfg, seed=s, batch_size=batch_size))
        for s in dict.fromkeys(s for s, _ in points)
    }
    task = next(iter(runs.values())).task  # every seed's model has the same structure
    stats_fn = jax.jit(
        pegrad.value_and_grad_stats(task.loss_fn, ("mean", "sq_mean"), impl=cfg.impl)
    )
    sample = jax.jit(task.sample)
    batches = {
        s: [
            sample(r.task.train_data, key=jax.random.fold_in(r.train_key, 10**8 + k))
            for k in range(n_batches)
        ]
        for s, r in runs.items()
    }
    n = n_batches * batch_size
    results = []
    for seed, params in points:
        g = q = np.zeros(())
        names: list[tuple[str, int]] = []
        for batch in batches[seed]:
            _, stats = stats_fn(params, batch)
            leaves = _leaves(stats["mean"])
            names = [(name, x.size) for name, x in leaves]
            g = g + np.concatenate([x for _, x in leaves]) / n_batches
            q = q + np.concatenate([x for _, x in _leaves(stats["sq_mean"])]) / n_batches
        mu2 = np.maximum((n * g * g - q) / (n - 1), 0.0)
        sigma2 = np.maximum(n / (n - 1) * (q - g * g), 0.0)
        results.append((mu2, sigma2, n, names))
    return results


def mu_sigma_records(
    cfg: train.Config, points: Sequence[tuple[int, str, Any]], shared: Shared
) -> list[dict[str, Any]]:
    """For each (seed, point name, parameters): its seed, point, number of examples and
    `snr_ratio`, measured on the scale's `snr_batches` × `snr_batch_size` fresh examples."""
    measured = measure_mu_sigma(
        cfg,
        [(s, p) for s, _, p in points],
        n_batches=shared.snr_batches,
        batch_size=shared.snr_batch_size,
    )
    return [
        {"seed": seed, "point": point, "examples": n, **snr_ratio(mu2, sigma2, names)}
        for (seed, point, _), (mu2, sigma2, n, names) in zip(points, measured, strict=True)
    ]


def snr_ratio(mu2: np.ndarray, sigma2: np.ndarray, names: Sequence[tuple[str, int]]):
    """Median over coordinates of μ̂²/σ̂² (coordinates with σ̂² = 0 left out), overall and per
    leaf, and the fraction of coordinates with μ̂² > σ̂² (where the mean dominates one
    example's gradient)."""
    keep = sigma2 > 0
    ratio = np.where(keep, mu2 / np.where(keep, sigma2, 1.0), np.nan)
    per_leaf, start = {}, 0
    for name, size in names:
        chunk = ratio[start : start + size]
        start += size
        if np.isfinite(chunk).any():
            per_leaf[name] = float(np.nanmedian(chunk))
    return {
        "median_mu2_over_sigma2": float(np.nanmedian(ratio)),
        "frac_mu2_gt_sigma2": float(np.mean(mu2[keep] > sigma2[keep])) if keep.any() else 0.0,
        "per_leaf_median": per_leaf,
    }


def snr_prediction(
    mu2: np.ndarray, sigma2: np.ndarray, batch_size: int, momentum: float
) -> dict[str, float]:
    """Predicted alignment of each sign rule (SPEC §4): per coordinate g_i ~ N(μ, σ²); the
    expected update direction of a rule is erf(k·μ/(√2σ)) with k = 1 (MicroSignSGD), √B
    (SignSGD), √(B(1+β)/(1−β)) (SignEMA: the EMA averages (1+β)/(1−β) times more steps). The
    alignment is Σ_j |μ_j|·erf(k|μ_j|/(√2σ_j)) / Σ_j |μ_j| in [0, 1], higher is better."""
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


def measured_points(cfg: train.Config, study: Study, seeds: Sequence[int]):
    """(seed, point name, params): each seed's initialisation and the final parameters of each
    family's scored run of that seed."""
    named: list[tuple[int, str, Any]] = []
    for seed in seeds:
        named.append((seed, "init", train.build(dataclasses.replace(cfg, seed=seed)).task.params))
        for fam, per_seed in study.held_traces.items():
            if (t := per_seed.get(seed)) is not None and t.status == "ok":
                named.append((seed, f"final {fam}", t.params))
    return named


# --------------------------------------------------------------------------------------------
# The studies. Each returns its summary dict (without the run's provenance, which `run` adds).


@dataclasses.dataclass(frozen=True)
class Context:
    """What a study's runner is given: the scale's shared settings (`--task` applied), its own
    settings at the scale (its dataclass; None for a study without), every study's settings at
    the scale (noise-floor reads sign's and precond's), and where and how it runs."""

    shared: Shared
    settings: Any
    scale: Mapping[str, Any]  # SCALES[scale]: study -> settings
    out: Path
    proto: Protocol
    cache: Path
    prov: dict[str, Any]
    only: tuple[str, ...] | None = None  # `--only`: these families of the study, no others
    floor: NoiseFloor | None = None  # `--noise-floor`: every verdict against it

    def families(self, variants: Sequence[Variant], families: Mapping[str, Sequence[str]]):
        """(variants, families) restricted to `only` (every name must be a family)."""
        if self.only is None:
            return list(variants), families
        if unknown := [f for f in self.only if f not in families]:
            raise ValueError(f"--only: {unknown} not among this study's {list(families)}")
        kept = {f: families[f] for f in self.only}
        labels = {lb for f in kept.values() for lb in f}
        return [v for v in variants if v.label in labels], kept


# --------------------------------------------------------------------------------------------
# Sign placement: MicroSignSGD, SignSGD and SignEMA, with the SNR model's prediction.


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


# --------------------------------------------------------------------------------------------
# Sign placement decided: SignEMA, SignSGD and plain SignSGD on fine grids, against a floor.


@dataclasses.dataclass(frozen=True)
class SignDecided:
    """sign-decided's settings: the starting grid (√2 steps) of SignEMA, SignSGD (β =
    `momentum`) and PLAIN_SIGN (β = 0), keyed by label."""

    lrs: dict[str, tuple[float, ...]]
    momentum: float = 0.9


def sqrt2_grid(center: float, half: int = 2) -> tuple[float, ...]:
    """center·√2^k for k = −half … half (3 significant digits): a grid around a known optimum."""
    return tuple(float(f"{center * 2 ** (k / 2):.3g}") for k in range(-half, half + 1))


def sign_decided_grids(ema: float, sgd: float, plain: float) -> dict[str, tuple[float, ...]]:
    return {
        LABELS["sign_ema"]: sqrt2_grid(ema),
        LABELS["sign_sgd"]: sqrt2_grid(sgd),
        PLAIN_SIGN: sqrt2_grid(plain),
    }


SIGN_DECIDED = {
    "smoke": SignDecided(
        {
            LABELS["sign_ema"]: (1e-3, 1e-2),
            LABELS["sign_sgd"]: (1e-3, 1e-2),
            PLAIN_SIGN: (1e-3, 1e-2),
        }
    ),
    # Around the sign study's chosen lrs (results/sign: SignEMA 1e-3, SignSGD 1e-2); the plain
    # rule around 5e-3 (on seed 0 its loss still falls from 2e-3 to 2.8e-3).
    "tiny": SignDecided(sign_decided_grids(1e-3, 1e-2, 5e-3)),
    "small": SignDecided(sign_decided_grids(1e-3, 1e-3, 1e-3)),
    "paper": SignDecided(sign_decided_grids(1e-4, 1e-4, 1e-4)),
}


def run_sign_decided(ctx: Context) -> dict[str, Any]:
    """SignEMA against SignSGD (β = `SignDecided.momentum`) and the paper's plain SignSGD (β =
    0), each on a √2-step grid around its optimum (`SignDecided.lrs`, grown at edges), meant
    for ten or more evaluation seeds and a noise floor (issue 39: the sign study's 3×-step
    grids left the LM's SignEMA vs SignSGD undecided)."""
    decided: SignDecided = ctx.settings
    beta = decided.momentum
    base = ctx.shared.config()
    variants = [
        Variant(label, sign_variant(base, beta, label), lrs) for label, lrs in decided.lrs.items()
    ]
    variants, families = ctx.families(variants, {v.label: [v.label] for v in variants})
    study = tune_and_score(
        "sign-decided", variants, families, ctx.proto, ctx.cache, ctx.shared.max_extensions
    )
    ema, sgd = LABELS["sign_ema"], LABELS["sign_sgd"]
    verdicts = verdicts_of(study, [(ema, sgd), (ema, PLAIN_SIGN), (sgd, PLAIN_SIGN)], ctx.floor)
    say(verdicts)
    if ctx.floor is None:
        floor = ["No noise floor given (`--noise-floor`): the verdicts use the interval alone."]
    else:
        sigmas = ", ".join(f"{k} {v:.3f}" for k, v in ctx.floor.sigma.items())
        floor = [
            f"Noise floor: {ctx.floor.source} (σ of one run per optimizer: {sigmas}); a verdict "
            "within its floor is undecided."
        ]
    return write_study(
        ctx.out,
        "sign-decided",
        f"Sign placement decided ({TASK_NAMES[task_of(base)]}: SignEMA and SignSGD at β = "
        f"{beta:g}, plain SignSGD at β = 0; √2-step lr grids; B = {base.batch_size}, "
        f"{base.steps} steps)",
        study,
        verdicts,
        ctx.prov,
        floor,
        {"momentum": beta, "noise_floor_from": None if ctx.floor is None else ctx.floor.source},
    )


# --------------------------------------------------------------------------------------------
# The noise floor (issue 39): the spread of a final loss under a perturbation that should not
# matter. It has no settings of its own: its optimizers are those of sign and precond.


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


# --------------------------------------------------------------------------------------------
# Preconditioners: Adam, MicroAdam and MicroAdamVar per regime, with μ̂²/σ̂² measured.


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


# --------------------------------------------------------------------------------------------
# MicroAdamMSQ: ε swept in both placements (and v̂ averaged over blocks), Adam the control.


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


# --------------------------------------------------------------------------------------------
# Clipping: MicroAdam and Adam, unclipped and clipped at each threshold.


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


# --------------------------------------------------------------------------------------------
# Batch-size scaling: the best lr against B, from an absolute grid, two β₂ arms.

BATCH_POWER = {"adam": 0.5, "micro_adam": 1.0}  # the paper's rules: lr ∝ B^p
ARMS = ("β₂ fixed", "β₂ half-life fixed")


@dataclasses.dataclass(frozen=True)
class BatchScaling:
    """batch-scaling's settings on one task: the batch sizes, B_ref of the half-life arm
    (β₂(B) = β₂_ref^(B/B_ref)), the examples every run sees (steps = examples // B), the
    absolute starting lr grid (the same at every B) and its extensions per B (a method whose lr
    grows like B moves its best lr 2× per doubling of B: the grid's far corner needs more
    extensions than the scale's before it is bracketed)."""

    task: str
    batch_sizes: tuple[int, ...]
    base: int
    examples: int
    lrs: tuple[float, ...]
    max_extensions: int


# Per scale, the settings of each task it has, the study's default task first (`--task` picks
# another).
# fmt: off
BATCH_SCALING = {
    "smoke": (BatchScaling("mlp", (4, 8), base=8, examples=32, lrs=(1e-3, 1e-2), max_extensions=1),
              BatchScaling("lm", (4, 8), base=8, examples=32, lrs=(1e-3, 1e-2), max_extensions=1)),
    "tiny": (
        BatchScaling("mlp", (4, 8, 16, 32, 64), base=16, examples=8000,
                     lrs=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), max_extensions=6),
        # The LM: 8000 windows (500 steps at B 16, half precond's budget, to fit a CPU), at B
        # 2-16: below its critical batch (18.6 at a loss of 2.445 by critical-batch-lm, larger
        # at the lower losses these runs reach); B 8-64 was past it (the loss rose per doubling).
        BatchScaling("lm", (2, 4, 8, 16), base=8, examples=8000,
                     lrs=(5e-4, 1e-3, 2e-3, 4e-3, 8e-3), max_extensions=6),
    ),
    "small": (BatchScaling("lm", (2, 4, 8, 16, 32, 64, 128, 256), base=32, examples=32 * 2000,
                           lrs=(2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3), max_extensions=6),),
    "paper": (BatchScaling("lm", (8, 16, 32, 64, 128, 256), base=64, examples=64 * 5000,
                           lrs=(1.5e-4, 3e-4, 6e-4, 1.2e-3, 2.4e-3), max_extensions=6),),
}
# fmt: on


def batch_b2(bs: BatchScaling, arm: str, b: int, b2_ref: float) -> float:
    """β₂ at batch size b: fixed, or with its half-life fixed in examples (β₂_ref at B_ref,
    β₂(B) = β₂_ref^(B/B_ref): the EMA forgets the same number of examples at every B)."""
    return b2_ref if arm == ARMS[0] else float(b2_ref ** (b / bs.base))


def batch_config(shared: Shared, bs: BatchScaling, method: str, b: int, arm: str) -> train.Config:
    base = shared.config(bs.task)
    steps = max(1, bs.examples // b)
    return dataclasses.replace(
        base,
        optimizer=method,
        batch_size=b,
        steps=steps,
        b2=batch_b2(bs, arm, b, base.b2),
        warmup=max(1, steps // 20),
        eval_interval=max(1, steps // 4),
        # The same number of held-out examples at every B.
        eval_batches=max(1, -(-base.eval_batches * base.batch_size // b)),
    )


def best_lr_per_b(
    rows: Sequence[dict[str, Any]], labels: dict[int, str], seeds: Sequence[int]
) -> dict[int, float]:
    """B -> the lr chosen on `seeds` (lowest mean among lrs every seed finished)."""
    out = {}
    for b, label in labels.items():
        if (c := choose(rows, [label], seeds)) is not None:
            out[b] = c["lr"]
    return out


def fit_exponent(best: dict[int, float]) -> float | None:
    """The least-squares slope of log(lr) against log(B)."""
    if len(best) < 2:
        return None
    bs = sorted(best)
    return float(np.polyfit(np.log(bs), np.log([best[b] for b in bs]), 1)[0])


def lr_vertex(lrs: Sequence[float], losses: Sequence[float]) -> tuple[float, bool] | None:
    """The lr that minimises the loss among the ascending grid points `lrs` (`losses`: their
    mean final losses, NaN where a seed did not finish): where the lowest point has a
    neighbour on each side, the vertex of the parabola in log lr through the three (it lies
    between them; the lowest point itself if they are collinear), else the lowest point. Second:
    True when the minimum is at an end of the points (the optimum may lie beyond them)."""
    ok = [(math.log(x), float(y)) for x, y in zip(lrs, losses, strict=True) if math.isfinite(y)]
    if not ok:
        return None
    i = min(range(len(ok)), key=lambda j: ok[j][1])
    if not 0 < i < len(ok) - 1:
        return math.exp(ok[i][0]), True
    (x0, y0), (x1, y1), (x2, y2) = ok[i - 1 : i + 2]
    a, b, _ = np.polyfit([x0, x1, x2], [y0, y1, y2], 2)
    v = x1 if a <= 0 else min(max(-b / (2 * a), x0), x2)
    return math.exp(v), False


@dataclasses.dataclass(frozen=True)
class Bracket:
    """One B's evaluation: the chosen lr and its grid neighbours (ascending), and the final
    loss of each evaluation seed at each (NaN: diverged or blew up)."""

    batch_size: int
    lrs: tuple[float, ...]
    losses: np.ndarray  # [len(lrs), seeds]


def eval_exponent(
    brackets: Sequence[Bracket], pick: Sequence[int] | np.ndarray
) -> tuple[float | None, dict[int, tuple[float, bool]]]:
    """The exponent on the evaluation seeds at column indices `pick` (repeats count: a
    bootstrap resample): per B, `lr_vertex` of the mean over `pick` (an lr where a picked seed
    did not finish is left out), then the least-squares slope of log(lr) against log(B)."""
    found = {}
    for br in brackets:
        v = lr_vertex(br.lrs, br.losses[:, np.asarray(pick)].mean(axis=1))
        if v is not None:
            found[br.batch_size] = v
    return fit_exponent({b: v[0] for b, v in found.items()}), found


def batch_select(
    ctx: Context, bs: BatchScaling
) -> tuple[Runs, list[Variant], dict[tuple[str, str, int], str], dict[str, dict[str, Any]]]:
    """Select: each (method, arm, B)'s grid on the selection seeds, grown at edges. Returns the
    runs, the variants, their labels by (method, arm, B) and the selection record per label."""
    labels = {
        (m, arm, b): f"{LABELS[m]} ({arm}) B={b}"
        for m in BATCH_POWER
        for arm in ARMS
        for b in bs.batch_sizes
    }
    variants = [
        Variant(lb, batch_config(ctx.shared, bs, m, b, arm), bs.lrs, (("arm", arm),))
        for (m, arm, b), lb in labels.items()
    ]
    runs = Runs("batch-scaling", ctx.cache)
    record = select_lrs(runs, variants, ctx.proto.select, bs.max_extensions)
    return runs, variants, labels, record


def batch_brackets(
    runs: Runs,
    variants: Sequence[Variant],
    record: Mapping[str, dict[str, Any]],
    evaluate: Sequence[int],
) -> dict[str, Bracket]:
    """Bracket: each chosen lr and its grid neighbours trained on the evaluation seeds, and
    their final losses (none without evaluation seeds: leave-one-seed-out)."""
    if not evaluate:
        return {}
    by_label = {v.label: v for v in variants}
    around: dict[str, tuple[float, ...]] = {}  # label -> the chosen lr and its neighbours
    for lb, rec in record.items():
        if rec["chosen"] is not None:
            grid = sorted(rec["grid"])
            i = grid.index(rec["chosen"]["lr"])
            around[lb] = tuple(grid[max(0, i - 1) : i + 2])
    runs.train(
        "evaluate",
        [
            (Point(lb, dataclasses.replace(by_label[lb].cfg, lr=lr), by_label[lb].extra), s)
            for lb, lrs in around.items()
            for lr in lrs
            for s in evaluate
        ],
    )
    loss_of = {
        (r["method"], r["lr"], r["seed"]): r["final_loss"]
        for r in runs.rows
        if r["phase"] == "evaluate"
    }
    brackets: dict[str, Bracket] = {}
    for lb, lrs in around.items():
        losses = [[loss_of.get((lb, lr, s)) for s in evaluate] for lr in lrs]
        brackets[lb] = Bracket(
            by_label[lb].cfg.batch_size,
            lrs,
            np.array([[math.nan if x is None else x for x in row] for row in losses]),
        )
    return brackets


def batch_verdict(
    point: float | None,
    ci: Sequence[float | None],
    power: float,
    source: str,
    interior: int,
    at_end: Sequence[int],
) -> str:
    """Verdict: the fitted exponent, its interval, and whether the predicted power is inside."""
    lo, hi = ci
    if point is None or lo is None or hi is None:
        return verdict_text("no verdict: fewer than two batch sizes with an interior best lr")
    inside = lo - 1e-9 <= power <= hi + 1e-9
    ends = (
        f", at B {', '.join(map(str, at_end))} the evaluation seeds' best lr is at the end of "
        "its bracket"
        if at_end
        else ""
    )
    return verdict_text(
        f"exponent {point:.2f}",
        f"95% bootstrap interval [{lo:.2f}, {hi:.2f}] over the {source}; {interior} B with an "
        f"interior best lr{ends}",
        [f"predicted {power:g}: " + ("inside the interval" if inside else "outside the interval")],
    )


def batch_fit(
    method: str,
    arm: str,
    runs: Runs,
    record: Mapping[str, dict[str, Any]],
    mine: Mapping[int, str],
    brackets: Mapping[str, Bracket],
    proto: Protocol,
    resamples: tuple[Sequence[np.ndarray], Sequence[np.ndarray]],
) -> dict[str, Any]:
    """Fit: one method and arm's exponent (`mine`: its label per B) over the B whose selected
    lr is interior: on the evaluation seeds' brackets (`eval_exponent`), its interval from
    their bootstrap (`resamples`' second part: column indices), else on the selection seeds;
    beside it the selection seeds' grid fit (best grid lrs, the seeds resampled by the first
    part); then its verdict (`batch_verdict`)."""
    seeds, evaluate = proto.select, proto.evaluate
    sel_resamples, eval_resamples = resamples
    interior = {b: lb for b, lb in mine.items() if record[lb]["edge"] is None}
    # On the selection seeds (the only fit of leave-one-seed-out; beside the held-out one,
    # what it was before): best grid lrs, seeds resampled, each re-choosing.
    sel_point = fit_exponent(best_lr_per_b(runs.rows, interior, seeds))
    sel_boot = [
        e
        for r in sel_resamples
        if (e := fit_exponent(best_lr_per_b(runs.rows, interior, list(r)))) is not None
    ]
    sel_ci = np.percentile(sel_boot, [2.5, 97.5]).tolist() if sel_boot else [None, None]
    mine_br = [brackets[lb] for lb in interior.values() if lb in brackets]
    per_seed_exp: dict[int, float | None] = {}
    at_end: list[int] = []
    if evaluate:
        point, found = eval_exponent(mine_br, range(len(evaluate)))
        at_end = sorted(b for b, (_, end) in found.items() if end)
        boot = [e for r in eval_resamples if (e := eval_exponent(mine_br, r)[0]) is not None]
        per_seed_exp = {s: eval_exponent(mine_br, [j])[0] for j, s in enumerate(evaluate)}
        source = f"evaluation seeds {seeds_text(evaluate)}"
    else:
        point, boot, source = sel_point, sel_boot, f"selection seeds {seeds_text(seeds)}"
    lo, hi = np.percentile(boot, [2.5, 97.5]).tolist() if boot else (None, None)
    power = BATCH_POWER[method]
    return {
        "method": method,
        "arm": arm,
        "predicted": power,
        "exponent": point,
        "ci95": [lo, hi],
        "seeds": list(evaluate or seeds),
        "exponent_per_seed": per_seed_exp,
        "bracket_end_at_b": at_end,
        "batch_sizes_fitted": sorted(interior),
        "selection_fit": {"exponent": sel_point, "ci95": sel_ci, "seeds": list(seeds)},
        "verdict": batch_verdict(point, (lo, hi), power, source, len(interior), at_end),
    }


def batch_rows(
    method: str,
    arm: str,
    bs: BatchScaling,
    runs: Runs,
    record: Mapping[str, dict[str, Any]],
    mine: Mapping[int, str],
    brackets: Mapping[str, Bracket],
    seeds: Sequence[int],
    b2_ref: float,
) -> list[dict[str, Any]]:
    """One method and arm's table: per B its grid, the lr chosen (and each selection seed's
    own pick: do they agree?), and the evaluation seeds' vertex and final loss there."""
    table = []
    for b, lb in mine.items():
        rec = record[lb]
        per_seed = {}
        for s in seeds:  # each seed's own pick: do the seeds agree?
            ok = [
                r
                for r in runs.rows
                if r["method"] == lb and r["seed"] == s and r["final_loss"] is not None
            ]
            if ok:
                per_seed[s] = min(ok, key=lambda r: r["final_loss"])["lr"]
        c = rec["chosen"]
        br = brackets.get(lb)
        ev = None if br is None else lr_vertex(br.lrs, br.losses.mean(axis=1))
        at_c = None if br is None or c is None else br.losses[br.lrs.index(c["lr"])]
        ok = None if at_c is None or not np.isfinite(at_c).all() else at_c
        table.append(
            {
                "method": method,
                "arm": arm,
                "batch_size": b,
                "b2": batch_b2(bs, arm, b, b2_ref),
                "grid": rec["grid"],
                "extended_with": rec["extended_with"],
                "best_lr": None if c is None else c["lr"],
                "edge": rec["edge"],
                "best_lr_per_seed": per_seed,
                "final_loss": None if c is None else c["mean"],
                "sd": None if c is None else c["sd"],
                "eval_lrs": None if br is None else list(br.lrs),
                "eval_best_lr": None if ev is None else ev[0],
                "eval_at_bracket_end": None if ev is None else ev[1],
                "eval_final_loss": None if ok is None else float(ok.mean()),
                "eval_sd": None if ok is None or len(ok) < 2 else float(ok.std(ddof=1)),
            }
        )
    return table


def batch_regime(table: Sequence[dict[str, Any]], evaluated: bool) -> list[dict[str, Any]]:
    """The regime: below the critical batch, the loss after a fixed number of examples is flat
    in B; above it, it rises with B. Per method and arm, the smallest B against the next."""
    regime = []
    for m in BATCH_POWER:
        for arm in ARMS:
            key, sd = ("eval_final_loss", "eval_sd") if evaluated else ("final_loss", "sd")
            mine = [t for t in table if t["method"] == m and t["arm"] == arm and t[key] is not None]
            if len(mine) >= 2:
                a, b = mine[0], mine[1]
                rise = b[key] - a[key]
                noise = math.hypot(a[sd] or 0.0, b[sd] or 0.0)
                regime.append(
                    {
                        "method": m,
                        "arm": arm,
                        "smallest_b": a["batch_size"],
                        "rise_to_next_b": rise,
                        "seed_sd": noise,
                        "small_b_regime_observed": rise <= noise,
                    }
                )
    return regime


def batch_markdown(
    ctx: Context,
    bs: BatchScaling,
    summary: dict[str, Any],
    b2_ref: float,
) -> list[str]:
    """Render: summary.md of batch-scaling (its settings, the table per B, the fits and their
    verdicts, each evaluation seed's exponent, the regime)."""
    seeds, evaluate = ctx.proto.select, ctx.proto.evaluate
    table, fits, regime = summary["best_lr_per_batch"], summary["fits"], summary["regime"]
    lines = [
        f"# Batch-size scaling ({TASK_NAMES[bs.task]}, {bs.examples} examples "
        f"per run, seeds {seeds_text(seeds)}"
        + (f", evaluation seeds {seeds_text(evaluate)}" if evaluate else "")
        + ")\n",
        *provenance_lines(ctx.prov),
        *code_lines(summary["code"]),
        f"Absolute lr grid {', '.join(fmt_lr(x) for x in bs.lrs)} at every B (extended "
        f"at an edge, up to {bs.max_extensions} points); β₂ = {b2_ref:g} (fixed arm) "
        f"or {b2_ref:g}^(B/{bs.base}) "
        "(half-life arm).",
        "",
        "Selection: each B's lr chosen on the selection seeds (per seed: each one's own pick). "
        + (
            f"Evaluation: the chosen lr and its grid neighbours on seeds {seeds_text(evaluate)}; "
            "their best lr is the vertex of the parabola in log lr through the three mean final "
            "losses (* where the lowest is an end of the bracket); the final loss there is at the "
            "chosen lr."
            if evaluate
            else "No evaluation seeds (leave-one-seed-out): everything is on the selection seeds."
        ),
        "",
        "| method | arm | B | β₂ | best lr (per seed) | final loss: mean ± sd | evaluation: "
        "best lr | evaluation: final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        flag = f" **{EDGE}**" if t["edge"] else ""
        picks = ", ".join(fmt_lr(x) for x in t["best_lr_per_seed"].values())
        loss = (
            "–"
            if t["final_loss"] is None
            else (f"{t['final_loss']:.3f}" + ("" if t["sd"] is None else f" ± {t['sd']:.3f}"))
        )
        ev_lr = (
            "–"
            if t["eval_best_lr"] is None
            else f"{t['eval_best_lr']:.3g}" + ("*" if t["eval_at_bracket_end"] else "")
        )
        ev_loss = (
            "–"
            if t["eval_final_loss"] is None
            else f"{t['eval_final_loss']:.3f}"
            + ("" if t["eval_sd"] is None else f" ± {t['eval_sd']:.3f}")
        )
        lines.append(
            f"| {LABELS[t['method']]} | {t['arm']} | {t['batch_size']} | {t['b2']:.5g} "
            f"| {fmt_lr(t['best_lr'])}{flag} ({picks}) | {loss} | {ev_lr} | {ev_loss} |"
        )
    lines += [
        "",
        "Fitted exponents (over the B whose selected lr is interior; "
        + (
            "on the evaluation seeds: their interpolated best lrs; interval: the evaluation "
            "seeds resampled, each resample re-locating every B's best lr):"
            if evaluate
            else "on the selection seeds; interval: seed bootstrap):"
        ),
        "",
    ]
    lines += [f"- {LABELS[f['method']]} ({f['arm']}): {f['verdict']}" for f in fits]
    if evaluate:
        lines += [
            "",
            "Beside them: per evaluation seed alone, and the selection seeds' grid fit (the "
            "pre-issue-39 number):",
            "",
        ]
        lines += [
            f"- {LABELS[f['method']]} ({f['arm']}): per seed "
            + ", ".join(f"{s}: {fmt_num(e, '.2f')}" for s, e in f["exponent_per_seed"].items())
            + f"; selection seeds {fmt_num(f['selection_fit']['exponent'], '.2f')} "
            f"[{fmt_num(f['selection_fit']['ci95'][0], '.2f')}, "
            f"{fmt_num(f['selection_fit']['ci95'][1], '.2f')}]"
            for f in fits
        ]
    lines += ["", "Regime (loss after a fixed number of examples, smallest B vs the next):", ""]
    lines += [
        f"- {LABELS[r['method']]} ({r['arm']}): B={r['smallest_b']} → next: "
        f"{r['rise_to_next_b']:+.3f} (seed sd {r['seed_sd']:.3f}): "
        + (
            "flat: the small-B regime is observed"
            if r["small_b_regime_observed"]
            else "rises: even the smallest B is not far below the critical batch"
        )
        for r in regime
    ]
    return lines


def run_batch_scaling(ctx: Context) -> dict[str, Any]:
    """The best lr against B (the paper's rules: lr ∝ B^p, p = 0.5 for Adam, 1 for MicroAdam),
    with β₂ fixed, or with its half-life fixed in examples, in five steps. Select
    (`batch_select`): per method, arm and B, the lr chosen on the selection seeds from an
    absolute grid (the same at every B, 2× steps, extended at edges). Bracket
    (`batch_brackets`, held-out: issue 39): the evaluation seeds train each B's chosen lr and
    its two grid neighbours. Fit (`batch_fit`): the exponent comes from the evaluation seeds
    alone: per B, the best lr is the vertex of the parabola in log lr through the three mean
    final losses over the evaluation seeds (`lr_vertex`: a continuous estimate, so a 2× grid no
    longer quantises the exponent to multiples of its step; where the lowest mean is an end of
    the bracket, that end, flagged: the optimum may lie beyond); the exponent is the
    least-squares slope of log(best lr) against log B over the B whose selected lr is interior;
    its 95 % interval is the percentile interval of BOOTSTRAP resamples of the evaluation seeds
    (with replacement, repeats weighted), each re-locating every B's vertex from its own means.
    So the selection seeds decide only where to look (the bracket), and the number and its
    interval are measured on seeds that chose nothing; the interval carries the evaluation
    seeds' noise of the optimum, not the bracket's placement (a flagged B is where that
    matters). Beside it the summary keeps each evaluation seed's own exponent and the selection
    seeds' grid fit (best grid lrs, seeds resampled: the number before issue 39, the only one
    under leave-one-seed-out, and on 3 seeds of a 2× grid a degenerate interval). Verdict
    (`batch_verdict`): whether the predicted power lies in the interval. Render
    (`batch_markdown`), with the regime (`batch_regime`): is the smallest B below the critical
    batch?"""
    bs: BatchScaling = ctx.settings
    proto = ctx.proto
    if proto.name == "fixed":
        raise ValueError("batch-scaling fits an exponent to chosen lrs: --lrs-from does not apply")
    seeds, evaluate = proto.select, proto.evaluate  # the grids run on these; the brackets on those
    runs, variants, labels, record = batch_select(ctx, bs)
    brackets = batch_brackets(runs, variants, record, evaluate)
    rng = np.random.default_rng(0)
    resamples = [rng.choice(seeds, size=len(seeds)) for _ in range(BOOTSTRAP)]
    eval_resamples = [rng.integers(0, len(evaluate), len(evaluate)) for _ in range(BOOTSTRAP)]
    b2_ref = variants[0].cfg.b2  # the first arm's: β₂ fixed
    fits, table = [], []
    for m in BATCH_POWER:
        for arm in ARMS:
            mine = {b: labels[(m, arm, b)] for b in bs.batch_sizes}
            fit = batch_fit(
                m, arm, runs, record, mine, brackets, proto, (resamples, eval_resamples)
            )
            fits.append(fit)
            table += batch_rows(m, arm, bs, runs, record, mine, brackets, seeds, b2_ref)
    regime = batch_regime(table, bool(evaluate))
    for f in fits:
        print(f"  {LABELS[f['method']]} ({f['arm']}): {f['verdict']}", flush=True)
    rows = runs.rows
    summary = {
        "experiment": "batch-scaling",
        **ctx.prov,
        "task": bs.task,
        "examples": bs.examples,
        "batch_base": bs.base,
        "rule": "best lr ∝ B^p, p = 0.5 (adam), 1 (micro_adam); β₂(B) = β₂_ref^(B/B_ref) in "
        "the half-life arm",
        "variants": [
            {
                "method": lb,
                **{k: v for k, v in rec.items() if k != "chosen"},
                "lr": None if rec["chosen"] is None else rec["chosen"]["lr"],
            }
            for lb, rec in record.items()
        ],
        "settings": aggregate(rows, ("method", "lr")),
        "best_lr_per_batch": table,
        "fits": fits,
        "regime": regime,
        "instability": instability(rows),
        "code": code_record(rows),
    }
    write_runs(ctx.out, summary, runs)
    (ctx.out / "summary.md").write_text("\n".join(batch_markdown(ctx, bs, summary, b2_ref)) + "\n")
    plots.draw(ctx.out)
    return summary


# --------------------------------------------------------------------------------------------
# Critical batch (issue 39): steps to a target loss against B, and the predictions of B_simple
# and (issue 51) B_P, the noise scale of Adam's preconditioned gradient.


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


# --------------------------------------------------------------------------------------------
# Windows: μ̂²/σ̂² of the LM against its window length.


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


# --------------------------------------------------------------------------------------------
# Overhead: bench.py's table.


@dataclasses.dataclass(frozen=True)
class Overhead:
    """overhead's settings: bench.Config overrides ("quick": True for bench's --quick)."""

    bench: dict[str, Any]


# fmt: off
OVERHEAD = {
    "smoke": Overhead(dict(quick=True, sections=("mlp",), stat_sets=("mean+sq_mean",), reps=1,
                           min_time_s=0.0, mlp_in=16, mlp_width=32, mlp_depth=2, mlp_batch=8,
                           mlp_batch_sizes=(8,))),
    "tiny": Overhead(dict(quick=True)),
    "small": Overhead(dict()),
    "paper": Overhead(dict()),
}
# fmt: on


def run_overhead(ctx: Context) -> dict[str, Any]:
    """bench.py's cost table (time and temporary memory of each statistic's implementation
    against the plain gradient) at the scale's bench settings, with its figure."""
    import bench

    settings: Overhead = ctx.settings
    out = ctx.out
    overrides = dict(settings.bench)
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
            plots.finish(
                ax,
                f"mean+sq_mean: {title} relative to jax.value_and_grad",
                "",
                f"{title} / plain gradient's",
                legend=False,
            )
        plots.save(fig, out / "overhead.png", plt)
    return summary


# --------------------------------------------------------------------------------------------
# Vectorize: the same runs as one vectorized program and one by one with train.main.


@dataclasses.dataclass(frozen=True)
class Vectorize:
    """vectorize's settings: the runs of the timed group (lrs × seeds), and how many of them
    the sequential side times one by one with train.main."""

    runs: int
    sequential: int


VECTORIZE = {
    "smoke": Vectorize(4, 2),
    "tiny": Vectorize(9, 3),
    "small": Vectorize(12, 2),
    "paper": Vectorize(8, 1),
}


def run_vectorize(ctx: Context) -> dict[str, Any]:
    """Runs/hour of one sweep group (`Vectorize.runs` runs: lrs × seeds of MicroAdam on the
    scale's task) trained by sweep.py, against `Vectorize.sequential` of the same runs trained
    one after another by train.main (each with its own compile, evaluation and checkpoint, as
    a user would run them). Both wall times include compiling. The final held-out losses of the
    runs done both ways are compared."""
    settings: Vectorize = ctx.settings
    out, seeds, task = ctx.out, ctx.proto.select or ctx.proto.evaluate, ctx.shared.task
    base = dataclasses.replace(ctx.shared.config(), optimizer="micro_adam")
    lrs = [base.lr * 2.0**k for k in range(-(-settings.runs // len(seeds)))]
    configs = [dataclasses.replace(base, lr=lr, seed=s) for lr in lrs for s in seeds]
    configs = configs[: settings.runs]
    t0 = time.perf_counter()
    traces = sweep.run_group(configs)  # no cache: this is a timing
    vectorized = time.perf_counter() - t0
    sequential, diffs = [], []
    for i, cfg in enumerate(configs[: settings.sequential]):
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
        "task": task,
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
        f"# Vectorized vs one by one ({TASK_NAMES[task]}, {base.steps} steps of batch "
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

# The scales, `{scale: {study: settings}}`: per scale, what its studies share ("shared") and each
# study's settings from the presets beside it (noise-floor has none of its own: it measures
# the optimizers of sign and precond).
PRESETS: dict[str, Mapping[str, Any]] = {
    "sign": SIGN,
    "sign-decided": SIGN_DECIDED,
    "precond": PRECOND,
    "msq": MSQ,
    "clipping": CLIPPING,
    "batch-scaling": BATCH_SCALING,
    "critical-batch": CRITICAL_BATCH,
    "windows": WINDOWS,
    "overhead": OVERHEAD,
    "vectorize": VECTORIZE,
}
SCALES: dict[str, dict[str, Any]] = {
    scale: {"shared": shared, **{study: presets[scale] for study, presets in PRESETS.items()}}
    for scale, shared in SHARED.items()
}


def study_settings(name: str, scale: str, task: str | None) -> tuple[Shared, Any]:
    """The shared settings of `scale` (with `task`, where given, as its task) and study `name`'s
    own there: batch-scaling's and critical-batch's for the task they run (batch-scaling's
    default task is its first settings'); a task without settings is refused."""
    studies = SCALES[scale]
    shared = (
        studies["shared"] if task is None else dataclasses.replace(studies["shared"], task=task)
    )
    settings: Any = studies.get(name)
    if name == "batch-scaling":
        found = [s for s in settings if task in (None, s.task)]
        if not found:
            raise ValueError(f"scale {scale!r} has no batch-scaling settings for task {task!r}")
        settings = found[0]
    elif name == "critical-batch":
        if shared.task not in settings:
            raise ValueError(
                f"scale {scale!r} has no critical-batch settings for task {shared.task!r}"
            )
        settings = settings[shared.task]
    return shared, settings


RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "sign": run_sign,
    "sign-decided": run_sign_decided,
    "noise-floor": run_noise_floor,
    "precond": run_precond,
    "msq": run_msq,
    "clipping": run_clipping,
    "batch-scaling": run_batch_scaling,
    "critical-batch": run_critical_batch,
    "windows": run_windows,
    "overhead": run_overhead,
    "vectorize": run_vectorize,
}


def run(
    name: str,
    *,
    scale: str,
    out: str,
    seeds: Sequence[int] | None = None,
    select_seeds: Sequence[int] | None = None,
    lrs_from: str | None = None,
    cache: str | None = None,
    task: str | None = None,
    only: Sequence[str] | None = None,
    noise_floor: str | None = None,
) -> dict[str, Any]:
    """Run study `name` (EXPERIMENTS or "all") at `scale` ("smoke", "tiny", "small", "paper")
    into `out`. Seeds (module docstring): `select_seeds` and `seeds` disjoint (held-out),
    `seeds` alone (leave-one-seed-out), `lrs_from` a summary.json and `seeds` (fixed); None
    everywhere: the scale's held-out defaults. `task` ("lm" or "mlp") replaces the scale's task
    of sign, precond, msq, clipping and critical-batch (and batch-scaling's, with its settings
    for that task);
    `only` keeps these families (variants) of the study; `noise_floor` (a noise-floor
    summary.json of the same task) holds every verdict against its floor.
    Returns its summary (for "all": a dict)."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
    if name == "all":
        return {
            n: run(
                n,
                scale=scale,
                out=str(Path(out) / n),
                seeds=seeds,
                select_seeds=select_seeds,
                cache=cache,
            )
            for n in EXPERIMENTS
            if n != "noise-floor"  # it reads its lrs from committed summaries (--lrs-from)
        }
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {(*EXPERIMENTS, 'all')}")
    if task not in (None, "lm", "mlp"):
        raise ValueError(f"unknown task {task!r}; choose lm or mlp")
    shared, settings = study_settings(name, scale, task)
    proto = make_protocol(seeds, select_seeds, lrs_from, shared)
    floor = None if noise_floor is None else read_noise_floor(noise_floor)
    if floor is not None and floor.task != task_of(shared.config()):
        raise ValueError(
            f"--noise-floor {noise_floor} was measured on the {floor.task} task, this study "
            f"trains the {task_of(shared.config())} task"
        )
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache) if cache else path / "cache"
    prov = provenance(name, scale, path, proto, cache_dir, task, only, noise_floor)
    print(f"experiment {name}, scale {scale}, {proto.describe()} -> {path}", flush=True)
    t0 = time.perf_counter()
    ctx = Context(
        shared,
        settings,
        SCALES[scale],
        path,
        proto,
        cache_dir,
        prov,
        None if only is None else tuple(only),
        floor,
    )
    summary = RUNNERS[name](ctx)
    seconds = time.perf_counter() - t0
    summary = {**summary, **prov, "scale": scale, "total_seconds": round(seconds, 1)}
    data = json.loads((path / "summary.json").read_text())
    (path / "summary.json").write_text(json.dumps({**data, **summary}, indent=1))
    print(f"experiment {name} done in {seconds:.0f}s: {path}", flush=True)
    return summary


def cli() -> argparse.ArgumentParser:
    """The command line of `main` (a committed summary's "command" parses with it)."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="The selection protocol, the scales and the shared definitions: see "
        "experiments.py's docstring; each study's methods: its run_* function's docstring.",
    )
    parser.add_argument("name", choices=(*EXPERIMENTS, "all"), help="which study")
    parser.add_argument("--scale", choices=tuple(SCALES), default="tiny", help="sizes and steps")
    parser.add_argument("--out", default=None, help="output directory (default runs/exp-NAME)")
    parser.add_argument(
        "--seeds",
        default=None,
        help="evaluation seeds, e.g. 3,4,5 or 3-7 "
        "(alone: leave-one-seed-out over them; default: the scale's)",
    )
    parser.add_argument(
        "--select-seeds",
        default=None,
        help="seeds the lrs are chosen on, disjoint from --seeds (default: the scale's)",
    )
    parser.add_argument(
        "--lrs-from",
        default=None,
        help="a summary.json (or several, comma-separated): its chosen lrs, evaluated on --seeds "
        "without selection (a re-check; noise-floor's lrs)",
    )
    parser.add_argument(
        "--task",
        choices=("lm", "mlp"),
        default=None,
        help="the task of sign, precond, msq, clipping, batch-scaling and critical-batch "
        "(default: the scale's)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="run this variant (family) of the study and not the others; repeat for more, "
        "e.g. --only SignSGD --only SignEMA",
    )
    parser.add_argument(
        "--noise-floor",
        default=None,
        help="a noise-floor summary.json of the study's task: a verdict within its floor is "
        "undecided",
    )
    parser.add_argument(
        "--cache",
        default=None,
        help="trace cache (default OUT/cache); studies sharing one share their common runs",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = cli()
    args = parser.parse_args(argv)
    out = args.out or f"runs/exp-{args.name}"
    try:
        seeds = None if args.seeds is None else parse_seeds(args.seeds)
        select = None if args.select_seeds is None else parse_seeds(args.select_seeds)
        run(
            args.name,
            scale=args.scale,
            out=out,
            seeds=seeds,
            select_seeds=select,
            lrs_from=args.lrs_from,
            cache=args.cache,
            task=args.task,
            only=args.only,
            noise_floor=args.noise_floor,
        )
    except (train.ConfigError, ValueError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
