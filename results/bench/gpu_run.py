"""The accelerator run in one command: measured time and memory beside hlo_cost.py's estimate.

`ACCELERATOR` below is bench.py's cost-table preset for a GPU or TPU; any bench.py flag given
here overrides it. For the first session lent a GPU (the device tool's `status`:
can_start_another). It runs the preset on the README's transformer families (list of blocks,
GQA + RoPE, `W[l]`, `lax.scan`, then the Flax and named-axis ones) and GPT-2 small (tied head,
T 1024, B 8, run and timed), plain grad and vmap and pegrad's factorized program, the mean and every
statistic set of issue 48, most important first. bench.py writes its JSON after every program,
so a run cut short keeps what it measured; this script then writes gpu.md beside it: measured
time and temporaries as ratios to plain grad, and the H200 estimate hlo_cost.py reads from the
same compiled program (`h200_estimate_s`), as a ratio too. Compiling dominates (XLA:GPU, about
10 s a program at d 256, 30-45 s a factorized GPT-2 small): about 8 minutes on an H200.

    PYTHONUNBUFFERED=1 python results/bench/gpu_run.py --out $OUT      # on the card
    python results/bench/gpu_run.py --tiny --out /tmp/gpu-run            # tiny families, a CPU
    python results/bench/gpu_run.py --out DIR --families transformer gqa-rope mlp \
        --family-stat-sets mean+var mean+sq_norms          # any bench.py flag after the preset
    python results/bench/gpu_run.py --out DIR --sections paper           # GPT-2 small alone

(Until issue 51 the preset was bench.py's `--accelerator` flag.)

tests/test_bench.py runs it with --tiny.
"""

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, REPO)
import bench  # noqa: E402

# bench.py's cost table (mean+sq_mean, every family) on a GPU or TPU. XLA:GPU compiles slower
# than XLA:CPU (on an H200 with jax 0.11.2 about 10 s per program of the d 256 transformers,
# 30-45 s per factorized GPT-2 small); --json is written after each program, so a run cut short
# keeps what it measured.
ACCELERATOR: dict[str, Any] = dict(
    sections=("families",),
    impls=("vmap", "factorized"),
    reps=5,
    min_time_s=0.05,
    max_program_s=5.0,
    max_run_gib=60.0,
    paper_tied_head=True,
    paper_run=True,
    paper_stat_sets=("mean+sq_mean",),
    families=(
        "transformer",
        "gqa-rope",
        "mlp",
        "transformer-stacked",
        "flax-gpt",
        "transformer-scan",
        "named-axis",
        "flax-gpt-scan",
        "cnn",
        "cnn-8x8",
        "cnn-scan",
        "gru",
        "moe",
    ),
    family_stat_sets=("mean+sq_mean",),
    family_impls=("vmap", "factorized"),
)
STAT_SETS = ["mean+sq_mean", "mean+var", "mean+sq_norms", "clipped_mean+sq_norms"]
FAMILIES = ["transformer", "gqa-rope", "transformer-stacked", "transformer-scan"]
FAMILIES += ["flax-gpt", "flax-gpt-scan", "named-axis"]
TINY = ["--family-batch", "4", "--family-width", "16", "--family-seq", "8"]
TINY += ["--family-layers", "1", "--paper-layers", "1", "--paper-seq", "16", "--paper-batch", "2"]
TINY += ["--reps", "1", "--min-time-s", "0", "--max-program-s", "1"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Any other flag is bench.py's (python bench.py --help) and overrides the preset.",
    )
    parser.add_argument("--out", default="runs/gpu", help="gpu.json and gpu.md go here")
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a test on any CPU")
    args, more = parser.parse_known_args(argv)  # the rest: bench.py's flags
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu.json")
    sections = ["families"] if args.tiny else ["families", "paper"]  # GPT-2's width, vocabulary
    flags = ["--sections", *sections, "--families", *args.families]
    flags += ["--family-stat-sets", *STAT_SETS, "--paper-stat-sets", *STAT_SETS, "--json", path]
    bench.main(flags + (TINY if args.tiny else []) + more, preset=ACCELERATOR)
    with open(path) as f:
        records = json.load(f)
    with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(table(records))


def table(records: list[dict]) -> str:
    """Per program: measured time and temporaries over plain grad's, and the estimate's."""
    plain = {r["model"]: r for r in records if r["impl"] == "plain"}
    lines = [
        f"device: {records[0]['device']}, jax {records[0]['jax']}\n",
        "| model | stats | impl | time ms | time / plain | H200 estimate ms | estimate / plain "
        "| temp / plain | kernels | note |",
        "|---" * 10 + "|",
    ]
    for r in records:
        base = plain.get(r["model"], {})
        ratio = lambda key, r=r, base=base: (  # noqa: E731
            f"{r[key] / base[key]:.2f}" if r.get(key) and base.get(key) else "—"
        )
        ms = lambda key, r=r: f"{r[key] * 1e3:.3f}" if r.get(key) else "—"  # noqa: E731
        cells = [r["model"], r["stats"], r["impl"], ms("time_s"), ratio("time_s")]
        cells += [ms("h200_estimate_s"), ratio("h200_estimate_s"), ratio("temp_bytes")]
        cells += [str(r.get("kernels") or "—"), r.get("note") or ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
