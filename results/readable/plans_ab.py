"""Per leaf, what two pegrad.py files plan, and where they differ (issue 57's precedence order).

- Bench's families (families.FAMILIES at BENCH, float32, B 32), each of the six statistics
  alone, in pairs, in threes and all six (and three more sets): per leaf the route, each
  ingredient's method, whether its gradients are kept for clipping, where they are formed
  (how many examples at once, their bytes) and whether inside a scan, from each file's
  `explain`, loaded as a module of its own.
- With --zoo A B: two digests of results/bench/neutral.py (--only zoo or --only bench), per
  case the route of every leaf (explain's text) and whether the first lines (the statistics'
  bytes; bench's compiled temporaries and optimized HLO) are equal.

    python results/readable/plans_ab.py BASE/pegrad.py pegrad.py [--families transformer]
    python results/readable/plans_ab.py --zoo zoo-before.json.gz zoo-after.json
"""

import argparse
import collections
import gzip
import itertools
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), HERE]

ALL = ("mean", "sq_mean", "sign_mean", "var", "sq_norms", "clipped_mean")
SETS = [s for r in (1, 2, 3, 6) for s in itertools.combinations(ALL, r)]
SETS += [ALL[:5], ALL[1:], ("mean", "sq_mean", "var", "clipped_mean")]
LEAF = re.compile(r"^(\S.*?) \(([\d, ]*)\): ([\w-]+) \(")


def bench(a: str, b: str, names: list[str]) -> None:
    import jax
    from runtime_ab import load

    import families

    mods = [load(a, "pegrad_a"), load(b, "pegrad_b")]

    def key(p: object) -> tuple:
        methods = tuple(sorted(p.methods.items()))  # type: ignore[attr-defined]
        return (p.route, methods, p.kept, p.formed, p.in_scan is not None)  # type: ignore[attr-defined]

    total = collections.Counter()
    for name in names or sorted(families.FAMILIES):
        fam, k = families.FAMILIES[name], jax.random.key(0)
        params, loss_fn = fam.build(families.BENCH, k)
        batch = fam.batch(families.BENCH, k, 32)
        n, differ = 0, collections.Counter()
        for stats in SETS:
            clip = 1.0 if "clipped_mean" in stats else None
            plans = [m.explain(loss_fn, params, batch, stats, clip_norm=clip) for m in mods]  # type: ignore[attr-defined]
            for p, q in zip(*plans, strict=True):
                n += 1
                if key(p) != key(q):
                    how = "methods/chunks" if p.route == q.route else f"{p.route} -> {q.route}"
                    differ[how] += 1
                    total[how] += 1
                    print(f"  {name} {'+'.join(stats)} {p.leaf}: {key(p)} -> {key(q)}")
        print(f"== {name}: {n} leaf plans, {differ.total()} differ {dict(differ)}", flush=True)
    print(f"== all: {total.total()} differ {dict(total)}")


def zoo(a: str, b: str) -> None:
    rows = []
    for path in (a, b):
        with gzip.open(path) if path.endswith(".gz") else open(path) as f:
            rows.append(json.load(f))
    same = values = 0
    routes = collections.Counter()
    cases = sorted(set(rows[0]) & set(rows[1]))
    for case in cases:
        (va, ta), (vb, tb) = ((r[case].split("\n", 1) + [""])[:2] for r in rows)
        ra, rb = ([m.group(3) for x in t.split("\n") if (m := LEAF.match(x))] for t in (ta, tb))
        changed = [f"{x} -> {y}" for x, y in zip(ra, rb, strict=True) if x != y]
        routes.update(changed)
        same += not changed
        values += va == vb
        if va != vb and not changed:
            print(f"  {case}: the same routes, the statistics' bytes differ")
    print(f"== {len(cases)} cases; the same routes in {same}, the same bytes in {values}")
    print(f"   leaf routes changed: {dict(routes)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--families", nargs="*", default=[])
    parser.add_argument("--zoo", action="store_true", help="a and b are zoo digests")
    args = parser.parse_args()
    zoo(args.a, args.b) if args.zoo else bench(args.a, args.b, args.families)


if __name__ == "__main__":
    main()
