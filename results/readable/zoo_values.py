"""How far apart two commits' statistics are where neutral.py's zoo digest says their bytes differ.

For every model of tests/zoo.py at B 5 (example granularity, no mask, the cost model's routes)
and each statistic set of neutral.py, the statistics of `impl="factorized"` under jit, saved
with --out; --compare A B prints, per case whose values differ, the largest difference relative
to the statistic's largest magnitude, and the largest over all cases. Run once in each commit's
checkout (this script imports the pegrad.py of its own repository root):

    (cd BASE && python results/readable/zoo_values.py --out /tmp/base.npz)
    (cd AFTER && python results/readable/zoo_values.py --out /tmp/after.npz)
    python results/readable/zoo_values.py --compare /tmp/base.npz /tmp/after.npz
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
# first: neutral.py sets what its zoo digest runs under before JAX starts (the tests' XLA
# flags, float64, strict promotion, the repository root and tests/ on the path)
from neutral import STAT_SETS  # noqa: E402

# isort: split
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402


def values() -> dict[str, np.ndarray]:
    from zoo import MODELS

    import pegrad

    out = {}
    for model in MODELS:
        jax.clear_caches()
        params, loss = model.build(jax.random.key(0))
        batch = model.batch(jax.random.key(5), 5)
        for stats in STAT_SETS:
            clip = {"clip_norm": 0.5} if "clipped_mean" in stats else {}
            fn = pegrad.value_and_grad_stats(loss, stats, **clip)
            got = eqx.filter_jit(fn)(params, batch)[1]
            for name in stats:
                leaves = jax.tree_util.tree_leaves_with_path(got[name])
                for path, x in leaves:
                    key = f"{model.name} {'+'.join(stats)} {name}{jax.tree_util.keystr(path)}"
                    out[key] = np.asarray(x)
        print(model.name, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.out:
        np.savez_compressed(args.out, **values())
        return
    a, b = (np.load(p) for p in args.compare)
    worst, differ = 0.0, 0
    for key in a.files:
        x, y = a[key], b[key]
        if np.array_equal(x, y):
            continue
        differ += 1
        rel = float(np.max(np.abs(x - y)) / max(np.max(np.abs(x)), np.finfo(x.dtype).tiny))
        worst = max(worst, rel)
        print(f"{rel:.1e}  {key}")
    print(f"{len(a.files)} leaves, {differ} differ; largest relative difference {worst:.1e}")


if __name__ == "__main__":
    main()
