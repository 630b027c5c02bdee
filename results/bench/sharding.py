"""What a batch sharded over devices costs: collective bytes and per-device memory, compiled.

Every program is jit-compiled with the batch sharded over the mesh axis "data" (P("data")) on
simulated CPU devices (XLA's host platform device count, set here before JAX starts), the
parameters replicated or, with --fsdp, split as train.py's `--param-sharding fsdp` splits them
(each leaf along its longest axis the device count divides). Read off XLA's optimized HLO:
the bytes every all-reduce, all-gather, collective-permute, all-to-all and reduce-scatter
returns per device, in multiples of the parameters' bytes, and the per-device temporaries
(XLA's memory analysis), against the same program compiled for one device. Plain grad (the
mean loss's `jax.grad`, one all-reduce of the parameters: its "ideal" is 1), vmap and
factorized per statistic set, each beside its ideal: one all-reduce of the parameters per
parameter-shaped statistic (mean + sq_mean 2, mean + var 2, clipped_mean 1), none for the [N]
statistics. `gram` pairs examples across devices by nature: every device needs every other
device's factors or gradients, so its all-gathers are reported, not held to an ideal.

    python results/bench/sharding.py --out results/bench/sharding       # the committed table
    python results/bench/sharding.py --families mlp --batch 16 --sets mean,var   # one row

Writes OUT.json (every row) and OUT.md (the table, with the command and commit).
"""

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Any, cast

DEVICES = int(os.environ.get("PEGRAD_SHARDING_DEVICES", "8"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
sys.path[:0] = [REPO]

import families  # noqa: E402
import pegrad  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}
_BYTES |= {"s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """(count, bytes) per collective of an optimized HLO module: the bytes of the arrays each
    returns on one device (a tuple's elements added)."""
    found = {name: (0, 0) for name in COLLECTIVES}
    for line in hlo.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        shape, name = match.groups()
        size = sum(
            _BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
            for t, dims in _ARRAY.findall(shape)
        )
        count, total = found[name]
        found[name] = (count + 1, total + size)
    return found


def fsdp_spec(shape: tuple[int, ...], n: int) -> P:
    """train.py's FSDP split: the longest axis n divides (the first of equals), else whole."""
    fits = [size if size % n == 0 else 0 for size in shape]
    if n == 1 or not any(fits):
        return P()
    axis = fits.index(max(fits))
    return P(*["data" if i == axis else None for i in range(len(shape))])


IDEAL = {"mean": 1, "sq_mean": 1, "sign_mean": 1, "var": 1, "clipped_mean": 1}


def ideal(stats: tuple[str, ...]) -> int:
    return sum(IDEAL.get(s, 0) for s in stats)


def program(family: str, size: families.Size, batch: int, stats: tuple[str, ...], impl: str):
    params, loss_fn = families.FAMILIES[family].build(size, jax.random.key(0))
    data = families.FAMILIES[family].batch(size, jax.random.key(1), batch)
    if stats == ("plain",):

        def fn(p, b):
            return jax.value_and_grad(lambda q: jnp.mean(jax.vmap(loss_fn, (None, 0))(q, b)))(p)

    else:
        clip = 1.0 if "clipped_mean" in stats else None
        fn = pegrad.value_and_grad_stats(
            loss_fn, stats, impl=cast(pegrad.Impl, impl), clip_norm=clip
        )
    return fn, params, data


def compiled(fn, params, data, devices: list, fsdp: bool):
    mesh = Mesh(np.array(devices), ("data",))
    n = len(devices)
    spec = lambda x: NamedSharding(mesh, P("data", *[None] * (np.ndim(x) - 1)))  # noqa: E731
    p_spec = lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), n) if fsdp else P())  # noqa: E731
    data = jax.device_put(data, jax.tree.map(spec, data))
    params = jax.device_put(params, jax.tree.map(p_spec, params))
    return jax.jit(fn).lower(params, data).compile()


def measure(
    family: str, size: families.Size, batch: int, stats: tuple[str, ...], impl: str, fsdp: bool
) -> dict:
    fn, params, data = program(family, size, batch, stats, impl)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    start = time.perf_counter()
    many = compiled(fn, params, data, jax.devices(), fsdp)
    one = compiled(fn, params, data, jax.devices()[:1], fsdp)
    found = collectives(str(many.as_text()))
    memory: Any = many.memory_analysis(), one.memory_analysis()
    return {
        "family": family,
        "batch": batch,
        "params": "fsdp" if fsdp else "replicated",
        "stats": "+".join(stats),
        "impl": "plain" if stats == ("plain",) else impl,
        "param_bytes": param_bytes,
        "ideal": 1 if stats == ("plain",) else ideal(stats),
        "devices": len(jax.devices()),
        **{f"{name}_count": found[name][0] for name in COLLECTIVES},
        **{f"{name}_x": found[name][1] / param_bytes for name in COLLECTIVES},
        "temp_bytes": memory[0].temp_size_in_bytes,
        "temp_bytes_one_device": memory[1].temp_size_in_bytes,
        "compile_s": time.perf_counter() - start,
    }


