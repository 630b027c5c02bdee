"""How long XLA:CPU takes to compile and run three of the zoo's test programs (every statistic,
float64, B 5) under the tests' flags with and without the new fusion emitters, each flag set in
a fresh process (tests/conftest.py's choice; results/ci/README.md).

    python results/ci/compile_flags.py
"""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
CASES = [
    ("linen_gpt", "vmap", 2, "cheapest"),
    ("linen_gpt", "factorized", None, "first"),
    ("eqx_conv", "factorized", 2, "first"),
]


def measure() -> float:
    """Seconds to compile and run CASES' programs in this process."""
    sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "tests")]
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    import helpers
    import zoo

    import pegrad

    total = 0.0
    for name, impl, chunk, choose in CASES:
        model = next(m for m in zoo.MODELS if m.name == name)
        params, loss = model.build(jax.random.key(0))
        batch = model.batch(jax.random.key(5), 5)
        fn = pegrad.value_and_grad_stats(
            loss, pegrad.STATISTICS, impl=impl, chunk_size=chunk, clip_norm=0.5, choose=choose
        )
        args = (params, batch)
        probe = helpers.probe_like(params)
        lowered = jax.jit(fn).trace(*args, dot_with=probe).lower()
        start = time.perf_counter()
        jax.block_until_ready(lowered.compile()(*args, dot_with=probe))
        total += time.perf_counter() - start
    return total


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        print(measure())
    else:
        for extra in ["", " --xla_cpu_use_fusion_emitters=false"] * 2:
            env = {**os.environ, "XLA_FLAGS": BASE + extra, "JAX_PLATFORMS": "cpu"}
            cmd = [sys.executable, __file__, "--measure"]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            print(f"{BASE + extra}: {float(out.stdout.split()[-1]):.2f} s")
