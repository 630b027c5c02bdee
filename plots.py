"""plots.py: the figures of experiments.py and of one train.py run; matplotlib is optional
(`pip install -e ".[plots]"`, or `pip install "pegrad[plots]"`; installed: `python -m
pegrad.plots ...`).

    python plots.py runs/adam          # a run: OUT/run.png, its train and eval loss beside its
                                       # gradient noise scale, from its metrics.jsonl
    python plots.py results/sign       # a study's figure, from summary.json and traces.csv.gz
    python plots.py --costs README.md results/figures/costs.png   # the cost table's picture
    python plots.py --help

Every multi-seed quantity is drawn as its mean over seeds with the seeds' spread (min to max)
as a band or an error bar, so that a difference can be read against the noise.
"""

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

NOTE = 'matplotlib not installed: wrote the CSV/JSON only; pip install -e ".[plots]" for plots'
NO_FIGURE = (
    'matplotlib is not installed, so no figure was written: pip install -e ".[plots]" in a '
    'checkout, or pip install "pegrad[plots]"'
)


def pyplot() -> Any:
    """matplotlib.pyplot (headless), or None with a one-line note."""
    try:
        import matplotlib  # pyright: ignore[reportMissingImports]  (the optional "plots" extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]
    except ImportError:
        print(NOTE)
        return None
    return plt


