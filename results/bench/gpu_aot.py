"""XLA:GPU's compiled temporary memory of bench.py's family programs, on a machine with no GPU.

JAX compiles for a GPU it does not have ("deviceless AOT"): with the CUDA plugin installed
(`pip install "jax[cuda12]"`) and JAX_PLATFORMS=cpu, a topology built from a target description
(`TARGET`, an H200's) gives a device whose sharding the abstract arguments carry, and
`jax.jit(f).lower(...).compile().memory_analysis()` is XLA:GPU's buffer assignment. Nothing
runs, and no autotuning happens (there is no card to time kernels on), so kernel choices can
differ from a real compile: on the transformer the real H200 gave 306 MiB where this gives 338.
Ratios are to plain grad's temporaries compiled the same way. With --gpt2: GPT-2 small (tied
head, T 1024) at B 8 (--gpt2-batch), every program's row as for the families, and each stat
set's plan (`pegrad.explain`: its fallback leaves and one contraction); with --gpt2 --gpt2-fit
instead the footprint at B 4 and 8, its line, and the largest B under 80 and 141 GiB (an H100's
and an H200's memory) on it. --chunk-sizes / --memory-budgets add each factorized program
compiled with the caller's bound; --tpu TOPOLOGY compiles for one chip of a TPU topology
(`pip install "jax[tpu]"`: libtpu), memory and kernels only.

Every row also carries the step time hlo_cost.py estimates from the optimized HLO (kernels,
loops by their trip counts, a roofline per kernel, the H200's fitted fixed costs) and its ratio
to plain grad's estimate. `--calibrate gpu.json --code DIR` compiles the programs of a measured
run with the bench.py, pegrad.py and models.py of the checkout DIR (the commit that was
measured), fits the fixed costs to the measured times and prints predicted against measured:
results/bench/gpu-time.md.

    JAX_PLATFORMS=cpu python results/bench/gpu_aot.py --families transformer mlp
    JAX_PLATFORMS=cpu python results/bench/gpu_aot.py --gpt2 --impls plain vmap factorized
    JAX_PLATFORMS=cpu python results/bench/gpu_aot.py --families transformer-scan \
        --impls factorized --chunk-sizes 16 8
    JAX_PLATFORMS=cpu python results/bench/gpu_aot.py --tpu v5p:2x2x1 --families transformer
    git worktree add /tmp/measured 7cc1926
    JAX_PLATFORMS=cpu python results/bench/gpu_aot.py --calibrate results/bench/gpu.json \
        --code /tmp/measured
"""

import argparse
import dataclasses
import importlib
import json
import os
import re
import statistics
import sys
import time
from typing import Any

import jax
from jax.experimental import topologies

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
sys.path.insert(0, REPO)
import hlo_cost  # noqa: E402

STAT_SETS = ["mean+sq_mean", "mean+var", "mean+sq_norms", "clipped_mean+sq_norms"]

TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 62914560
  clock_rate_ghz: 1.98 device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H200"
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["transformer", "mlp"])
    parser.add_argument("--stat-sets", nargs="+", default=STAT_SETS)
    parser.add_argument("--impls", nargs="+", default=["vmap", "factorized"])
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 small (tied head, T 1024)")
    parser.add_argument(
        "--tpu",
        default="",
        metavar="TOPOLOGY",
        help="compile for one chip of a TPU topology instead (e.g. v5e:2x2): memory and kernels, "
        "no time estimate (hlo_cost's card is the H200's)",
    )
    parser.add_argument("--gpt2-batch", type=int, default=8, help="GPT-2's batch size")
    parser.add_argument(
        "--gpt2-fit", action="store_true", help="GPT-2: the footprint at B 4 and 8, largest B"
    )
    parser.add_argument(
        "--chunk-sizes",
        nargs="+",
        type=int,
        default=[],
        help="also compile each factorized program with the caller's chunk_size, each of these",
    )
    parser.add_argument(
        "--memory-budgets",
        nargs="+",
        type=float,
        default=[],
        help="also compile each factorized program with memory_budget, each of these (MiB)",
    )
    parser.add_argument("--code", default=REPO, help="the checkout whose bench/pegrad compile")
    parser.add_argument("--calibrate", metavar="JSON", help="measured rows (bench.py --json)")
    parser.add_argument("--hlo-dir", default="", help="also write each program's HLO here")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.code))  # before REPO: the measured commit's files
    bench = importlib.import_module("bench")
    pegrad = importlib.import_module("pegrad")
    print(f"compiling {pegrad.__file__} and {bench.__file__}", flush=True)
    if args.tpu:  # needs libtpu (pip install "jax[tpu]"); one chip of the topology
        topology = topologies.get_topology_desc(platform="tpu", topology_name=args.tpu)
    else:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=TARGET, topology="1x1x1"
        )
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    if args.gpt2 and args.gpt2_fit:
        return gpt2_fit(bench, args, sharding)
    if args.gpt2:
        return gpt2(bench, pegrad, args, sharding)
    measured = []
    if args.calibrate:
        with open(args.calibrate) as f:
            measured = json.load(f)
        args.stat_sets = sorted({r["stats"] for r in measured if r["impl"] != "plain"})
    config = dataclasses.replace(
        bench.Config(),
        families=tuple(args.families),
        family_stat_sets=tuple(args.stat_sets),
        family_impls=tuple(args.impls),
    )
    rows: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    for make in bench.family_workloads(config):
        workload = make()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            (workload.params, workload.batch),
        )
        plain: dict[str, Any] = {}
        for program in workload.programs:
            for variant in variants(program, args):
                fn = build(pegrad, program, workload.loss_fn, *variant)
                row = compile_row(fn, abstract, workload.model, program, variant, args)
                plain = plain or row
                rows.append(row)
                print(table_row(row, plain), flush=True)
                save(rows, args.json)
    if measured:
        calibrate(rows, measured)


