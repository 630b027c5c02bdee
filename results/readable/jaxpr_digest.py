"""Is an edit of pegrad.py's code neutral to the bit? The traced programs and plans over the zoo.

For every model of tests/zoo.py (MODELS; with --families also its FAMILIES), at B 5 (and B 2 at
token granularity for the sequence models), ten statistic sets, plain, choose="first", a mask,
nonfinite="drop" and chunk_size=2: the text of `jax.make_jaxpr` of `value_and_grad_stats` and
of `pegrad.explain` (object addresses blanked). Two checkouts are neutral when every row is
equal: the same operations traced in the same order, the same plans. Stricter than
results/bench/neutral.py's digests (which compare compiled programs and the statistics' bytes),
and blind to lowering (a primitive's per-platform rules: use neutral.py and gpu_aot.py there).
Run from inside each checkout (cwd and PYTHONPATH the checkout), then compare:

    cd A && PYTHONPATH=. python results/readable/jaxpr_digest.py /tmp/a.json --families
    cd B && PYTHONPATH=. python results/readable/jaxpr_digest.py /tmp/b.json --families
    python results/readable/jaxpr_digest.py --compare /tmp/a.json /tmp/b.json
"""

import json
import os
import re
import sys

if len(sys.argv) == 4 and sys.argv[1] == "--compare":
    a, b = ({}, {})
    for into, path in zip((a, b), sys.argv[2:], strict=True):
        with open(path) as f:
            into.update(json.load(f))
    both = a.keys() & b.keys()
    differ = sorted(k for k in both if a[k] != b[k])
    for k in differ[:20]:
        print("DIFFERS", k)
    print(
        f"{len(a)} vs {len(b)} keys, {len(both)} in both, {len(differ)} differ, "
        f"only-a {len(a.keys() - both)}, only-b {len(b.keys() - both)}"
    )
    raise SystemExit(1 if differ or a.keys() != b.keys() else 0)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
REPO = os.getcwd()
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import jax.numpy as jnp  # noqa: E402

import pegrad  # noqa: E402

assert os.path.dirname(os.path.abspath(pegrad.__file__)) == REPO, pegrad.__file__
from zoo import FAMILIES, MODELS  # noqa: E402  # pyright: ignore[reportMissingImports]

STAT_SETS = [
    ("mean",),
    ("mean", "sq_mean"),
    ("clipped_mean", "sq_norms"),
    ("mean", "var"),
    ("sign_mean",),
    ("sq_norms",),
    ("dot",),
    ("gram",),
    ("mean", "sq_mean", "sign_mean", "var", "sq_norms", "clipped_mean"),
    ("mean", "var", "sq_norms", "clipped_mean", "dot", "gram"),
]
ADDR = re.compile(r" at 0x[0-9a-f]+")


def clean(s: str) -> str:
    return ADDR.sub(" at 0x?", s)


out_path = sys.argv[1]
models = (
    list(FAMILIES)
    if "--families-only" in sys.argv
    else list(MODELS) + (list(FAMILIES) if "--families" in sys.argv else [])
)
rows: dict[str, str] = {}
for model in models:
    jax.clear_caches()
    params, loss = model.build(jax.random.key(0))
    for b, granularity in [(5, "example"), *([(2, "token")] if model.sequence else [])]:
        batch = model.batch(jax.random.key(b), b)
        mask = jnp.arange(b) != 1
        for stats in STAT_SETS:
            cases = [("plain", {}, None), ("first", {"choose": "first"}, None)]
            if granularity == "example":
                cases += [("mask", {}, mask), ("drop", {"nonfinite": "drop"}, None),
                          ("chunk2", {"chunk_size": 2}, None)]  # fmt: skip
            for label, options, m in cases:
                key = f"{model.name} B{b} {granularity} {'+'.join(stats)} {label}"
                options = {**options, "granularity": granularity}
                if "clipped_mean" in stats:
                    options["clip_norm"] = 1.0
                planned = {k: v for k, v in options.items() if k != "nonfinite"}
                kw = {"dot_with": params} if "dot" in stats else {}
                try:
                    fn = pegrad.value_and_grad_stats(loss, stats, **options)
                    jaxpr = str(
                        jax.make_jaxpr(lambda p, x, mk, fn=fn, kw=kw: fn(p, x, mk, **kw))(
                            params, batch, m
                        )
                    )
                except Exception as error:
                    jaxpr = f"raised {type(error).__name__}: {error}"
                try:
                    plan = str(pegrad.explain(loss, params, batch, stats, **planned))
                except Exception as error:
                    plan = f"raised {type(error).__name__}: {error}"
                rows[key] = clean(f"{jaxpr}\n=== plan ===\n{plan}")
    print(model.name, len(rows), flush=True)
with open(out_path, "w") as f:
    json.dump(rows, f, indent=0, sort_keys=True)
print("wrote", len(rows), "rows to", out_path)
