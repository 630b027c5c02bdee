"""Smoke test of bench.py: every section runs in-process on tiny sizes and yields sane records.

conftest.py lowers XLA's optimization level and turns on float64, so this checks the structure
of the output, not the speed of anything.
"""

import dataclasses
import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, naive_stats, naive_unit_grads

import bench
import models

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
