"""How large a batch fits: GPT-2 small and a ResNet-18 compiled, never run (issue 38).

GPT-2 small (12 blocks, d 768, T 1024, vocabulary 50257, tied head: 124M) and a ResNet-18
(`ResNet18`: GroupNorm in place of BatchNorm) on 224×224×3 images, as shapes only
(`eqx.filter_eval_shape`: nothing model-sized is allocated, nothing runs): plain grad, each of
`scale_stat_sets` under pegrad's factorized, vmap and vmap-chunked, optax's micro_grad and
jax-privacy's `clipped_grad` (where installed) at the microbatch with the smallest footprint.
Each program's footprint (XLA:CPU's `memory_analysis()`: arguments + outputs + temporaries −
aliased bytes) is compiled at `scale_batches` and fitted affine in B; the largest B under each of
`scale_budgets_gib` is predicted, then compiled there to check it (`fit_budgets`). Writes
`scale_out`.md/.json (command, commit) after every program; one model per command merges into
the same files, and hand-written notes below "## Notes" in the .md survive a rewrite:

    python results/bench/scale_fit.py --scale-models gpt2 --scale-batches 4 8
    python results/bench/scale_fit.py --scale-models resnet18 --scale-batches 8 32
    python results/bench/scale_fit.py --help          # every option, from `Config` below

(Until issue 51 this was bench.py's "scale" section: `python bench.py --sections scale` with the
same --scale-* flags, as results/bench/scale.md's older runs record.) The programs are bench.py's
(`bench.Program`); results/bench/gpu_aot.py compiles `scale_model` for an H200 or a TPU.
tests/test_bench.py checks the fit and the largest batch on constructed numbers, and the whole
machinery on a tiny MLP.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jaxtyping import Array, Float, PyTree  # noqa: E402

import bench  # noqa: E402
import families  # noqa: E402
import models  # noqa: E402
import pegrad  # noqa: E402
from bench import PLAIN, Program, Record, _footprint, _label  # noqa: E402

SCRIPT = "results/bench/scale_fit.py"  # the command and the file a record's provenance names
SCALE_MODELS = ("gpt2", "resnet18")
SCALE_IMPLS = ("plain", "factorized", "micro_grad", "jax-privacy", "vmap-chunked", "vmap")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the scale fit compiles. Each field is a flag: `scale_seq` is --scale-seq."""

    seed: int = 0  # the (abstract) parameters' key
    clip_norm: float = 1.0  # C of "clipped_mean"
    scale_models: tuple[str, ...] = SCALE_MODELS  # which models
    scale_stat_sets: tuple[str, ...] = (  # statistic sets, names joined by "+"
        "mean+sq_mean",
        "mean+var",
        "mean+sq_norms",
        "clipped_mean+sq_norms",
    )
    scale_impls: tuple[str, ...] = SCALE_IMPLS  # programs ("plain": plain grad)
    scale_batches: tuple[int, ...] = (2, 4)  # batch sizes the footprint's affine fit reads
    scale_budgets_gib: tuple[float, ...] = (16.0, 40.0, 80.0)  # the largest B that fits each
    scale_verify: bool = True  # compile at each predicted largest B (no: the prediction only)
    scale_unverified: tuple[str, ...] = ()  # implementations whose largest B is predicted only
    scale_chunk_size: int = 1  # examples per chunk of "vmap-chunked" (fixed in B)
    scale_microbatches: tuple[int, ...] = (1, 2)  # micro_grad / jax-privacy: the best is kept
    scale_layers: int = 12  # gpt2 blocks (12: GPT-2 small)
    scale_seq: int = 1024  # gpt2 sequence length
    scale_image: int = 224  # resnet18 image side (3 channels)
    scale_norm: str = "group"  # resnet18 normalization: "group" (GroupNorm, 32 groups) or "none"
    scale_out: str = "results/bench/scale"  # writes PATH.md and PATH.json ("": do not)


@dataclasses.dataclass(frozen=True)
class ScaleModel:
    name: str  # e.g. "gpt2-small d768 L12 T1024 V50257, tied head (124M)"
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]]
    params: PyTree  # jax.ShapeDtypeStruct leaves: nothing model-sized is allocated
    batch: Callable[[int], PyTree]  # B -> the batch's shapes


