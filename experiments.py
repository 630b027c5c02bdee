"""experiments.py: one command per finding of Roulet & Agarwala (arXiv 2510.00236), each verdict
computed on seeds its learning rates were not chosen on.

    python experiments.py sign --select-seeds 0,1,2 --seeds 3-7    # the protocol, explicitly
    python experiments.py sign --seeds 0-4                  # leave-one-seed-out on seeds 0..4
    python experiments.py sign --seeds 20-24 --lrs-from results/sign/summary.json
                                                            # re-check committed settings, new seeds
    python experiments.py critical-batch --task mlp --seeds 20-24 \
        --lrs-from results/critical-batch-mlp/summary.json --out results/recheck/cb-mlp

Each study is one module of studies/ (its settings at every scale, its runner and its usage
lines: `python experiments.py --help` lists every study's); studies/protocol.py holds what they
share (its docstring: the selection protocol, the output files, the scales and the definitions
shared by the studies), studies/__init__.py how a study registers. Each study's own methods are
in its run_* function's docstring.

This is the studies' one entry point (train.py trains one run). In Python: `experiments.run(name,
scale=..., out=..., seeds=(3, 4, 5), select_seeds=(0, 1, 2)) -> summary dict`.
"""

import argparse
import dataclasses
import json
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import studies
import train
from studies.batch_scaling import ARMS, BATCH_POWER, Bracket, eval_exponent, lr_vertex
from studies.clipping import clip_gap_verdict
from studies.critical_batch import (
    CritBatch,
    crit_compare,
    crit_fit,
    crit_target,
    crit_verdict,
    fit_critical,
    half_window,
    loss_level,
    percentile_interval,
    steps_to_target,
)
from studies.msq import MSQ_ARMS
from studies.protocol import (
    CSV_COLUMNS,
    EDGE,
    PLAIN_SIGN,
    SHARED,
    SIGN_METHODS,
    ULP,
    Context,
    NoiseFloor,
    Protocol,
    Shared,
    Variant,
    aggregate,
    best,
    compare,
    count_spikes,
    fmt_num,
    leave_one_out,
    make_protocol,
    parse_seeds,
    provenance,
    read_noise_floor,
    snr_prediction,
    strength,
    t975,
    task_of,
    tune_and_score,
    verdicts_of,
    write_study,
)

# Names other code reads from here (tests, results/*.py): each study's and the protocol's.
__all__ = [
    "ARMS",
    "BATCH_POWER",
    "CSV_COLUMNS",
    "EDGE",
    "EXPERIMENTS",
    "MSQ_ARMS",
    "PLAIN_SIGN",
    "PRESETS",
    "REGISTRY",
    "RUNNERS",
    "SCALES",
    "SHARED",
    "SIGN_METHODS",
    "TRAINING",
    "ULP",
    "Bracket",
    "Context",
    "CritBatch",
    "NoiseFloor",
    "Protocol",
    "Shared",
    "Variant",
    "aggregate",
    "best",
    "cli",
    "clip_gap_verdict",
    "compare",
    "count_spikes",
    "crit_compare",
    "crit_fit",
    "crit_target",
    "crit_verdict",
    "eval_exponent",
    "fit_critical",
    "fmt_num",
    "half_window",
    "leave_one_out",
    "loss_level",
    "lr_vertex",
    "main",
    "make_protocol",
    "parse_seeds",
    "percentile_interval",
    "provenance",
    "read_noise_floor",
    "run",
    "snr_prediction",
    "steps_to_target",
    "strength",
    "study_settings",
    "t975",
    "tune_and_score",
    "usage",
    "verdicts_of",
    "write_study",
]

# The studies (studies/*.py, each registered by its module), in their order.
REGISTRY: dict[str, studies.Entry] = studies.discover()
TRAINING = tuple(n for n, e in REGISTRY.items() if e.seeded)  # seeded studies
EXPERIMENTS = (*TRAINING, *(n for n, e in REGISTRY.items() if not e.seeded))
# Each study's settings per scale (noise-floor has none of its own) and its runner.
PRESETS: dict[str, Mapping[str, Any]] = {
    n: e.presets for n, e in REGISTRY.items() if e.presets is not None
}
RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {n: e.runner for n, e in REGISTRY.items()}
# The scales, `{scale: {study: settings}}`: per scale, what its studies share ("shared") and each
# study's settings from its presets.
SCALES: dict[str, dict[str, Any]] = studies.scales(REGISTRY)


def usage() -> str:
    """Every study's usage lines, in the studies' order (the epilog of `--help`)."""
    return "\n".join(textwrap.indent(e.usage, "    ") for e in REGISTRY.values())


def study_settings(name: str, scale: str, task: str | None) -> tuple[Shared, Any]:
    """The shared settings of `scale` (with `task`, where given, as its task) and study `name`'s
    own there: batch-scaling's and critical-batch's for the task they run (batch-scaling's
    default task is its first settings'); a task without settings is refused."""
    studies_at = SCALES[scale]
    shared = (
        studies_at["shared"]
        if task is None
        else dataclasses.replace(studies_at["shared"], task=task)
    )
    settings: Any = studies_at.get(name)
    pick = REGISTRY[name].pick  # among its settings per task (batch-scaling, critical-batch)
    return shared, settings if pick is None else pick(settings, shared, task, scale)


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
            if REGISTRY[n].in_all  # not noise-floor: it reads its lrs from summaries (--lrs-from)
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
        epilog="studies (each studies/NAME.py):\n\n" + usage() + "\n\nThe selection protocol, "
        "the scales and the shared definitions: see studies/protocol.py's docstring; each "
        "study's methods: its run_* function's docstring.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
