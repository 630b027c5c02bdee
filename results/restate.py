"""Re-state every committed verdict under experiments.py's one verdict rule (issue 39), without
retraining: "consistent" when the 95 % t-interval of the paired differences excludes 0 and
every seed agrees on their sign (it was: every seed agrees and |mean| > 2·se, looser than the
interval at n = 5, where t = 2.78). "no difference" (|mean| ≤ se) and "weak" are unchanged.

experiments.py cannot regenerate a summary without its trace cache (runs/cache-tiny, never
committed): it would retrain. Every number a verdict needs is in the summary itself, though: each
family's final loss per scored seed ("held_out"), per selection seed ("same_seed"), and each
verdict's per-seed differences. This script recomputes each verdict with `experiments.compare`
from those (the clipping study's gap verdicts with `experiments.clip_gap_verdict`), checks that
the numbers it recomputes are the committed ones (mean, per-seed differences, seeds agreeing),
rewrites the verdicts in summary.json and summary.md (nothing else; a note in summary.md says
so) and prints each change of strength:

    python results/restate.py > results/restated.md    # its record; run again, it changes nothing
    python results/recheck/pool.py > results/recheck/summary.md    # the pooled table, re-stated

With a noise floor (issue 39), every verdict of the LM's summaries is also held against it
(`experiments.NoiseFloor`: "undecided" where |mean difference| is within the floor of its pair
and seed count); the summaries of the other task are left as they are, and so is the noise-floor
study's own. The record of that pass is appended to restated.md:

    python results/restate.py --noise-floor results/noise-floor-lm/summary.json \
        >> results/restated.md

A summary whose verdicts already hold a floor keeps it when re-stated without one.
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import experiments  # noqa: E402

NOTE = "Verdicts re-stated (issue 39)"
FLOOR_NOTE = "Verdicts held against the noise floor (issue 39)"
GAP = "MicroAdam − Adam, both clipped at "
RULE_COMMIT = "9c08b38"  # the commit that made the interval rule experiments.py's
# what a verdict holds only when it was computed against a noise floor
FLOOR_KEYS = {"noise_floor", "above_noise_floor", "strength_without_floor", "noise_floor_from"}


def ints(per_seed: dict[str, Any] | None) -> dict[int, Any] | None:
    """JSON's string seed keys back to the ints the study used (so seeds sort by number)."""
    return None if per_seed is None else {int(s): v for s, v in per_seed.items()}


def scores(tree: dict[str, Any] | None) -> dict[str, Any]:
    return {
        fam: None if h is None else {**h, "per_seed": ints(h["per_seed"])}
        for fam, h in (tree or {}).items()
    }


def old_strength(d: list[float]) -> str:
    """The rule the summaries were written with: every seed agrees and |mean| > 2·se."""
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else math.inf
    if abs(mean) <= se:
        return "no difference"
    agree = sum(x < 0 for x in d) if mean < 0 else sum(x > 0 for x in d)
    return "consistent" if agree == n and abs(mean) > 2 * se else "weak"


def kind(verdict: str | None) -> str:
    """A verdict's strength: consistent, weak, no difference, or no verdict."""
    return "no verdict" if verdict is None else verdict.split(":")[0]


def todays_rule(data: dict[str, Any]) -> bool:
    """Whether a summary's verdicts were written under today's rule: re-stated already, or
    written by a commit that descends from RULE_COMMIT."""
    if "verdict_rule" in data:
        return True
    commit = data.get("git_commit")
    found = subprocess.run(
        ["git", "merge-base", "--is-ancestor", RULE_COMMIT, str(commit)],
        cwd=ROOT,
        capture_output=True,
    )
    return commit is not None and found.returncode == 0


def task_of(data: dict[str, Any]) -> str | None:
    """The task every run of a summary trained ("lm", "mlp"), or None where they mix."""
    tasks = {r.get("task") for r in data.get("runs", ())}
    return tasks.pop() if len(tasks) == 1 else None


def floor_for(
    data: dict[str, Any], floor: experiments.NoiseFloor | None
) -> experiments.NoiseFloor | None:
    """The floor a summary's verdicts are held against: `floor` for an LM study (not the
    noise-floor study itself), else the one its verdicts already name, else none."""
    if data["experiment"] == "noise-floor":
        return None
    if floor is not None and task_of(data) == floor.task:
        return floor
    named = {v["noise_floor_from"] for v in data["verdicts"] if "noise_floor_from" in v}
    return experiments.read_noise_floor(ROOT / named.pop()) if named else None


