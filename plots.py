"""plots.py: the figures of experiments.py; matplotlib is optional (`pip install -e ".[plots]"`).

Every multi-seed quantity is drawn as its mean over seeds with the seeds' spread (min to max)
as a band or an error bar, so that a difference can be read against the noise.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

NOTE = 'matplotlib not installed: wrote the CSV/JSON only; pip install -e ".[plots]" for plots'


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
        ax.errorbar(x, y, yerr=err if len(ok) else None, fmt="o-", color=c, capsize=3,
                    label=label, ms=4)  # fmt: skip
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
