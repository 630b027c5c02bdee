"""First-compile time of pegrad against plain grad, in one process (issue 57).

The README transformer (families "transformer" at BENCH: d 256, T 64, 4 blocks, float32), B 32:
for plain `jax.grad` of the mean loss and for `pegrad.value_and_grad_stats` (impl="factorized")
with each statistic set, a fresh function is traced, lowered and compiled (XLA:CPU), in
alternating rounds so that load on the machine falls on both alike. Each program's phases are
timed apart: trace (Python: pegrad's graph, planner and executor run here), lower (to
StableHLO) and compile (XLA). The ratio is pegrad's total over plain grad's, the median of the
rounds. `--vmap` adds impl="vmap"'s programs (the exact reference: what the statistics cost
XLA without the rewrite). `--profile` prints cProfile's top functions of pegrad's trace (where
its Python goes).
`--h200` compiles for an H200 instead, with no GPU (gpu_aot.py's deviceless target: the CUDA
plugin installed, JAX_PLATFORMS=cpu): the trace is the same Python, lower and compile XLA:GPU's.
`--tpu TOPOLOGY` compiles for one chip of a TPU topology the same way (libtpu installed:
`pip install "jax[tpu]"`), lower and compile XLA:TPU's.
Each program's size is printed beside its times (what compile time follows: XLA's time grows
with the program, not with one pass — results/readable/README.md): the traced equations (sub-
jaxprs included), the optimized HLO's instructions, and the kernels one step launches
(hlo_cost.py, as gpu_aot.py counts them).

    python results/bench/compile_time.py --rounds 3 --out results/bench/compile-time.json
    JAX_PLATFORMS=cpu python results/bench/compile_time.py --rounds 3 --h200
    JAX_PLATFORMS=cpu python results/bench/compile_time.py --rounds 3 --tpu v5p:2x2x1
"""

import argparse
import cProfile
import json
import os
import pstats
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..")]

import families  # noqa: E402
import hlo_cost  # noqa: E402
import pegrad  # noqa: E402

SETS = {"mean+sq_mean": ("mean", "sq_mean"), "clipped_mean+sq_norms": ("clipped_mean", "sq_norms")}


def programs(family: str, batch: int, h200: bool, tpu: str | None, vmap: bool) -> dict:
    fam = families.FAMILIES[family]
    key = jax.random.key(0)
    params, loss_fn = fam.build(families.BENCH, key)
    data = fam.batch(families.BENCH, key, batch)
    if h200 or tpu:  # abstract arguments placed on the deviceless H200 or one TPU chip
        from gpu_aot import TARGET
        from jax.experimental import topologies

        topology = (
            topologies.get_topology_desc(platform="tpu", topology_name=tpu)
            if tpu
            else topologies.get_topology_desc(
                platform="cuda", target_config=TARGET, topology="1x1x1"
            )
        )
        on = jax.sharding.SingleDeviceSharding(topology.devices[0])
        params, data = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), (params, data)
        )

    def plain() -> object:
        def mean_loss(p: object, b: object) -> jax.Array:
            return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0))(p, b))

        return jax.jit(jax.grad(mean_loss))

    def stats(names: tuple[str, ...], impl: pegrad.Impl = "factorized") -> object:
        def step(p: object, b: object) -> object:
            clip = 1.0 if "clipped_mean" in names else None
            return pegrad.value_and_grad_stats(loss_fn, names, clip_norm=clip, impl=impl)(p, b)

        return jax.jit(step)

    made = {"plain grad": plain} | {k: (lambda n=n: stats(n)) for k, n in SETS.items()}
    if vmap:
        made |= {f"{k} vmap": (lambda n=n: stats(n, "vmap")) for k, n in SETS.items()}
    return {"make": made, "args": (params, data)}


def phases(fn: object, args: tuple) -> tuple[dict[str, float], dict[str, int]]:
    """The seconds of each phase, and the size of what they made: the traced equations (sub-
    jaxprs included), the optimized HLO's instructions, and the kernels one step launches
    (hlo_cost.py's reading of it, loops by their trip counts)."""
    t0 = time.perf_counter()
    traced = fn.trace(*args)  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()

    def eqns(jaxpr: object) -> int:
        subs = lambda e: sum(eqns(s) for s in pegrad._sub_jaxprs(e))  # noqa: E731
        return sum(1 + subs(e) for e in jaxpr.eqns)  # type: ignore[attr-defined]

    text = compiled.as_text()
    size = {
        "equations": eqns(traced.jaxpr.jaxpr),
        "instructions": len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", text, re.M)),
        "kernels": hlo_cost.read_hlo(text).launches,
    }
    return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2, "total": t3 - t0}, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="transformer")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--h200", action="store_true", help="compile for an H200 (deviceless)")
    parser.add_argument("--tpu", metavar="TOPOLOGY", help="compile for one chip (libtpu)")
    parser.add_argument("--vmap", action="store_true", help='also impl="vmap"')
    parser.add_argument("--out")
    args = parser.parse_args()
    built = programs(args.family, args.batch, args.h200, args.tpu, args.vmap)
    make, call_args = built["make"], built["args"]
    phases(make["plain grad"](), call_args)  # warm JAX's own caches (not pegrad's)
    if args.profile:
        for name in SETS:  # (the rewrite's)
            prof = cProfile.Profile()
            prof.enable()
            make[name]().trace(*call_args)
            prof.disable()
            print(f"== {name}: trace profile")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in make}
    size: dict[str, dict[str, int]] = {}
    for r in range(args.rounds):
        for name in make:
            jax.clear_caches()
            times, size[name] = phases(make[name](), call_args)
            rows[name].append(times)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['total']:.2f}s" for k, v in rows.items()))
    median = {
        name: {ph: statistics.median(x[ph] for x in got) for ph in got[0]}
        for name, got in rows.items()
    }
    base = median["plain grad"]["total"]
    for name, m in median.items():
        parts = ", ".join(f"{ph} {m[ph]:.2f}s" for ph in ("trace", "lower", "compile"))
        print(f"{name:24s} {m['total']:.2f}s ({parts}) = {m['total'] / base:.2f}x plain grad")
        print(f"{'':24s} " + ", ".join(f"{v:,} {k}" for k, v in size[name].items()))
    if args.out:
        record = {
            "family": args.family,
            "batch": args.batch,
            "target": f"tpu {args.tpu}" if args.tpu else "h200" if args.h200 else "cpu",
            "jax": jax.__version__,
            "rounds": rows,
            "median": median,
            "ratio": {name: m["total"] / base for name, m in median.items()},
            "sizes": size,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
