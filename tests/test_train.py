"""train.py end to end, on tiny models and a few steps (float64 and strict promotion: conftest).

Covered: the CLI round trip to Config; config.json, metrics.jsonl (losses, eval losses, the SPEC §4
gradient diagnostics) and the checkpoint written by a run; --impl vmap and factorized giving the
same losses; a user's own model and data (a module written outside the repo) trained through
--task and through main(cfg, task=...), and a bad task refused before any work; a killed run
resumed, a run killed before its first checkpoint restarted, and a finished run extended, each
to bitwise the parameters of an uninterrupted one, and an extension that would re-lay the
learning-rate schedule refused; Ctrl-C ending with one line naming the last checkpoint (a real
SIGINT, in a subprocess), and the command it prints continuing the run as it was configured
(before and after its first checkpoint); --resume taking the flags that may change and refusing
the others with both values; the console and metrics.jsonl labelling each loss with the same
step; checkpoints keeping dtypes (bfloat16 too) and refusing another model; a crash while saving
leaving the previous checkpoint loadable; a NaN loss stopping the run with the step named,
recorded in metrics.jsonl, and the last good checkpoint kept; bad input as a one-line error and
exit status 1 (in a subprocess: a factory of the wrong signature, a loss that is no scalar, an
--out under a file among them) leaving no directory behind, nor does a run that fails before
its first step; two (fake) devices giving the losses of one.
"""

import dataclasses
import gc
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
import trainkit

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


def script_env(devices: int = 1) -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def run_script(*args: str, devices: int = 1, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=script_env(devices),
        capture_output=True,
        text=True,
        timeout=900,  # against a hang only: a 2-core machine under load is 10x slower than idle
    )


def strip_seconds(ms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "seconds"} for m in ms]


def assert_same_params(a: Path, b: Path) -> None:
    """Bitwise the same checkpointed leaves (parameters and optimizer state)."""
    first, second = checkpoint(a), checkpoint(b)
    assert first.keys() == second.keys()
    for name in first:
        if name != "__meta__":
            np.testing.assert_array_equal(first[name], second[name], err_msg=name)


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


def test_diagnostics_hold_the_gradient_noise_scale():
    """train.diagnostics (logged at every --log-interval; sweep.py keeps trace_cov and grad_sq,
    compared with metrics.jsonl in tests/test_experiments.py) carry pegrad.gradient_noise_scale's
    global numbers from the step's own statistics. By hand: N 3, ḡ (1, 2), q (2, 5): σ̂² =
    3/2·(q − ḡ²) = (1.5, 1.5), tr Σ 3, |G|² = 5 − 3/3 = 4, B_simple 0.75."""
    stats = {
        "mean": {"a": jnp.array([1.0, 2.0])},
        "sq_mean": {"a": jnp.array([2.0, 5.0])},
        "batch_size": jnp.array(3),
    }
    diag = train.diagnostics(stats)
    assert (float(diag["trace_cov"]), float(diag["grad_sq"])) == (3.0, 4.0)
    assert float(diag["noise_scale_batch"]) == 0.75
    # ...on any statistics: pegrad's global numbers (train forms them in float32, flat)
    import pegrad

    rng = np.random.default_rng(0)
    mean = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
    sq_mean = jax.tree.map(lambda m: m**2 + rng.uniform(size=m.shape), mean)
    stats = {
        "mean": jax.tree.map(jnp.asarray, mean),
        "sq_mean": jax.tree.map(jnp.asarray, sq_mean),
        "batch_size": jnp.array(5),
    }
    want = pegrad.gradient_noise_scale(stats)
    diag = train.diagnostics(stats)
    for ours, theirs in (
        ("trace_cov", "trace_cov"),
        ("grad_sq", "grad_sq"),
        ("noise_scale_batch", "b_simple"),
    ):
        np.testing.assert_allclose(diag[ours], want[theirs], rtol=1e-5, err_msg=ours)


def test_diagnostics_per_leaf_equal_the_flat_ones():
    """Under FSDP the step reduces each leaf on its own (one flat vector would gather every
    shard): the same numbers, to float32's rounding of a sum taken in another order."""
    rng = np.random.default_rng(1)
    mean = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4), "z": np.zeros(2)}
    stats = {
        "mean": jax.tree.map(jnp.asarray, mean),
        "sq_mean": jax.tree.map(lambda m: jnp.asarray(m**2 + rng.uniform(size=m.shape)), mean),
        "batch_size": jnp.array(5),
    }
    stats["sq_mean"]["z"] = jnp.zeros(2)  # q = 0: left out of ν_adam/ν_micro
    p = jax.tree.map(lambda m: jnp.asarray(rng.uniform(size=m.shape)), mean)
    flat, each = train.diagnostics(stats, p), train.diagnostics(stats, p, per_leaf=True)
    assert flat.keys() == each.keys()
    for key in flat:
        np.testing.assert_allclose(each[key], flat[key], rtol=1e-6, err_msg=key)


