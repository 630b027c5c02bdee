"""What logging B_P costs train.py: its default config's jitted step (micro_adam, the byte-level
LM) with the preconditioned noise scale (`train.adam_preconditioner` feeding `train.diagnostics`)
and without it (the preconditioner replaced by None, what a sign-family run gets), compared by
XLA's cost analysis of the two compiled programs (flops, bytes accessed, temporaries) and by time:
ROUNDS rounds alternating the two, STEPS steps each on the same state and batch, per-step time
median and minimum over the rounds. On a shared CPU the rounds spread by ±15 %: read the ratio of
medians against that spread, and the compiled bytes as the cost that does not jitter.

    python results/bench/noise_scale_p_cost.py            # ~2 minutes on 2 cores
"""

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train  # noqa: E402

ROUNDS, STEPS = 15, 20


def main() -> None:
    cfg = train.Config()
    run = train.build(cfg)
    params, state = run.task.params, run.opt.init(run.task.params)
    batch = run.task.sample(run.task.train_data, key=jax.random.fold_in(run.train_key, 0))
    original = train.adam_preconditioner
    steps: dict[str, Any] = {}
    for mode in ("with", "without"):
        train.adam_preconditioner = original if mode == "with" else (lambda *a, **k: None)
        step = jax.jit(train.make_step(cfg, run.task, run.opt))
        compiled = step.lower(params, state, batch).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        temp = compiled.memory_analysis().temp_size_in_bytes  # pyright: ignore[reportOptionalMemberAccess]
        print(
            f"{mode:8s} flops {cost['flops']:.4g}  bytes accessed {cost['bytes accessed']:.4g}  "
            f"temporaries {temp / 1e6:.2f} MB"
        )
        assert ("trace_cov_p" in step(params, state, batch)[3]) == (mode == "with")
        steps[mode] = step
    train.adam_preconditioner = original
    for _ in range(5):  # past step 0 (v̂ defined), both programs warm
        params, state, *_ = steps["with"](params, state, batch)
    times: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(ROUNDS):
        for mode in ("with", "without") if r % 2 else ("without", "with"):
            jax.block_until_ready(steps[mode](params, state, batch))
            start = time.perf_counter()
            for _ in range(STEPS):
                out = steps[mode](params, state, batch)
            jax.block_until_ready(out)
            times[mode].append((time.perf_counter() - start) / STEPS * 1e3)
    for mode, t in times.items():
        spread = [round(x, 1) for x in t]
        print(f"{mode:8s} median {statistics.median(t):.2f} ms  min {min(t):.2f} ms  {spread}")
    median = statistics.median(times["with"]) / statistics.median(times["without"])
    least = min(times["with"]) / min(times["without"])
    print(f"with / without: median {median:.3f}, min {least:.3f}")


if __name__ == "__main__":
    main()
