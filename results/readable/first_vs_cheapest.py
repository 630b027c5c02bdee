"""Where the cost model decides a route that precedence order would not (issue 57).

Issue 57 asks what the planner's cost model decides that precedence order (choose="first")
decides equally, measured before anything is removed. Per leaf, the route `explain` prints with
choose="cheapest" (the default) against choose="first":
- bench's families (families.FAMILIES at BENCH, float32, B 32) with six statistic sets, run here;
- the zoo (tests/zoo.py at B 5, and B 2 per token, float64) with neutral.py's five statistic
  sets (neither masked nor dropping: the digest's "first" cases are neither), read from a
  committed zoo digest, which holds explain's text under both choices.
"mean-loss" (the mean alone is plain grad; choose="first" turns it off by definition) is
counted as agreeing.

    python results/readable/first_vs_cheapest.py --zoo results/bench/neutral/zoo-ba2de22.json.gz
"""

import argparse
import collections
import gzip
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "bench")]

import jax  # noqa: E402

import families  # noqa: E402
import pegrad  # noqa: E402

LEAF = re.compile(r"^(\S.*?) \(([\d, ]*)\): ([\w-]+) \(")
SETS = [
    ("mean", "sq_mean"),
    ("mean", "var"),
    ("mean", "sq_norms"),
    ("clipped_mean", "sq_norms"),
    ("sign_mean",),
    ("mean", "sq_mean", "sign_mean", "var", "sq_norms", "clipped_mean"),
]


def routes(text: str) -> list[tuple[str, str]]:
    """(leaf path, route) per leaf line of explain's text."""
    return [(m.group(1), m.group(3)) for line in text.split("\n") if (m := LEAF.match(line))]


def tally(pairs: list[tuple[str, str, str]], title: str) -> None:
    """pairs: (case, cheapest's text, first's text)."""
    same, differ, seen = 0, collections.Counter(), {}
    for case, cheapest, first in pairs:
        for (leaf, a), (_, b) in zip(routes(cheapest), routes(first), strict=True):
            if a == b or a == "mean-loss":
                same += 1
                continue
            differ[a, b] += 1
            seen.setdefault((a, b), []).append(f"{case} {leaf}")
    print(f"== {title}: {same + differ.total()} leaf plans, {differ.total()} differ")
    for (a, b), n in differ.most_common():
        sets = collections.Counter(e.split(" ")[1] for e in seen[a, b])
        print(f"  cheapest {a} / first {b}: {n}, by statistic set {dict(sets)}")
        print(f"    e.g. {seen[a, b][0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--zoo", help="a zoo digest of results/bench/neutral.py")
    args = parser.parse_args()
    pairs = []
    for name in sorted(families.FAMILIES):
        fam, key = families.FAMILIES[name], jax.random.key(0)
        params, loss_fn = fam.build(families.BENCH, key)
        batch = fam.batch(families.BENCH, key, 32)
        for stats in SETS:
            clip = 1.0 if "clipped_mean" in stats else None
            cheapest = pegrad.explain(loss_fn, params, batch, stats, clip_norm=clip)
            first = pegrad.explain(loss_fn, params, batch, stats, clip_norm=clip, choose="first")
            pairs.append((f"{name} {'+'.join(stats)}", str(cheapest), str(first)))
    tally(pairs, f"bench's {len(families.FAMILIES)} families, {len(SETS)} statistic sets")
    if args.zoo:
        with gzip.open(args.zoo) as f:
            rows = json.load(f)
        zoo = []
        for key, text in rows.items():
            model, b, granularity, stats, label = key.split(" ")
            first = rows.get(f"{model} {b} {granularity} {stats} first")
            if label == "plain" and first is not None:  # (first: no mask, no drop)
                case = f"{model}-{b}-{granularity} {stats}"
                zoo.append((case, text.split("\n", 1)[1], first.split("\n", 1)[1]))
        tally(zoo, f"the zoo ({os.path.basename(args.zoo)})")


if __name__ == "__main__":
    main()
