"""XLA:CPU run time of two commits' pegrad.py on bench's transformer families, in one process.

Each commit's pegrad.py is loaded as a module of its own (the file is copyable alone), the
same workload's factorized programs compiled from both, and their steps timed in alternation
(A, B, A, B, ...), so that load on the machine falls on both alike; the medians and their
ratio B / A are printed, with plain grad's for scale, and each program's compiled temporaries.

    python results/readable/runtime_ab.py BASE/pegrad.py AFTER/pegrad.py --families transformer
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..")]

import families  # noqa: E402


def load(path: str, name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--families", nargs="+", default=["transformer"])
    parser.add_argument("--stat-sets", nargs="+", default=["mean+sq_mean", "mean+var"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    mods = [load(args.a, "pegrad_a"), load(args.b, "pegrad_b")]
    for family in args.families:
        fam = families.FAMILIES[family]
        key = jax.random.key(0)
        params, loss_fn = fam.build(families.BENCH, key)
        data = fam.batch(families.BENCH, key, args.batch)

        def mean_loss(p: object, b: object, loss_fn: object = loss_fn) -> jax.Array:
            return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0))(p, b))

        plain = jax.jit(jax.grad(mean_loss)).lower(params, data).compile()
        for names in args.stat_sets:
            stats = tuple(names.split("+"))
            clip = 1.0 if "clipped_mean" in stats else None
            fns = [
                jax.jit(m.value_and_grad_stats(loss_fn, stats, clip_norm=clip))  # type: ignore[attr-defined]
                .lower(params, data)
                .compile()
                for m in mods
            ]
            times: list[list[float]] = [[], [], []]
            for _ in range(args.steps):
                for k, fn in enumerate([plain, *fns]):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(params, data))
                    times[k].append(time.perf_counter() - start)
            p, a, b = (statistics.median(t[1:]) for t in times)
            ta, tb = (f.memory_analysis().temp_size_in_bytes / 2**20 for f in fns)  # type: ignore[union-attr]
            print(
                f"{family} {names}: plain {p * 1e3:.0f} ms, A {a * 1e3:.0f} ms ({a / p:.2f}x), "
                f"B {b * 1e3:.0f} ms ({b / p:.2f}x), B / A {b / a:.3f}; "
                f"temporaries A {ta:.0f} MiB, B {tb:.0f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
