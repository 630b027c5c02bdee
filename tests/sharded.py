"""The checks tests/test_sharding.py runs on 8 simulated CPU devices (XLA's host platform device
count must be set before JAX starts, so they run here, in a process of their own).

    python tests/sharded.py OUT.json CASE [CASE ...]     # CASE: kind:model:... (test_sharding)

Each case writes "ok" or the first failure's message into OUT.json:
- exact:MODEL:IMPL:B:CHUNK:MASK — every statistic with the batch sharded over the 8 devices
  (jit, P("data")) equals the same call on one device (float64, tests/helpers.py's closeness);
- merged:MODEL:IMPL:B:MASK[:STATS] — every statistic but "gram" (or STATS, e.g. mean+var,
  which a scanned model then forms inside its scan) computed per shard in `jax.shard_map` (its
  default checks) and merged by `pegrad.merge_shards` equals one device's; "gram" refused;
- traffic:MODEL:STATS:PARAMS — the optimized HLO's collectives at float32 (d 32, T 16, 2 blocks,
  B 16): every all-reduce together ≤ 1.25× one all-reduce of the parameters per parameter-shaped
  statistic, no collective-permute or all-to-all, all-gathers ≤ 1 % of the parameters and 1 kB
  (a few scalars per device) with replicated parameters, ≤ plain grad's (the parameters
  themselves) under FSDP.
"""

import os
import sys

# pytest's compile flags (tests/conftest.py), inherited, and 8 devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import cast  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "results" / "bench")]

import helpers  # noqa: E402
import sharding  # noqa: E402  # pyright: ignore[reportMissingImports]  (results/bench/sharding.py)

import families  # noqa: E402
import pegrad  # noqa: E402

MESH = Mesh(np.array(jax.devices()), ("data",))
EVERY = ("mean", "sq_mean", "sign_mean", "var", "sq_norms", "clipped_mean", "dot", "gram")
CLIP = 0.5


def built(model: str, n: int, dtype: str = "float64", size: families.Size = families.TINY):
    size = families.Size(size.width, size.seq, size.layers, dtype)
    params, loss = families.FAMILIES[model].build(size, jax.random.key(0))
    return params, loss, families.FAMILIES[model].batch(size, jax.random.key(1), n)


def sharded(tree):
    spec = lambda x: NamedSharding(MESH, P("data", *[None] * (np.ndim(x) - 1)))  # noqa: E731
    return jax.device_put(tree, jax.tree.map(spec, tree))


