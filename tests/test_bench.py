"""Smoke test of bench.py: every section runs in-process on tiny sizes and yields sane records;
of results/bench/scale_fit.py (the compiled scale fit) and results/bench/gpu_run.py (the
accelerator preset) likewise.

conftest.py lowers XLA's optimization level and turns on float64, so this checks the structure
of the output, not the speed of anything.
"""

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, naive_stats, naive_unit_grads

import bench
import models

RESULTS = Path(__file__).resolve().parent.parent / "results" / "bench"


def _script(name: str) -> Any:
    """A script of results/bench, imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, RESULTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # inspect reads it there
    spec.loader.exec_module(module)
    return module


TINY = bench.Config(
    stat_sets=("mean+sq_mean",),
    reps=1,
    min_time_s=0.0,
    mlp_in=16,
    mlp_width=32,
    mlp_depth=2,
    mlp_batch=8,
    mlp_batch_sizes=(8,),  # = mlp_batch: the scaling table reuses the "mlp" rows
    lm_d_model=8,
    lm_layers=1,
    lm_heads=2,
    lm_seq=8,
    lm_batch=4,
    paper_layers=1,
    paper_seq=8,
    paper_batch=2,
    paper_stat_sets=("mean+sq_mean",),
)

REQUIRED = {"model", "stats", "impl", "granularity", "batch_size", "time_ratio", "memory_ratio"}
REQUIRED |= {"compile_s", "time_s", "temp_bytes", "footprint_bytes", "footprint_ratio"}


def test_bench_records(tmp_path):
    # Every implementation once (MLP), token granularity (LM), memory only (paper).
    records = bench.run(dataclasses.replace(TINY, sections=("mlp", "mlp-scaling")))
    records += bench.run(dataclasses.replace(TINY, sections=("lm",), impls=("factorized-token",)))
    records += bench.run(dataclasses.replace(TINY, sections=("paper",), impls=("vmap-chunked",)))
    families = dict(families=("cnn", "moe"), family_batch=4, family_width=8, family_seq=8)
    families |= dict(family_stat_sets=("mean+sq_mean",), family_impls=("micro_grad",))
    records += bench.run(dataclasses.replace(TINY, sections=("families",), **families))
    assert records and all(set(r) >= REQUIRED for r in records)

    for r in records:
        assert r["temp_bytes"] is not None and r["temp_bytes"] >= 0, r
        assert r["footprint_bytes"] is not None and r["footprint_bytes"] > r["temp_bytes"], r
        assert r["compile_s"] is not None and r["compile_s"] > 0, r
        if r["section"] == "paper":
            assert r["time_ratio"] is None and r["note"] == "compiled only", r
        else:
            assert math.isfinite(r["time_ratio"]) and r["time_ratio"] > 0, r
            assert math.isfinite(r["time_s"]) and r["time_s"] > 0, r
        if r["impl"] == bench.PLAIN:
            assert (
                r["time_ratio"] in (1.0, None) and r["memory_ratio"] == r["footprint_ratio"] == 1.0
            )
        elif r["memory_ratio"] is not None:
            assert math.isfinite(r["memory_ratio"]) and r["memory_ratio"] >= 0, r

    kinds = {(r["section"], r["impl"], r["granularity"]) for r in records}
    for impl in ("vmap", "vmap-chunked", "factorized"):
        assert ("mlp", impl, "example") in kinds
    assert ("lm", "factorized", "token") in kinds and ("paper", "vmap-chunked", "example") in kinds
    assert sum(1 for r in records if r["impl"] == "micro_grad") == 2  # optax's peer, per family

    # --json writes the records as they are.
    path = tmp_path / "out" / "bench.json"
    bench.write_json(records, str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(records))


def test_command_line():
    argv = ["--sections", "mlp", "lm", "--reps", "3", "--no-lm-tied-head", "--clip-norm", "0.5"]
    config = bench.parse_config(argv)
    assert config == dataclasses.replace(
        bench.Config(), sections=("mlp", "lm"), reps=3, lm_tied_head=False, clip_norm=0.5
    )
    quick = bench.parse_config(["--quick", "--reps", "2"])
    assert quick.reps == 2 and quick.mlp_width == bench.QUICK["mlp_width"]
    preset = _script("gpu_run").ACCELERATOR
    accelerator = bench.parse_config(["--families", "mlp"], preset=preset)
    assert accelerator.families == ("mlp",) and accelerator.paper_run
    assert accelerator.family_stat_sets == preset["family_stat_sets"]
    with pytest.raises(SystemExit, match="scale_fit.py"):  # the scale fit's own script now
        bench.check(bench.parse_config(["--sections", "scale"]))
    scale_fit = _script("scale_fit")
    argv = ["--scale-models", "gpt2", "--scale-batches", "4", "8", "--no-scale-verify"]
    assert scale_fit.parse_config(argv) == dataclasses.replace(
        scale_fit.Config(), scale_models=("gpt2",), scale_batches=(4, 8), scale_verify=False
    )


def test_a_program_that_fails_to_build_is_recorded_and_the_run_goes_on(monkeypatch):
    # An accelerator's run is one call: one failure (a newer JAX, say) must not lose the rest.
    config = dataclasses.replace(
        bench.Config(**bench.QUICK), sections=("mlp",), reps=1, min_time_s=0.0
    )
    workload = bench.mlp_workload(config, 4, "mlp", ("mean+sq_mean",))
    build = bench.Program.build

    def broken(self, loss_fn, clip_norm):
        if self.impl == "vmap":
            raise KeyError("num_consts")
        return build(self, loss_fn, clip_norm)

    monkeypatch.setattr(bench.Program, "build", broken)
    saved: list[int] = []  # what --json would hold after each compilation
    records = bench.measure(workload, config, lambda rows: saved.append(len(rows)))
    failed = [r for r in records if r["impl"] == "vmap"]
    assert failed and all(r["note"] == "failed: KeyError: 'num_consts'" for r in failed)
    assert all(r["time_ratio"] is not None for r in records if r["impl"] != "vmap")
    assert len(saved) == len(records) - len(failed) and saved[-1] == len(records)


@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_the_hand_written_mlp_floor_computes_the_mean_and_the_mean_square(batch_size, activation):
    # The floor bench.py times beside pegrad is a floor for the same numbers: the naive loop's.
    key_model, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    model = models.MLP(6, 3, 5, 2, activation=activation, dtype="float64", key=key_model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jax.random.normal(key_x, (batch_size, 6), jnp.float64)
    batch = (x, jax.random.randint(key_y, (batch_size,), 0, 3, jnp.int32))
    loss_fn = models.make_loss_fn(static, models.mlp_loss)
    losses, grads = naive_unit_grads(loss_fn, params, batch)
    expected = naive_stats(grads, clip_norm=1.0)

    loss, stats = jax.jit(bench.hand_written_mlp(static))(params, batch)

    assert float(loss) == pytest.approx(float(losses.mean()), rel=1e-12)
    for name in ("mean", "sq_mean"):
        assert_tree_close(stats[name], expected[name], name)


GIB = 2**30


def test_scale_fit_largest_batch_and_a_tiny_compile(tmp_path):
    scale_fit = _script("scale_fit")
    # The affine fit and the largest batch, on constructed numbers: 3 GiB + 0.5 GiB per example.
    points = [(2, 4 * GIB), (4, 5 * GIB), (8, 7 * GIB)]
    intercept, slope = scale_fit.affine_fit(points)
    assert intercept == pytest.approx(3 * GIB) and slope == pytest.approx(0.5 * GIB)
    assert scale_fit.largest_batch(intercept, slope, 16 * GIB) == 26
    assert scale_fit.largest_batch(intercept, slope, 16 * GIB, multiple=4) == 24
    assert scale_fit.largest_batch(intercept, slope, 2 * GIB) == 0  # not even one example
    assert scale_fit.largest_batch(GIB, 0.0, 2 * GIB) is None  # flat: every B fits
    with pytest.raises(ValueError, match="two distinct"):
        scale_fit.affine_fit([(4, GIB), (4, 2 * GIB)])

    # Verification: compiled at the prediction; where the footprint jumps above the fit (here
    # 1 GiB past B 20) B is lowered through the measured point until it fits.
    measured = []

    def footprint(b: int) -> int:
        measured.append(b)
        return int(3 * GIB + 0.5 * GIB * b + (GIB if b > 20 else 0))

    fit = [(2, footprint(2)), (4, footprint(4))]
    measured.clear()
    rows = scale_fit.fit_budgets(footprint, fit, [16 * GIB, 40 * GIB, 2 * GIB])
    # 40 GiB is predicted from the two checks made for 16 GiB (B 24, 26): on the jump, exact.
    assert measured == [26, 24, 72]
    assert [r["predicted_B"] for r in rows] == [26, 72, 0]
    assert rows[0]["B"] == 24 and rows[0]["fits"] and rows[0]["compiles"] == 2  # 26 ✗, 24 ✓
    assert rows[0]["footprint_bytes"] == footprint(24) <= 16 * GIB
    assert rows[1]["B"] == 72 and rows[1]["fits"] and rows[1]["footprint_bytes"] == 40 * GIB
    assert rows[2]["B"] == 0 and rows[2]["fits"] is None and rows[2]["compiles"] == 0

    # Below the budget where small B sat above the large-B line: B rises to the line's.
    def offset(b: int) -> int:
        return int((1 + 0.5 * b) * GIB) if b >= 10 else int((3.5 + 0.5 * b) * GIB)

    (row,) = scale_fit.fit_budgets(offset, [(2, offset(2)), (4, offset(4))], [16 * GIB])
    assert (row["predicted_B"], row["B"], row["compiles"], row["fits"]) == (25, 30, 3, True)

    # A flat fit (two points of one footprint) far over the budget: lowered through the point
    # just compiled, not stepped down one example at a time.
    def flat(b: int) -> int:
        return 5 * GIB + b * (2**20 if b > 100 else 2**10)

    (row,) = scale_fit.fit_budgets(flat, [(8, flat(8)), (16, flat(16))], [6 * GIB], tries=3)
    assert row["predicted_B"] > 10**6 and row["fits"] and row["compiles"] <= 3
    assert 1000 <= row["B"] <= 1024 and flat(row["B"]) <= 6 * GIB

    # The machinery on a tiny MLP, shapes only: plain, factorized and optax's peer (its
    # microbatch chosen), compiled at two B, fitted, one budget, written as .json and .md.
    model = eqx.filter_eval_shape(models.MLP, 8, 3, 16, 1, key=jax.random.key(0))
    params, static = eqx.partition(model, bench._is_float_leaf)

    def batch(b: int):
        return (jax.ShapeDtypeStruct((b, 8), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))

    tiny = scale_fit.ScaleModel(
        "mlp 8-16-3", models.make_loss_fn(static, models.mlp_loss), params, batch
    )
    config = dataclasses.replace(
        scale_fit.Config(),
        scale_stat_sets=("mean+sq_mean",),
        scale_impls=("plain", "factorized", "micro_grad"),
        scale_batches=(2, 4),
        scale_budgets_gib=(1.0,),
        scale_verify=False,
    )
    programs = scale_fit.scale_programs(config)
    assert [(p.impl, p.stats) for p in programs] == [
        ("plain", "mean"),
        ("factorized", "mean+sq_mean"),
        ("micro_grad", "mean+sq_mean"),
    ]
    rows = scale_fit.scale_rows(tiny, programs, config)
    for row in rows:
        assert [p["B"] for p in row["points"]] == [2, 4], row
        assert all(p["footprint_bytes"] > p["temp_bytes"] >= 0 for p in row["points"]), row
        (budget,) = row["budgets"]
        assert budget["B"] is None or budget["B"] > 1000, row  # 1 GiB holds many tiny examples
    assert rows[2]["microbatch"] in (1, 2)  # and every B of the peer compiled at that one:
    assert {r["microbatch"] for r in rows[2]["compiled"]} == {rows[2]["microbatch"]}
    meta: dict[str, Any] = dict(model=tiny.name, command="test", commit="abc", modified="")
    meta |= dict(jax="0", optax="0", jax_privacy=None, device="cpu", seconds=1.0)
    meta["config"] = dataclasses.asdict(config)
    scale_fit.write_scale(str(tmp_path / "scale"), {"meta": meta, "rows": rows})
    text = (tmp_path / "scale.md").read_text()
    assert "## mlp 8-16-3" in text and "- `test` at commit abc" in text
    assert json.loads((tmp_path / "scale.json").read_text())["runs"][0]["rows"] == json.loads(
        json.dumps(rows)
    )
    # Notes written by hand below the tables survive the next run's rewrite, once.
    notes = "\n## Notes\n\n- written by hand\n"
    (tmp_path / "scale.md").write_text(text.rstrip("\n") + "\n" + notes)
    scale_fit.write_scale(
        str(tmp_path / "scale"), {"meta": {**meta, "command": "again"}, "rows": rows}
    )
    again = (tmp_path / "scale.md").read_text()
    assert again.endswith(notes) and again.count("## Notes") == 1
    assert "- `again` at commit abc" in again and "- `test` at commit abc" in again


def test_the_scale_peers_compute_what_they_name():
    # optax's micro_grad as bench.py calls it: each statistic equals the naive loop's.
    key_model, key_x, key_y = jax.random.split(jax.random.key(1), 3)
    model = models.MLP(5, 3, 4, 1, dtype="float64", key=key_model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jax.random.normal(key_x, (4, 5), jnp.float64)
    batch = (x, jax.random.randint(key_y, (4,), 0, 3, jnp.int32))
    loss_fn = models.make_loss_fn(static, models.mlp_loss)
    losses, grads = naive_unit_grads(loss_fn, params, batch)
    expected = naive_stats(grads, clip_norm=0.05)
    names = ("mean", "sq_mean", "var", "sq_norms", "clipped_mean")
    fn = bench.optax_micro_grad(loss_fn, names, microbatch=2, clip_norm=0.05)
    loss, stats = jax.jit(fn)(params, batch)
    assert float(loss) == pytest.approx(float(losses.mean()), rel=1e-12)
    for name in names:
        assert_tree_close(stats[name], expected[name], name)


def test_the_accelerator_script_writes_measured_time_beside_the_estimate(tmp_path):
    """results/bench/gpu_run.py, the one command for a lent GPU, at tiny sizes on the CPU."""
    gpu_run = _script("gpu_run")
    gpu_run.main(["--tiny", "--out", str(tmp_path), "--families", "transformer"])
    records = json.loads((tmp_path / "gpu.json").read_text())
    assert {(r["stats"], r["impl"]) for r in records} >= {
        (s, i) for s in gpu_run.STAT_SETS for i in ("vmap", "factorized")
    }
    for r in records:
        assert r["time_s"] > 0 and r["h200_estimate_s"] > 0 and r["kernels"] > 0, r
    text = (tmp_path / "gpu.md").read_text()
    assert text.count("| transformer") == len(records) and "estimate / plain" in text
