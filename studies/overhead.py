"""Overhead: bench.py's table.

`python experiments.py overhead` runs it: its `register` call (last) names its runner,
its settings per scale and its usage (studies/__init__.py).
"""

import contextlib
import csv
import dataclasses
import io
import json
import time
from typing import Any

import jax

import plots
from studies import register
from studies.protocol import Context

# Its lines of experiments.py's usage (`python experiments.py --help`).
USAGE = r"""
python experiments.py overhead --out runs/overhead      # bench.py's cost table
"""


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


register("overhead", run_overhead, order=100, usage=USAGE, presets=OVERHEAD, seeded=False)
