"""Is a change to pegrad.py's engine neutral? A digest of what it does, to compare two commits.

For every model of tests/zoo.py (float64) and every statistic set below, at B 5 (and B 2
for the token granularity of the sequence models), with and without a mask, with
nonfinite="drop", and with choose="first" (every route a leaf proves then runs):
`pegrad.explain`'s text and the SHA-256 of the statistics' bytes (jit, impl="factorized").
For bench.py's transformer families (float32, the README's cost table): each factorized
program's route summary, its compiled XLA:CPU temporaries and the SHA-256 of its optimized
HLO. Two commits are neutral when the two digests are equal (results/bench/neutral.md).

--only costs: the README's cost table (issue 51's registry move) — bench.py's MLP and every
family at the bench size (float32), plain grad and mean, mean + sq_mean under factorized and
vmap: the SHA-256 of each model's parameters and batch (the same model and data are built),
each program's XLA:CPU compiled temporaries and footprint, and each factorized program's
`pegrad.explain` text; and the scale fit's ResNet-18 (GroupNorm and none, 64×64 images, B 2,
shapes only): its label, every parameter's path, shape and dtype, plain grad's and two factorized
programs' compiled memory and their `explain` text (results/bench/registry-neutral.md).

    python results/bench/neutral.py --only zoo --out zoo-before.json     # at the base commit
    python results/bench/neutral.py --only bench --out bench-before.json
    ... the same after the change, then
    python results/bench/neutral.py --compare zoo-before.json zoo-after.json
    python results/bench/neutral.py --only costs --out costs-before.json

--anonymous blanks the optimized HLO's instruction names before hashing (bench): two programs
that differ only in how XLA numbered their instructions (an operand order that compiles away)
then digest alike. Compare two digests taken with the same flag.

(--only zoo compiles with the tests' XLA flags, which only speed compilation up: both sides
alike.)
"""

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