HEADER = (
    "| model | stats | impl | temp MiB | temp / plain | footprint GiB | launches | copies "
    "| loop its | GFLOP | roofline ms | est ms | est / plain | est / plain, bandwidth at "
    "roofline |\n" + "|---" * 14 + "|"
)


def variants(program: Any, args: argparse.Namespace) -> list[tuple[int | None, int | None]]:
    """(chunk_size, memory_budget in bytes) to compile `program` with: its own, then for a
    factorized program each of --chunk-sizes and --memory-budgets."""
    out: list[tuple[int | None, int | None]] = [(program.chunk_size, None)]
    if program.impl == "factorized":
        out += [(c, None) for c in args.chunk_sizes]
        out += [(None, int(m * 2**20)) for m in args.memory_budgets]
    return out


def build(pegrad: Any, program: Any, loss_fn: Any, chunk: int | None, budget: int | None) -> Any:
    """The program, or pegrad's with the caller's chunk_size / memory_budget."""
    if budget is None and chunk == program.chunk_size:
        return program.build(loss_fn, 1.0)
    names = tuple(program.stats.split("+"))
    return pegrad.value_and_grad_stats(
        loss_fn,
        names,
        impl="factorized",
        chunk_size=chunk,
        memory_budget=budget,
        clip_norm=1.0 if "clipped_mean" in names else None,
    )


def compile_row(
    fn: Any,
    abstract: Any,
    model: str,
    program: Any,
    variant: tuple[int | None, int | None],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Compile `fn` for the target; its memory, kernels and estimated time (hlo_cost.H200)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*abstract).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    assert memory is not None, "this JAX gives no compiled memory analysis"
    text = compiled.as_text() or ""
    chunk, budget = variant
    impl = program.impl + (f" chunk {chunk}" if chunk else "")
    impl += f" budget {budget / 2**20:g} MiB" if budget else ""
    if args.hlo_dir:
        slug = re.sub(r"[^A-Za-z0-9.+]+", "_", model.split(" (")[0]).strip("_")
        name = f"{slug}-{program.stats}-{impl.replace(' ', '_')}.hlo"
        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, name), "w") as f:
            f.write(text)
    read = hlo_cost.read_hlo(text)
    footprint = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    row = dict(model=model, stats=program.stats, impl=impl, chunk_size=chunk)
    row |= dict(memory_budget=budget, temp_bytes=memory.temp_size_in_bytes)
    row |= dict(footprint_bytes=footprint, compile_s=seconds, program=read)
    # At GPT-2's size kernels are not launch-bound: the fitted card prices bandwidth-bound
    # kernels at their launch alone (other_factor 0); this prices them at their roofline too.
    bandwidth = dataclasses.replace(hlo_cost.H200, other_factor=1.0)
    row |= dict(estimate_bw_ms=read.time_s(bandwidth) * 1e3)
    row |= read.summary(hlo_cost.H200)
    if args.tpu:  # kernels and flops only: the H200's fitted costs say nothing of a TPU
        # (nor its flops: XLA:TPU writes dots as convolutions the reader does not count right)
        row |= dict(target=f"TPU {args.tpu}", roofline_ms=None, estimate_ms=None)
        row |= dict(estimate_bw_ms=None, gflop=None, mbytes=None)
    return row


