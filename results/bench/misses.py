"""The CPU targets of issue 38 that pegrad misses, measured against their floors.

1. The transformer's clipped mean, time <= vmap's. The one-pass clipped mean does plain grad's
   work (the weighted sums are plain grad's weight gradients, (c∘Δ)ᵀX) plus every example's
   norm (the Gram identity). XLA's cost analysis counts the flops of each program; bench.py's
   paired timing gives the ratios to plain grad and vmap's in the same run.
2. The MLP's variance, temporary memory <= 1.35x plain grad. The exact variance needs K = ÃᵀB̃,
   one weight-sized buffer (OuterProduct.compute). The probe forms the variance in row blocks
   of K instead (a monkeypatched OuterProduct.compute: `lax.map` over blocks, a `fori_loop`, or
   the blocks unrolled into in-place updates), checks it equals pegrad's, and reads the compiled
   memory.
3. The clipped mean of blocks in `lax.scan`, temporary memory 1.23x (target <= 1.1x): compiled
   memory beside the bytes of every layer's output gradients, which one pass keeps.

    python results/bench/misses.py            # writes results/bench/misses.json, prints tables
"""

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench  # noqa: E402
import pegrad  # noqa: E402

HERE = os.path.dirname(__file__)


def clipped_floor() -> list[dict[str, Any]]:
    config = bench.parse_config(
        ["--families", "transformer", "--family-impls", "factorized", "vmap"]
        + ["--family-stat-sets", "sq_norms", "clipped_mean"]
    )
    workload = bench.family_workloads(config)[0]()
    records = bench.measure(workload, config)
    args = (workload.params, workload.batch)
    for program, record in zip(workload.programs, records, strict=True):
        exe = jax.jit(program.build(workload.loss_fn, config.clip_norm)).lower(*args).compile()
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        assert cost is not None, "XLA gave no cost analysis"
        record["gflop"] = cost["flops"] / 1e9
    # plain grad's weight gradients: 2 flops per token for every entry of each dense weight
    tokens = config.family_batch * config.family_seq
    dense = sum(
        x.size
        for path, x in jax.tree_util.tree_leaves_with_path(workload.params)
        if x.ndim == 2 and "blocks" in jax.tree_util.keystr(path)
    )
    for record in records:
        record["weight_grad_gflop"] = 2.0 * tokens * dense / 1e9
    return records


def scanned_clipped() -> dict[str, Any]:
    """The clipped mean of blocks in lax.scan: compiled memory only, and the bytes of every
    block weight's output gradients stacked over layers ([L, B, T, out] in float32)."""
    config = bench.parse_config(
        ["--families", "transformer-scan", "--family-impls", "factorized"]
        + ["--family-stat-sets", "clipped_mean"]
    )
    workload = bench.family_workloads(config)[0]()
    args = (workload.params, workload.batch)
    temp = {}
    for program in workload.programs:
        exe = jax.jit(program.build(workload.loss_fn, config.clip_norm)).lower(*args).compile()
        memory = exe.memory_analysis()
        assert memory is not None, "XLA gave no memory analysis"
        temp[f"{program.stats} / {program.impl}"] = memory.temp_size_in_bytes / 2**20
    tokens = config.family_batch * config.family_seq
    stacked = [
        x.shape
        for path, x in jax.tree_util.tree_leaves_with_path(workload.params)
        if x.ndim == 3 and "blocks" in jax.tree_util.keystr(path)
    ]
    deltas = sum(layers * tokens * out * 4 for layers, out, _ in stacked) / 2**20
    return {"model": workload.model, "temp_mib": temp, "output_gradients_mib": deltas}


