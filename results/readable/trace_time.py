"""pegrad's trace and lowering time alone on the README transformer (families "transformer" at
BENCH, float32, B 32), for the checkout `--code` (default: this one), so that two engines can
be compared in alternating processes: mean + sq_mean and clipped_mean + sq_norms, 3 rounds.

    python results/readable/trace_time.py --code /tmp/other-checkout
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--code", default=os.path.join(os.path.dirname(__file__), "..", ".."))
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
sys.path[:0] = [os.path.abspath(args.code)]

import jax  # noqa: E402

import families  # noqa: E402
import pegrad  # noqa: E402

fam = families.FAMILIES["transformer"]
key = jax.random.key(0)
params, loss_fn = fam.build(families.BENCH, key)
data = fam.batch(families.BENCH, key, 32)
out = []
for names in [("mean", "sq_mean"), ("clipped_mean", "sq_norms")] * args.rounds:
    clip = 1.0 if "clipped_mean" in names else None
    step = lambda p, b, n=names, c=clip: pegrad.value_and_grad_stats(loss_fn, n, clip_norm=c)(p, b)  # noqa: E731
    start = time.perf_counter()
    traced = jax.jit(step).trace(params, data)
    middle = time.perf_counter()
    traced.lower()
    out.append(
        f"{'+'.join(names)} trace {middle - start:.2f} lower {time.perf_counter() - middle:.2f}"
    )
print(os.path.abspath(pegrad.__file__), " | ".join(out))
