"""`_sum0` (pegrad's sum over the examples) four ways, for the first compile and the run time.

The README transformer (families "transformer" at BENCH: d 256, T 64, 4 blocks, float32), B 32,
mean + sq_mean and clipped_mean + sq_norms (impl="factorized"), with pegrad's `_sum0` replaced
at trace time by:
- "pairs": pegrad's own (up to 32 slices added pairwise; longer axes a dot with ones);
- "small": one reduction for a tensor of at most 2¹⁵ entries (a bias's rows), pairs otherwise;
- "halves": x zero-padded to a power of two, then x[:h] + x[h:] until one row (log₂ B steps);
- "sum": one reduction, jnp.sum(x, 0).
Each round traces, lowers and compiles plain grad and the variants (--variants) (jax.clear_caches()
between), then runs each compiled program 5 times (the fastest is reported). Same process,
alternating, so that load falls on all alike; ratios only on a loaded machine.

    python results/readable/sum0_variants.py --rounds 1 --out results/readable/sum0-variants.json
    python results/readable/sum0_variants.py --rounds 3 --variants pairs small
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "bench")]

import compile_time  # noqa: E402  # pyright: ignore[reportMissingImports]

import pegrad  # noqa: E402

PAIRS = pegrad._sum0


def halves(x: jax.Array) -> jax.Array:
    if pegrad._devices(x) > 1 or x.shape[0] == 0:
        return PAIRS(x)
    size = 1 << (x.shape[0] - 1).bit_length()
    x = jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        x = x[:h] + x[h:]
    return x[0]


def small(x: jax.Array) -> jax.Array:
    return jnp.sum(x, 0) if x.size <= 2**15 else PAIRS(x)


VARIANTS = {"pairs": PAIRS, "small": small, "halves": halves, "sum": lambda x: jnp.sum(x, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    built = compile_time.programs("transformer", 32)
    make, call = built["make"], built["args"]
    rows = []
    for r in range(args.rounds):
        programs = [("plain grad", "plain grad", PAIRS)]
        programs += [(s, v, VARIANTS[v]) for s in compile_time.SETS for v in args.variants]
        for stats, name, variant in programs:
            pegrad._sum0 = variant
            jax.clear_caches()
            t0 = time.perf_counter()
            lowered = make[stats]().trace(*call)
            lowered = lowered.lower()
            ops = lowered.as_text().count("\n")
            compiled = lowered.compile()
            seconds = time.perf_counter() - t0
            jax.block_until_ready(compiled(*call))
            runs = []
            for _ in range(5):
                t = time.perf_counter()
                jax.block_until_ready(compiled(*call))
                runs.append(time.perf_counter() - t)
            row = {"round": r, "stats": stats, "program": name, "compile_s": seconds,
                   "run_s": min(runs), "stablehlo_lines": ops}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    pegrad._sum0 = PAIRS
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