# the tests' flags, which compile in a fraction: for the zoo, and where zoo_values.py imports this
if __name__ != "__main__" or "--only" in sys.argv and "zoo" in sys.argv:
    os.environ.setdefault(
        "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

STAT_SETS = [  # every ingredient and phase: the mean alone, norms alone (Grams), the variance,
    ("mean",),  # clipping (after the norms), all six together
    ("sq_norms",),
    ("mean", "var"),
    ("clipped_mean", "sq_norms"),
    ("mean", "sq_mean", "sign_mean", "var", "sq_norms", "clipped_mean"),
]
FAMILIES = ["transformer", "transformer-scan", "gqa-rope", "transformer-stacked", "flax-gpt",
            "flax-gpt-scan", "named-axis"]  # fmt: skip


def digest(tree: object) -> str:
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        a = np.asarray(x)
        h.update(f"{jax.tree_util.keystr(path)}{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def zoo_rows(rows: dict[str, str], save: Callable[[], None]) -> dict[str, str]:
    from zoo import MODELS

    import pegrad

    for model in MODELS:
        jax.clear_caches()  # hundreds of programs: their executables would pile up
        save()
        params, loss = model.build(jax.random.key(0))
        for b, granularity in [(5, "example"), *([(2, "token")] if model.sequence else [])]:
            batch = model.batch(jax.random.key(b), b)
            mask = jnp.arange(b) != 1
            for stats in STAT_SETS:
                cases: list[tuple[str, dict[str, Any], Any]] = [("plain", {}, None)]
                cases += [("first", {"choose": "first"}, None)]
                if granularity == "example":
                    cases += [("mask", {}, mask), ("drop", {"nonfinite": "drop"}, None)]
                for label, options, m in cases:
                    key = f"{model.name} B{b} {granularity} {'+'.join(stats)} {label}"
                    if key in rows:  # from the run this one resumes
                        continue
                    options = {**options, "granularity": granularity}
                    clip: dict[str, Any] = {"clip_norm": 0.5} if "clipped_mean" in stats else {}
                    planned = {k: v for k, v in options.items() if k != "nonfinite"}
                    try:
                        fn = pegrad.value_and_grad_stats(loss, stats, **options, **clip)
                        out = digest(eqx.filter_jit(fn)(params, batch, m))
                    except Exception as error:  # a refusal is part of the behaviour
                        out = f"raised {type(error).__name__}: {error}"
                    try:
                        plan = pegrad.explain(loss, params, batch, stats, **planned, **clip)
                    except Exception as error:
                        plan = f"raised {type(error).__name__}: {error}"
                    rows[key] = f"{out}\n{plan}"
                print(key, rows[key].split("\n")[0], flush=True)
    return rows


def bench_rows(anonymous: bool = False) -> dict[str, str]:
    import bench
    import pegrad

    jax.config.update("jax_enable_x64", False)
    config = dataclasses.replace(
        bench.Config(),
        families=tuple(FAMILIES),
        family_stat_sets=("mean+sq_mean", "mean+var", "mean+sq_norms", "clipped_mean+sq_norms"),
        family_impls=("factorized",),
    )
    rows = {}
    for make in bench.family_workloads(config):
        workload = make()
        for program in workload.programs:
            if program.impl != "factorized":
                continue
            key = f"{workload.model} {program.stats}"
            stats = tuple(program.stats.split("+"))
            clip: dict[str, Any] = {"clip_norm": 1.0} if "clipped_mean" in stats else {}
            plan = pegrad.explain(workload.loss_fn, workload.params, workload.batch, stats, **clip)
            compiled = (
                jax.jit(program.build(workload.loss_fn, 1.0))
                .lower(workload.params, workload.batch)
                .compile()
            )
            memory = compiled.memory_analysis()
            # the program without its debug information: each op's metadata (source lines of
            # pegrad.py, op names) and the module's tables of files, functions and frames
            text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text() or "")
            first = min(i for i in (text.find("\n%"), text.find("\nENTRY")) if i >= 0)
            text = text.split("\n", 1)[0] + text[first:]
            if anonymous:  # the same program whatever its instructions are named
                text = re.sub(r"%[\w.\-]+", "%v", text)
            hlo = hashlib.sha256(text.encode()).hexdigest()[:16]
            temp = getattr(memory, "temp_size_in_bytes", None)
            rows[key] = f"temp {temp} hlo {hlo}\n{plan}"
            print(key, rows[key].split("\n")[0], flush=True)
    return rows


def costs_rows(rows: dict[str, str], save: Callable[[], None]) -> dict[str, str]:
    import bench
    import pegrad

    jax.config.update("jax_enable_x64", False)
    jax.config.update("jax_numpy_dtype_promotion", "standard")  # bench.py's setting
    print(f"compiling {bench.__file__} and {pegrad.__file__}", flush=True)
    stat_sets = ("mean", "mean+sq_mean")
    config = dataclasses.replace(
        bench.Config(),
        impls=("vmap", "factorized"),
        family_stat_sets=stat_sets,
        family_impls=("vmap", "factorized"),
    )
    makers = [lambda: bench.mlp_workload(config, config.mlp_batch, "mlp", list(stat_sets))]
    for make in makers + list(bench.family_workloads(config)):
        jax.clear_caches()
        workload = make()
        data = f"params {digest(workload.params)} batch {digest(workload.batch)}"
        rows[f"{workload.model} data"] = data
        print(workload.model, data, flush=True)
        for program in workload.programs:
            if program.impl == "hand-written":
                continue
            key = f"{workload.model} {program.stats} {program.impl}"
            if key in rows:  # from the run this one resumes
                continue
            args = (workload.params, workload.batch)
            compiled = jax.jit(program.build(workload.loss_fn, 1.0)).lower(*args).compile()
            memory = compiled.memory_analysis()
            temp = getattr(memory, "temp_size_in_bytes", None)
            out = getattr(memory, "output_size_in_bytes", None)
            arg = getattr(memory, "argument_size_in_bytes", None)
            rows[key] = f"temp {temp} argument {arg} output {out}"
            if program.impl == "factorized":
                stats = tuple(program.stats.split("+"))
                rows[key] += "\n" + str(pegrad.explain(workload.loss_fn, *args, stats))
            print(key, rows[key].split("\n")[0], flush=True)
            save()
    return rows | resnet_rows()


def resnet_rows() -> dict[str, str]:
    """The scale fit's ResNet-18: bench.py's "scale" section before issue 51, scale_fit.py's
    since (beside this file)."""
    import bench
    import pegrad

    scale: Any = bench if hasattr(bench, "scale_model") else __import__("scale_fit")
    rows = {}
    for norm in ("group", "none"):
        config = dataclasses.replace(scale.Config(), scale_image=64, scale_norm=norm)
        model = scale.scale_model(config, "resnet18")
        leaves = jax.tree_util.tree_leaves_with_path(model.params)
        shapes = [f"{jax.tree_util.keystr(p)} {x.shape} {x.dtype}" for p, x in leaves]
        rows[f"resnet18 {norm} model"] = "\n".join([model.name, *shapes])
        for stats, impl in [("mean", "plain"), ("mean+sq_mean", "factorized"),
                            ("clipped_mean+sq_norms", "factorized")]:  # fmt: skip
            program = bench.Program(stats, impl)
            memory = scale.compile_memory(program, model, 2, 1.0)
            key = f"resnet18 {norm} B2 {stats} {impl}"
            rows[key] = f"temp {memory['temp_bytes']} footprint {memory['footprint_bytes']}"
            if impl == "factorized":
                names = tuple(stats.split("+"))
                clip = 1.0 if "clipped_mean" in names else None
                plan = pegrad.explain(model.loss_fn, model.params, model.batch(2), names,
                                      clip_norm=clip)  # fmt: skip
                rows[key] += f"\n{plan}"
            print(key, rows[key].split("\n")[0], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", help="write the digest here (JSON)")
    parser.add_argument("--only", choices=["zoo", "bench", "costs"], help="one half")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument(
        "--anonymous", action="store_true", help="bench: the HLO's instruction names blanked"
    )
    args = parser.parse_args()
    if args.compare:
        opener = lambda p: gzip.open(p, "rt") if p.endswith(".gz") else open(p)  # noqa: E731, SIM115
        before, after = (json.loads(opener(p).read()) for p in args.compare)
        both = before.keys() & after.keys()
        print(f"{len(both)} cases in both; only before: {len(before.keys() - both)}, only after: "
              f"{len(after.keys() - both)}")  # fmt: skip
        differ = sorted(k for k in both if before[k] != after[k])
        for k in differ:
            print(f"DIFFERS {k}\n  before: {before.get(k)}\n  after:  {after.get(k)}")
        print(f"{len(before)} and {len(after)} cases; {len(differ)} differ")
        raise SystemExit(1 if differ else 0)
    rows = {}
    if os.path.exists(args.out):  # a run to resume
        with open(args.out) as f:
            rows = json.load(f)

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=0, sort_keys=True)

    if args.only == "costs":
        rows |= costs_rows(rows, save)
    if args.only in (None, "zoo"):
        zoo_rows(rows, save)
    if args.only in (None, "bench"):
        rows |= bench_rows(args.anonymous)
    save()


if __name__ == "__main__":
    main()
