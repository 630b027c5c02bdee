"""A batch sharded over 8 devices (SPEC §2.3): the statistics are exactly one device's, in jit
with the batch sharded and in `jax.shard_map` merged by `pegrad.merge_shards`, and the
compiled programs move what the statistics need and no more.

Each case runs tests/sharded.py in a process of its own (XLA's host platform device count is
read when JAX starts), which says what each case checks:
- exact: every statistic (float64) with the batch sharded equals the call on one device, with
  the chunk loop's chunks split within each device's examples (chunk 16 of 24 examples: 2 of
  each device's 3) and with a mask;
- merged: per-shard statistics in `jax.shard_map` (its default checks) merged into one
  device's; "gram" refused; a shard with no kept example; blocks in lax.scan whose statistics
  are formed inside the scan (the head gathers each shard's examples without a collective);
- traffic: the optimized HLO's collectives (float32): ≤ 1.25× one all-reduce of the parameters
  per parameter-shaped statistic, no collective-permute or all-to-all, no gathered
  activations (replicated parameters), no more gathers than plain grad's (FSDP).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import pegrad

HERE = Path(__file__).resolve().parent

EXACT = [
    "exact:mlp:factorized:24:16:some",
    "exact:mlp:vmap:24:16:none",
    "exact:transformer:factorized:16:none:none",
    "exact:transformer:factorized:24:16:some",
    "exact:transformer-scan:factorized:16:none:none",
    "exact:cnn:factorized:16:none:some",
    "exact:moe:factorized:16:none:none",
]
MERGED = [
    "merged:mlp:factorized:16:shard",
    "merged:transformer:factorized:16:some",
    "merged:transformer:vmap:16:none",
    "merged:transformer-scan:factorized:16:none",
    "merged:transformer-scan:factorized:16:none:mean+var",
]
TRAFFIC = [
    "traffic:transformer:mean+sq_mean:replicated",
    "traffic:transformer:mean+var:replicated",
    "traffic:transformer:clipped_mean+sq_norms:replicated",
    "traffic:transformer:sq_norms:replicated",
    "traffic:transformer:mean+sq_mean:fsdp",
    "traffic:transformer:mean+var:fsdp",
    "traffic:mlp:mean+var:replicated",
]


@pytest.mark.parametrize("case", EXACT + MERGED + TRAFFIC)
def test_a_sharded_batch_gives_one_devices_statistics_at_the_gradients_traffic(
    case: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(HERE / "sharded.py"), str(out), case],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(out.read_text())[case] == "ok", json.loads(out.read_text())[case]


def test_merge_shards_refuses_what_it_cannot_merge() -> None:
    with pytest.raises(ValueError, match="'gram'"):
        pegrad.merge_shards({"gram": 0.0, "batch_size": 2}, "data")
    with pytest.raises(ValueError, match="'mean'"):
        pegrad.merge_shards({"var": 0.0, "batch_size": 2}, "data")
    with pytest.raises(ValueError, match="batch_size"):
        pegrad.merge_shards({"mean": 0.0}, "data")
    with pytest.raises(ValueError, match="unknown statistic"):
        pegrad.merge_shards({"means": 0.0, "batch_size": 2}, "data")