def scale_model(config: Config, name: str) -> ScaleModel:
    """A model of the "scale" section, as shapes only (`eqx.filter_eval_shape`)."""
    key = jax.random.key(config.seed)
    if name == "gpt2":
        lm = models.TransformerConfig.paper(
            n_layers=config.scale_layers, context_length=config.scale_seq
        )
        model = eqx.filter_eval_shape(models.TransformerLM, lm, key=key)
        loss: Callable = models.lm_loss
        seq = config.scale_seq

        def batch(b: int) -> PyTree:
            tokens = jax.ShapeDtypeStruct((b, seq), jnp.int32)
            return (tokens, tokens)

        head = "tied head" if lm.tied_head else "separate head"
        label = f"gpt2-small d{lm.d_model} L{lm.n_layers} T{seq} V{lm.vocab_size}, {head}"
    elif name == "resnet18":
        model = eqx.filter_eval_shape(families.ResNet18, 1000, config.scale_norm, key=key)
        side = config.scale_image

        loss = families._classify_loss

        def batch(b: int) -> PyTree:
            images = jax.ShapeDtypeStruct((b, 3, side, side), jnp.float32)
            return (images, jax.ShapeDtypeStruct((b,), jnp.int32))

        norm = "GroupNorm(32)" if config.scale_norm == "group" else "no normalization"
        label = f"resnet18 {side}x{side}x3, 1000 classes, {norm}"
    else:
        raise ValueError(f"unknown scale model {name!r}; choose from {SCALE_MODELS}")
    params, static = eqx.partition(model, bench._is_float_leaf)
    n = models.count_params(model)
    return ScaleModel(f"{label} ({n / 1e6:.0f}M)", models.make_loss_fn(static, loss), params, batch)


def compile_memory(program: Program, model: ScaleModel, b: int, clip_norm: float) -> Record:
    """Compile `program` at batch size `b` (shapes only): temp and footprint bytes, seconds."""
    start = time.perf_counter()
    fn = jax.jit(program.build(model.loss_fn, clip_norm))
    memory = fn.lower(model.params, model.batch(b)).compile().memory_analysis()
    if memory is None:
        raise RuntimeError("this backend gives no compiled memory analysis")
    return {
        "B": b,
        "microbatch": program.microbatch,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "footprint_bytes": _footprint(memory),
        "compile_s": time.perf_counter() - start,
    }


def affine_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y ≈ intercept + slope·x through (x, y) points."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise ValueError(f"an affine fit needs two distinct batch sizes, got {xs}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope /= sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def largest_batch(intercept: float, slope: float, budget: float, multiple: int = 1) -> int | None:
    """The largest multiple of `multiple` B with intercept + slope·B ≤ budget (0: not even
    one); None where the footprint does not grow with B (slope ≤ 0) and fits at all B."""
    if slope <= 0:
        return None if intercept <= budget else 0
    b = math.floor((budget - intercept) / slope + 1e-9)  # + 1e-9: a fit's rounding
    return max(0, b - b % multiple)


