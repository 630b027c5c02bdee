"""train.py end to end, on tiny models and a few steps (float64 and strict promotion: conftest).

Covered: the CLI round trip to Config; config.json, metrics.jsonl (losses, eval losses, the SPEC §4
gradient diagnostics) and the checkpoint written by a run; --impl vmap and factorized giving the
same losses; a killed run resumed, and a finished run extended, to bitwise the parameters of an
uninterrupted one; checkpoints keeping dtypes (bfloat16 too) and refusing another model; a crash
while saving leaving the previous checkpoint loadable; a NaN loss stopping the run with the step
named and the last good checkpoint kept; bad input as a one-line error and exit status 1 (in a
subprocess); two (fake) devices giving the losses of one.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train

REPO = Path(__file__).resolve().parent.parent


def tiny(out: Path, **overrides: Any) -> train.Config:
    """A one-block byte-level transformer of ~3k parameters, a handful of steps, float64."""
    base: dict[str, Any] = dict(
        size="tiny", n_layers=1, seq_len=8, batch_size=4, steps=4, warmup=2, lr=1e-2,
        eval_interval=2, eval_batches=2, log_interval=1, checkpoint_interval=2, dtype="float64",
    )  # fmt: skip
    return train.Config(**{**base, "out": str(out), **overrides})


def argv(cfg: train.Config) -> list[str]:
    """The command line that spells `cfg`."""
    args = []
    for key, value in dataclasses.asdict(cfg).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> train.Config:
    """One factorized run, compared against by the vmap and the two-device runs."""
    cfg = tiny(tmp_path_factory.mktemp("reference"))
    train.main(cfg)
    return cfg


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def checkpoint(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "checkpoint.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def run_script(*args: str, devices: int = 1) -> subprocess.CompletedProcess:
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


# --------------------------------------------------------------------------------------------


def test_cli_round_trip():
    cfg = train.Config(
        model="mlp", optimizer="sign_ema", impl="vmap", lr=0.5, batch_size=8, steps=7,
        max_grad_norm=0.01, momentum=0.8, msq_block="tensor", data="x.txt", out="runs/x",
        resume=True,
    )  # fmt: skip
    assert train.parse_config(argv(cfg)) == cfg
    assert train.parse_config([]) == train.Config()
    assert train.parse_config(["--max-grad-norm", "none"]).max_grad_norm is None
    with pytest.raises(SystemExit):  # argparse's own one-line error: unknown choice
        train.parse_config(["--optimizer", "sgd"])


def test_impls_agree_and_run_writes_its_files(reference: train.Config, tmp_path: Path):
    """vmap and factorized give the same trajectory; config, metrics and checkpoint are written."""
    result = train.main(dataclasses.replace(reference, impl="vmap", out=str(tmp_path)))
    ref = Path(str(reference.out))
    assert train.Config(**json.loads((ref / "config.json").read_text())) == reference
    vmap, fact = metrics(tmp_path), metrics(ref)
    assert [m["step"] for m in fact] == [0, 1, 2, 3, 4]
    assert [m["step"] for m in fact if "eval_loss" in m] == [0, 2, 4]
    for a, b in zip(vmap, fact, strict=True):
        for key in ("loss", "eval_loss", "grad_norm", "nu_adam_over_nu_micro"):
            if key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-10)
        if "loss" in b:
            assert 0.0 <= b["frac_snr_gt_1_over_B"] <= 1.0
            assert 0.0 < b["nu_adam_over_nu_micro"] <= 1.0  # ḡ² ≤ q (Jensen)
    assert fact[-1]["eval_loss"] < fact[0]["eval_loss"]
    assert result["eval_loss"] == vmap[-1]["eval_loss"] and result["out"] == str(tmp_path)
    for name, x in checkpoint(tmp_path).items():
        if name != "__meta__":
            np.testing.assert_allclose(x, checkpoint(ref)[name], rtol=1e-9)
    meta = json.loads((ref / "checkpoint.json").read_text())
    assert meta["step"] == 4 and any("tok_emb" in name for name in meta["leaves"])


def test_resume_reproduces_an_uninterrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    steps = dict(model="mlp", steps=6, schedule="cosine")
    train.main(tiny(tmp_path / "full", **steps))

    # Kill the run after step 4's update: its last checkpoint is the one after 4 steps.
    def crash(self: train.Progress, step: int, loss: float) -> None:
        if step == 4:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(train.Progress, "update", crash)
        with pytest.raises(KeyboardInterrupt):
            train.main(tiny(tmp_path / "killed", **steps))
    assert json.loads((tmp_path / "killed" / "checkpoint.json").read_text())["step"] == 4
    train.main(tiny(tmp_path / "killed", resume=True, **steps))

    full, resumed = checkpoint(tmp_path / "full"), checkpoint(tmp_path / "killed")
    assert full.keys() == resumed.keys()
    for name in full:
        if name != "__meta__":
            np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)
    strip = lambda ms: [{k: v for k, v in m.items() if k != "seconds"} for m in ms]
    assert strip(metrics(tmp_path / "full")) == strip(metrics(tmp_path / "killed"))


def test_extending_a_finished_run_equals_the_longer_run(tmp_path: Path):
    """--steps 3 then --resume --steps 5 (constant schedule: it does not depend on --steps)."""
    mlp = dict(model="mlp", schedule="constant", checkpoint_interval=10)
    train.main(tiny(tmp_path / "long", steps=5, **mlp))
    train.main(tiny(tmp_path / "split", steps=3, **mlp))
    train.main(tiny(tmp_path / "split", steps=5, resume=True, **mlp))
    long, split = checkpoint(tmp_path / "long"), checkpoint(tmp_path / "split")
    for name in long:
        if name != "__meta__":
            np.testing.assert_array_equal(long[name], split[name], err_msg=name)


def test_crash_while_saving_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    cfg = tiny(tmp_path, model="mlp", steps=2)
    train.main(cfg)
    before = checkpoint(tmp_path)

    def torn_savez(f: Any, **arrays: Any) -> None:
        f.write(b"PK\x03\x04 half a zip")  # the crash comes mid-write
        raise OSError("disk full")

    monkeypatch.setattr(train.np, "savez", torn_savez)
    state = {"params": {"w": np.ones(3)}}
    with pytest.raises(OSError, match="disk full"):
        train.save_checkpoint(tmp_path, 99, state, cfg)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.json", "checkpoint.npz", "config.json", "metrics.jsonl",
    ]  # fmt: skip
    after = checkpoint(tmp_path)
    assert json.loads(str(after["__meta__"]))["step"] == 2
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])


def test_checkpoint_round_trip_keeps_dtypes_and_rejects_another_model(tmp_path: Path):
    tree = {
        "params": {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 7, "b": jnp.ones(3)},
        "opt_state": (jnp.asarray(3, jnp.int32), jnp.full((2, 3), 0.1, jnp.float32)),
    }
    train.save_checkpoint(tmp_path, 7, tree, train.Config())
    loaded, step = train.load_checkpoint(tmp_path, tree)
    assert step == 7
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(loaded), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(f"u{a.dtype.itemsize}"),
                                      np.asarray(b).view(f"u{b.dtype.itemsize}"))  # fmt: skip
    other = {**tree, "params": {"w": jnp.zeros((3, 2), jnp.bfloat16), "b": jnp.ones(3)}}
    with pytest.raises(train.ConfigError, match=r"does not fit: \['params'\]\['w'\]"):
        train.load_checkpoint(tmp_path, other)


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path):
    # lr 1e30 in float32: the first update is finite but huge, the next loss overflows.
    cfg = tiny(tmp_path, model="mlp", dtype="float32", optimizer="adam", lr=1e30, warmup=0,
               steps=10, checkpoint_interval=1)  # fmt: skip
    with pytest.raises(train.Diverged, match=r"at step \d+") as err:
        train.main(cfg)
    assert "checkpoint" in str(err.value)
    saved = checkpoint(tmp_path)
    step = json.loads(str(saved["__meta__"]))["step"]
    assert 1 <= step < 10
    assert all(np.isfinite(x).all() for k, x in saved.items() if k != "__meta__")


def test_bad_input_is_a_config_error(tmp_path: Path):
    with pytest.raises(train.ConfigError, match="context length"):
        train.main(tiny(tmp_path / "a", seq_len=9))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(train.ConfigError, match="too short"):
        train.main(tiny(tmp_path / "b", data=str(short)))
    with pytest.raises(train.ConfigError, match="no checkpoint"):
        train.main(tiny(tmp_path / "c", resume=True))
    train.main(tiny(tmp_path / "d", model="mlp", steps=1))
    with pytest.raises(train.ConfigError, match="already holds a run"):
        train.main(tiny(tmp_path / "d", model="mlp", steps=1))
    with pytest.raises(train.ConfigError, match="lr differ"):
        train.main(tiny(tmp_path / "d", model="mlp", steps=2, lr=0.5, resume=True))
    with pytest.raises(train.ConfigError, match="max-grad-norm"):
        train.main(tiny(tmp_path / "e", optimizer="sign_sgd", max_grad_norm=1.0))
    with pytest.raises(train.ConfigError, match="option of micro_adam_msq only"):
        train.main(tiny(tmp_path / "f", optimizer="adam", msq_block="row"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/nonexistent/corpus.txt"], "data file not found"),
        (["--batch-size", "3"], "not divisible by the 2 devices"),
        (["--model", "mlp", "--size", "tiny", "--lr", "1e30", "--steps", "5"], "at step"),
    ],
)
def test_cli_bad_input_is_one_line_and_nonzero_exit(tmp_path: Path, args: list[str], message: str):
    proc = run_script("train.py", *args, "--out", str(tmp_path / "run"), devices=2)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def test_two_devices_give_the_losses_of_one(reference: train.Config, tmp_path: Path):
    """The reference run again through the command line, its batch split over two devices."""
    two = dataclasses.replace(reference, out=str(tmp_path))
    proc = run_script("train.py", *argv(two), devices=2)
    assert proc.returncode == 0, proc.stderr
    assert "2 x cpu device(s)" in proc.stdout
    for a, b in zip(metrics(Path(str(reference.out))), metrics(tmp_path), strict=True):
        for key in ("loss", "eval_loss", "grad_norm", "frac_snr_gt_1_over_B"):
            if key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-12, err_msg=key)
