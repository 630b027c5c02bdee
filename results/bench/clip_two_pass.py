"""Is a second, reweighted backward pass a cheaper clipped mean? (issue 17; not adopted)

The clipped mean (1/B) Σ_i c_i g_i, c_i = min(1, C/‖g_i‖), is formed by pegrad in one pass: each
leaf keeps what its route reads (for a dense layer δ_i and x_i) until every norm is known. The
alternative DP libraries call ghost clipping runs the norms first, then a second backward pass of
the loss reweighted per example, Σ_i c_i ℓ_i (exact where the gradient is linear in its seed).
This script measures both against plain grad on bench.py's MLP and three of its families (or
the families named on the command line, without the MLP):

    python results/bench/clip_two_pass.py > results/bench/clip-two-pass.md
    python results/bench/clip_two_pass.py transformer-scan transformer
"""

import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench  # noqa: E402
import pegrad  # noqa: E402

CLIP = 1.0
ROUNDS = 7


def programs(loss_fn):
    norms = pegrad.value_and_grad_stats(loss_fn, "sq_norms")
    reweighted = pegrad.value_and_grad_stats(lambda p, ex: ex[1] * loss_fn(p, ex[0]), "mean")

    def two_pass(params, batch):
        loss, stats = norms(params, batch)
        factors = jnp.minimum(1.0, CLIP / jnp.sqrt(stats["sq_norms"]))
        return loss, reweighted(params, (batch, factors))[1]["mean"]

    one_pass = pegrad.value_and_grad_stats(loss_fn, "clipped_mean", clip_norm=CLIP)
    return {
        "plain": bench.plain_value_and_grad(loss_fn),
        "one pass (pegrad)": lambda p, b: (lambda out: (out[0], out[1]["clipped_mean"]))(
            one_pass(p, b)
        ),
        "two passes": two_pass,
    }


def seconds(exe, args, n):
    jax.block_until_ready(exe(*args))
    start = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(exe(*args))
    return (time.perf_counter() - start) / n


def temp_bytes(exe) -> int:
    analysis = exe.memory_analysis()
    assert analysis is not None, "this backend gives no compiled memory analysis"
    return analysis.temp_size_in_bytes


def main():
    named = sys.argv[1:]
    config = bench.parse_config(["--families", *(named or ["transformer", "cnn", "gru"])])
    workloads = [] if named else [lambda: bench.mlp_workload(config, 128, "mlp", ["clipped_mean"])]
    workloads += bench.family_workloads(config)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; float32; C = {CLIP}; "
        f"time: median of {ROUNDS} paired ratios to plain grad; memory: compiled temp bytes\n"
    )
    print(
        "| model | B | one pass: time / memory | two passes: time / memory "
        "| two vs one, max rel. diff |"
    )
    print("|---|---|---|---|---|")
    for make in workloads:
        w = make()
        args = (w.params, w.batch)
        exes = {k: jax.jit(f).lower(*args).compile() for k, f in programs(w.loss_fn).items()}
        temp = {k: temp_bytes(e) for k, e in exes.items()}
        n = max(1, int(0.2 / seconds(exes["plain"], args, 1)))
        ratios = {k: [] for k in exes if k != "plain"}
        for _ in range(ROUNDS):
            for k in ratios:
                ratios[k].append(seconds(exes[k], args, n) / seconds(exes["plain"], args, n))
        one = jax.tree.leaves(exes["one pass (pegrad)"](*args)[1])
        two = jax.tree.leaves(exes["two passes"](*args)[1])
        diff = max(
            float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
            for a, b in zip(one, two, strict=True)
        )
        cells = [
            f"{statistics.median(ratios[k]):.2f} / {temp[k] / temp['plain']:.2f}" for k in ratios
        ]
        print(f"| {w.model} | {w.batch_size} | {' | '.join(cells)} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