def table_row(row: dict[str, Any], plain: dict[str, Any]) -> str:
    cells = (row["model"].split(" (")[0], row["stats"], row["impl"])
    ratio = row["temp_bytes"] / plain["temp_bytes"] if plain["temp_bytes"] else float("nan")
    cells += (f"{row['temp_bytes'] / 2**20:.1f}", f"{ratio:.2f}")
    cells += (f"{row['footprint_bytes'] / 2**30:.2f}",)
    cells += (str(row["launches"]), str(row["copies"]), str(row["loop_iterations"]))
    if row["estimate_ms"] is None:
        cells += ("—",) * 5
    else:
        cells += (f"{row['gflop']:.1f}", f"{row['roofline_ms']:.2f}", f"{row['estimate_ms']:.2f}")
        cells += (f"{row['estimate_ms'] / plain['estimate_ms']:.2f}",)
        cells += (f"{row['estimate_bw_ms'] / plain['estimate_bw_ms']:.2f}",)
    return "| " + " | ".join(cells) + " |"


def save(rows: list[dict[str, Any]], path: str) -> None:
    """Every row so far (a killed run keeps them)."""
    if path:
        with open(path, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "program"} for r in rows], f, indent=1)


def calibrate(rows: list[dict[str, Any]], measured: list[dict[str, Any]]) -> None:
    """Fit the H200's fixed costs to the measured rows; print predicted against measured."""
    key = lambda r: (r["model"], r["stats"] if r["impl"] != "plain" else "mean", r["impl"])  # noqa: E731
    compiled = {key(r): r for r in rows}
    pairs = [(compiled[key(m)], m) for m in measured if key(m) in compiled]
    missing = [key(m) for m in measured if key(m) not in compiled]
    if missing:
        raise SystemExit(f"measured rows with no compiled program: {missing}")
    fit = hlo_cost.calibrate(
        [c["program"] for c, _ in pairs], [m["time_s"] for _, m in pairs], hlo_cost.H200
    )
    card = fit.card
    print(f"\nfitted: step {card.step_s * 1e6:.1f} us, launch {card.launch_s * 1e6:.2f} us, "
          f"loop iteration {card.loop_s * 1e6:.2f} us, dots {card.gemm_factor:.2f}x their "
          f"roofline, other kernels {card.other_factor:.2f}x\n")  # fmt: skip
    print("| model | stats | impl | launches | copies | loop its | GFLOP | roofline ms "
          "| measured ms | estimated ms | error | left-out error | measured / plain "
          "| estimated / plain |\n" + "|---" * 14 + "|")  # fmt: skip
    plain = {c["model"]: (c["program"].time_s(card), m["time_s"]) for c, m in pairs
             if c["impl"] == "plain"}  # fmt: skip
    for (c, m), err, loo in zip(pairs, fit.relative_errors, fit.loo_errors, strict=True):
        est = c["program"].time_s(card)
        cells = (c["model"].split(" (")[0], m["stats"], m["impl"], str(c["launches"]))
        cells += (str(c["copies"]), str(c["loop_iterations"]), f"{c['gflop']:.1f}")
        cells += (f"{c['program'].roofline_s(card) * 1e3:.3f}", f"{m['time_s'] * 1e3:.3f}")
        cells += (f"{est * 1e3:.3f}", f"{err:+.1%}", f"{loo:+.1%}")
        cells += (f"{m['time_s'] / plain[c['model']][1]:.2f}", f"{est / plain[c['model']][0]:.2f}")
        print("| " + " | ".join(cells) + " |")
    abs_err = [abs(e) for e in fit.relative_errors]
    abs_loo = [abs(e) for e in fit.loo_errors]
    print(f"\n|error|: mean {statistics.mean(abs_err):.1%}, max {max(abs_err):.1%}; "
          f"left out: mean {statistics.mean(abs_loo):.1%}, max {max(abs_loo):.1%}")  # fmt: skip
    agree = total = 0
    for i, (ci, mi) in enumerate(pairs):  # every pair of programs of one model
        for cj, mj in pairs[i + 1 :]:
            if ci["model"] != cj["model"]:
                continue
            total += 1
            same = (ci["program"].time_s(card) < cj["program"].time_s(card)) == (
                mi["time_s"] < mj["time_s"]
            )
            agree += same
            if not same:
                print(f"  ordered unlike the card: {key(mi)} {mi['time_s'] * 1e3:.2f} ms vs "
                      f"{key(mj)} {mj['time_s'] * 1e3:.2f} ms")  # fmt: skip
    print(f"pairs of one model's programs ordered as the card did: {agree} of {total}")
    groups = {(m["model"], m["stats"]) for _, m in pairs if m["impl"] != "plain"}
    same_winner = 0
    for model, stats in sorted(groups):
        both = {m["impl"]: (c["program"].time_s(card), m["time_s"]) for c, m in pairs
                if (m["model"], m["stats"]) == (model, stats)}  # fmt: skip
        if {"vmap", "factorized"} <= set(both):
            est_f = both["factorized"][0] < both["vmap"][0]
            meas_f = both["factorized"][1] < both["vmap"][1]
            same_winner += est_f == meas_f
    print(f"vmap against factorized, the faster one as on the card: {same_winner} of {len(groups)}")