def train_step(how: str, impl: str, devices: list) -> dict:
    """train.py's default step (its Config's defaults: the mini transformer, B 32, MicroAdam,
    the statistics it asks pegrad for) compiled as train.py jits it (`train.jit_step`), on a
    mesh of `devices`, parameters `how` ("replicated" or "fsdp")."""
    import train
    import trainkit

    cfg = train.Config(impl=cast(Any, impl), param_sharding=cast(Any, how), out="/dev/null")
    mesh = Mesh(np.array(devices), ("data",))
    run = train.build(cfg)
    tree = {"params": run.task.params, "opt_state": run.opt.init(run.task.params)}
    shardings = trainkit.placement(tree, mesh, cfg.param_sharding)
    tree = trainkit.place(tree, shardings)
    batch = trainkit.make_sampler(run.task, mesh)(run.task.train_data, key=run.train_key)
    step = train.jit_step(run, mesh, shardings)
    return step.lower(tree["params"], tree["opt_state"], batch).compile(), run.task.params


def measure_train(how: str, impl: str) -> dict:
    many, params = train_step(how, impl, jax.devices())
    one, _ = train_step(how, impl, jax.devices()[:1])
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    found = collectives(str(many.as_text()))
    memory: Any = many.memory_analysis(), one.memory_analysis()
    return {
        "family": "train.py default",
        "batch": 32,
        "params": how,
        "stats": "its step",
        "impl": impl,
        "param_bytes": param_bytes,
        "ideal": 2,
        "devices": len(jax.devices()),
        **{f"{name}_count": found[name][0] for name in COLLECTIVES},
        **{f"{name}_x": found[name][1] / param_bytes for name in COLLECTIVES},
        "temp_bytes": memory[0].temp_size_in_bytes,
        "temp_bytes_one_device": memory[1].temp_size_in_bytes,
    }


SETS = ["mean,sq_mean", "mean,var", "clipped_mean,sq_norms", "sq_norms", "mean,gram"]


def table(rows: list[dict]) -> str:
    head = (
        "| family | B | params | statistics | impl | all-reduce (ideal) | all-gather | "
        "permute | all-to-all | reduce-scatter | temp / device (1 device) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    line = (
        "| {family} | {batch} | {params} | {stats} | {impl} | {ar:.2f}× in {arn} ({ideal}) | "
        "{ag:.2f}× | {cp:.2f}× | {aa:.2f}× | {rs:.2f}× | {t:.3g} MB ({t1:.3g}) |"
    )
    return head + "\n".join(
        line.format(
            **r,
            ar=r["all-reduce_x"],
            arn=r["all-reduce_count"],
            ag=r["all-gather_x"],
            cp=r["collective-permute_x"],
            aa=r["all-to-all_x"],
            rs=r["reduce-scatter_x"],
            t=r["temp_bytes"] / 1e6,
            t1=r["temp_bytes_one_device"] / 1e6,
        )
        for r in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=str(__doc__).split("\n\n")[0])
    parser.add_argument("--families", default="mlp,transformer,transformer-scan,gqa-rope")
    parser.add_argument("--batch", default="16,64", help="batch sizes, comma-separated")
    parser.add_argument("--sets", default=";".join(SETS), help="statistic sets, ';'-separated")
    parser.add_argument("--impls", default="factorized,vmap")
    parser.add_argument("--fsdp", action="store_true", help="also with FSDP parameters")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=None, help="OUT.json and OUT.md")
    parser.add_argument("--train", action="store_true", help="also train.py's default step")
    args = parser.parse_args()
    size = families.Size(width=args.width, seq=args.seq, layers=args.layers, dtype="float32")
    rows = []
    placements = [False, True] if args.fsdp else [False]
    for how in ["replicated", "fsdp"] if args.train else []:
        for impl in args.impls.split(","):
            rows.append(measure_train(how, impl))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    for family in args.families.split(",") if args.families else []:
        for batch in [int(b) for b in args.batch.split(",")]:
            for fsdp in placements:
                jobs = [(("plain",), "plain")] + [
                    (tuple(s.split(",")), impl)
                    for s in args.sets.split(";")
                    for impl in args.impls.split(",")
                ]
                for stats, impl in jobs:
                    row = measure(family, size, batch, stats, impl, fsdp)
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
    if args.out:
        import json

        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
        command = "python results/bench/sharding.py " + " ".join(sys.argv[1:])
        with open(args.out + ".json", "w") as f:
            json.dump({"command": command, "commit": commit, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"`{command}` at {commit}, {DEVICES} simulated CPU devices, ")
            f.write(f"{size.shape} float32; bytes per device in multiples of the parameters'.\n\n")
            f.write(table(rows) + "\n")


if __name__ == "__main__":
    main()
