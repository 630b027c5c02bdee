"""studies/protocol.py: what every study of experiments.py shares: the selection protocol,
the seeds and their provenance, the lr grids and their extensions, the verdicts and their
one formatter, the summary files, the μ̂²/σ̂² measurements, the scales' shared settings
(`SHARED`) and the `Context` a study's runner is given. Each study is its own module beside
this one (studies/__init__.py: how one registers).

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

import csv
import dataclasses
import datetime
import gzip
import json
import math
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pegrad
import plots
import sweep
import train

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
    here = Path(__file__).resolve().parents[1]  # the repository
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