def _blocked_compute(blocks: int, how: str) -> Callable:
    """OuterProduct.compute with the variance formed `blocks` rows of K at a time, by `how`:
    "map" (`lax.map` over row blocks), "unrolled" (in-place updates), "fori" (`fori_loop`
    writing into a carry whose zeros depend on the layer, so that no two layers share them)."""
    original = pegrad.OuterProduct.compute

    def compute(self: Any, env: Any, what: str) -> jax.Array:
        if what != "var":
            return original(self, env, what)
        dtype, n = self.dtype, self.graph.n_units
        lc, rc, lb, rb = pegrad._dot_dims(self.core)
        a, b = pegrad._operands(self.core, env, dtype, tie=False)
        ua, ub = self.units
        A, B = pegrad._units_layout(a, lb, ua), pegrad._units_layout(b, rb, ub)
        A, B = pegrad._gauge(pegrad._merge01(A), pegrad._merge01(B))
        abar, bbar = jnp.mean(A, 0), jnp.mean(B, 0)
        Ac, Bc = A - abar, B - bbar
        s = 1.0 / (n - 1)
        Bq, sB, b_ = Bc * (Bc + 2.0 * bbar), jnp.sum(Bc * Bc, 0)[:, None, :], bbar[:, None, :]

        def outer(x: jax.Array, y: jax.Array) -> jax.Array:
            return jnp.einsum("unf,ung->nfg", x, y, preferred_element_type=dtype)

        def rows(part: tuple[jax.Array, jax.Array]) -> jax.Array:  # the same terms, some rows
            ac, ab = part
            kt, a_ = outer(ac * math.sqrt(s / n), Bc), ab[:, :, None]
            return jnp.abs(
                (a_ * a_ * s) * sB
                + (jnp.sum(ac * ac, 0) * s)[:, :, None] * (b_ * b_)
                + outer(ac * (ac + 2.0 * ab) * s, Bq)
                - (a_ * (2.0 * math.sqrt(n * s))) * b_ * kt
                - kt * kt
            )

        units, nb, f = Ac.shape
        k = blocks if f % blocks == 0 else 1  # the 10-class head: whole
        fb = f // k
        if how == "unrolled":
            total = jnp.zeros((nb, f, Bc.shape[-1]), dtype)
            for j in range(k):
                part = rows((Ac[..., j * fb : (j + 1) * fb], abar[..., j * fb : (j + 1) * fb]))
                total = jax.lax.dynamic_update_slice_in_dim(total, part, j * fb, 1)
        elif how == "fori":

            def body(j: jax.Array, total: jax.Array) -> jax.Array:
                ac = jax.lax.dynamic_slice_in_dim(Ac, j * fb, fb, 2)
                ab = jax.lax.dynamic_slice_in_dim(abar, j * fb, fb, 1)
                return jax.lax.dynamic_update_slice_in_dim(total, rows((ac, ab)), j * fb, 1)

            zeros = jnp.zeros((nb, f, Bc.shape[-1]), dtype) * abar[:, :1, None]
            total = jax.lax.fori_loop(0, k, body, zeros)
        else:
            parts = (
                Ac.reshape(units, nb, k, fb).transpose(2, 0, 1, 3),
                abar.reshape(nb, k, fb).transpose(1, 0, 2),
            )
            total = jax.lax.map(rows, parts).transpose(1, 0, 2, 3).reshape(nb, f, -1)
        shape = jax.eval_shape(
            lambda x, y: jax.lax.dot_general(x, y, ((lc, rc), (lb, rb))), a[0], b[0]
        )
        return total.reshape(shape.shape)

    return compute


def variance_blocks() -> list[dict[str, Any]]:
    config = bench.parse_config([])
    workload = bench.mlp_workload(config, config.mlp_batch, "mlp", ["var"])
    args = (workload.params, workload.batch)
    plain, var = (p for p in workload.programs if p.impl in ("plain", "factorized"))
    original = pegrad.OuterProduct.compute
    variants = [("plain grad", plain, None), ("pegrad (K whole)", var, None)]
    variants += [(f"lax.map, {k} blocks", var, (k, "map")) for k in (4, 16)]
    variants += [(f"fori_loop, zeros per layer, {k} blocks", var, (k, "fori")) for k in (4, 16)]
    variants += [(f"unrolled, {k} blocks", var, (k, "unrolled")) for k in (4, 16)]
    rows, reference = [], None
    for name, program, blocked in variants:
        pegrad.OuterProduct.compute = original if blocked is None else _blocked_compute(*blocked)
        try:
            exe = jax.jit(program.build(workload.loss_fn, config.clip_norm)).lower(*args).compile()
        finally:
            pegrad.OuterProduct.compute = original
        memory = exe.memory_analysis()
        assert memory is not None, "XLA gave no memory analysis"
        out = jax.block_until_ready(exe(*args))
        seconds = []
        for _ in range(7):
            start = time.perf_counter()
            jax.block_until_ready(exe(*args))
            seconds.append(time.perf_counter() - start)
        row = {
            "variant": name,
            "temp_mib": memory.temp_size_in_bytes / 2**20,
            "time_ms": 1e3 * statistics.median(seconds),
        }
        if program is var:
            got = out[1]["var"]
            reference = got if reference is None else reference
            row["max_rel_diff"] = max(
                float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
                for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True)
            )
        rows.append(row)
    return rows


def main() -> None:
    provenance = bench._provenance() | {"command": "python results/bench/misses.py"}
    out = {"provenance": provenance, "clipped": clipped_floor(), "var": variance_blocks()}
    out["scanned"] = scanned_clipped()
    with open(os.path.join(HERE, "misses.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("| program | time vs plain | temporary vs plain | GFLOP (XLA) |")
    print("|---|---|---|---|")
    for r in out["clipped"]:
        print(
            f"| {r['stats']} / {r['impl']} | {r['time_ratio']:.2f} | {r['memory_ratio']:.2f}"
            f" | {r['gflop']:.2f} |"
        )
    print(f"\nplain grad's weight gradients: {out['clipped'][0]['weight_grad_gflop']:.2f} GFLOP\n")
    base = out["var"][0]
    print("| MLP variance | temporary MiB | vs plain | time vs plain | max rel. diff to pegrad |")
    print("|---|---|---|---|---|")
    for r in out["var"]:
        diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else "—"
        print(
            f"| {r['variant']} | {r['temp_mib']:.2f} | {r['temp_mib'] / base['temp_mib']:.2f}"
            f" | {r['time_ms'] / base['time_ms']:.2f} | {diff} |"
        )
    scanned = out["scanned"]
    print(f"\n{scanned['model']}: temporary MiB {scanned['temp_mib']}")
    print(
        f"its blocks' output gradients, stacked over layers: {scanned['output_gradients_mib']} MiB"
    )


if __name__ == "__main__":
    main()