def save(fig: Any, path: Path, plt: Any) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def binned(values: np.ndarray, bins: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, NaN-aware bin means) of a per-step series: a readable curve from noisy
    per-batch losses. Bins that hold only NaN (a diverged run) stay NaN."""
    edges = np.linspace(0, len(values), min(bins, len(values)) + 1).astype(int)
    means = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        chunk = values[a:b]
        means.append(np.nanmean(chunk) if np.isfinite(chunk).any() else np.nan)
    return (edges[:-1] + edges[1:] - 1) / 2, np.array(means)


def band(ax: Any, x: np.ndarray, runs: Sequence[np.ndarray], color: str, label: str, **kw: Any):
    """Mean over runs (seeds) as a line, min to max as a shaded band."""
    stacked = np.stack(runs)
    with np.errstate(all="ignore"):
        finite = np.isfinite(stacked).any(axis=0)
        mean = np.where(
            finite, np.nanmean(np.where(np.isfinite(stacked), stacked, np.nan), 0), np.nan
        )
        lo, hi = np.nanmin(stacked, axis=0), np.nanmax(stacked, axis=0)
    ax.plot(x, mean, color=color, label=label, **kw)
    if len(runs) > 1:
        ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)


def colors(labels: Sequence[str]) -> dict[str, str]:
    """One colour per label, the same in every panel of a figure."""
    return {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(labels))}


def lr_sweep(
    ax: Any,
    series: dict[str, list[dict[str, Any]]],
    title: str,
    *,
    color: dict[str, str] | None = None,
    xkey: str = "lr",
    xlabel: str = "peak learning rate",
) -> None:
    """Final eval loss against lr (log x): per series the mean over seeds that finished, with
    error bars from the seeds' min to max; an x at the top marks a setting in which some seed
    diverged or blew up (final loss above the initial one)."""
    color = color or colors(list(series))
    from matplotlib.ticker import NullFormatter  # pyright: ignore[reportMissingImports]

    finite = [a["mean"] for rows in series.values() for a in rows if a["mean"] is not None]
    top = max(finite) if finite else 1.0
    for label, rows in series.items():
        rows = sorted(rows, key=lambda a: a[xkey])
        ok = [a for a in rows if a["mean"] is not None]
        x = np.array([a[xkey] for a in ok])
        y = np.array([a["mean"] for a in ok])
        err = np.array([[a["mean"] - a["min"] for a in ok], [a["max"] - a["mean"] for a in ok]])
        c = color[label]
        ax.errorbar(
            x, y, yerr=err if len(ok) else None, fmt="o-", color=c, capsize=3, label=label, ms=4
        )
        bad = [a[xkey] for a in rows if a["unstable"]]
        if bad:
            ax.plot(bad, [top * 1.03] * len(bad), "x", color=c, ms=8, mew=2)
    ax.set_xscale("log")
    xs = sorted({a[xkey] for rows in series.values() for a in rows})
    ax.set_xticks(xs, [f"{x:.3g}" for x in xs], fontsize=7)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final eval loss (mean, min–max over seeds)")
    ax.set_title(title + "\n(x at the top: some seed diverged or blew up)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def finish(ax: Any, title: str, xlabel: str, ylabel: str, *, legend: bool = True) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


# --------------------------------------------------------------------------------------------
# A study's figure, redrawn from its committed files: `python plots.py OUT` (summary.json and
# traces.csv.gz, as experiments.py writes them).

Curves = dict[tuple[str, float, int], dict[str, tuple[np.ndarray, np.ndarray]]]


def read_traces(path: Path) -> Curves:
    """traces.csv.gz -> {(method, lr, seed): {kind: (steps, values)}}, plus "batch_size"."""
    import csv
    import gzip

    found: dict[tuple[str, float, int], dict[str, list[tuple[float, float]]]] = {}
    sizes: dict[tuple[str, float, int], int] = {}
    with gzip.open(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            key = (r["method"], float(r["lr"]), int(r["seed"]))
            found.setdefault(key, {}).setdefault(r["kind"], []).append(
                (float(r["step"]), float(r["value"]))
            )
            sizes[key] = int(r["batch_size"])
    out: Curves = {}
    for key, kinds in found.items():
        out[key] = {
            k: (np.array([x for x, _ in v]), np.array([y for _, y in v])) for k, v in kinds.items()
        }
        out[key]["batch_size"] = (np.array([sizes[key]]), np.array([sizes[key]]))
    return out


def _held_runs(summary: dict[str, Any], family: str) -> list[tuple[str, float, int]]:
    """(method, lr, seed) of each run a family was scored on."""
    h = summary["held_out"][family]
    per_lr = h.get("lr_per_seed") or {}
    return [(h["member"] or "", float(per_lr.get(s, h["lr"])), int(s)) for s in h["per_seed"]]


def draw(out: Path) -> None:
    """OUT/<experiment>.png from OUT/summary.json and OUT/traces.csv.gz; for a train.py run's
    directory (metrics.jsonl, no summary.json), OUT/run.png (`draw_run`)."""
    import json

    if not (out / "summary.json").exists() and (out / "metrics.jsonl").exists():
        draw_run(out)
        return
    plt = pyplot()
    if plt is None:
        return
    summary = json.loads((out / "summary.json").read_text())
    curves = read_traces(out / "traces.csv.gz")
    name = summary["experiment"]
    if name == "batch-scaling":
        fig = _draw_batch(plt, summary, curves)
    elif name == "critical-batch":
        fig = _draw_critical(plt, summary)
    else:
        fig = _draw_selected(plt, summary, curves)
    fig.suptitle(
        f"{name}: {summary.get('protocol_text', '')}\n{summary.get('command', '')} @ "
        f"{(summary.get('git_commit') or '?')[:10]}",
        fontsize=9,
    )
    save(fig, out / f"{name}.png", plt)


def _draw_selected(plt: Any, summary: dict[str, Any], curves: Curves) -> Any:
    fig, axes = plt.subplots(1, 4, figsize=(24, 5.2))
    series: dict[str, list[dict[str, Any]]] = {}
    for a in summary["settings"]:
        series.setdefault(a["method"], []).append(a)
    color = colors([*series, *summary["held_out"]])
    if series:
        lr_sweep(axes[0], series, "selection seeds: final loss vs lr (star: chosen)", color=color)
        for v in summary["variants"]:
            mine = [a for a in series.get(v["method"], []) if a["lr"] == v["lr"]]
            if mine and mine[0]["mean"] is not None:
                axes[0].plot(
                    v["lr"], mine[0]["mean"], "*", color=color[v["method"]], ms=14, mec="k"
                )
    families = list(summary["held_out"])
    for ax, kind, title in (
        (axes[1], "train_loss", "training loss at the chosen lr, scored seeds (band: min–max)"),
        (axes[2], "frac_mean_dominated", "mean-dominated coordinates: μ̂² > σ̂²/B"),
    ):
        for fam in families:
            found = [curves[k][kind] for k in _held_runs(summary, fam) if k in curves]
            if found:
                band(ax, found[0][0], [y for _, y in found], color[fam], fam)
        if kind == "train_loss":
            ax.set_yscale("log")
        finish(ax, title, "step", kind.replace("_", " "))
    ax = axes[3]
    for i, fam in enumerate(families):
        per = summary["held_out"][fam]["per_seed"]
        ys = [np.nan if v is None else v for v in per.values()]
        ax.plot([i] * len(ys), ys, "o", color=color[fam])
    seeds = sorted({s for fam in families for s in summary["held_out"][fam]["per_seed"]})
    for s in seeds:  # one line per seed: the paired comparison
        ys = [summary["held_out"][f]["per_seed"].get(s) for f in families]
        ax.plot(
            range(len(families)),
            [np.nan if y is None else y for y in ys],
            "-",
            color="0.7",
            lw=0.8,
            zorder=0,
        )
    ax.set_xticks(range(len(families)), families, rotation=30, ha="right", fontsize=7)
    finish(ax, "final loss per scored seed (grey: one seed)", "", "final eval loss", legend=False)
    return fig


def _draw_batch(plt: Any, summary: dict[str, Any], curves: Curves) -> Any:
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    table = summary["best_lr_per_batch"]
    groups = list(dict.fromkeys((t["method"], t["arm"]) for t in table))
    for i, (m, arm) in enumerate(groups):
        mine = [t for t in table if (t["method"], t["arm"]) == (m, arm) and t["best_lr"]]
        c, ls = f"C{i // 2}", "-" if i % 2 == 0 else "--"
        bs = np.array([t["batch_size"] for t in mine], float)
        axes[0].plot(bs, [t["best_lr"] for t in mine], "o" + ls, color=c, label=f"{m}, {arm}")
        ev = [t for t in mine if t.get("eval_best_lr")]  # the evaluation seeds' (issue 39)
        axes[0].plot(
            [t["batch_size"] for t in ev], [t["eval_best_lr"] for t in ev], "s", color=c, mfc="none"
        )
        edge = [t for t in mine if t["edge"]]
        axes[0].plot(
            [t["batch_size"] for t in edge], [t["best_lr"] for t in edge], "x", color="k", ms=9
        )
        fit = next(f for f in summary["fits"] if (f["method"], f["arm"]) == (m, arm))
        if mine and fit["exponent"] is not None:
            ref = mine[0]["best_lr"] * (bs / bs[0]) ** fit["predicted"]
            axes[0].plot(bs, ref, ":", color=c, lw=0.8)
        held = all(t.get("eval_final_loss") is not None for t in mine)  # evaluation seeds
        axes[1].errorbar(
            bs,
            [t["eval_final_loss" if held else "final_loss"] for t in mine],
            yerr=[t["eval_sd" if held else "sd"] or 0 for t in mine],
            fmt="o" + ls,
            color=c,
            capsize=3,
            label=f"{m}, {arm}",
        )
        if i == 0:
            cmap = plt.get_cmap("viridis")
            for j, t in enumerate(mine):
                found = [
                    v["train_loss"]
                    for k, v in curves.items()
                    if k[0].endswith(f"B={t['batch_size']}")
                    and k[0].startswith("Adam (")
                    and arm in k[0]
                    and k[1] == t["best_lr"]
                ]
                if found:
                    x = found[0][0] * t["batch_size"]
                    band(
                        axes[2],
                        x,
                        [y for _, y in found],
                        cmap(j / max(1, len(mine) - 1)),
                        f"B={t['batch_size']}",
                    )
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    finish(
        axes[0],
        "best lr vs B (o: selection grid; □: evaluation seeds, interpolated; x: at a grid edge; "
        "dotted: the predicted slope)",
        "B",
        "lr",
    )
    finish(axes[1], f"final loss after {summary['examples']} examples", "B", "final eval loss")
    finish(
        axes[2],
        f"{groups[0][0]}, {groups[0][1]}: training loss at each B's best lr",
        "examples seen",
        "training loss (binned)",
    )
    return fig


def _draw_critical(plt: Any, summary: dict[str, Any]) -> Any:
    """critical-batch: S against E (every evaluation seed, the means, the fitted hyperbola
    S/S_min − 1 = (E/E_min − 1)⁻¹), S against B with the fit, and the measured B_crit beside
    the predicted B_simple and B_P (each with its interval, and per B; B_P where the summary has
    it: one written before it was measured has not)."""
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    per_b = [t for t in summary["per_batch"] if t["steps"] is not None]
    meas, pred = summary["measured"], summary["predicted"]
    cmap = plt.get_cmap("viridis")
    for j, t in enumerate(per_b):
        c = cmap(j / max(1, len(per_b) - 1))
        s = np.array([x for x in t["steps_per_seed"].values() if x is not None], float)
        b = t["batch_size"]
        axes[0].plot(b * s, s, ".", color=c, alpha=0.5)
        axes[0].plot(b * t["steps"], t["steps"], "o", color=c, mec="k", label=f"B={b}")
        axes[1].plot([b] * len(s), s, ".", color=c, alpha=0.5)
        axes[1].plot(b, t["steps"], "o", color=c, mec="k")
    bs = np.array([t["batch_size"] for t in per_b], float)
    if meas["s_min"] is not None and meas["e_min"] is not None and len(bs):
        grid = np.geomspace(bs.min() / 2, bs.max() * 2, 200)
        fit = meas["s_min"] + meas["e_min"] / grid
        ok = fit > 0
        label = f"fit: S_min {meas['s_min']:.3g}, E_min {meas['e_min']:.3g}"
        axes[0].plot((grid * fit)[ok], fit[ok], "-", color="C3", label=label)
        axes[1].plot(grid[ok], fit[ok], "-", color="C3", label=label)
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_yscale("log")
    finish(axes[0], f"steps vs examples to loss {summary['target_loss']:.4g}", "E = B·S", "S")
    finish(axes[1], "steps to the target vs B (dots: seeds; o: mean)", "B", "S")
    ax = axes[2]
    bands = [
        (meas["b_crit"], meas["ci95"], "C3", "measured B_crit = E_min/S_min"),
        (pred["mean"], pred["ci95"], "C0", "predicted B_simple (mean over seeds)"),
    ]
    pred_p = summary.get("predicted_p")
    if pred_p is not None:
        bands.append((pred_p["mean"], pred_p["ci95"], "C2", "predicted B_P (Adam's P; mean)"))
    for key, color, marker in (("b_simple", "C0", "s-"), ("b_p", "C2", "^-")):
        per = [(t["batch_size"], t[key]) for t in summary["per_batch"] if t.get(key)]
        if per:
            name = "B_simple" if key == "b_simple" else "B_P"
            ax.plot(
                *zip(*per, strict=True), marker, color=color, label=f"{name} at the target, per B"
            )
    for value, (lo, hi), color, name in bands:
        if value is not None:
            ax.axhline(value, color=color, lw=2, label=f"{name}: {value:.3g}")
        if lo is not None:
            top = hi if hi is not None else ax.get_ylim()[1] * 10
            ax.axhspan(max(lo, 1e-3), top, color=color, alpha=0.15, lw=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    said = "B_simple and B_P" if pred_p is not None else "B_simple"
    finish(ax, f"measured B_crit vs predicted {said}", "B", "examples (band: 95% interval)")
    return fig


# --------------------------------------------------------------------------------------------
# One run's gradient noise scale: `python plots.py RUN` (metrics.jsonl, as train.py writes it).

NOISE_EMA = 0.9  # decay per logged step of the averages whose ratio is the smoothed B_simple


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """RUN/metrics.jsonl as train.py writes it: one record per logged step."""
    import json

    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def noise_scale_series(run: Path, decay: float = NOISE_EMA) -> dict[str, np.ndarray]:
    """From RUN/metrics.jsonl, per logged step: "step", the per-batch "noise_scale_batch"
    (B_simple = trace_cov / grad_sq of that step's batch), "trace_cov" and "grad_sq" as logged,
    their exponential moving averages "trace_cov_ema" and "grad_sq_ema" (decay per logged step),
    and "smoothed", the ratio of the two EMAs: train.py's "noise_scale" (`train.NoiseScale`),
    recomputed here so that a run logged before it is drawn the same. Each of trace_cov and
    grad_sq is unbiased and their ratio is not, so they are averaged first
    (pegrad.gradient_noise_scale); both EMAs start at 0 with the same decay, so their ratio
    needs no bias correction. A step whose grad_sq EMA is ≤ 0 (noise outweighs the signal so
    far) has no smoothed value (NaN)."""
    logged = [m for m in read_metrics(run) if "trace_cov" in m and "grad_sq" in m]
    if not logged:
        raise ValueError(f"{run / 'metrics.jsonl'}: no trace_cov/grad_sq (written by train.py)")
    trace = np.array([m["trace_cov"] for m in logged], float)
    grad = np.array([m["grad_sq"] for m in logged], float)
    num, den = np.zeros_like(trace), np.zeros_like(grad)
    t = g = 0.0
    for i in range(len(logged)):
        t, g = decay * t + (1 - decay) * trace[i], decay * g + (1 - decay) * grad[i]
        num[i], den[i] = t, g
    with np.errstate(divide="ignore", invalid="ignore"):
        return {
            "step": np.array([m["step"] for m in logged], float),
            "noise_scale_batch": trace / grad,
            "smoothed": np.where(den > 0, num / den, np.nan),
            "trace_cov": trace,
            "grad_sq": grad,
            "trace_cov_ema": num,
            "grad_sq_ema": den,
        }


def loss_series(run: Path) -> dict[str, np.ndarray]:
    """From RUN/metrics.jsonl: "step" and "loss" of each logged training batch, "eval_step"
    and "eval_loss" of each evaluation (train.py's labels: the loss of the parameters after
    that many updates)."""
    records = read_metrics(run)
    train = [(m["step"], m["loss"]) for m in records if "loss" in m]
    held = [(m["step"], m["eval_loss"]) for m in records if "eval_loss" in m]
    pairs = lambda xs: np.array(xs, float).reshape(-1, 2).T  # noqa: E731
    (step, loss), (eval_step, eval_loss) = pairs(train), pairs(held)
    return {"step": step, "loss": loss, "eval_step": eval_step, "eval_loss": eval_loss}


def draw_run(run: Path, decay: float = NOISE_EMA) -> Path | None:
    """RUN/run.png: the train and eval loss against step; B_simple against step (log y; the
    smoothed estimate train.py logs as noise_scale as a line, each batch's ratio as dots, those
    ≤ 0 marked at the bottom); and its numerator tr Σ and denominator |G|² (their EMAs). The
    path written, or None without matplotlib (`NO_FIGURE`)."""
    series, losses = noise_scale_series(run, decay), loss_series(run)
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    ax = axes[0]
    ax.plot(losses["step"], losses["loss"], "-", color="C0", lw=1, label="train (one batch)")
    ax.plot(losses["eval_step"], losses["eval_loss"], "o-", color="C3", label="eval (held out)")
    finish(ax, "loss", "step", "loss")
    x, raw, smooth = series["step"], series["noise_scale_batch"], series["smoothed"]
    ax = axes[1]
    ok = np.isfinite(raw) & (raw > 0)
    ax.plot(x[ok], raw[ok], ".", color="0.6", ms=3, label="one batch: tr Σ / |G|²")
    if (~ok).any():
        floor = np.nanmin(np.where(ok, raw, np.nan)) if ok.any() else 1.0
        ax.plot(x[~ok], np.full((~ok).sum(), floor), "v", color="C3", ms=4,
                label="one batch: |G|² ≤ 0 (noise outweighs the signal)")  # fmt: skip
    ax.plot(x, smooth, "-", color="C0", label=f"noise_scale: EMA(tr Σ) / EMA(|G|²), {decay:g}/log")
    ax.set_yscale("log")
    finish(ax, "gradient noise scale B_simple (≈ the critical batch)", "step", "units (examples)")
    ax = axes[2]
    for key, label, c in (("trace_cov", "tr Σ", "C1"), ("grad_sq", "|G|²", "C2")):
        ema = series[key + "_ema"]
        ax.plot(x, np.where(series[key] > 0, series[key], np.nan), ".", color=c, ms=2, alpha=0.4)
        ax.plot(x, np.where(ema > 0, ema, np.nan), "-", color=c, label=f"{label} (EMA)")
    ax.set_yscale("log")
    finish(ax, "numerator and denominator (each unbiased; values ≤ 0 not drawn)", "step", "")
    fig.suptitle(str(run), fontsize=9)
    save(fig, run / "run.png", plt)
    return run / "run.png"


def cost_table(markdown: str) -> tuple[list[str], list[str], np.ndarray]:
    """(columns, rows, ratios [row, column, (time, memory)]) of the first Markdown table whose
    cells read "time / memory" (ratios to plain grad, as the README's cost table); a cell
    holding something else ("—", "not run") is NaN."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, body = cells[0], [row for row in cells[2:] if len(row) == len(cells[0])]

    def number(text: str) -> float:
        try:
            return float(text.split()[0])
        except (ValueError, IndexError):
            return float("nan")

    def pair(cell: str) -> tuple[float, float]:
        parts = cell.split("/")
        return number(parts[0]), number(parts[1]) if len(parts) > 1 else float("nan")

    ratios = np.array([[pair(c) for c in row[1:]] for row in body], dtype=float)
    return header[1:], [row[0] for row in body], ratios


def draw_costs(markdown: Path, out: Path) -> None:
    """The cost table of `markdown` (e.g. README.md) as a picture: time and temporary memory
    of each model and column as multiples of plain grad, log scale, 1 marked."""
    plt = pyplot()
    if plt is None:
        return
    columns, rows, ratios = cost_table(markdown.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.35 * len(rows) + 2.5), sharey=True)
    y, height = np.arange(len(rows)), 0.8 / len(columns)
    labels = [re.sub(r"\[(.*?)\]\(.*?\)", r"\1", r).replace("`", "") for r in rows]  # link text
    for ax, k, what in zip(axes, (0, 1), ("time", "temporary memory"), strict=True):
        for j, column in enumerate(columns):
            ax.barh(y + (j - (len(columns) - 1) / 2) * height, ratios[:, j, k], height,
                    label=column)  # fmt: skip
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        ax.set_yticks(y, labels, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{what} / plain jax.value_and_grad's", fontsize=10)
    axes[0].invert_yaxis()  # the table's order, top down (the axes share y)
    axes[1].legend(fontsize=8, loc="lower right")
    out.parent.mkdir(parents=True, exist_ok=True)
    save(fig, out, plt)


def main(argv: Sequence[str] | None = None) -> None:
    """`python plots.py DIR ... | --costs TABLE.md OUT.png | --help`: one line "error: ..." and
    exit status 1 on a folder it cannot draw, or without matplotlib (`NO_FIGURE`)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="plots.py",
        description="Draw a train.py run (OUT/run.png: train and eval loss, gradient noise "
        "scale) or an experiments.py study (OUT/<experiment>.png), from the files they wrote.",
        epilog='matplotlib is optional: pip install -e ".[plots]" (installed: "pegrad[plots]")',
    )
    parser.add_argument("folders", nargs="*", type=Path, metavar="DIR",
                        help="a train.py --out directory, or a study's results/NAME")  # fmt: skip
    parser.add_argument("--costs", nargs=2, type=Path, metavar=("TABLE.md", "OUT.png"),
                        help="the cost table of TABLE.md (the README) as a picture")  # fmt: skip
    args = parser.parse_args(argv)
    if not (args.folders or args.costs):
        parser.error("give a DIR to draw, or --costs TABLE.md OUT.png")
    for folder in args.folders:
        if not ((folder / "metrics.jsonl").is_file() or (folder / "summary.json").is_file()):
            sys.exit(f"error: {folder} holds no metrics.jsonl (train.py) or summary.json (a study)")
    try:
        import matplotlib  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        sys.exit(f"error: {NO_FIGURE}")
    if args.costs:
        draw_costs(*args.costs)
        print(f"wrote {args.costs[1]}")
    for folder in args.folders:
        try:
            draw(folder)
        except (ValueError, KeyError, OSError) as err:
            sys.exit(f"error: {folder}: {err}")
        print(f"drew {folder}")


if __name__ == "__main__":
    main()
