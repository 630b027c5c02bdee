"""Do the committed verdicts survive seeds nobody has seen? (issue 18)

Each committed study chose its lrs on seeds 0-2 and computed its verdicts on seeds 3-7. The
re-checks below train the same variants at the same (committed) lrs on seeds 20-24, without any
selection (`--lrs-from`); batch-scaling, whose result is a fitted exponent, keeps its committed
selection (seeds 0-2 decide only where each B's lr bracket lies) and trains the brackets on
seeds 20-24, at the commit that trained the study (the cache then holds its selection runs).
This script puts each committed verdict beside its re-check and beside the verdict over all ten
evaluation seeds pooled (3-7 and 20-24: neither set chose an lr):

Issue 51 adds the studies that had none: the decided LM sign study and the two noise floors
(their verdicts as above, each floor's σ beside its re-check's), the critical batch of both
tasks (B_crit, B_simple and B_P measured on seeds 20-24 at the committed lrs and target, and
on all ten seeds pooled: every run cached, nothing retrained) and the windows measurement
(μ̂²/σ̂² per window on seeds 20-24). A study whose re-check was not run is said so.

    python experiments.py sign --task mlp --lrs-from results/sign-mlp/summary.json \
        --seeds 20-24 --out results/recheck/sign-mlp --cache runs/cache-tiny      # and so on
    python results/recheck/pool.py > results/recheck/summary.md

(the exact command of each re-check is in its own summary.md). Where a committed summary's
verdicts are held against a noise floor (the LM's, issue 39: results/restate.py --noise-floor),
its pooled verdicts are held against the same floor, at ten seeds.
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import experiments  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1]
STUDIES = (
    "sign-mlp",
    "precond-mlp",
    "msq-mlp",
    "clipping-mlp",
    "sign",
    "precond-lm",
    "msq-lm",
    "clipping-lm",
    "sign-lm-decided",
    "noise-floor-mlp",
    "noise-floor-lm",
)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def short(v: dict) -> str:
    """A verdict in a table cell: its strength, the mean difference A − B, its 95 % CI, the seeds
    agreeing with the sign of the mean."""
    if "mean_diff" not in v:
        return v["verdict"]
    kind = v["verdict"].split(":")[0]
    lo, hi = v["ci95"]
    return f"{kind} {v['mean_diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] {v['seeds_agreeing']}/{v['seeds']}"


def kind(v: dict) -> tuple[str, int]:
    """(strength, sign of the mean difference); no difference and undecided (within the noise
    floor) have no sign."""
    strength = v["verdict"].split(":")[0]
    if strength in ("no difference", "undecided") or "mean_diff" not in v:
        return strength, 0
    return strength, 1 if v["mean_diff"] > 0 else -1


def agreement(committed: dict, recheck: dict) -> str:
    """How the re-check relates to the committed verdict."""
    (s0, d0), (s1, d1) = kind(committed), kind(recheck)
    if (s0, d0) == (s1, d1):
        return "same"
    if d0 and d1 and d0 != d1:
        return "**reversed**"
    if "consistent" in (s0, s1):
        return "**not confirmed**" if s0 == "consistent" else "stronger"
    return "undecided both"


def floor_of(summary: dict) -> experiments.NoiseFloor | None:
    """The noise floor a summary's verdicts were held against, or None."""
    named = {v["noise_floor_from"] for v in summary["verdicts"] if "noise_floor_from" in v}
    return experiments.read_noise_floor(RESULTS.parent / named.pop()) if named else None


def pooled(a: str, b: str, committed: dict, recheck: dict) -> dict | None:
    """The verdict over both sets of evaluation seeds, each variant at its committed lr (against
    the committed summary's noise floor, where it has one)."""
    held, again = committed["held_out"], recheck["held_out"]
    if not all(x in held and x in again for x in (a, b)):
        return None  # a derived comparison (e.g. a difference of differences)
    merged = {
        x: {"per_seed": {**held[x]["per_seed"], **again[x]["per_seed"]}, "lr": held[x]["lr"]}
        for x in (a, b)
    }
    return experiments.compare(merged[a], merged[b], a, b, floor=floor_of(committed))


