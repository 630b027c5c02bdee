"""XLA:GPU's compiled temporary memory of bench.py's family programs, on a machine with no GPU.

JAX compiles for a GPU it does not have ("deviceless AOT"): with the CUDA plugin installed
(`pip install "jax[cuda12]"`) and JAX_PLATFORMS=cpu, a topology built from a target description
(`TARGET`, an H200's) gives a device whose sharding the abstract arguments carry, and
`jax.jit(f).lower(...).compile().memory_analysis()` is XLA:GPU's buffer assignment. Nothing
runs, and no autotuning happens (there is no card to time kernels on), so kernel choices can
differ from a real compile: on the transformer the real H200 gave 306 MiB where this gives 338.
Ratios are to plain grad's temporaries compiled the same way. With --gpt2: GPT-2 small (tied
head, T 1024) at B 4 and 8, the footprint's line through them, and the largest B under 80 and
141 GiB (an H100's and an H200's memory) on that line.

    JAX_PLATFORMS=cpu python results/bench/gpu_aot.py --families transformer mlp
    JAX_PLATFORMS=cpu python results/bench/gpu_aot.py --gpt2
"""

import argparse
import dataclasses
import os
import sys

import jax
from jax.experimental import topologies

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench  # noqa: E402

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
    parser.add_argument("--families", nargs="+", default=list(bench.FAMILIES))
    parser.add_argument(
        "--stat-sets",
        nargs="+",
        default=["mean+sq_mean", "mean+var", "mean+sq_norms", "clipped_mean+sq_norms"],
    )
    parser.add_argument("--impls", nargs="+", default=["vmap", "factorized"])
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 small's largest batch")
    args = parser.parse_args()
    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGET, topology="1x1x1")
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    if args.gpt2:
        return gpt2(args, sharding)
    config = dataclasses.replace(
        bench.Config(),
        families=tuple(args.families),
        family_stat_sets=tuple(args.stat_sets),
        family_impls=tuple(args.impls),
    )
    print("| model | stats | impl | temp MiB | temp / plain |\n|---|---|---|---|---|")
    for make in bench.family_workloads(config):
        workload = make()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            (workload.params, workload.batch),
        )
        plain = None
        for program in workload.programs:
            fn = jax.jit(program.build(workload.loss_fn, 1.0))
            memory = fn.lower(*abstract).compile().memory_analysis()
            assert memory is not None, "this JAX gives no compiled memory analysis"
            temp = memory.temp_size_in_bytes
            plain = plain or temp
            row = (workload.model, program.stats, program.impl, f"{temp / 2**20:.1f}")
            print("| " + " | ".join(row) + f" | {temp / plain:.2f} |", flush=True)


def gpt2(args: argparse.Namespace, sharding: jax.sharding.Sharding) -> None:
    model = bench.scale_model(bench.Config(), "gpt2")
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
            (b, bench.compile_memory(program, placed, b, 1.0)["footprint_bytes"] / 2**30)
            for b in (4, 8)
        ]
        fixed, slope = bench.affine_fit(feet)
        fits = [str(bench.largest_batch(fixed, slope, budget)) for budget in (80, 141)]
        row = (program.stats, program.impl, f"{feet[1][1]:.2f}", f"{slope:.3f}", f"{fixed:.2f}")
        print("| " + " | ".join((*row, *fits)) + " |", flush=True)


if __name__ == "__main__":
    main()
