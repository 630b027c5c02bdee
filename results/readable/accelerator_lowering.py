"""Do two pegrad.py files lower the same programs for a GPU and a TPU? (issue 57)

Each file is loaded as a module of its own (pegrad.py is copyable alone); for bench's
families (families.FAMILIES at BENCH, float32, B 32) and four statistic sets, each program
is traced once per file and lowered for "cuda", "tpu" and "cpu" (`lowering_platforms`: no
device and no plugin needed). Prints, per program and platform, whether the two StableHLO
texts are equal, source locations stripped. Equal StableHLO is the same program XLA compiles
(results/bench/gpu_aot.py compiles it for the H200 target).

    python results/readable/accelerator_lowering.py BASE/pegrad.py AFTER/pegrad.py
"""

import argparse
import importlib.util
import os
import re
import sys
from typing import Any

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "bench")]

import families  # noqa: E402

SETS = [("mean", "sq_mean"), ("clipped_mean", "sq_norms"), ("mean", "var"), ("sign_mean",)]


def load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--families", nargs="+", default=["transformer", "transformer-scan", "mlp"])
    args = parser.parse_args()
    engines = [load(args.a, "pegrad_a"), load(args.b, "pegrad_b")]
    for name in args.families:
        fam, key = families.FAMILIES[name], jax.random.key(0)
        params, loss_fn = fam.build(families.BENCH, key)
        batch = fam.batch(families.BENCH, key, 32)
        for stats in SETS:
            clip = 1.0 if "clipped_mean" in stats else None
            traced = [
                jax.jit(pg.value_and_grad_stats(loss_fn, stats, clip_norm=clip)).trace(
                    params, batch
                )
                for pg in engines
            ]
            for platform in ("cuda", "tpu", "cpu"):
                texts = [
                    re.sub(
                        r"#loc.*|loc\([^)]*\)",
                        "",
                        t.lower(lowering_platforms=(platform,)).as_text(),
                    )
                    for t in traced
                ]
                same = "equal" if texts[0] == texts[1] else "differ"
                lines = "/".join(str(t.count("\n")) for t in texts)
                print(f"{name} {'+'.join(stats)} {platform}: {same} ({lines} lines)", flush=True)


if __name__ == "__main__":
    main()