def _rule_divisor_inverse(nu: np.ndarray, t: int, cfg: train.Config) -> np.ndarray:
    """1/(√(⟨v̂⟩ + ε_root) + ε), v̂ = ν/(1 − β₂^t): SPEC §4's preconditioner of each Adam-family
    rule, in numpy (micro_adam_msq: v̂ averaged over its block, then ReLU'd)."""
    with np.errstate(invalid="ignore"):  # t = 0: 0/0, no v̂ yet
        v = nu / (1.0 - cfg.b2**t)
    if cfg.msq_block == "row" and v.ndim >= 1:
        v = np.broadcast_to(v.mean(-1, keepdims=True), v.shape)
    if cfg.optimizer == "micro_adam_msq":
        v = np.maximum(v, 0.0)
    return 1.0 / (np.sqrt(v + (cfg.eps_root or 0.0)) + cfg.eps)


@pytest.mark.parametrize(
    "rule",
    [
        dict(optimizer="adam"),  # micro_adam: adam's P of another ν (the metrics test below)
        dict(optimizer="micro_adam_var", eps_root=1e-6),
        dict(optimizer="micro_adam_msq", eps=0.0, eps_root=1e-6, msq_block="row"),
        dict(optimizer="micro_sign_sgd"),
    ],
    ids=lambda r: r["optimizer"],
)
def test_the_adam_family_logs_the_noise_scale_of_its_own_preconditioner(
    rule: dict[str, Any], tmp_path: Path
):
    """B_P's parts are pegrad.gradient_noise_scale(stats, P) for the P the rule divides by, from
    its state BEFORE the step (built here from ν and t by the formula, not by train.py): NaN at
    the first step (no v̂ yet), then finite and unlike B_simple's (P left out would fail); the
    P it names is the rule's own: m̂·P after the update is the rule's direction. A rule without
    a second moment has none."""
    import pegrad

    knobs = dict(eps=1e-3, weight_decay=0.0, warmup=0, lr=2.0**-7, schedule="constant")
    cfg = tiny(tmp_path, **(knobs | rule))  # lr exact in float32, constant: the update is −lr·d
    run = train.build(cfg)
    params, state = run.task.params, cast(Any, run.opt.init(run.task.params))
    step = jax.jit(run.step)
    fn = pegrad.value_and_grad_stats(run.task.loss_fn, ("mean", "sq_mean"))
    for t in range(3):
        batch = run.task.sample(run.task.train_data, key=jax.random.fold_in(run.train_key, t))
        _, stats = fn(params, batch)
        new_params, new_state, _, diag = step(params, state, batch)
        if cfg.optimizer == "micro_sign_sgd":
            assert train.adam_preconditioner(cfg, state) is None
            assert not [k for k in diag if k.endswith(("_p", "_p_batch"))]
            return
        adam, new_adam = state[0], new_state[0]  # chain(rule, decay, lr): the rule's state
        p = jax.tree.map(lambda nu, t=t: _rule_divisor_inverse(np.asarray(nu), t, cfg), adam.nu)
        if t == 0:
            assert all(np.isnan(float(diag[k])) for k in ("trace_cov_p", "grad_sq_p"))
        else:
            want = pegrad.gradient_noise_scale(stats, p)
            for k in ("trace_cov_p", "grad_sq_p"):  # train's are float32 sums of the flat vector
                np.testing.assert_allclose(diag[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_allclose(diag["noise_scale_p_batch"], want["b_p"], rtol=1e-4)
            assert abs(float(want["trace_cov_p"]) - float(want["trace_cov"])) > 1e-3
        # the rule's own divisor: its update is −lr·m̂·P(state after the update)
        p_new = train.adam_preconditioner(cfg, new_state)
        m_hat = jax.tree.map(lambda m, t=t: m / (1.0 - cfg.b1 ** (t + 1)), new_adam.mu)
        moved = jax.tree.map(lambda a, b: (b - a) / -cfg.lr, params, new_params)
        for got, m, q in zip(*map(jax.tree.leaves, (moved, m_hat, p_new)), strict=True):
            np.testing.assert_allclose(got, m * q, rtol=1e-9, atol=1e-12)
        params, state = new_params, new_state


def test_resume_reproduces_an_uninterrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    steps = dict(model="mlp", steps=6, schedule="cosine")
    train.main(tiny(tmp_path / "full", **steps))

    # Kill the run after step 4's update: its last checkpoint is the one after 4 steps.
    def crash(self: train.Progress, step: int, loss: float) -> None:
        if step == 4:
            raise KeyboardInterrupt

    killed = tmp_path / "killed"
    with monkeypatch.context() as m:
        m.setattr(train.Progress, "update", crash)
        # Interrupted is a KeyboardInterrupt: callers that catch one still do.
        with pytest.raises(train.Interrupted) as err:
            train.main(tiny(killed, **steps))
    assert isinstance(err.value, KeyboardInterrupt)
    assert str(err.value) == (
        f"the last checkpoint is {killed / 'checkpoint.npz'} (step 4); continue it with: "
        f"{trainkit.resume_command(killed)}"
    )
    assert json.loads((killed / "checkpoint.json").read_text())["step"] == 4
    train.main(tiny(killed, resume=True, **steps))

    assert_same_params(tmp_path / "full", killed)
    assert strip_seconds(metrics(tmp_path / "full")) == strip_seconds(metrics(killed))


def test_a_run_killed_before_its_first_checkpoint_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Killed before any checkpoint: the same command refuses to overwrite it and names
    --resume, with which it starts over at step 0. --resume in a directory that holds nothing
    yet (a job preempted before it wrote anything) starts the run too."""
    run = dict(model="mlp", steps=4, checkpoint_interval=10)

    def crash(self: train.Progress, step: int, loss: float) -> None:
        if step == 1:
            raise KeyboardInterrupt

    killed = tmp_path / "killed"
    with monkeypatch.context() as m:
        m.setattr(train.Progress, "update", crash)
        with pytest.raises(train.Interrupted, match="before the first checkpoint"):
            train.main(tiny(killed, **run))
    assert (killed / "config.json").exists() and not (killed / "checkpoint.npz").exists()
    assert len(metrics(killed)) == 2  # steps 0 and 1 were logged
    with pytest.raises(train.ConfigError, match="killed before its first checkpoint.*--resume"):
        train.main(tiny(killed, **run))
    train.main(tiny(killed, resume=True, **run))
    train.main(tiny(tmp_path / "fresh", resume=True, **run))  # nothing there: a new run

    assert_same_params(tmp_path / "fresh", killed)
    assert strip_seconds(metrics(tmp_path / "fresh")) == strip_seconds(metrics(killed))


@pytest.mark.parametrize(
    "schedule, warmup",
    [("constant", 2), ("cosine", 5)],
    ids=["constant", "cosine-in-warmup"],
)
def test_extending_a_finished_run_equals_the_longer_run(tmp_path: Path, schedule: str, warmup: int):
    """--steps 3 then --resume --steps 5, where the learning rate of the 3 steps taken does not
    depend on --steps: a constant schedule, or a cosine one whose warmup outlasts them."""
    mlp = dict(model="mlp", schedule=schedule, warmup=warmup, checkpoint_interval=10)
    train.main(tiny(tmp_path / "long", steps=5, **mlp))
    train.main(tiny(tmp_path / "split", steps=3, **mlp))
    train.main(tiny(tmp_path / "split", steps=5, resume=True, **mlp))
    assert_same_params(tmp_path / "long", tmp_path / "split")


def test_resume_refuses_steps_that_relay_the_schedule(tmp_path: Path):
    """A cosine schedule is laid over --steps: resuming 4 steps of a 4-step run as a 6-step one
    would have taken them at other learning rates. Refused, naming the knob, before anything
    in the run's directory changes; so is a --steps short of the checkpoint."""
    out = tmp_path / "run"
    train.main(tiny(out, model="mlp", steps=4, warmup=1, schedule="cosine"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(train.ConfigError, match=r"--resume --steps 6: .*with --steps 4") as err:
        train.main(tiny(out, model="mlp", steps=6, warmup=1, schedule="cosine", resume=True))
    assert "learning rate of step 2" in str(err.value)  # steps 0, 1: warmup, the same
    with pytest.raises(train.ConfigError, match="--steps 3: the checkpoint is at step 4"):
        train.main(tiny(out, model="mlp", steps=3, warmup=1, schedule="cosine", resume=True))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint(tmp_path: Path):
    """A real SIGINT to `python train.py` mid-run: one line on stderr, exit status 130, and the
    checkpoint it names is the one on disk. The script starts with Ctrl-C handled as in a
    terminal: a suite started as a background job (`cmd &` in a script) passes SIGINT on
    ignored, and Python keeps an ignored SIGINT ignored."""
    out = tmp_path / "run"
    never = "100000000"
    args = ["--model", "mlp", "--size", "tiny", "--steps", never, "--warmup", "0",
            "--checkpoint-interval", "3", "--eval-interval", never, "--out", str(out)]  # fmt: skip
    as_in_a_terminal = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", as_in_a_terminal, *args],
        cwd=REPO,
        env=script_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint.json").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    step = train.checkpoint_step(out)
    assert step is not None and step % 3 == 0
    assert stderr.strip().splitlines() == [  # a command to paste where the run started
        f"interrupted: the last checkpoint is {out / 'checkpoint.npz'} (step {step}); "
        f"continue it with: python train.py --resume --out {out}"
    ]


def test_a_ctrl_c_python_would_drop_still_ends_the_run():
    """A SIGINT handled inside a garbage-collection callback: Python's own handler raises
    KeyboardInterrupt there, Python prints it ("Exception ignored in ...") and drops it, and the
    run went on (the test above then timed out). Within ctrl_c_between_steps it is marked and
    raised at the next step boundary (`check`); a second Ctrl-C raises at once and stays
    marked; one not yet checked raises on leaving; Python's handler is back after."""

    def ctrl_c_in_gc(phase: str, info: dict) -> None:
        if phase == "start":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, inside the callback

    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with trainkit.ctrl_c_between_steps() as check:
            gc.callbacks.append(ctrl_c_in_gc)
            try:
                gc.collect()
            finally:
                gc.callbacks.remove(ctrl_c_in_gc)
            with pytest.raises(KeyboardInterrupt):
                check()
            check()  # delivered once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1.0)
            with pytest.raises(KeyboardInterrupt):  # still marked, should that one be dropped
                check()
        with pytest.raises(KeyboardInterrupt), trainkit.ctrl_c_between_steps():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)


def test_the_ctrl_c_hint_continues_the_run_as_it_was_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """The command Ctrl-C prints, run as printed (its --out has a space), continues the run in
    --out as it was configured, not with the defaults: killed before its first checkpoint and
    after it, both end as the uninterrupted run (metrics, parameters), config.json untouched."""
    flags = ["--model", "mlp", "--size", "tiny", "--dtype", "float64", "--batch-size", "4",
             "--steps", "5", "--lr", "0.02", "--warmup", "1", "--log-interval", "1",
             "--eval-interval", "2", "--eval-batches", "2",
             "--checkpoint-interval", "3"]  # fmt: skip
    full = tmp_path / "full"
    train.cli([*flags, "--out", str(full)])
    for kill_at, then in [(1, "start it over with"), (4, "continue it with")]:

        def crash(self: train.Progress, step: int, loss: float, kill_at: int = kill_at) -> None:
            if step == kill_at:
                raise KeyboardInterrupt

        out = tmp_path / f"killed at {kill_at}"
        capsys.readouterr()
        with monkeypatch.context() as m, pytest.raises(SystemExit) as exit:
            m.setattr(train.Progress, "update", crash)
            train.cli([*flags, "--out", str(out)])
        assert exit.value.code == 130
        (line,) = capsys.readouterr().err.strip().splitlines()
        printed = re.fullmatch(rf"interrupted: .*; {then}: python (\S+) (--resume --out .*)", line)
        assert printed is not None, line
        assert Path(printed.group(1)).resolve() == REPO / "train.py"  # the program, to paste
        saved = (out / "config.json").read_bytes()
        train.cli(shlex.split(printed.group(2)))
        assert (out / "config.json").read_bytes() == saved
        assert train.checkpoint_step(out) == 5
        assert strip_seconds(metrics(out)) == strip_seconds(metrics(full))
        assert_same_params(full, out)


def test_resume_takes_resumable_flags_and_refuses_others_naming_both_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """`--resume --out DIR` with flags: a knob that may change on resume (--steps, under a
    constant schedule) changes; one that may not is refused, each named with the value typed and
    the run's, and nothing in DIR changes."""
    out = tmp_path / "run"
    flags = ["--model", "mlp", "--size", "tiny", "--batch-size", "4", "--steps", "2",
             "--schedule", "constant", "--lr", "0.02", "--eval-interval", "2"]  # fmt: skip
    train.cli([*flags, "--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as exit:
        train.cli(["--resume", "--out", str(out), "--lr", "0.01", "--seed", "1", "--steps", "3"])
    assert isinstance(exit.value.code, str) and exit.value.code.startswith(
        "error: --resume: --lr 0.01 differs from the run's 0.02, --seed 1 differs from the "
        f"run's 0 in {out / 'config.json'}; "
    )
    assert "\n" not in exit.value.code
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    train.cli(["--resume", "--out", str(out), "--steps", "3", "--lr", "0.02"])  # the same lr
    assert train.checkpoint_step(out) == 3
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 3 and config["lr"] == 0.02 and config["model"] == "mlp"


def test_console_and_metrics_label_each_loss_with_the_same_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Off a terminal the console prints a loss on the steps metrics.jsonl logs one, under the
    same step number, and the same number to its precision; so with the held-out losses."""
    train.main(tiny(tmp_path, model="mlp", steps=6, log_interval=2, eval_interval=3))
    console = capsys.readouterr().out
    printed = dict(re.findall(r"^step (\d+)/6  loss (\S+)", console, re.MULTILINE))
    logged = {str(m["step"]): m["loss"] for m in metrics(tmp_path) if "loss" in m}
    assert printed.keys() == logged.keys() == {"0", "2", "3", "4", "5"}
    assert printed == {step: f"{loss:.4f}" for step, loss in logged.items()}
    evaluated = dict(re.findall(r"^step (\d+): eval loss (\S+)", console, re.MULTILINE))
    logged = {str(m["step"]): m["eval_loss"] for m in metrics(tmp_path) if "eval_loss" in m}
    assert evaluated == {step: f"{loss:.4f}" for step, loss in logged.items()}
    assert evaluated.keys() == {"0", "3", "6"}


# Tasks that cannot train, each as a user might write it.
WRONG_SIGNATURE = """
import train

def make(cfg):
    return train.mlp_task(cfg, key=None)
"""
VECTOR_LOSS = """
import jax.numpy as jnp

import train

def make(cfg, *, key):
    task = train.mlp_task(cfg, key=key)
    return task._replace(loss_fn=lambda params, example: jnp.square(example[1]))
"""


@pytest.mark.parametrize(
    "files, args, message",
    [
        ({"task.py": WRONG_SIGNATURE}, ["--task", "task.py:make", "--out", "new/run"],
         "define it as make(cfg, *, key)"),
        ({"task.py": VECTOR_LOSS}, ["--task", "task.py:make"], "must return a scalar"),
        ({"file": ""}, ["--out", "file/run"], "file is not a directory"),
    ],
    ids=["factory-signature", "vector-loss", "out-under-a-file"],
)  # fmt: skip
def test_cli_failure_is_one_line_naming_the_fix_and_leaves_nothing_behind(
    tmp_path: Path, files: dict[str, str], args: list[str], message: str
):
    """`python train.py` in a directory of the user's: one line "error: ..." naming the fix,
    exit status 1, no traceback, and no directory created (runs/<timestamp> nor --out)."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    small = ["--model", "mlp", "--size", "tiny", "--batch-size", "4", "--steps", "2"]
    proc = run_script(str(REPO / "train.py"), *small, *args, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)


def test_a_run_that_fails_before_step_0_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A failure no check foresees (here: the step cannot be traced) removes what the run
    created, its --out and the parents it made, and leaves a directory that was there as it
    was; Ctrl-C before anything is written says there is nothing to resume."""

    def untraceable(cfg: train.Config, task: train.Task, opt: Any) -> Any:
        def step(params: Any, state: Any, batch: Any) -> Any:
            raise ValueError("this step cannot be traced")

        return step

    with monkeypatch.context() as m:
        m.setattr(train, "make_step", untraceable)
        with pytest.raises(ValueError, match="cannot be traced"):
            train.main(tiny(tmp_path / "new" / "run", model="mlp"))
        assert not (tmp_path / "new").exists()
        (tmp_path / "mine").mkdir()
        with pytest.raises(ValueError, match="cannot be traced"):
            train.main(tiny(tmp_path / "mine", model="mlp"))
        assert list((tmp_path / "mine").iterdir()) == []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "build", interrupted)
    with pytest.raises(train.Interrupted, match="nothing to resume"):
        train.main(tiny(tmp_path / "other", model="mlp"))
    assert not (tmp_path / "other").exists()


# A model and its data defined outside the repo, as a user writes them: a small Equinox network
# regressing a noisy linear map.
OWN_TASK = """
import equinox as eqx
import jax
import jax.numpy as jnp

import train


class Net(eqx.Module):
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, dtype, *, key):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(3, 8, dtype=dtype, key=k1)
        self.out = eqx.nn.Linear(8, "scalar", dtype=dtype, key=k2)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def make(cfg, *, key):
    dtype = jnp.dtype(cfg.dtype)
    params, static = eqx.partition(Net(dtype, key=key), eqx.is_inexact_array)

    def loss_fn(params, example):
        x, y = example
        return (eqx.combine(params, static)(x) - y) ** 2

    def sample(w, *, key):
        x_key, noise_key = jax.random.split(key)
        x = jax.random.normal(x_key, (cfg.batch_size, 3), dtype)
        return x, x @ w + 0.1 * jax.random.normal(noise_key, (cfg.batch_size,), dtype)

    w = jnp.asarray([1.0, -2.0, 0.5], dtype)
    return train.Task(params, loss_fn, sample, train_data=w, eval_data=w)
"""


@pytest.fixture(scope="module")
def own_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("project") / "my_task.py"
    path.write_text(OWN_TASK)
    return path


def test_own_model_trains_through_the_python_and_the_cli_hook(own_task: Path, tmp_path: Path):
    """train.main(cfg, task=make), then `python train.py --task PATH.py:make` from the repo and
    `python /repo/train.py --task my_task:make` from the user's directory: the user's network
    trained (its leaves checkpointed, its loss falling), the same numbers all three ways."""
    spec = importlib.util.spec_from_file_location("my_task", own_task)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = tiny(tmp_path / "python", steps=8, lr=0.1, eval_interval=4)
    train.main(cfg, task=module.make)
    assert json.loads((tmp_path / "python" / "config.json").read_text())["task"] == "my_task:make"
    names = checkpoint(tmp_path / "python").keys()
    assert "['params'].hidden.weight" in names and "['params'].out.bias" in names
    python = metrics(tmp_path / "python")
    evals = [m["eval_loss"] for m in python if "eval_loss" in m]
    assert len(evals) == 3 and evals[-1] < 0.6 * evals[0]

    for task, cwd in [(f"{own_task}:make", REPO), ("my_task:make", own_task.parent)]:
        out = tmp_path / ("cli" if cwd == REPO else "cwd")
        proc = run_script(
            str(REPO / "train.py"), *argv(dataclasses.replace(cfg, task=task, out=str(out))),
            cwd=cwd,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert json.loads((out / "config.json").read_text())["task"] == task
        for a, b in zip(python, metrics(out), strict=True):
            assert a.keys() == b.keys()
            for key in ("loss", "eval_loss"):
                if key in a:
                    np.testing.assert_allclose(a[key], b[key], rtol=1e-12, err_msg=key)


def _make_from(task: Any) -> Any:
    return lambda cfg, *, key: task


def _good(cfg: train.Config, *, key: Any) -> train.Task:
    return train.mlp_task(cfg, key=key)


@pytest.mark.parametrize(
    "hook, message",
    [
        (lambda p: dict(task=_make_from({"w": 1})), "returned a dict, not a train.Task"),
        (
            lambda p: dict(task=lambda cfg, *, key: _good(cfg, key=key)._replace(
                params={"w": jnp.ones(3), "count": jnp.arange(3)})),
            r"params\['count'\] is int64, not a floating array.*eqx.partition",
        ),
        (
            lambda p: dict(task=lambda cfg, *, key: _good(cfg, key=key)._replace(
                sample=lambda data, *, key: jnp.zeros((cfg.batch_size + 1, 2)))),
            r"shape \(5, 2\); every leaf's leading axis must be --batch-size 4",
        ),
        (lambda p: dict(task=train.mlp_task(train.Config(), key=jax.random.key(0))),
         "takes a factory"),
        (lambda p: dict(cfg_task=f"{p}:nothing"), "'nothing' in .* is absent, not a function"),
        (lambda p: dict(cfg_task=f"{p.parent / 'absent.py'}:make"), "no file"),
        (lambda p: dict(cfg_task="my_task"), "want MODULE:FACTORY or PATH.py:FACTORY"),
        (lambda p: dict(cfg_task="no_such_module_of_pegrad:make"), "no module"),
    ],
    ids=["not-a-task", "integer-params", "batch-size", "a-task-not-a-factory", "no-factory",
         "no-file", "no-colon", "no-module"],
)  # fmt: skip
def test_a_bad_task_is_refused_before_any_work(
    own_task: Path, tmp_path: Path, hook: Any, message: str
):
    given = hook(own_task)
    cfg = tiny(tmp_path, model="mlp", task=given.get("cfg_task"))
    with pytest.raises(train.ConfigError, match=message):
        train.main(cfg, task=given.get("task"))
    assert not (tmp_path / "config.json").exists()


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
    assert "checkpoint" in str(err.value) and "a smaller --lr (this run: 1e+30" in str(err.value)
    diverged = int(re.search(r"at step (\d+)", str(err.value)).group(1))  # pyright: ignore[reportOptionalMemberAccess]
    logged = metrics(tmp_path)
    assert logged[-1]["step"] == diverged and logged[-1]["diverged"].startswith("loss is ")
    assert all(np.isfinite(m["loss"]) for m in logged[:-1])
    saved = checkpoint(tmp_path)
    step = json.loads(str(saved["__meta__"]))["step"]
    assert 1 <= step <= diverged < 10
    assert all(np.isfinite(x).all() for k, x in saved.items() if k != "__meta__")


def test_bad_input_is_a_config_error(tmp_path: Path):
    with pytest.raises(train.ConfigError, match="context length"):
        train.main(tiny(tmp_path / "a", seq_len=9))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(train.ConfigError, match="too short"):
        train.main(tiny(tmp_path / "b", data=str(short)))
    train.main(tiny(tmp_path / "d", model="mlp", steps=1))
    with pytest.raises(train.ConfigError, match=r"already holds a run \(at step 1\)"):
        train.main(tiny(tmp_path / "d", model="mlp", steps=1))
    # From Python the Config is the whole config: each knob that may not change, checked.
    with pytest.raises(train.ConfigError, match=r"--lr 0.5 differs from the run's 0.01 in "):
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


# --------------------------------------------------------------------------------------------
# Issue 50: a new user's first hour with train.py.


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
        (["--d-model", "0"], "--d-model must be >= 1, got 0"),
        (["--eps=-1e-8"], "--eps must be >= 0"),
        (["--b1", "1.5"], "b1 must be in"),
        (["--optimizer", "sign_sgd", "--max-grad-norm", "1.0"], "invariant to gradient scale"),
        (["--max-grad-norm", "0"], "max_grad_norm must be > 0"),
    ],
    ids=["chunk-size", "d-model", "eps", "b1", "sign-clip", "clip-zero"],
)
def test_every_flag_is_checked_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], message: str
):
    """A bad flag is refused by `check`, before a device, a model or a file is touched."""

    def work(*args: Any) -> Any:
        raise AssertionError("the run began before the flags were checked")

    monkeypatch.setattr(train, "_train", work)
    cfg = train.parse_config([*flags, "--out", str(tmp_path / "run")])
    with pytest.raises(train.ConfigError, match=re.escape(message)):
        train.main(cfg)
    assert not (tmp_path / "run").exists()


def test_a_refused_resume_prints_learning_rates_with_the_digits_that_differ():
    """A schedule laid over another --steps: the two learning rates of the first step that
    changes are printed with as many digits as tell them apart (not "0.003, not 0.003")."""
    old = train.Config(schedule="cosine", warmup=0, steps=600, lr=3e-3)
    new = dataclasses.replace(old, steps=601)
    with pytest.raises(train.ConfigError) as err:
        trainkit.check_schedule(old, new, 300, train.make_schedule)
    now, was = re.search(r"would be (\S+), not (\S+)\)", str(err.value)).groups()  # pyright: ignore[reportOptionalMemberAccess]
    assert now != was and float(now) != float(was)
    assert trainkit.digits(0.003, 0.0030000001) == ["0.003", "0.0030000001"]
    assert trainkit.digits(0.1, 0.2) == ["0.1", "0.2"]


def test_metrics_log_the_smoothed_noise_scale_and_the_console_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """metrics.jsonl's noise_scale is the ratio of the averaged parts (`train.NoiseScale`,
    what `python plots.py OUT` draws), never one batch's ratio, which is logged as
    noise_scale_batch; the console prints the smoothed one beside the loss."""
    import plots

    train.main(tiny(tmp_path, model="mlp", steps=8, log_interval=1, eval_interval=4))
    logged = [m for m in metrics(tmp_path) if "trace_cov" in m]
    noise, noise_p = train.NoiseScale(), train.NoiseScale(suffix="_p")  # B_simple, B_P
    for m in logged:
        np.testing.assert_allclose(m["noise_scale_batch"], m["trace_cov"] / m["grad_sq"], 1e-6)
        assert {k: m[k] for k in ("trace_cov_ema", "grad_sq_ema", "noise_scale")} == noise.add(m)
        p_keys = ("trace_cov_p_ema", "grad_sq_p_ema", "noise_scale_p")
        assert {k: m[k] for k in p_keys} == noise_p.add(m)  # micro_adam: B_P beside B_simple
        if m["step"] == 0:  # no v̂ before the first update: B_P's parts null, averages 0
            assert [m[k] for k in ("trace_cov_p", "grad_sq_p", "noise_scale_p_batch")] == [None] * 3
            assert (m["trace_cov_p_ema"], m["noise_scale_p"]) == (0.0, None)
        else:
            assert m["trace_cov_p"] > 0 and m["trace_cov_p_ema"] > 0
            assert m["noise_scale_p_batch"] == pytest.approx(m["trace_cov_p"] / m["grad_sq_p"])
    drawn = plots.noise_scale_series(tmp_path)["smoothed"]
    logged_ratio = np.array(
        [np.nan if m["noise_scale"] is None else m["noise_scale"] for m in logged]
    )
    np.testing.assert_allclose(drawn, logged_ratio, rtol=1e-12)
    assert any(m["noise_scale"] != m["noise_scale_batch"] for m in logged[1:])
    console = capsys.readouterr().out
    shown = re.findall(r"^step (\d+)/8  loss \S+  noise scale (\S+)", console, re.MULTILINE)
    ratio = {str(m["step"]): m["noise_scale"] for m in logged if m["noise_scale"] is not None}
    assert shown and all(f"{ratio[s]:.3g}" == v for s, v in shown)


def test_a_resumed_run_reports_the_steps_it_ran_and_the_runs_first_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    run = dict(model="mlp", schedule="constant", eval_interval=2, checkpoint_interval=2)
    first = train.main(tiny(tmp_path, steps=4, **run))
    capsys.readouterr()
    resumed = train.main(tiny(tmp_path, steps=6, resume=True, **run))
    assert resumed["steps_run"] == 2 and first["steps_run"] == 4
    assert (
        resumed["first_eval_loss"] == first["first_eval_loss"] == metrics(tmp_path)[0]["eval_loss"]
    )
    assert "done: steps 4 -> 6 (resumed)" in capsys.readouterr().out


def test_a_task_file_resumes_from_any_directory(
    own_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """--task PATH.py:make typed relative to where the run started: config.json records the
    file's absolute path, so --resume --out DIR works from another directory (and the same
    file typed relative to there is the same task)."""
    monkeypatch.chdir(own_task.parent)
    out = tmp_path / "run"
    train.cli(["--task", "my_task.py:make", "--batch-size", "4", "--steps", "2", "--dtype",
               "float64", "--schedule", "constant", "--out", str(out)])  # fmt: skip
    recorded = json.loads((out / "config.json").read_text())["task"]
    assert recorded == f"{own_task}:make"
    monkeypatch.chdir(tmp_path)
    train.cli(["--resume", "--out", str(out), "--steps", "3"])
    train.cli(["--resume", "--out", str(out), "--steps", "4",
               "--task", f"{os.path.relpath(own_task)}:make"])  # fmt: skip
    assert train.checkpoint_step(out) == 4


@pytest.mark.parametrize(
    "optimizer, flags", [("micro_adam_msq", "--eps 0 --eps-root 1e-08"), ("adam", "--lr")]
)
def test_a_divergence_names_the_flags_that_fix_it(optimizer: str, flags: str):
    message = trainkit.divergence_fixes(train.Config(optimizer=optimizer))  # type: ignore[arg-type]
    assert flags in message and "a smaller --lr (this run: 0.003" in message


TUPLE_LOSS = """
import train

def make(cfg, *, key):
    task = train.mlp_task(cfg, key=key)
    return task._replace(loss_fn=lambda params, example: (task.loss_fn(params, example), 0.0))
"""
LIST_BATCH = """
import jax

import train

def make(cfg, *, key):
    task = train.mlp_task(cfg, key=key)
    def sample(data, *, key):
        x, y = task.sample(data, key=key)
        return [(x[i], y[i]) for i in range(cfg.batch_size)]
    return task._replace(sample=sample)
"""


@pytest.mark.parametrize(
    "source, message",
    [(TUPLE_LOSS, "a (loss, aux) pair? return the loss alone"), (LIST_BATCH, "stack them")],
    ids=["tuple-loss", "list-of-examples"],
)
def test_a_task_written_the_other_way_names_the_fix(tmp_path: Path, source: str, message: str):
    (tmp_path / "task.py").write_text(source)
    cfg = tiny(tmp_path / "run", model="mlp", task=f"{tmp_path / 'task.py'}:make")
    with pytest.raises(train.ConfigError, match=re.escape(message)):
        train.main(cfg)


# --------------------------------------------------------------------------------------------
# Issue 58: every field of a user's Task checked before any work (SPEC §6.1), one line each.


def _mlp_model() -> Any:
    import equinox as eqx

    return eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))  # holds activation functions


BAD_FIELDS: dict[str, Any] = {
    "params": lambda: {"w": jnp.ones(2), "steps": jnp.arange(2)},
    "loss_fn": lambda: "mse",
    "sample": lambda: None,
    "train_data": _mlp_model,
    "eval_data": lambda: {"x": jnp.ones(3), "f": jnp.tanh},
    "unit": lambda: 3,
    "units_per_example": lambda: 0,
}


@pytest.mark.parametrize("field", list(BAD_FIELDS))
def test_each_task_field_is_checked_before_any_work_in_one_line(tmp_path: Path, field: str):
    """A Task from a user's factory with one bad field: one line naming Task.<field>, before
    --out is created."""
    assert set(BAD_FIELDS) == set(train.Task._fields)

    def make(cfg: train.Config, *, key: Any) -> train.Task:
        return _good(cfg, key=key)._replace(**{field: BAD_FIELDS[field]()})

    with pytest.raises(train.ConfigError) as err:
        train.main(tiny(tmp_path / "run", model="mlp"), task=make)
    message = str(err.value)
    assert "\n" not in message and f"Task.{field}" in message, message
    assert not (tmp_path / "run").exists()


MLP_AS_DATA = """
import equinox as eqx
import jax

import train

def make(cfg, *, key):
    task = train.mlp_task(cfg, key=key)
    teacher = eqx.nn.MLP(32, 8, 16, 1, key=key)
    return task._replace(train_data=teacher, eval_data=teacher)
"""


def test_an_equinox_mlp_as_train_data_is_one_error_line(tmp_path: Path):
    """eqx.nn.MLP holds its activation functions as leaves: once a JAX traceback of 22 lines,
    now one line naming the field and the leaf, and the fix."""
    (tmp_path / "task.py").write_text(MLP_AS_DATA)
    small = ["--size", "tiny", "--batch-size", "4", "--steps", "2", "--out", "run"]
    proc = run_script(str(REPO / "train.py"), "--task", "task.py:make", *small, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Task.train_data.activation" in lines[0] and "eqx.partition" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_the_first_minute_says_what_it_does_and_only_the_knobs_that_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Before the compile wait the console says it is compiling; it shows the knobs that differ
    from the defaults (config.json holds them all) and no line over 300 characters."""
    cfg = tiny(tmp_path, model="mlp", steps=2)
    train.main(cfg)
    console = capsys.readouterr().out
    lines = console.splitlines()
    assert max(map(len, lines)) <= 300, max(lines, key=len)
    assert lines[0].startswith("building ")
    compiling = next(i for i, line in enumerate(lines) if line.startswith("compiling the training"))
    assert compiling < next(i for i, line in enumerate(lines) if line.startswith("step 0"))
    shown = " ".join(line for line in lines if line.startswith(("config", "  ")))
    assert "model=mlp" in shown and "steps=2" in shown
    assert "optimizer=" not in shown and "b1=" not in shown  # defaults: not shown
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == {**dataclasses.asdict(cfg), "resume": False}