def main() -> None:
    print("# Re-check of every committed verdict on unseen seeds (20-24)\n")
    print((__doc__ or "").split("\n\n")[1].replace("\n", " ") + "\n")
    print(
        "Cells: verdict, mean difference A − B of final held-out loss, its 95 % t-interval, "
        "seeds agreeing. *same*: same strength and direction; *not confirmed*: a consistent "
        "verdict that the re-check calls weak or no difference; *stronger*: the reverse; "
        "*reversed*: opposite directions; *undecided both*: neither is consistent.\n"
    )
    tally: dict[str, int] = {}
    for study in STUDIES:
        if not (RESULTS / "recheck" / study / "summary.json").exists():
            print(f"## {study}\n\nNo re-check run (no compute for it in its session).\n")
            continue
        committed = load(RESULTS / study / "summary.json")
        recheck = load(RESULTS / "recheck" / study / "summary.json")
        print(f"## {study}\n")
        print(f"Committed: `{committed['command']}` at {committed['git_commit'][:7]}  ")
        print(f"Re-check: `{recheck['command']}` at {recheck['git_commit'][:7]}\n")
        seen, again_seeds = committed["evaluation_seeds"], recheck["evaluation_seeds"]
        columns = (
            "A vs B",
            f"seeds {span(seen)} (committed)",
            f"seeds {span(again_seeds)} (re-check)",
            "agreement",
            f"pooled, {len(seen) + len(again_seeds)} seeds",
        )
        print("| " + " | ".join(columns) + " |")
        print("|---|---|---|---|---|")
        again = {(v["a"], v["b"]): v for v in recheck["verdicts"]}
        for v in committed["verdicts"]:
            w = again[(v["a"], v["b"])]
            p = pooled(v["a"], v["b"], committed, recheck)
            cell = "–" if p is None else short(p)
            agrees = agreement(v, w)
            tally[agrees] = tally.get(agrees, 0) + 1
            row = (f"{v['a']} vs {v['b']}", short(v), short(w), agrees, cell)
            print("| " + " | ".join(row) + " |")
        print()
        if "noise_floor" in committed:
            sigmas(committed, recheck)
    counts = ", ".join(f"{k.strip('*')} {n}" for k, n in sorted(tally.items(), key=lambda x: -x[1]))
    print(f"Of {sum(tally.values())} committed verdicts: {counts}.\n")
    exponents("batch-scaling-mlp")
    exponents("batch-scaling-lm")
    for task in ("mlp", "lm"):
        critical(f"critical-batch-{task}")
    windows()


def span(seeds: list[int]) -> str:
    """Seeds as a range where they are consecutive (3-7), else listed."""
    consecutive = seeds == list(range(seeds[0], seeds[0] + len(seeds)))
    return f"{seeds[0]}-{seeds[-1]}" if consecutive else ",".join(map(str, seeds))


def sigmas(committed: dict, recheck: dict) -> None:
    """A noise floor's σ per optimizer (one run's chaos alone) on the committed seeds, on the
    re-check's, and over both (the RMS of every null difference, over √2)."""
    print("σ of one run's final loss (RMS of the null differences / √2):\n")
    print(
        "| optimizer | committed σ (seeds) | re-check σ (seeds) | re-check / committed | pooled σ |"
    )
    print("|---|---|---|---|---|")
    for name, f in committed["noise_floor"].items():
        g = recheck["noise_floor"].get(name)
        if g is None:
            continue
        diffs = [*f["null_diffs"].values(), *g["null_diffs"].values()]
        pooled_sigma = (sum(d * d for d in diffs) / len(diffs)) ** 0.5 / 2**0.5 if diffs else None
        ratio = g["sigma"] / f["sigma"] if f["sigma"] and g["sigma"] is not None else None
        cells = (
            name,
            f"{f['sigma']:.2g} ({f['seeds']})",
            f"{g['sigma']:.2g} ({g['seeds']})",
            "–" if ratio is None else f"{ratio:.2g}",
            "–" if pooled_sigma is None else f"{pooled_sigma:.2g}",
        )
        print("| " + " | ".join(cells) + " |")
    print()


def interval(value: float | None, ci: list, unbounded: bool = False) -> str:
    lo, hi = ci
    top = "∞" if unbounded else experiments.fmt_num(hi, ".3g")
    return f"{experiments.fmt_num(value, '.3g')} [{experiments.fmt_num(lo, '.3g')}, {top}]"