def mask_of(n: int, how: str):
    """ "none"; "some": every third example dropped; "shard": also the first device's examples
    (a shard with no kept example)."""
    if how == "none":
        return None
    keep = np.arange(n) % 3 != 1
    if how == "shard":
        keep[: n // 8] = False
    return jnp.asarray(keep)


def compare(got: dict, want: dict, unit_grads, where: str) -> None:
    top = max(float(np.max(np.abs(g), initial=0.0)) for g in jax.tree.leaves(unit_grads))
    for name, value in want.items():
        if name == "batch_size":
            assert int(got[name]) == int(value), (where, name, got[name], value)
            continue
        a, b = got[name], value
        if name == "sign_mean":  # a sign left to round-off is no fact (tests/helpers.py)
            keep = jax.tree.map(lambda g: helpers._well_posed_signs(np.asarray(g), top), unit_grads)
            a = jax.tree.map(lambda x, m: np.where(m, x, 0.0), a, keep)
            b = jax.tree.map(lambda x, m: np.where(m, x, 0.0), b, keep)
        helpers.assert_tree_close(a, b, f"{where}/{name}")


def unit_grads_of(loss, params, batch, keep):
    grads = jax.vmap(jax.grad(loss), (None, 0))(params, batch)
    if keep is None:
        return grads
    return jax.tree.map(lambda g: np.asarray(g)[np.asarray(keep)], grads)


def exact(model: str, impl: str, n: str, chunk: str, mask: str) -> None:
    params, loss, batch = built(model, int(n))
    keep = mask_of(int(n), mask)
    v = helpers.probe_like(params)
    chunk_size = None if chunk == "none" else int(chunk)
    grads = unit_grads_of(loss, params, batch, keep)
    for stats in (EVERY, ("mean", "var"), ("mean",), ("clipped_mean", "sq_norms")):
        clip = CLIP if "clipped_mean" in stats else None
        fn = pegrad.value_and_grad_stats(
            loss, stats, impl=cast(pegrad.Impl, impl), chunk_size=chunk_size, clip_norm=clip
        )
        fn = jax.jit(fn)
        extra = {"dot_with": v} if "dot" in stats else {}
        one_loss, one = fn(params, batch, keep, **extra)
        many_loss, many = fn(params, sharded(batch), keep, **extra)
        where = f"{model}/{impl}/B{n}/chunk {chunk}/mask {mask}/{stats}"
        np.testing.assert_allclose(many_loss, one_loss, rtol=1e-12, err_msg=where)
        compare(many, one, grads, where)


def merged(model: str, impl: str, n: str, mask: str, names: str = "") -> None:
    params, loss, batch = built(model, int(n))
    keep = mask_of(int(n), mask)
    keep_all = jnp.ones(int(n), bool) if keep is None else keep
    v = helpers.probe_like(params)
    stats = tuple(names.split("+")) if names else tuple(s for s in EVERY if s != "gram")
    if names:  # without clipping or a mask: blocks in lax.scan form their statistics inside it
        plan = pegrad.explain(loss, params, batch, stats)
        assert any("inside the scan" in str(p) for p in plan), plan
    clip = CLIP if "clipped_mean" in stats else None
    fn = pegrad.value_and_grad_stats(loss, stats, impl=cast(pegrad.Impl, impl), clip_norm=clip)
    extra = {"dot_with": v} if "dot" in stats else {}
    # with STATS and no mask none is passed: any mask, all True too, keeps them out of the scan
    given = names == "" or keep is not None

    def local(p, b, k):
        value, found = fn(p, b, k if given else None, **extra)
        count = found["batch_size"]
        total = jax.lax.psum(jnp.where(count > 0, value * count, 0.0), "data")
        return total / jax.lax.psum(count, "data"), pegrad.merge_shards(found, "data")

    specs = (P(), P("data"), P("data"))
    run = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=specs, out_specs=P()))
    many_loss, many = run(params, sharded(batch), sharded(keep_all))
    one_loss, one = jax.jit(fn)(params, batch, keep, **extra)
    where = f"{model}/{impl}/B{n}/mask {mask}/{stats}/shard_map"
    np.testing.assert_allclose(many_loss, one_loss, rtol=1e-12, err_msg=where)
    compare(many, one, unit_grads_of(loss, params, batch, keep), where)
    try:
        pegrad.merge_shards({"gram": jnp.zeros((2, 2)), "batch_size": 2}, "data")
    except ValueError as error:
        assert "gram" in str(error), error
    else:
        raise AssertionError("merge_shards merged 'gram'")


def traffic(model: str, stats: str, params_how: str) -> None:
    size = families.Size(width=32, seq=16, layers=2, dtype="float32")
    fsdp = params_how == "fsdp"
    names = tuple(stats.split("+"))
    fn, params, data = sharding.program(model, size, 16, names, "factorized")
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    found = sharding.collectives(sharding.compiled(fn, params, data, jax.devices(), fsdp).as_text())
    plain_fn, _, _ = sharding.program(model, size, 16, ("plain",), "plain")
    plain = sharding.collectives(
        sharding.compiled(plain_fn, params, data, jax.devices(), fsdp).as_text()
    )
    where = f"{model}/{stats}/{params_how}: {found}"
    reduced = found["all-reduce"][1] + found["reduce-scatter"][1]
    assert reduced <= 1.25 * sharding.ideal(names) * param_bytes + 1024, where
    assert found["collective-permute"][0] == 0 and found["all-to-all"][0] == 0, where
    gathered = found["all-gather"][1]
    # replicated: 1 % of the parameters and a few scalars per device (a gauge's argmax: the
    # largest b_u of the batch), where one example's activations are kilobytes
    limit = plain["all-gather"][1] if fsdp else 0.01 * param_bytes + 1024
    assert gathered <= limit, f"{where}; plain grad gathers {plain['all-gather']}"


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    results = {}
    for case in cases:
        kind, *args = case.split(":")
        try:
            {"exact": exact, "merged": merged, "traffic": traffic}[kind](*args)
            results[case] = "ok"
        except Exception:  # noqa: BLE001  the test reports it
            results[case] = traceback.format_exc(limit=4)[-3000:]
        Path(out).write_text(json.dumps(results, indent=1))
        print(case, "ok" if results[case] == "ok" else "FAILED", flush=True)


if __name__ == "__main__":
    main()