def scale_fit(bench: Any) -> Any:
    """Where `scale_model` and the fit live: bench.py itself before issue 51 (a --code checkout
    of then), results/bench/scale_fit.py of the same checkout since."""
    if hasattr(bench, "scale_model"):
        return bench
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(bench.__file__)), "results", "bench")
    )
    return importlib.import_module("scale_fit")


def gpt2(bench: Any, pegrad: Any, args: argparse.Namespace, sharding: Any) -> None:
    """GPT-2 small at one batch (--gpt2-batch): plain, then each impl × stat set, as main's
    rows; then each factorized leaf's route (pegrad.explain)."""
    scale = scale_fit(bench)
    model = scale.scale_model(scale.Config(), "gpt2")
    put = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
    )
    abstract = (put(model.params), put(model.batch(args.gpt2_batch)))
    label = f"{model.name} B{args.gpt2_batch}"
    programs = [bench.Program("mean", "plain")]
    programs += [bench.Program(s, i) for i in args.impls if i != "plain" for s in args.stat_sets]
    rows: list[dict[str, Any]] = []
    plain: dict[str, Any] = {}
    target = f"XLA:TPU ({args.tpu}, one chip)" if args.tpu else "XLA:GPU (H200 target)"
    print(f"{label}, {target}\n\n{HEADER}", flush=True)
    for program in programs:
        for variant in variants(program, args):
            fn = build(pegrad, program, model.loss_fn, *variant)
            row = compile_row(fn, abstract, label, program, variant, args)
            plain = plain or row
            rows.append(row)
            print(table_row(row, plain) + f"  (compiled in {row['compile_s']:.0f} s)", flush=True)
            save(rows, args.json)
    if "factorized" in args.impls:
        for stats in args.stat_sets:
            names = tuple(stats.split("+"))
            clip = 1.0 if "clipped_mean" in names else None
            plan = pegrad.explain(model.loss_fn, *abstract, names, clip_norm=clip)
            # The summary, one contraction (12 × 6 alike) and every leaf not fully factorized.
            shown = [p for p in plan if p.status != "factorized" or p.route == "row-scatter"]
            shown += [p for p in plan if p.route == "contraction"][:1]
            print(f"\nexplain, {stats}: {plan.summary}", flush=True)
            print("\n".join(map(str, shown)), flush=True)


def gpt2_fit(bench: Any, args: argparse.Namespace, sharding: jax.sharding.Sharding) -> None:
    scale = scale_fit(bench)
    model = scale.scale_model(scale.Config(), "gpt2")
    put = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
    )
    placed = dataclasses.replace(
        model, params=put(model.params), batch=lambda b: put(model.batch(b))
    )
    programs = [bench.Program("mean", "plain")]
    programs += [bench.Program(s, i) for i in args.impls for s in args.stat_sets]
    print(f"{model.name}, XLA:GPU (H200 target), footprint in GiB\n")
    print("| stats | impl | B 8 | GiB / example | fixed | largest B, 80 GiB | largest B, 141 GiB |")
    print("|---|---|---|---|---|---|---|")
    for program in programs:
        feet = [
            (b, scale.compile_memory(program, placed, b, 1.0)["footprint_bytes"] / 2**30)
            for b in (4, 8)
        ]
        fixed, slope = scale.affine_fit(feet)
        fits = [str(scale.largest_batch(fixed, slope, budget)) for budget in (80, 141)]
        row = (program.stats, program.impl, f"{feet[1][1]:.2f}", f"{slope:.3f}", f"{fixed:.2f}")
        print("| " + " | ".join((*row, *fits)) + " |", flush=True)


if __name__ == "__main__":
    main()
