"""Vectorize: the same runs as one vectorized program and one by one with train.main.

`python experiments.py vectorize` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import contextlib
import dataclasses
import io
import json
import time
from typing import Any

import jax
import numpy as np

import sweep
import train
from studies import register
from studies.protocol import TASK_NAMES, Context

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py vectorize --out runs/vec          # runs/hour: vmap vs one by one
"""


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


register("vectorize", run_vectorize, order=110, usage=USAGE, presets=VECTORIZE, seeded=False)
