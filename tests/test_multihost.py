"""Several processes and sharded parameters (train.py's "Several hosts"), on a CPU.

Covered: two local processes, joined by jax.distributed at a free localhost port and talking
through CPU collectives (gloo), give the losses of one process, with parameters replicated and
with --param-sharding fsdp, and the checkpoint they write resumes in one process to the run that
never stopped; on two (fake) devices in one process, FSDP gives the replicated losses while the
step really keeps parameters and optimizer state split; each device draws only its own rows of
a batch; the FSDP rule (which axis of a leaf is split); bad process flags as one-line errors.
Determinism: gloo pairs the collectives of two processes by their order in each process's
program, so the processes must run one program: two fresh processes trace the step of several
configs to the same text, and processes that differ (config, initial parameters, compiled
program) stop before step 0 with one line saying what differs (trainkit.agree_across_processes).

Tolerance: the runs are float64, and two processes add the two halves of a batch's gradient
sums in another order than one device does, so only rounding may differ: losses agree to
rtol 1e-12 and parameters to 1e-12 of each leaf's largest entry (we see ~2e-15 after 4 steps);
the gradient diagnostics are computed in float32, so to rtol 1e-6.
"""

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from test_train import argv, checkpoint, metrics, run_script, tiny

import train
import trainkit

# The processes started here inherit tests/conftest.py's compile flags (XLA_FLAGS).
REPO = Path(__file__).resolve().parent.parent
KEYS = ("loss", "eval_loss", "grad_norm", "frac_snr_gt_1_over_B", "nu_adam_over_nu_micro")


def base(out: Path, **overrides: Any) -> train.Config:
    """test_train's tiny float64 transformer; constant schedule, so that --steps may grow on
    resume; a batch of 6, a length that no other axis has (see the sampler's test)."""
    return tiny(out, schedule="constant", batch_size=6, **overrides)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> train.Config:
    """The reference: one process, one device, 4 steps."""
    cfg = base(tmp_path_factory.mktemp("one"))
    train.main(cfg)
    return cfg


def assert_same_losses(a: list[dict], b: list[dict]) -> None:
    """Losses to float64 rounding; the diagnostics are float32 (train.diagnostics): to its."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b, strict=True):
        assert {k for k in KEYS if k in x} == {k for k in KEYS if k in y}, (x, y)
        for key in KEYS:
            if key in x:
                rtol = 1e-12 if "loss" in key else 1e-6
                np.testing.assert_allclose(x[key], y[key], rtol=rtol, err_msg=f"{key} {x}")


def assert_same_run(a: Path, b: Path) -> None:
    """Same logged steps and losses, same final parameters and optimizer state, to rounding."""
    assert_same_losses(metrics(a), metrics(b))
    ca, cb = checkpoint(a), checkpoint(b)
    assert ca.keys() == cb.keys()
    for name in ca.keys() - {"__meta__"}:
        scale = np.abs(ca[name]).max()
        np.testing.assert_allclose(ca[name], cb[name], rtol=0, atol=1e-12 * scale, err_msg=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    cfg: train.Config,
    logs: Path,
    processes: int = 2,
    timeout: float = 240,
    perturb: str | None = None,
) -> list[str]:
    """Run `cfg` as `processes` local processes of one run (python train.py ... --coordinator
    --num-processes --process-id); return each one's stdout. Output goes to files, not pipes,
    so that no process blocks on a full pipe while another waits for it in a collective.
    `perturb`: the last process runs this file as a script that first changes its own
    `perturb` (see PERTURB below); processes may then fail: their exit codes are not checked."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    logs.mkdir(parents=True, exist_ok=True)
    running, files = [], []
    deadline = time.monotonic() + timeout
    try:
        for i in range(processes):
            me = dataclasses.replace(
                cfg, coordinator=f"127.0.0.1:{port}", num_processes=processes, process_id=i
            )
            files += [open(logs / f"{i}.out", "w"), open(logs / f"{i}.err", "w")]  # noqa: SIM115
            cmd = [sys.executable, "train.py", *argv(me)]
            if perturb is not None and i == processes - 1:
                cmd = [sys.executable, __file__, "perturb", perturb, *argv(me)]
            running.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=files[-2], stderr=files[-1])
            )
        # One process failing leaves the others waiting for it: stop at the first failure.
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            if any(p.returncode for p in running):
                break
            time.sleep(0.2)
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    for i, p in enumerate(running):
        stderr = (logs / f"{i}.err").read_text()[-3000:]
        ok = p.returncode == 0 or perturb is not None
        assert ok, f"process {i} exited {p.returncode} (killed: -9): {stderr}"
    return [(logs / f"{i}.out").read_text() for i in range(processes)]


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharding", ["replicated", "fsdp"])
def test_two_processes_give_the_losses_of_one_and_resume_in_one(
    one: train.Config, tmp_path: Path, sharding: str
):
    """Two processes run the first 2 of the reference's 4 steps, and their checkpoint resumes in
    one process (replicated, whatever the two did) for the other 2."""
    run = tmp_path / "run"
    half = dataclasses.replace(one, out=str(run), steps=2, param_sharding=sharding)
    first, second = launch(half, tmp_path / "logs")
    assert f"({sharding}), 2 x cpu device(s) in 2 processes" in first
    # Process 0 speaks (and writes) for the run; gloo itself says hello in every process.
    assert [line for line in second.splitlines() if not line.startswith("[Gloo]")] == []
    reference = metrics(Path(str(one.out)))
    # The two-process run ends with an evaluation at step 2, where the reference goes on.
    *steps, last = metrics(run)
    assert_same_losses([m for m in reference if m["step"] < 2], steps)
    assert last["step"] == 2
    np.testing.assert_allclose(last["eval_loss"], reference[2]["eval_loss"], rtol=1e-12)
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 2
    train.main(dataclasses.replace(one, out=str(run), resume=True, param_sharding="replicated"))
    assert_same_run(Path(str(one.out)), run)