def fit_budgets(
    measure: Callable[[int], int],
    points: Sequence[tuple[int, int]],
    budgets: Sequence[float],
    *,
    multiple: int = 1,
    verify: bool = True,
    tries: int = 3,
) -> list[Record]:
    """Per budget (bytes, in the order given): the largest B (a multiple of `multiple`) that the
    line through the two measured (B, footprint) points nearest the budget predicts — from
    `points` and every compile made here, so a larger budget is predicted from the smaller
    ones' checks — and, with `verify`, `measure(B)` (the compiled footprint) at it. Over the
    budget, the line through that point lowers B; under it, B rises to what that line predicts
    (XLA's buffer assignment at small B can sit off the line of large B); the largest B
    compiled within the budget is kept, at most `tries` compiles per budget."""
    known = dict(points)

    def predict(budget: float, anchor: int | None = None) -> tuple[float, float, int | None]:
        """Through `anchor` (the B just compiled) and the point nearest the budget, or else the
        two nearest points."""
        order = sorted(known.items(), key=lambda p: (abs(p[1] - budget), -p[0]))
        if anchor is not None:
            order = [(anchor, known[anchor])] + [p for p in order if p[0] != anchor]
        intercept, slope = affine_fit(order[:2])
        return intercept, slope, largest_batch(intercept, slope, budget, multiple)

    out = []
    for budget in budgets:
        intercept, slope, b = predict(budget)
        row: Record = {
            "budget_bytes": budget,
            "predicted_B": b,
            "B": b,
            "footprint_bytes": None,
            "predicted_bytes": None if b is None else intercept + slope * b,
            "fits": None,
            "compiles": 0,
        }
        out.append(row)
        best: tuple[int, int] | None = None  # the largest B compiled within the budget
        while verify and b is not None and b > 0 and row["compiles"] < tries:
            footprint = known[b] = measure(b)
            row.update(B=b, footprint_bytes=footprint, compiles=row["compiles"] + 1, fits=False)
            if footprint <= budget and (best is None or b > best[0]):
                best = (b, footprint)
            after = predict(budget, anchor=b)[2]  # through this point and its nearest
            if footprint <= budget:  # below the line: try the larger B it now predicts
                if after is None or after <= b:
                    break
                b = after
            else:
                b = b - multiple if after is None else min(b - multiple, after)
                if best is not None and b <= best[0]:
                    break
        if best is not None:
            row.update(B=best[0], footprint_bytes=best[1], fits=True)
    return out


def scale_programs(config: Config) -> list[Program]:
    """Plain grad, then each implementation of `config.scale_impls` on each statistic set, in
    the order of SCALE_IMPLS (the peers' microbatch is chosen when measured)."""
    variants = {
        "factorized": Program("", "factorized"),
        "vmap": Program("", "vmap"),
        "vmap-chunked": Program("", "vmap-chunked", chunk_size=config.scale_chunk_size),
        "micro_grad": Program("", "micro_grad"),
        "jax-privacy": Program("", "jax-privacy"),
    }
    out = [Program("mean", PLAIN)] if PLAIN in config.scale_impls else []
    for impl in (i for i in SCALE_IMPLS[1:] if i in config.scale_impls):
        for stats in config.scale_stat_sets:
            names = set(stats.split("+"))
            if impl == "jax-privacy" and not (
                {"clipped_mean"} <= names <= {"clipped_mean", "sq_norms"}
            ):
                continue  # clipped_grad computes the clipped mean only
            out.append(dataclasses.replace(variants[impl], stats=stats))
    return out