def restate(
    data: dict[str, Any], floor: experiments.NoiseFloor | None = None
) -> list[dict[str, Any]]:
    """The summary's verdicts recomputed under today's rule (against `floor` where given), each
    checked against the committed numbers (and, under the old rule, against the committed
    strength, the one without a floor where the verdict had one)."""
    held, same = scores(data["held_out"]), scores(data.get("same_seed"))
    restated = todays_rule(data)
    out = []
    for v in data["verdicts"]:
        a, b = v["a"], v["b"]
        if a in held and b in held:
            new = experiments.compare(held[a], held[b], a, b, floor=floor)
            if "same_seed_verdict" in v:
                new["same_seed_verdict"] = experiments.compare(
                    same.get(a), same.get(b), a, b, floor=floor
                )["verdict"]
        elif a.startswith(GAP):
            new = experiments.clip_gap_verdict(held, float(a.removeprefix(GAP)), floor)
        else:
            raise ValueError(f"{a} vs {b}: neither two scored families nor a clipping gap")
        assert set(new) - FLOOR_KEYS == set(v) - FLOOR_KEYS, (set(new) ^ set(v), a, b)
        if "mean_diff" in v:
            assert math.isclose(new["mean_diff"], v["mean_diff"], rel_tol=1e-12, abs_tol=1e-15)
            assert new["seeds_agreeing"] == v["seeds_agreeing"] and new["seeds"] == v["seeds"]
            assert {str(s): x for s, x in new["per_seed_diff"].items()} == v["per_seed_diff"]
            rule = experiments.strength if restated else old_strength
            committed = v.get("strength_without_floor", kind(v["verdict"]))
            assert rule(list(v["per_seed_diff"].values())) == committed, (a, b)
        else:
            assert new["verdict"] == v["verdict"]
        out.append(new)
    return out


def rewrite_md(
    path: Path,
    old: list[dict[str, Any]],
    new: list[dict[str, Any]],
    note: str,
    marker: str = NOTE,
) -> None:
    text = path.read_text()
    lines = text.split("\n")
    for v, w in zip(old, new, strict=True):
        head = f"- **{v['a']} vs {v['b']}**: "
        i = lines.index(head + v["verdict"])
        lines[i] = head + w["verdict"]
        if "same_seed_verdict" in v and v["same_seed_verdict"]:
            sub = "  - same seeds as the selection: "
            assert lines[i + 1] == sub + v["same_seed_verdict"], (path, lines[i + 1])
            lines[i + 1] = sub + w["same_seed_verdict"]
    if not any(line.startswith(marker) for line in lines):  # once: the first re-statement's
        first = min(
            lines.index(f"- **{v['a']} vs {v['b']}**: {w['verdict']}")
            for v, w in zip(old, new, strict=True)
        )
        lines[first:first] = [note, ""]
    path.write_text("\n".join(lines))