# What the last process changes in itself before train.main (the script mode "perturb" below):
# each is a way for processes to disagree that no collective would report.
PERTURB = {
    "config": "--lr",  # launched with another learning rate
    "parameters": "one initial weight",  # e.g. a model initialised differently on one host
    "program": "its loss rounded to float32",  # the step traced to another program
}


@pytest.mark.parametrize(
    "perturb, message",
    [
        ("config", "in their config (except --process-id)"),
        ("parameters", "in their initial parameters and optimizer state"),
        ("program", "in their compiled train step"),
    ],
)
def test_processes_that_disagree_stop_before_step_0(
    one: train.Config, tmp_path: Path, perturb: str, message: str
):
    """The guard (trainkit.agree_across_processes): when one process differs, every process stops
    with one line naming what differs, before any step; never a silently wrong number."""
    run = tmp_path / "run"
    cfg = dataclasses.replace(one, out=str(run), steps=2, param_sharding="fsdp")
    launch(cfg, tmp_path / "logs", perturb=perturb)
    for i in range(2):
        stderr = (tmp_path / "logs" / f"{i}.err").read_text()
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert errors == [f"error: processes [1] differ from process 0 {message}: their "
                          "collectives would exchange the wrong arrays, silently; stopped before "
                          "step 0"], stderr[-3000:]  # fmt: skip
    metrics_file = run / "metrics.jsonl"
    assert not metrics_file.exists() or not metrics_file.read_text()  # no step was taken


# Configs whose step is traced by two fresh processes (below): a jaxpr variable's hash is its
# address, so a set of them iterated in two processes comes out in two orders.
TRACED = {
    "transformer": {},
    "token granularity": {"granularity": "token", "optimizer": "micro_adam_var"},
    "vmap": {"impl": "vmap", "optimizer": "micro_adam_msq"},
    "chunked": {"chunk_size": 2},
    "mlp": {"model": "mlp", "optimizer": "sign_ema"},
}