def scale_rows(
    model: ScaleModel,
    programs: Sequence[Program],
    config: Config,
    done: Callable[[list[Record]], None] = lambda rows: None,
) -> list[Record]:
    """One record per program: its compiled memory at each of `config.scale_batches`, the affine
    fit, and the largest B under each budget (verified by compiling there); `done(rows)` after
    each program."""
    batches = sorted(set(config.scale_batches))
    reference = batches[-1]
    budgets = [g * 2**30 for g in config.scale_budgets_gib]
    rows = []
    for program in programs:
        row: Record = {
            "model": model.name,
            "stats": program.stats,
            "impl": program.impl,
            "chunk_size": program.chunk_size,
            "microbatch": None,
            "points": [],
            "intercept_bytes": None,
            "slope_bytes": None,
            "budgets": [],
            "note": "",
        }
        rows.append(row)
        cache: dict[int, Record] = {}
        extra, extra_s = 0, 0.0  # the microbatches tried and not kept

        chosen = [program]  # the program as measured (the peers: at the microbatch kept)

        def at(b: int, chosen: list[Program] = chosen, cache: dict[int, Record] = cache) -> Record:
            if b not in cache:
                cache[b] = compile_memory(chosen[0], model, b, config.clip_norm)
                print(
                    f"  {_label(chosen[0]):40s} B={b:<8d} footprint "
                    f"{cache[b]['footprint_bytes'] / 2**30:8.2f} GiB, "
                    f"compiled in {cache[b]['compile_s']:5.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            return cache[b]

        try:
            if program.impl in ("micro_grad", "jax-privacy"):  # the memory-best microbatch
                tried = {}
                for mb in (m for m in config.scale_microbatches if reference % m == 0):
                    candidate = dataclasses.replace(program, microbatch=mb)
                    tried[mb] = compile_memory(candidate, model, reference, config.clip_norm)
                if not tried:
                    raise ValueError(f"no microbatch in {config.scale_microbatches} divides B")
                mb = min(tried, key=lambda m: (tried[m]["footprint_bytes"], -m))
                program = chosen[0] = dataclasses.replace(program, microbatch=mb)
                cache[reference] = tried[mb]
                extra = len(tried) - 1
                extra_s = sum(r["compile_s"] for m, r in tried.items() if m != mb)
                row["microbatch"] = mb
                row["microbatch_tried"] = {m: r["footprint_bytes"] for m, r in tried.items()}
                if any(b % mb for b in batches):
                    raise ValueError(f"microbatch {mb} does not divide every B of {batches}")
            row["points"] = [at(b) for b in batches]
        except ValueError as error:  # refused for this model (pegrad, or a peer)
            row["note"] = f"not available: {str(error).splitlines()[0]}"
            print(f"  {_label(program):40s} not available", file=sys.stderr)
            done(rows)
            continue
        points = [(p["B"], p["footprint_bytes"]) for p in row["points"]]
        row["intercept_bytes"], row["slope_bytes"] = affine_fit(points)
        multiple = row["microbatch"] or 1
        verify = config.scale_verify and program.impl not in config.scale_unverified
        measure = lambda b, at=at: at(b)["footprint_bytes"]  # noqa: E731
        row["budgets"] = fit_budgets(measure, points, budgets, multiple=multiple, verify=verify)
        row["compiled"] = sorted(cache.values(), key=lambda r: r["B"])  # every B compiled
        row["compile_s"] = sum(r["compile_s"] for r in cache.values()) + extra_s
        row["compiles"] = len(cache) + extra
        done(rows)
    return rows


def run_scale(config: Config) -> list[Record]:
    """The "scale" section: every model of `config.scale_models`, one run each, written to
    `config.scale_out` (.json, .md) after every program; other runs (model, command) in that
    JSON are kept (a model's programs may come from several commands)."""
    rows: list[Record] = []
    for name in config.scale_models:
        start = time.perf_counter()
        model = scale_model(config, name)
        print(f"scale: {model.name}", file=sys.stderr, flush=True)
        meta = {
            **bench._provenance(SCRIPT),
            "model": model.name,
            "config": dataclasses.asdict(config),
        }

        def save(
            mine: list[Record], finished: bool = False, meta: Record = meta, start: float = start
        ) -> None:
            meta.update(seconds=time.perf_counter() - start, finished=finished)
            if config.scale_out:
                write_scale(config.scale_out, {"meta": meta, "rows": mine})

        mine = scale_rows(model, scale_programs(config), config, save)
        save(mine, finished=True)
        rows += mine
    if config.scale_out:
        with open(config.scale_out + ".md") as f:
            print(f.read(), flush=True)
    return rows


def _run_key(run: Record) -> tuple[str, str]:
    return run["meta"]["model"], run["meta"]["command"]


NOTES = "\n## Notes"  # PATH.md from this heading on is written by hand: every rewrite keeps it


def _scale_text(path: str, runs: list[Record]) -> str:
    """PATH.md's text: the tables from `runs`, then PATH.md's own hand-written notes, if any."""
    notes = ""
    if os.path.exists(path + ".md"):
        with open(path + ".md") as f:
            old = f.read()
        notes = old[old.index(NOTES) :] if NOTES in old else ""
    return scale_markdown(runs).rstrip("\n") + "\n" + notes if notes else scale_markdown(runs)


def rewrite_scale_markdown(path: str) -> None:
    """PATH.md again from PATH.json (after a change to the table's layout, or runs stopped)."""
    with open(path + ".json") as f:
        runs = json.load(f)["runs"]
    text = _scale_text(path, runs)
    with open(path + ".md", "w") as f:
        f.write(text)


def write_scale(path: str, run: Record) -> None:
    """Put `run` into PATH.json in place of any run of the same model and command; PATH.md
    from them all (each file replaced whole: two runs may write beside each other)."""
    runs: list[Record] = []
    if os.path.exists(path + ".json"):
        with open(path + ".json") as f:
            runs = json.load(f)["runs"]
    runs = [r for r in runs if _run_key(r) != _run_key(run)] + [run]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for suffix, text in ((".json", json.dumps({"runs": runs}, indent=1)), (".md", None)):
        text = _scale_text(path, runs) if text is None else text
        with open(f"{path}{suffix}.{os.getpid()}", "w") as f:
            f.write(text)
        os.replace(f"{path}{suffix}.{os.getpid()}", path + suffix)  # whole, for a run beside


def _gib(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x / 2**30, spec)


def _plain_at(plain: Record, b: int, key: str) -> float:
    """Plain grad's `key` bytes at batch size b: compiled there, or else on the line through the
    two B compiled nearest it (plain grad's footprint is affine in B at these sizes)."""
    known = {p["B"]: p[key] for p in [*plain["points"], *plain.get("compiled", [])]}
    if key == "footprint_bytes":  # the largest-B checks: footprints only
        known |= {c["B"]: c[key] for c in plain["budgets"] if c[key] is not None}
    if b in known:
        return known[b]
    intercept, slope = affine_fit(sorted(known.items(), key=lambda p: abs(p[0] - b))[:2])
    return intercept + slope * b


def scale_markdown(runs: Sequence[Record]) -> str:
    """The scale table: one section per run (model), with its command and commit."""
    lines = [
        "# Scale: compiled, never run (results/bench/scale_fit.py, issue 38)",
        "",
        "Memory is XLA's compiled `memory_analysis()` of `jax.jit(f).lower(...).compile()`,"
        " float32; inputs are `jax.ShapeDtypeStruct`s, so nothing model-sized is allocated and"
        " nothing runs. temp: the temporaries; footprint: arguments + outputs + temporaries"
        " − aliased bytes (what the device holds while the step runs). B, temp and footprint:"
        " at the larger fitted B; ratios are to plain `jax.value_and_grad` of the mean loss at"
        " that B (compiled there, or on the line through plain's two nearest compiled B)."
        " GiB / example and fixed GiB: the line through the two largest B compiled. Largest B"
        " under a budget: predicted by the line through the two compiled points nearest the"
        " budget (first the fit at the run's two batch sizes), then compiled at that B; over the"
        " budget B goes down, under it up, along the line through the new point (at most 3"
        " compiles a budget); a cell gives the largest B compiled within the budget and its"
        " footprint in GiB (✓), or the last B tried (✗), or the prediction alone (fit only)."
        " micro_grad (optax) and jax-privacy: at the microbatch, of those tried, with the"
        " smallest footprint. Runs before issue 51 were `python bench.py --sections scale`:"
        " the same flags go to `python results/bench/scale_fit.py` now.",
    ]
    order = {impl: k for k, impl in enumerate(SCALE_IMPLS)}
    for model in dict.fromkeys(run["meta"]["model"] for run in runs):
        mine = [run for run in runs if run["meta"]["model"] == model]
        config = mine[0]["meta"]["config"]
        budgets = config["scale_budgets_gib"]
        lines += ["", f"## {model}", ""]
        for run in mine:
            meta, c = run["meta"], run["meta"]["config"]
            fitted = ", ".join(map(str, sorted(set(c["scale_batches"]))))
            state = "" if meta.get("finished") else " (partial: stopped here)"
            lines.append(
                f"- `{meta['command']}` at commit {meta['commit']}"
                + (" (with local changes)" if meta["modified"] else "")
                + f": {len(run['rows'])} programs, {meta['seconds'] / 60:.0f} min on a 2-core CPU"
                f"{state}; jax {meta['jax']}, optax {meta['optax']}, jax-privacy "
                + (meta["jax_privacy"] or "not installed")
                + f", XLA on {meta['device']}; fitted at B = {fitted}; vmap-chunked:"
                f" {c['scale_chunk_size']} example(s) a chunk; microbatches tried:"
                f" {', '.join(map(str, c['scale_microbatches']))}."
            )
        rows = [r for run in mine for r in run["rows"]]
        stats_seen = [st for run in mine for st in run["meta"]["config"]["scale_stat_sets"]]
        stat_order = {st: k for k, st in enumerate(["mean", *Config.scale_stat_sets, *stats_seen])}
        rows.sort(key=lambda r: (order.get(r["impl"], 99), stat_order.get(r["stats"], 99)))
        plain = next((r for r in rows if r["impl"] == PLAIN and r["points"]), None)
        head = ["stats", "impl", "B", "temp GiB", "footprint GiB"]
        head += ["temp / plain", "footprint / plain", "GiB / example", "fixed GiB"]
        head += [f"largest B, {g:g} GiB" for g in budgets] + ["compiles (s)", "note"]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            impl = r["impl"]
            if r["chunk_size"]:
                impl += f" (chunk {r['chunk_size']})"
            if r["microbatch"]:
                impl += f" (mb {r['microbatch']})"
            if not r["points"]:
                cells = [r["stats"], impl] + ["—"] * (len(head) - 3) + [r["note"]]
                lines.append("| " + " | ".join(cells) + " |")
                continue
            p = r["points"][-1]
            cells = [r["stats"], impl, str(p["B"]), _gib(p["temp_bytes"])]
            cells.append(_gib(p["footprint_bytes"]))
            for key in ("temp_bytes", "footprint_bytes"):
                q = None if plain is None else _plain_at(plain, p["B"], key)
                cells.append("—" if not q else f"{p[key] / q:.2f}")
            compiled = {c["B"]: c["footprint_bytes"] for c in r.get("compiled", [])}
            compiled |= {c["B"]: c["footprint_bytes"] for c in r["points"]}
            compiled |= {c["B"]: c["footprint_bytes"] for c in r["budgets"] if c["footprint_bytes"]}
            intercept, slope = affine_fit(sorted(compiled.items())[-2:])
            cells += [_gib(slope, ".3f"), _gib(intercept)]
            for budget in r["budgets"]:
                if budget["B"] is None:
                    cells.append("any (flat fit)")
                    continue
                mark = {True: " ✓", False: " ✗", None: ""}[budget["fits"]]
                got = budget["footprint_bytes"]
                shown = " (fit only)" if got is None else f" ({_gib(got, '.1f')}{mark})"
                cells.append(f"{budget['B']:,}{shown}")
            cells += [f"{r['compiles']} ({r['compile_s']:.0f})", r["note"]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Command line, generated from Config.


def parse_config(argv: Sequence[str] | None = None) -> Config:
    return bench.parse_fields(Config, argv, (__doc__ or "").split("\n\n")[0])


def check(config: Config) -> None:
    if unknown := set(config.scale_models) - set(SCALE_MODELS):
        raise SystemExit(f"unknown scale model(s) {sorted(unknown)}; choose from {SCALE_MODELS}")
    if unknown := set(config.scale_impls) - set(SCALE_IMPLS):
        raise SystemExit(f"unknown scale implementation(s) {sorted(unknown)}: {SCALE_IMPLS}")
    for stats in config.scale_stat_sets:
        if bad := [s for s in stats.split("+") if s not in pegrad.STATISTICS]:
            raise SystemExit(f"unknown statistic(s) {bad} in {stats!r}: {pegrad.STATISTICS}")
    if len(set(config.scale_batches)) < 2 or min(config.scale_batches) < 1:
        raise SystemExit("need two or more distinct scale_batches >= 1 (the fit is affine in B)")
    if config.scale_chunk_size < 1 or min(config.scale_microbatches, default=0) < 1:
        raise SystemExit("need scale_chunk_size >= 1 and scale_microbatches >= 1")
    if config.clip_norm <= 0:
        raise SystemExit("need clip_norm > 0")


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    check(config)
    print("config:", json.dumps(dataclasses.asdict(config)), flush=True)
    run_scale(config)


if __name__ == "__main__":
    main()