def critical(study: str) -> None:
    """critical-batch: the measured B_crit, B_simple and B_P (each with its interval) and which
    predicts better, committed beside the re-check at its lrs and target on seeds 20-24, and
    beside the same over all ten evaluation seeds (the pooled run trains nothing)."""
    paths = [RESULTS / study, RESULTS / "recheck" / study, RESULTS / "recheck" / f"{study}-pooled"]
    print(f"\n## {study} (the committed lrs and target, evaluated on seeds 20-24)\n")
    if not all((p / "summary.json").exists() for p in paths):
        print("No re-check run (no compute for it in its session).\n")
        return
    runs = [load(p / "summary.json") for p in paths]
    for what, run in zip(("Committed", "Re-check", "Pooled"), runs, strict=True):
        print(f"{what}: `{run['command']}` at {run['git_commit'][:7]}  ")
    print("\n| seeds | B_crit [95 % bootstrap] | B_simple [95 % t] | B_P [95 % t] | better |")
    print("|---|---|---|---|---|")
    for run in runs:
        m, ps, pp = run["measured"], run["predicted"], run.get("predicted_p")
        unb = m["b_crit_unbounded"]
        crit = "unbounded" if unb else interval(m["b_crit"], m["ci95"], m["ci95_upper_unbounded"])
        cells = (
            span(run["evaluation_seeds"]),
            crit,
            interval(ps["mean"], ps["ci95"]),
            "–" if pp is None else interval(pp["mean"], pp["ci95"]),
            "–" if "comparison" not in run else run["comparison"]["verdict"],
        )
        print("| " + " | ".join(cells) + " |")
    print()


def windows() -> None:
    """windows: the median μ̂²/σ̂² (median over seeds, their range) per window and point."""
    paths = [RESULTS / "windows", RESULTS / "recheck" / "windows"]
    print("\n## windows (μ̂²/σ̂² of the LM against its window length, on seeds 20-24)\n")
    if not (paths[1] / "summary.json").exists():
        print("No re-check run (no compute for it in its session).\n")
        return
    runs = [load(p / "summary.json") for p in paths]
    for what, run in zip(("Committed", "Re-check"), runs, strict=True):
        print(f"{what}: `{run['command']}` at {run['git_commit'][:7]}  ")
    seeds = [span(sorted({r["seed"] for r in run["mu2_over_sigma2"]})) for run in runs]
    print(f"\n| window | point | seeds {seeds[0]}: median μ̂²/σ̂² (range) | seeds {seeds[1]} |")
    print("|---|---|---|---|")
    cells: dict[tuple[int, str], list[str]] = {}
    for run in runs:
        groups: dict[tuple[int, str], list[float]] = {}
        for r in run["mu2_over_sigma2"]:
            groups.setdefault((r["window"], r["point"]), []).append(r["median_mu2_over_sigma2"])
        for key, med in groups.items():
            med = sorted(med)
            mid = statistics.median(med)
            cells.setdefault(key, []).append(f"{mid:.3g} ({med[0]:.3g}–{med[-1]:.3g})")
    for (w, point), got in cells.items():
        print(f"| {w} | {point} | {' | '.join(got + ['–'] * (2 - len(got)))} |")
    print()


def exponents(study: str) -> None:
    """A batch-scaling study's fitted exponents beside its re-check's and beside the fit over
    both sets of evaluation seeds (every run then cached)."""
    runs = [load(RESULTS / study / "summary.json")]
    runs += [load(RESULTS / "recheck" / f"{study}{x}" / "summary.json") for x in ("", "-pooled")]
    print(f"\n## {study} (the committed brackets, evaluated on seeds 20-24)\n")
    for what, run in zip(("Committed", "Re-check", "Pooled"), runs, strict=True):
        print(f"{what}: `{run['command']}` at {run['git_commit'][:7]}  ")
    head = "| method, arm | committed: exponent [95 % interval] (B fitted) | re-check | pooled |"
    print(f"\n{head} predicted |\n" + "|---" * head.count("|") + "|")
    found = [{(f["method"], f["arm"]): f for f in run["fits"]} for run in runs]
    for f in runs[0]["fits"]:
        cells = [
            "–"
            if (x := fits[(f["method"], f["arm"])])["exponent"] is None
            else f"{x['exponent']:.2f} [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}] "
            f"(B {', '.join(map(str, x['batch_sizes_fitted']))})"
            for fits in found
        ]
        print(f"| {f['method']}, {f['arm']} | {' | '.join(cells)} | {f['predicted']:g} |")


if __name__ == "__main__":
    main()