def test_every_process_traces_the_step_to_the_same_program(tmp_path: Path):
    """The cause of the wrong step-0 losses this file once saw with fsdp: two processes traced
    the step to programs whose all-gathers came in another order. Two fresh interpreters
    (other string hashes, other addresses) must lower each config's step to the same text."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    texts = []
    for seed in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, __file__, "trace", str(tmp_path)],
            env={**env, "PYTHONHASHSEED": seed},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        texts.append(json.loads(proc.stdout.splitlines()[-1]))
    assert texts[0].keys() == TRACED.keys()
    assert [k for k in TRACED if texts[0][k] != texts[1][k]] == []


@pytest.fixture(scope="module")
def fake_two_devices(one: train.Config, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference config, FSDP over two fake CPU devices in one process: this file run as a
    script (below) reports the shardings of what the step returned and the sampler's shapes."""
    out = tmp_path_factory.mktemp("fake")
    cfg = dataclasses.replace(one, out=str(out / "run"), param_sharding="fsdp")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    config = json.dumps(dataclasses.asdict(cfg))
    proc = subprocess.run(
        [sys.executable, __file__, config], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(fsdp), 2 x cpu device(s), steps 0 -> 4" in proc.stdout
    report = json.loads(proc.stdout.splitlines()[-1])
    return {**report, "out": cfg.out}


def test_fsdp_on_two_devices_gives_the_replicated_losses(one: train.Config, fake_two_devices):
    assert_same_run(Path(str(one.out)), Path(fake_two_devices["out"]))


@pytest.mark.parametrize(
    "leaf, spec",
    [
        ("['params'].tok_emb.weight", "P('data', None)"),  # [vocab 256, 8]
        ("['params'].blocks[0].mlp.up.weight", "P('data', None)"),  # [32, 8] (eqx.nn: out, in)
        ("['params'].blocks[0].mlp.up.bias", "P('data',)"),  # [32]
        ("['opt_state'][0].mu.tok_emb.weight", "P('data', None)"),
        ("['opt_state'][0].nu.blocks[0].mlp.up.weight", "P('data', None)"),
        ("['opt_state'][0].count", "P()"),  # a scalar stays whole
    ],
)
def test_fsdp_step_keeps_parameters_and_optimizer_state_split(fake_two_devices, leaf, spec):
    assert fake_two_devices["shardings"][leaf] == spec


def test_each_device_draws_only_its_rows_of_a_batch(fake_two_devices):
    """The compiled sampler, per device, holds 3 of the 6 rows and never all 6."""
    shapes = fake_two_devices["sampler_shapes"]
    assert "s32[3,8]" in shapes  # the device's inputs (and targets): 3 windows of 8 bytes
    assert not [s for s in shapes if re.search(r"\[6[,\]]", s)], shapes


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-processes", "2", "--process-id", "2"], "--process-id 2: there are 2 processes"),
        (["--coordinator", "127.0.0.1:1"], "jax.distributed.initialize: "),  # how many?
    ],
)
def test_cli_bad_process_flags_are_one_line_errors(tmp_path: Path, args: list[str], message: str):
    proc = run_script("train.py", *args, "--out", str(tmp_path / "run"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize(
    "shape, n, axis",
    [
        ((256, 8), 2, 0),  # the longest axis
        ((8, 32), 2, 1),
        ((32,), 2, 0),
        ((6, 6), 2, 0),  # the first of equals
        ((3, 4), 2, 1),  # the longest that n divides
        ((9, 6), 3, 0),
        ((3,), 2, None),  # none fits: stays whole
        ((), 2, None),  # a scalar
    ],
)
def test_fsdp_axis(shape: tuple[int, ...], n: int, axis: int | None):
    assert trainkit.fsdp_axis(shape, n) == axis


# --------------------------------------------------------------------------------------------
# As a script (the fixture `fake_two_devices` runs it with two fake devices): train the config
# given as JSON, recording the shardings of the parameters and optimizer state that the first
# step returns, and compile the sampler; the report is the last line of stdout.


def perturbed_main(what: str, args: list[str]) -> None:
    """train.py's command line, after changing `what` (PERTURB) in this process."""
    import jax.numpy as jnp

    import models

    cfg = train.parse_config(args)
    if what == "config":
        cfg = dataclasses.replace(cfg, lr=cfg.lr * 2)
    elif what == "parameters":
        build = train.build

        def perturbed_build(cfg: train.Config, factory: Any = None) -> train.Run:
            run = build(cfg, factory)
            leaves, treedef = jax.tree.flatten(run.task.params)
            leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].add(1e-12)
            params = jax.tree.unflatten(treedef, leaves)
            return run._replace(task=run.task._replace(params=params))

        train.build = perturbed_build
    elif what == "program":
        lm_loss = models.lm_loss
        models.lm_loss = lambda *a: lm_loss(*a).astype(jnp.float32).astype(jnp.float64)
    else:
        raise ValueError(what)
    try:
        train.main(cfg)
    except train.ConfigError as err:
        sys.exit(f"error: {err}")


def trace(out: str) -> None:
    """Print {config: sha256 of the lowered step} for the configs in TRACED."""
    import hashlib

    jax.config.update("jax_enable_x64", True)
    digests = {}
    for name, overrides in TRACED.items():
        cfg = base(Path(out) / name, **overrides)
        run = train.build(cfg)
        params = run.task.params
        batch = run.task.sample(run.task.train_data, key=jax.random.key(0))
        lowered = jax.jit(run.step).lower(params, run.opt.init(params), batch)
        digests[name] = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    print(json.dumps(digests))


if __name__ == "__main__" and sys.argv[1] == "perturb":
    perturbed_main(sys.argv[2], sys.argv[3:])
elif __name__ == "__main__" and sys.argv[1] == "trace":
    trace(sys.argv[2])
elif __name__ == "__main__":
    cfg = train.Config(**json.loads(sys.argv[1]))
    seen: dict[str, str] = {}
    jit_step = train.jit_step

    def spying_jit_step(*args: Any, **kwargs: Any) -> Any:
        step = jit_step(*args, **kwargs)

        def spied(*inputs: Any) -> Any:
            outputs = step(*inputs)
            params, opt_state = outputs[:2]
            tree = {"params": params, "opt_state": opt_state}
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                seen.setdefault(jax.tree_util.keystr(path), repr(leaf.sharding.spec))
            return outputs

        return spied

    train.jit_step = spying_jit_step
    train.main(cfg)
    task = train.lm_task(cfg, key=jax.random.key(0))
    sampler = trainkit.make_sampler(task, trainkit.make_mesh(cfg))
    hlo = sampler.lower(task.train_data, key=jax.random.key(0)).compile().as_text()
    shapes = sorted(set(re.findall(r"\b[a-z]+\d+\[[\d,]*\]", hlo)))
    print(json.dumps({"shardings": seen, "sampler_shapes": shapes}))