def main_floor(floor: experiments.NoiseFloor) -> None:
    """Hold every LM verdict against `floor`: rewrite the summaries, print the record."""
    print("\n## The LM's verdicts against the noise floor (issue 39)\n")
    print(
        f"`python results/restate.py --noise-floor {floor.source}`: each verdict of an LM "
        "summary held against the floor of its pair at its seed count, 1.96·√((σ_A² + σ_B²)/n) "
        "with σ per optimizer "
        + ", ".join(f"{k} {v:.3f}" for k, v in floor.sigma.items())
        + " (the largest where the optimizer was not measured); within it a verdict is "
        "undecided. No run retrained.\n"
    )
    print("| study | A vs B | scored on | mean A − B | floor | before | now |")
    print("|---|---|---|---|---|---|---|")
    total = 0
    moves: dict[str, int] = {}  # "consistent -> undecided": verdicts on their scored seeds
    for path in sorted((ROOT / "results").rglob("summary.json")):
        data = json.loads(path.read_text())
        if not data.get("verdicts") or "held_out" not in data:
            continue
        mine = floor_for(data, floor)
        if mine is None or task_of(data) != floor.task:
            continue
        study = str(path.parent.relative_to(ROOT / "results"))
        new = restate(data, mine)
        changes = []
        for v, w in zip(data["verdicts"], new, strict=True):
            if kind(v["verdict"]) == "no verdict":
                continue
            total += 1
            shown = f"{w['mean_diff']:+.3f}" if "mean_diff" in w else "–"
            cut = f"{w['noise_floor']:.3f}" if "noise_floor" in w else "–"
            if kind(v["verdict"]) != kind(w["verdict"]):
                move = f"{kind(v['verdict'])} → {kind(w['verdict'])}"
                moves[move] = moves.get(move, 0) + 1
                changes.append(f"{v['a']} vs {v['b']}")
            cells = (study, f"{v['a']} vs {v['b']}", "evaluation seeds", shown, cut)
            print("| " + " | ".join((*cells, kind(v["verdict"]), kind(w["verdict"]))) + " |")
            before, after = v.get("same_seed_verdict"), w.get("same_seed_verdict")
            if kind(before) != "no verdict" and kind(before) != kind(after):
                changes.append(f"{v['a']} vs {v['b']} (same-seed)")
        note = (
            f"{FLOOR_NOTE} by `python results/restate.py --noise-floor {mine.source}`, from this "
            "summary's own per-seed numbers, no run retrained: a verdict within 1.96·√((σ_A² + "
            "σ_B²)/n) is undecided. "
            + (f"Changed: {'; '.join(changes)}." if changes else "No strength changed.")
        )
        rewrite_md(path.parent / "summary.md", data["verdicts"], new, note, FLOOR_NOTE)
        data["verdicts"] = new
        data.setdefault("verdict_rule", {})["noise_floor"] = (
            f"{mine.source}: within 1.96 * sqrt((sigma_A^2 + sigma_B^2) / n) a verdict is undecided"
        )
        path.write_text(json.dumps(data, indent=1))
    counted = "; ".join(f"{m}: {n}" for m, n in sorted(moves.items(), key=lambda x: -x[1]))
    print(
        f"\n{sum(moves.values())} of {total} LM verdicts on their scored seeds change "
        f"({counted or 'none'}); every other one is unchanged. The same-seed verdicts (seeds "
        "0–2) are held against the floor too, in each summary.md."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--noise-floor", default=None, help="a noise-floor summary.json")
    args = parser.parse_args()
    if args.noise_floor is not None:
        main_floor(experiments.read_noise_floor(args.noise_floor))
        return
    print("# Verdicts re-stated under the 95 %-interval rule (issue 39)\n")
    print((__doc__ or "").split("\n\n")[0].replace("\n", " ") + "\n")
    print("| study | A vs B | scored on | committed (2·se rule) | now |")
    print("|---|---|---|---|---|")
    total = changed = 0
    for path in sorted((ROOT / "results").rglob("summary.json")):
        data = json.loads(path.read_text())
        if not data.get("verdicts") or "held_out" not in data:
            continue
        study = str(path.parent.relative_to(ROOT / "results"))
        new = restate(data, floor_for(data, None))
        changes = []
        for v, w in zip(data["verdicts"], new, strict=True):
            for which, before, after in (
                ("evaluation seeds", v["verdict"], w["verdict"]),
                (
                    "selection seeds (same-seed)",
                    v.get("same_seed_verdict"),
                    w.get("same_seed_verdict"),
                ),
            ):
                if kind(before) == "no verdict":
                    continue
                total += 1
                if kind(before) != kind(after):
                    changed += 1
                    changes.append(f"{v['a']} vs {v['b']} ({which})")
                    cells = (study, f"{v['a']} vs {v['b']}", which, kind(before), kind(after))
                    print("| " + " | ".join(cells) + " |")
        note = (
            f"{NOTE} by `python results/restate.py` from this summary's own per-seed numbers, no "
            "run retrained: consistent = the 95 % t-interval excludes 0 and every seed agrees "
            "(was: every seed agrees and |mean| > 2·se). "
            + (f"Changed: {'; '.join(changes)}." if changes else "No strength changed.")
        )
        rewrite_md(path.parent / "summary.md", data["verdicts"], new, note)
        data["verdicts"] = new
        data["verdict_rule"] = {
            "consistent": "95% t-interval (n - 1 degrees of freedom) excludes 0, every seed agrees",
            "restated_by": "results/restate.py (issue 39), from this summary's per-seed numbers",
        }
        path.write_text(json.dumps(data, indent=1))
    print(f"\n{changed} of {total} verdicts change strength; every other one is unchanged.")


if __name__ == "__main__":
    main()
