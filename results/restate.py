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
"""

import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import experiments  # noqa: E402

NOTE = "Verdicts re-stated (issue 39)"
GAP = "MicroAdam − Adam, both clipped at "


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


def restate(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary's verdicts recomputed under today's rule, each checked against the committed
    numbers (and, under the old rule, against the committed strength)."""
    held, same = scores(data["held_out"]), scores(data.get("same_seed"))
    restated = "verdict_rule" in data  # already re-stated: the rule is today's
    out = []
    for v in data["verdicts"]:
        a, b = v["a"], v["b"]
        if a in held and b in held:
            new = experiments.compare(held[a], held[b], a, b)
            if "same_seed_verdict" in v:
                new["same_seed_verdict"] = experiments.compare(same.get(a), same.get(b), a, b)[
                    "verdict"
                ]
        elif a.startswith(GAP):
            new = experiments.clip_gap_verdict(held, float(a.removeprefix(GAP)))
        else:
            raise ValueError(f"{a} vs {b}: neither two scored families nor a clipping gap")
        assert set(new) == set(v), (set(new) ^ set(v), a, b)
        if "mean_diff" in v:
            assert math.isclose(new["mean_diff"], v["mean_diff"], rel_tol=1e-12, abs_tol=1e-15)
            assert new["seeds_agreeing"] == v["seeds_agreeing"] and new["seeds"] == v["seeds"]
            assert {str(s): x for s, x in new["per_seed_diff"].items()} == v["per_seed_diff"]
            rule = experiments.strength if restated else old_strength
            assert rule(list(v["per_seed_diff"].values())) == kind(v["verdict"]), (a, b)
        else:
            assert new["verdict"] == v["verdict"]
        out.append(new)
    return out


def rewrite_md(path: Path, old: list[dict[str, Any]], new: list[dict[str, Any]], note: str) -> None:
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
    if not any(line.startswith(NOTE) for line in lines):  # once: the first re-statement's
        first = min(
            lines.index(f"- **{v['a']} vs {v['b']}**: {w['verdict']}")
            for v, w in zip(old, new, strict=True)
        )
        lines[first:first] = [note, ""]
    path.write_text("\n".join(lines))


def main() -> None:
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
        new = restate(data)
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
