"""train.py: train a model with the per-example-gradient optimizers of pegrad; one script.

    python train.py                      # byte-level transformer LM, MicroAdam, on the English
                                         # text shipped with CPython: eval loss 5.4 -> 2.1 in
                                         # under 2 minutes on a 2-core CPU
    python train.py --optimizer adam --lr 1e-3 --steps 2000 --out runs/adam
    python train.py --model mlp --optimizer sign_ema --noise 1.0       # teacher-student MLP
    python train.py --resume --out runs/adam                  # continue it, as configured
    python train.py --task my_task.py:make --out runs/mine     # your model and data (Task)
    python train.py --help                                             # every knob
    python train.py --size paper --param-sharding fsdp --coordinator HOST0:1234 \
        --num-processes 2 --process-id I --out /shared/runs/paper   # on each of 2 hosts, I=0,1

The paper's studies (many runs, vectorized) are experiments.py: `python experiments.py NAME`.

Read top to bottom: the config (every knob, each with its help text), the data (random windows
of a byte string, or a teacher-student regression whose label noise `--noise` sets), the model
and optimizer with one pure training step that asks pegrad for the optimizer's statistics plus
"mean" and "sq_mean" for the gradient diagnostics of SPEC §4 (`build`, which experiments.py's
vectorized sweeps share), where arrays live (processes, the device mesh, shardings), atomic
checkpoints, the loop.

Writes into --out (default runs/<timestamp>), created when training starts: config.json (the
resolved config; --resume, how a process began, is recorded false), metrics.jsonl (one object
per logged step: step, loss, lr, grad_norm, frac_snr_gt_1_over_B (the fraction of coordinates
with μ̂² > σ̂²/B), nu_adam_over_nu_micro (ḡ²/q averaged over coordinates), the gradient noise
scale B_simple = tr Σ / |G|² (`pegrad.gradient_noise_scale`): noise_scale, the one to plot,
is the ratio of trace_cov_ema and grad_sq_ema, moving averages over the logged steps of the
step's batch's trace_cov = tr Σ and grad_sq = |G|² (each unbiased; `NoiseScale`; null while
the averaged |G|² is ≤ 0), and noise_scale_batch is one batch's ratio (biased, noisy, can be
negative); for the Adam family the same for B_P = tr(PΣ) / |G|²_P, P = 1/(√v̂ + ε) of the state
before the step: trace_cov_p, grad_sq_p, their _ema and noise_scale_p (null at step 0); and
eval_loss when evaluated), checkpoint.npz (no pickle) with a human-readable
checkpoint.json. "step" counts the optimizer updates applied to the parameters a loss was
measured on, everywhere: the console's `step N/STEPS  loss L  noise scale S` is metrics.jsonl's
{"step": N, "loss": L, "noise_scale": S}, printed (off a terminal) on the steps metrics.jsonl
logs, every --log-interval, at each evaluation and at the last step.

Your own model and data: a factory `make(cfg, *, key) -> Task` (the parameters, the loss of one
example, a batch sampler and its data; see `Task`), named by `--task MODULE:NAME` or
`--task PATH.py:NAME`, or handed to `main(cfg, task=make)` in Python. It reads what it needs of
cfg (batch_size, dtype, data, seed through `key`); --model and its size knobs are then unused.

Resume: batches depend only on (seed, step), so `--resume` continues from the last checkpoint to
bitwise the parameters of an uninterrupted run on the same devices, to float rounding on others.
`python train.py --resume --out DIR` continues the run in DIR as it was configured: every knob
not typed comes from DIR/config.json (--process-id excepted), so the command Ctrl-C prints
works as printed. A flag typed beside it changes a knob that may change on resume (how a run is
watched, how long it runs, where and with what rounding: knob(resume=True)); one that may not
and differs is refused, naming each with both values ("--lr 0.01 differs from the run's 0.003
in DIR/config.json"). --steps may change only where the learning rate of every step already
taken stays the same (a constant schedule; a cosine one still in its warmup): a resumed run
always equals an uninterrupted run of its final config. With no checkpoint yet (a run killed
before its first) --resume starts the run over at step 0, as configured; with nothing in DIR (a
job preempted before it wrote anything), a new run of the flags typed, so the same command
with --resume restarts a preempted job wherever it stopped. In Python, `main(Config(...,
resume=True))` takes the Config whole: every knob that may not change must equal the run's, or
ConfigError names it; `resume_config({"out": DIR})` is the Config the command line would run.

Data-parallel over all devices along the mesh axis "data": each device draws only its rows of
the batch; parameters and optimizer state are replicated, or with --param-sharding fsdp each
leaf is split along its longest axis that the device count divides (`fsdp_axis`). Several
processes (hosts) run the same command, each with its --process-id (or --distributed under
Slurm, Open MPI, Cloud TPU: JAX detects the rest); they join through jax.distributed and one
mesh spans all their devices. Process 0 prints and writes; checkpoints are gathered to it and
resume on any number of processes and devices. Before step 0 the processes check that they hold
the same config, data, initial state and compiled programs, or stop (`agree_across_processes`).

Bad input and a NaN/Inf loss end the run with one line "error: ..." and exit status 1; the step
that diverged is the last line of metrics.jsonl ({"step", "diverged", "lr"}) and the last good
checkpoint is kept. Bad input is refused before --out is created (a --task factory that cannot
be called as factory(cfg, *, key), a loss that is not a scalar per example, an --out that
cannot be a directory), and a run that fails before it logs its first step removes what it
created. Ctrl-C ends it with one line naming the last checkpoint and the command that
continues the run, exit status 130.
In-process, `main(Config(...))` returns the final metrics; `build(Config(...))` is what a run
is made of before any device or file (task, optimizer, step), for drivers that run many at
once.
"""

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
import types
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple, get_args, get_origin

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

# In a checkout these are the files beside this one; installed, they are the modules of the
# package `pegrad` (pegrad/__init__.py is pegrad.py), so that a user's own models.py or
# optimizers.py beside their script never stands in for them.
if __package__:
    from . import models, optimizers
else:
    import models
    import optimizers

AdamFamily = Literal["adam", "micro_adam", "micro_adam_var", "micro_adam_msq"]
SignFamily = Literal["micro_sign_sgd", "sign_sgd", "sign_ema"]


def knob(default: Any, help: str, *, min: float | None = None, resume: bool = False) -> Any:
    """A config field: its help text (shown by --help), the least value it accepts, and
    whether it may change when a run is resumed (how a run is watched, how long it runs, and
    what changes float rounding only; any other change is an error)."""
    return dataclasses.field(default=default, metadata=dict(help=help, min=min, resume=resume))


@dataclasses.dataclass(frozen=True)
class Config:
    # What to train.
    task: str | None = knob(
        None, "your model and data: MODULE:FACTORY or PATH.py:FACTORY, a function "
        "(cfg, *, key) -> train.Task (None: --model's)"
    )  # fmt: skip
    model: Literal["transformer", "mlp"] = knob("transformer", "model family")
    size: Literal["tiny", "mini", "small", "paper"] = knob(
        "mini", "preset: SIZES, MLP_SIZES in train.py"
    )
    d_model: int | None = knob(None, "transformer width (None: the preset's)", min=1)
    n_layers: int | None = knob(None, "transformer blocks (None: the preset's)", min=1)
    n_heads: int | None = knob(None, "attention heads (None: the preset's)", min=1)
    d_ff: int | None = knob(None, "transformer MLP width (None: the preset's)", min=1)
    context_length: int | None = knob(None, "transformer context (None: the preset's)", min=1)
    dtype: Literal["float32", "bfloat16", "float64"] = knob("float32", "parameter dtype")
    # Data.
    data: str | None = knob(None, "UTF-8 text file (None: CPython's pydoc_data.topics text)")
    seq_len: int = knob(64, "tokens per training window (transformer)", min=1)
    noise: float = knob(0.5, "label noise std of the teacher-student regression (mlp)", min=0)
    # Optimizer and statistics.
    optimizer: Literal[AdamFamily, SignFamily] = knob("micro_adam", "update rule (optimizers.py)")
    impl: Literal["vmap", "factorized"] = knob("factorized", "pegrad implementation", resume=True)
    granularity: Literal["example", "token"] = knob("example", "statistics over examples/tokens")
    chunk_size: int | None = knob(
        None, "max per-example gradients at once (pegrad)", min=1, resume=True
    )
    lr: float = knob(3e-3, "peak learning rate", min=0)
    schedule: Literal["constant", "cosine"] = knob("cosine", "after warmup: constant or cosine")
    warmup: int = knob(50, "linear warmup steps", min=0)
    b1: float = knob(0.9, "Adam family: first-moment decay")
    b2: float = knob(0.999, "Adam family: second-moment decay")
    eps: float = knob(1e-8, "Adam family: epsilon outside the square root", min=0)
    eps_root: float | None = knob(
        None, "Adam family: epsilon inside the square root, optax's eps_root (None: none)", min=0
    )
    momentum: float | None = knob(None, "sign family EMA decay (None: the optimizer's default)")
    msq_block: Literal["none", "tensor", "row"] = knob(
        "none", "micro_adam_msq: average v̂ over each tensor or row before the root"
    )
    weight_decay: float = knob(0.0, "decoupled weight decay on matrices and embeddings", min=0)
    max_grad_norm: float | None = knob(None, "clip by the global norm of the mean gradient", min=0)
    # Run.
    batch_size: int = knob(32, "examples per step, over all devices", min=1)
    steps: int = knob(600, "updates in the whole run (cosine: over these)", min=1, resume=True)
    seed: int = knob(0, "seeds the model and every batch (batch of step s: fold_in(key, s))")
    devices: int | None = knob(None, "use N devices of each process (None: all)", resume=True)
    param_sharding: Literal["replicated", "fsdp"] = knob(
        "replicated",
        "parameters and optimizer state: on every device, or split (FSDP)",
        resume=True,
    )
    eval_interval: int = knob(100, "evaluate every N steps (and at the end)", min=1, resume=True)
    eval_batches: int = knob(8, "held-out batches per evaluation", min=1, resume=True)
    log_interval: int = knob(10, "log to metrics.jsonl every N steps", min=1, resume=True)
    checkpoint_interval: int = knob(200, "checkpoint every N steps", min=1, resume=True)
    out: str | None = knob(None, "output directory (None: runs/<timestamp>)", resume=True)
    resume: bool = knob(
        False, "continue the run in --out as configured (its config.json; flags typed change "
        "only knobs that may change on resume)", resume=True
    )  # fmt: skip
    # Several processes (jax.distributed): one per host, or per accelerator. None: what JAX
    # detects (Slurm, Open MPI, Cloud TPU; $JAX_COORDINATOR_ADDRESS for the address).
    coordinator: str | None = knob(None, "HOST:PORT of process 0's coordinator", resume=True)
    num_processes: int | None = knob(None, "processes in the run", min=1, resume=True)
    process_id: int | None = knob(
        None, "this process: 0 .. --num-processes - 1", min=0, resume=True
    )
    distributed: bool = knob(
        False, "join the other processes (implied by the three above and by "
        "$JAX_COORDINATOR_ADDRESS)", resume=True
    )  # fmt: skip


# Transformer presets are models' presets with overrides; the vocabulary is always bytes.
SIZES: dict[str, Callable[..., models.TransformerConfig]] = {
    "tiny": models.TransformerConfig.tiny,
    "mini": lambda **kw: models.TransformerConfig.small(
        **{"d_model": 64, "n_layers": 2, "d_ff": 256, "context_length": 64, **kw}
    ),
    "small": models.TransformerConfig.small,
    "paper": models.TransformerConfig.paper,
}
# MLP presets: (input dim, width, depth, output dim); "paper" is MNIST-shaped, deep and wide
# (the L < D regime of the overhead experiment, where per-example gradients are costly).
MLP_SIZES = {
    "tiny": (8, 16, 2, 4),
    "mini": (32, 128, 2, 8),
    "small": (64, 256, 3, 16),
    "paper": (784, 1024, 4, 10),
}
EVAL_FRACTION = 0.1  # the last 10% of the text is held out for evaluation


class ConfigError(Exception):
    """Bad input (SPEC §6): reported as one line and a non-zero exit, not a traceback."""


class Diverged(Exception):
    """The loss became NaN/Inf; the last good checkpoint is kept."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the message names the last checkpoint, from which --resume continues."""


# --------------------------------------------------------------------------------------------
# Command line: one --flag-name per Config field, typed from its annotation.


def flag(name: str) -> str:
    """The command-line flag of a Config field."""
    return "--" + name.replace("_", "-")


def spell(value: Any) -> str:
    """A knob's value as the command line spells it (None: "none")."""
    return "none" if value is None else str(value)


def parse_flags(argv: list[str]) -> dict[str, Any]:
    """The knobs `argv` gives, by field name: only the flags typed (a knob left at its default
    is absent), which `--resume` tells from the run's own (`resume_config`). --help shows every
    default; argparse's own errors exit here (status 2)."""
    parser = argparse.ArgumentParser(
        description="Train with pegrad's optimizers; see train.py's docstring.",
        argument_default=argparse.SUPPRESS,
        epilog="The paper's studies: python experiments.py --help",
    )
    for field in dataclasses.fields(Config):
        shown = f"{field.metadata['help']} (default: {spell(field.default)})"
        kwargs: dict[str, Any] = {"help": shown.replace("%", "%%")}
        args = get_args(field.type)
        if field.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(field.type) is Literal:
            kwargs |= {"choices": args, "type": type(args[0])}
        elif isinstance(field.type, types.UnionType):  # `X | None`: "none" on the CLI is None
            (kind,) = [a for a in args if a is not type(None)]
            kwargs["type"] = lambda s, kind=kind: None if s.lower() == "none" else kind(s)
        else:
            kwargs["type"] = field.type
        parser.add_argument(flag(field.name), **kwargs)
    return vars(parser.parse_args(argv))


def parse_config(argv: list[str]) -> Config:
    """The Config `argv` spells: the flags typed, the defaults for the rest."""
    return Config(**parse_flags(argv))


def cli_config(argv: list[str]) -> Config:
    """What `python train.py ARGV` runs: `parse_config(argv)`, except that with --resume the run
    in --out supplies every knob not typed (`resume_config`), so that `--resume --out DIR`
    alone continues the run in DIR as it was configured."""
    given = parse_flags(argv)
    return resume_config(given) if given.get("resume") else Config(**given)


def read_config(saved: Path) -> dict[str, Any]:
    """A run's config.json, as {field name: value}."""
    try:
        old = json.loads(saved.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{saved} is not a config.json of train.py: {err}") from None
    names = {f.name for f in dataclasses.fields(Config)}
    if not isinstance(old, dict) or not old.keys() <= names:
        unknown = ", ".join(sorted(set(old) - names)) if isinstance(old, dict) else "not an object"
        raise ConfigError(f"{saved} is not a config.json of this train.py ({unknown})")
    return old


def refuse_changes(saved: Path, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """ConfigError unless every knob of `new` that may not change on resume equals the run's
    (`old`, read from `saved`), naming each that differs with both values."""
    same = lambda k, a, b: task_spec(a) == task_spec(b) if k == "task" else a == b  # noqa: E731
    differ = [
        f"{flag(f.name)} {spell(new[f.name])} differs from the run's {spell(old.get(f.name))}"
        for f in dataclasses.fields(Config)
        if not f.metadata["resume"]
        and f.name in new
        and not same(f.name, new[f.name], old.get(f.name))
    ]
    if differ:
        raise ConfigError(
            f"--resume: {', '.join(differ)} in {saved}; a resumed run keeps the knobs that "
            "shape its trajectory (to change them, start a new run with another --out)"
        )


def resume_config(given: Mapping[str, Any]) -> Config:
    """What `--resume --out DIR [flags]` runs: the run in DIR as it was configured (its
    config.json), with the knobs in `given` ({field name: value}, the flags typed) in place of
    its own: those that may change on resume (knob(resume=True)) change, any other that differs
    is refused (ConfigError naming each, with both values). --process-id is never taken from
    config.json (it holds process 0's). Nothing in DIR yet (a job preempted before it wrote
    anything): `given` over the defaults, a new run, as without --resume."""
    if given.get("out") is None:
        raise ConfigError("--resume needs --out DIR, the run to continue")
    saved = Path(given["out"]) / "config.json"
    if not saved.is_file():
        return Config(**{**given, "resume": True})  # check: a checkpoint alone is refused
    old = read_config(saved)
    refuse_changes(saved, old, given)
    kept = {k: v for k, v in old.items() if k != "process_id"}
    return Config(**{**kept, **given, "resume": True})


def check(cfg: Config) -> Config:
    """Reject bad input before any work; resolve the output directory. With `cfg.resume`, every
    knob that may not change on resume must equal the run's in --out (its config.json): `cfg`
    is the whole config (`resume_config` makes one from the knobs typed)."""
    for field in dataclasses.fields(Config):
        value, least = getattr(cfg, field.name), field.metadata["min"]
        if least is not None and value is not None and not value >= least:
            raise ConfigError(f"{flag(field.name)} must be >= {least}, got {value}")
    if cfg.task is None and cfg.model == "mlp" and cfg.granularity == "token":
        raise ConfigError("--granularity token needs sequences: use --model transformer")
    units = cfg.batch_size * (cfg.seq_len if cfg.granularity == "token" else 1)
    if cfg.msq_block != "none" and cfg.optimizer != "micro_adam_msq":
        raise ConfigError(f"--msq-block {cfg.msq_block} is an option of micro_adam_msq only")
    if cfg.optimizer in ("micro_adam_var", "micro_adam_msq") and units < 2:
        raise ConfigError(f"{cfg.optimizer} divides by B - 1: needs --batch-size >= 2")
    me, processes = cfg.process_id, cfg.num_processes
    if me is not None and processes is not None and me >= processes:
        raise ConfigError(
            f"--process-id {me}: there are {processes} processes (0 .. {processes - 1})"
        )
    if cfg.data is not None and not Path(cfg.data).is_file():
        raise ConfigError(f"data file not found: {cfg.data}")
    make_optimizer(cfg, schedule=False)  # its own checks (b1, momentum, ...), no JAX call yet
    cfg = dataclasses.replace(cfg, task=task_spec(cfg.task))
    if cfg.resume and cfg.out is None:
        raise ConfigError("--resume needs --out DIR, the run to continue")
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=time.strftime("runs/%Y%m%d-%H%M%S"))
    out = Path(str(cfg.out))
    check_out(out)
    saved, step = out / "config.json", checkpoint_step(out)
    if not (saved.exists() or step is not None):
        return cfg  # a new run (--resume too: nothing to continue yet, it starts at step 0)
    if not cfg.resume:
        held = "at step {step}" if step is not None else "killed before its first checkpoint"
        raise ConfigError(
            f"{cfg.out} already holds a run ({held.format(step=step)}); pass --resume to "
            "continue it, or choose another --out"
        )
    if not saved.exists():
        raise ConfigError(f"--resume: {cfg.out} has a checkpoint but no config.json")
    old = read_config(saved)
    refuse_changes(saved, old, dataclasses.asdict(cfg))
    if step is not None and step > cfg.steps:
        raise ConfigError(f"--resume --steps {cfg.steps}: the checkpoint is at step {step}")
    if step is not None and old["steps"] != cfg.steps:
        check_schedule(dataclasses.replace(cfg, steps=old["steps"]), cfg, step)
    return cfg


def task_spec(spec: str | None) -> str | None:
    """--task as config.json records it: PATH.py:NAME with the path made absolute, so that
    --resume finds the file from any directory; MODULE:NAME (and None) as given."""
    where, sep, name = (spec or "").rpartition(":")
    if spec is None or not (sep and where) or not (where.endswith(".py") or "/" in where):
        return spec
    return f"{Path(where).expanduser().resolve()}:{name}"


def check_out(out: Path) -> None:
    """--out is a directory this process may create, or write into."""
    for there in (out, *out.parents):
        if there.exists() or there.is_symlink():
            if not there.is_dir():
                raise ConfigError(f"--out {out}: {there} is not a directory; choose another --out")
            if not os.access(there, os.W_OK | os.X_OK):
                raise ConfigError(f"--out {out}: {there} is not writable; choose another --out")
            return


def digits(*values: float) -> list[str]:
    """The values with the fewest significant digits (at least 6) that tell them apart."""
    for p in range(6, 18):
        shown = [f"{float(v):.{p}g}" for v in values]
        if len(set(shown)) == len(set(map(float, values))):
            return shown
    return [repr(float(v)) for v in values]


def check_schedule(old: Config, new: Config, taken: int) -> None:
    """A resumed run equals an uninterrupted run of its new config only if the learning rate of
    each of the `taken` steps behind its checkpoint is what the new config gives it: --steps
    may change on resume only where the schedule does not depend on it (a constant schedule;
    a cosine one still in its warmup)."""
    steps = jnp.arange(taken, dtype=jnp.int32)
    before, after = (np.asarray(make_schedule(c)(steps)) for c in (old, new))
    if not np.array_equal(before, after):
        first = int(np.flatnonzero(before != after)[0])
        now, was = digits(after[first], before[first])
        raise ConfigError(
            f"--resume --steps {new.steps}: the {new.schedule} schedule is laid over --steps, "
            f"and this run took its {taken} steps with --steps {old.steps} (the learning rate "
            f"of step {first} would be {now}, not {was}), so it would equal no uninterrupted "
            f"run; resume with --steps {old.steps}, or start a "
            "new run (--schedule constant does not depend on --steps)"
        )


# --------------------------------------------------------------------------------------------
# Data: a task bundles the model's parameters, the loss of one example, and a sampler that
# draws one batch from `data` with a key. Batches depend on (seed, step) only. Your own model
# and data come in the same way: a factory `(cfg, *, key) -> Task` (--task, or main's `task=`).


class Task(NamedTuple):
    """What train.py trains: a model's parameters, its loss, and its data.

    Example (a linear regression; `python train.py --task my_task.py:make`)::

        def make(cfg: train.Config, *, key: PRNGKeyArray) -> train.Task:
            model = eqx.nn.Linear(3, 1, key=key)
            params, static = eqx.partition(model, eqx.is_inexact_array)

            def loss_fn(params, example):  # ONE example (SPEC §1)
                x, y = example
                return jnp.sum((eqx.combine(params, static)(x) - y) ** 2)

            def sample(w, *, key):  # a batch: every leaf's leading axis is cfg.batch_size
                x = jax.random.normal(key, (cfg.batch_size, 3))
                return x, x @ w

            w = jnp.ones((3, 1))
            return train.Task(params, loss_fn, sample, train_data=w, eval_data=w)
    """

    params: PyTree  # the trainable floating arrays (an Equinox model: eqx.partition's first)
    loss_fn: Callable[[PyTree, Any], Float[Array, ""]]  # loss of ONE example (SPEC §1)
    sample: Callable[..., Any]  # sample(data, *, key) -> batch, leaves [batch_size, ...]
    train_data: PyTree  # what `sample` draws training batches from (arrays)
    eval_data: PyTree  # ...and the held-out batches
    unit: str = "ex"  # what the throughput counts: "tok" or "ex"
    units_per_example: int = 1


TaskFactory = Callable[..., Task]  # factory(cfg, *, key) -> Task


def read_text(path: str | None) -> bytes:
    if path is None:
        from pydoc_data.topics import topics  # ~465 KB of English, shipped with CPython

        return "".join(topics[k] for k in sorted(topics)).encode()
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    return data


def sample_windows(
    tokens: Int[Array, " n"], *, key: PRNGKeyArray, batch_size: int, seq_len: int
) -> tuple[Int[Array, "b t"], Int[Array, "b t"]]:
    """`batch_size` random windows of seq_len + 1 bytes: (inputs, next-byte targets)."""
    starts = jax.random.randint(key, (batch_size,), 0, tokens.shape[0] - seq_len, jnp.int32)
    windows = tokens[starts[:, None] + jnp.arange(seq_len + 1, dtype=jnp.int32)]
    return windows[:, :-1], windows[:, 1:]


def lm_task(cfg: Config, *, key: PRNGKeyArray) -> Task:
    names = ("d_model", "n_layers", "n_heads", "d_ff", "context_length")
    overrides = {k: getattr(cfg, k) for k in names if getattr(cfg, k) is not None}
    try:
        config = SIZES[cfg.size](**overrides, vocab_size=256, dtype=cfg.dtype)
    except ValueError as err:  # e.g. n_heads not dividing d_model
        raise ConfigError(str(err)) from None
    if cfg.seq_len > config.context_length:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} exceeds the model's context length "
            f"{config.context_length} (--context-length)"
        )
    text = np.frombuffer(read_text(cfg.data), np.uint8).astype(np.int32)
    split = int(len(text) * (1 - EVAL_FRACTION))
    if min(split, len(text) - split) < cfg.seq_len + 1:
        raise ConfigError(
            f"data too short: {len(text)} bytes, and its held-out 10% must hold "
            f"--seq-len + 1 = {cfg.seq_len + 1}"
        )
    params, static = eqx.partition(models.TransformerLM(config, key=key), eqx.is_inexact_array)
    sample = functools.partial(sample_windows, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    loss_fn = models.make_loss_fn(static, models.lm_loss)
    train, held_out = jnp.asarray(text[:split]), jnp.asarray(text[split:])
    return Task(params, loss_fn, sample, train, held_out, "tok", cfg.seq_len)


def mlp_task(cfg: Config, *, key: PRNGKeyArray) -> Task:
    """Regression onto a random teacher MLP, y = teacher(x) + noise·ε: `noise` sets how much of
    each per-example gradient is noise, i.e. the gradient SNR the optimizers face."""
    d_in, width, depth, d_out = MLP_SIZES[cfg.size]
    student_key, teacher_key = jax.random.split(key)
    student = models.MLP(d_in, d_out, width, depth, dtype=cfg.dtype, key=student_key)
    teacher = models.MLP(d_in, d_out, width, depth, dtype=cfg.dtype, key=teacher_key)
    params, static = eqx.partition(student, eqx.is_inexact_array)

    def sample(teacher: models.MLP, *, key: PRNGKeyArray) -> tuple[Array, Array]:
        x_key, noise_key = jax.random.split(key)
        x = jax.random.normal(x_key, (cfg.batch_size, d_in), jnp.dtype(cfg.dtype))
        noise = jax.random.normal(noise_key, (cfg.batch_size, d_out), x.dtype)
        return x, jax.vmap(teacher)(x) + jnp.asarray(cfg.noise, x.dtype) * noise

    # Train and held-out examples: the same teacher, independent key streams.
    loss_fn = models.make_loss_fn(static, models.mlp_mse_loss)
    return Task(params, loss_fn, sample, teacher, teacher, "ex", 1)


def load_factory(spec: str) -> TaskFactory:
    """The task factory `--task` names: "MODULE:NAME" (a module importable from here or from
    the working directory) or "PATH.py:NAME" (a file, loaded under a name of its own so that
    it shadows no module)."""
    where, sep, name = spec.rpartition(":")
    if not (sep and where and name):
        raise ConfigError(f"--task {spec}: want MODULE:FACTORY or PATH.py:FACTORY")
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise ConfigError(f"--task {spec}: no file {path}")
        module_name = f"_pegrad_task_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
        module = sys.modules.get(module_name)
        if module is None:
            spec_ = importlib.util.spec_from_file_location(module_name, path)
            assert spec_ is not None and spec_.loader is not None
            module = importlib.util.module_from_spec(spec_)
            # The file's own helper modules import from its directory; appended, so that no
            # module already found elsewhere is shadowed.
            sys.path.append(str(path.parent))
            sys.modules[module_name] = module  # dataclasses and pickle look modules up here
            try:
                spec_.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())  # `python train.py --task my_module:f` from a project
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            if err.name is None or not (where == err.name or where.startswith(err.name + ".")):
                raise  # the module itself failed on an import of its own: its traceback
            raise ConfigError(f"--task {spec}: no module {err.name!r} ({err})") from None
    if not callable(getattr(module, name, None)):
        found = type(getattr(module, name, None)).__name__ if hasattr(module, name) else "absent"
        raise ConfigError(f"--task {spec}: {name!r} in {where} is {found}, not a function")
    return getattr(module, name)


def make_task(cfg: Config, *, key: PRNGKeyArray, factory: TaskFactory | None = None) -> Task:
    """The task of `cfg`: `factory`'s, else --task's, else --model's built-in one; checked
    before any work: a factory callable as factory(cfg, key=key) that returns a Task whose
    parameters are floating arrays, whose batches have cfg.batch_size examples, and whose loss
    of one example is a floating scalar."""
    if factory is None and cfg.task is not None:
        factory = load_factory(cfg.task)
    if factory is None:
        return (lm_task if cfg.model == "transformer" else mlp_task)(cfg, key=key)
    name = cfg.task or getattr(factory, "__qualname__", repr(factory))
    try:
        inspect.signature(factory).bind(cfg, key=key)
    except TypeError as err:
        called = getattr(factory, "__name__", "make")
        raise ConfigError(
            f"task {name}: {err} (called as {called}(cfg, key=key)); define it as "
            f"{called}(cfg, *, key) -> train.Task"
        ) from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    task = factory(cfg, key=key)
    # `python train.py --task ...` runs this file as __main__; a factory that imported `train`
    # has another copy of the class: the same fields are the same Task.
    if getattr(task, "_fields", None) == Task._fields and isinstance(task, tuple):
        task = Task(*task)
    if not isinstance(task, Task):
        raise ConfigError(f"task {name} returned a {type(task).__name__}, not a train.Task")
    for path, leaf in jax.tree_util.tree_leaves_with_path(task.params):
        if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)):
            kind = getattr(leaf, "dtype", type(leaf).__name__)
            raise ConfigError(
                f"task {name}: params{jax.tree_util.keystr(path)} is {kind}, not a floating "
                "array; Task.params holds the trainable arrays only (an Equinox model: "
                "params, static = eqx.partition(model, eqx.is_inexact_array), the loss "
                "closing over static)"
            )
    batch = jax.eval_shape(functools.partial(task.sample, key=key), task.train_data)
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if leaf.shape[:1] != (cfg.batch_size,):
            raise ConfigError(
                f"task {name}: sample's batch{jax.tree_util.keystr(path)} has shape "
                f"{leaf.shape}; every leaf's leading axis must be --batch-size "
                f"{cfg.batch_size}"
                + (
                    "; a list of examples? stack them: jax.tree.map(lambda *x: jnp.stack(x), "
                    "*examples)"
                    if isinstance(batch, list)
                    else ""
                )  # fmt: skip
            )
    example = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype), batch)
    loss = jax.eval_shape(task.loss_fn, task.params, example)
    if not (
        isinstance(loss, jax.ShapeDtypeStruct)
        and loss.shape == ()
        and jnp.issubdtype(loss.dtype, jnp.floating)
    ):
        what = (
            f"shape {loss.shape} {loss.dtype}"
            if isinstance(loss, jax.ShapeDtypeStruct)
            else f"a {type(loss).__name__}"
            + (" (a (loss, aux) pair? return the loss alone)" if isinstance(loss, tuple) else "")
        )
        raise ConfigError(
            f"task {name}: loss_fn(params, example) returned {what} for one example; it must "
            "return a scalar, the floating loss of ONE example (reduce inside it, e.g. "
            "jnp.sum over its positions; train.py takes the batch mean)"
        )
    return task


# --------------------------------------------------------------------------------------------
# Processes, devices and where arrays live. Every process runs this script on the same config;
# JAX's multi-controller runtime makes `jax.devices()` all processes' devices, and a jitted
# function over a mesh of them runs as one program, each process computing its devices' shards.


def join_processes(cfg: Config) -> None:
    """Start jax.distributed when this is one of several processes; values not given come from
    JAX's cluster detection. Must run before any computation."""
    given = (cfg.coordinator, cfg.num_processes, cfg.process_id)
    wanted = cfg.distributed or any(x is not None for x in given)
    if not (wanted or "JAX_COORDINATOR_ADDRESS" in os.environ) or jax.distributed.is_initialized():
        return  # one process; or a driver calling main() again, or one that initialised JAX
    # Each process traces and compiles the step itself; main checks that they all compiled the
    # same programs (agree_across_processes) before the first step.
    try:
        jax.distributed.initialize(*given)
    except (RuntimeError, ValueError, TypeError) as err:  # e.g. no process count given or found
        raise ConfigError(f"jax.distributed.initialize: {err}") from None


def make_mesh(cfg: Config) -> Mesh:
    """One axis, "data", over the first --devices devices of every process, process by process
    (so each process's part of a batch is one contiguous block of rows)."""
    local = len(jax.local_devices())
    if cfg.devices is not None and not 1 <= cfg.devices <= local:
        raise ConfigError(f"--devices {cfg.devices}: {local} device(s) per process available")
    per_process = cfg.devices or local
    taken: dict[int, int] = {}
    devices = []
    # A stable sort: each process's devices keep JAX's order.
    for device in sorted(jax.devices(), key=lambda d: d.process_index):
        if taken.setdefault(device.process_index, 0) < per_process:
            taken[device.process_index] += 1
            devices.append(device)
    if cfg.batch_size % len(devices):
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is not divisible by the {len(devices)} devices"
        )
    return Mesh(np.array(devices), ("data",))


def on_host() -> contextlib.AbstractContextManager[Any]:
    """Where the model and data are built before they are placed: in host memory, so that a
    sharded model never exists whole on one accelerator (on the default device when JAX runs
    without a CPU backend, e.g. JAX_PLATFORMS=tpu)."""
    try:
        return jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:
        return contextlib.nullcontext()


def fsdp_axis(shape: tuple[int, ...], n: int) -> int | None:
    """The axis of a leaf that FSDP splits over n devices: its longest axis whose length n
    divides (the first of equals); None: the leaf stays whole (a scalar, or no axis fits)."""
    fits = [size if size % n == 0 else 0 for size in shape]
    return fits.index(max(fits)) if any(fits) else None


def placement(tree: PyTree, mesh: Mesh, how: Literal["replicated", "fsdp"]) -> PyTree:
    """A sharding per leaf. "replicated": every leaf whole on every device. "fsdp" (fully
    sharded data parallel): each leaf split along its `fsdp_axis` over the mesh axis "data",
    the one that also splits the batch; a leaf with no such axis stays replicated. Where the
    step needs a leaf whole, GSPMD gathers it (and splits its gradient back)."""
    n = mesh.shape["data"]

    def one(leaf: Any) -> NamedSharding:
        shape = np.shape(leaf)
        axis = fsdp_axis(shape, n) if how == "fsdp" and n > 1 else None
        spec = [("data" if i == axis else None) for i in range(len(shape))]
        return NamedSharding(mesh, P(*spec) if axis is not None else P())

    return jax.tree.map(one, tree)


def place(tree: PyTree, shardings: PyTree) -> PyTree:
    """Global arrays from a tree that every process holds whole (a fresh model, a checkpoint,
    the data): each process transfers only the shards its own devices hold."""

    def one(leaf: Any, sharding: NamedSharding) -> jax.Array:
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def make_sampler(task: Task, mesh: Mesh) -> Callable[..., Any]:
    """`task.sample`, jitted to return the batch split along "data": each device computes only
    its own rows, so each process materialises only its part of the batch, and the batch of a
    step is the same whatever the devices and processes (threefry random bits depend on an
    element's index, not on how the array is split: jax_threefry_partitionable, the default)."""
    return jax.jit(task.sample, out_shardings=NamedSharding(mesh, P("data")))


def agree_across_processes(
    cfg: Config, run: "Run", programs: Mapping[str, tuple[Any, tuple[Any, ...]]]
) -> None:
    """Stop with ConfigError unless every process has the same config, data, initial state
    and compiled programs (`programs`: name -> (jitted function, the arguments the run calls it
    with), compiled here, so the run reuses them). One process: nothing to compare.

    Why programs: CPU collectives (gloo) pair the collectives of two processes by their
    position in each one's program, not by any name, so two programs that order two
    same-shaped all-gathers differently exchange the wrong arrays with no error. Each process
    traces and compiles the step itself; if tracing is not deterministic (it was not:
    pegrad iterated a set of jaxpr variables, ordered by address), the programs differ. Why not
    a checksum of the loss or the parameters after a step: the loss is all-reduced, so every
    process holds the same number, wrong or not, and with FSDP no process holds another's
    shard to compare with. Identical compiled programs (the schedule included) fed identical
    inputs are what make the collectives pair up; this checks exactly that, before step 0."""
    if jax.process_count() == 1:
        return
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "process_id"}
    digests = {
        "config (except --process-id)": _digest(json.dumps(config, sort_keys=True)),
        "training and held-out data": _digest((run.task.train_data, run.task.eval_data)),
    }
    if cfg.resume:  # the state is what each process read from --out
        digests["checkpoint file"] = _digest((Path(str(cfg.out)) / "checkpoint.npz").read_bytes())
    else:
        with on_host():
            state = {"params": run.task.params, "opt_state": run.opt.init(run.task.params)}
        digests["initial parameters and optimizer state"] = _digest(state)
    for name, (jitted, args) in programs.items():
        compiled = jitted.lower(*args).compile()
        digests[f"compiled {name}"] = _digest(_program_text(compiled.as_text()))
    mine = np.stack([np.frombuffer(d, np.uint8) for d in digests.values()])
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, items, 32]
    for k, name in enumerate(digests):
        differ = [i for i in range(len(every)) if not np.array_equal(every[i, k], every[0, k])]
        if differ:
            raise ConfigError(
                f"processes {differ} differ from process 0 in their {name}: their collectives "
                "would exchange the wrong arrays, silently; stopped before step 0"
            )


def _program_text(hlo: str) -> str:
    """A compiled HLO module's text without what may differ between hosts running the same
    program (source files, lines, stack frames, op names); what is left holds the schedule,
    so the order of the collectives."""
    debug = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    blocks = [b for b in hlo.split("\n\n") if not b.lstrip().startswith(debug)]
    return re.sub(r", metadata=\{[^}]*\}", "", "\n\n".join(blocks))


def _digest(x: Any) -> bytes:
    """SHA-256 of a string, bytes, or the leaves of a tree (dtype, shape and bytes of each)."""
    h = hashlib.sha256()
    if isinstance(x, str | bytes):
        h.update(x.encode() if isinstance(x, str) else x)
        return h.digest()
    for leaf in jax.tree.leaves(x):
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.digest()


def gather(tree: PyTree) -> PyTree:
    """NumPy copies of global arrays, on every process (a collective: all must call it). Leaf
    by leaf, so that at most one whole leaf at a time is gathered onto the devices."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


# --------------------------------------------------------------------------------------------
# Optimizer and the jitted step.


# Config fields that may differ between the runs of one vectorized program (experiments.py):
# numbers the optimizer reads only at run time, so each run may bring its own as a traced array.
HYPERPARAMETERS = ("lr", "b1", "b2", "eps", "eps_root", "momentum", "max_grad_norm")


def make_schedule(
    cfg: Config, peak: float | Float[Array, ""] | None = None
) -> Callable[[Int[Array, ""]], Float[Array, ""]]:
    """Linear warmup to the peak lr (`peak`, else cfg.lr) from peak/(warmup+1) at step 0, then
    constant, or cosine decay to a tenth of it at the last step: the peak times optax's
    schedule of a unit peak, so that the peak may be traced (a vectorized sweep's per-run lr)."""
    w = cfg.warmup
    if cfg.schedule == "cosine":
        # Past `steps` nothing is trained: decay_steps > warmup keeps optax's cosine defined.
        unit = optax.warmup_cosine_decay_schedule(
            1.0 / (w + 1), 1.0, w, max(cfg.steps, w + 1), end_value=0.1
        )
    else:
        unit = optax.linear_schedule(1.0 / (w + 1), 1.0, w)
    # float32 whatever the peak's dtype: a traced peak gives the numbers a Python float gives.
    lr0 = jnp.asarray(cfg.lr if peak is None else peak).astype(jnp.float32)

    def schedule(count: Int[Array, ""]) -> Float[Array, ""]:
        with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix ints and floats
            factor = jnp.asarray(unit(count))
        return lr0 * factor.astype(jnp.float32)

    return schedule


def make_optimizer(
    cfg: Config, hyper: Mapping[str, Any] | None = None, *, schedule: bool = True
) -> optax.GradientTransformationExtraArgs:
    """The optimizer `cfg` names; `hyper` overrides fields in HYPERPARAMETERS with values that
    may be traced (a vectorized sweep's per-run arrays); None stays None. `schedule=False`:
    the peak lr as a number in place of the schedule, which builds no JAX array (`check` runs
    before jax.distributed joins the processes)."""
    h = {name: getattr(cfg, name) for name in HYPERPARAMETERS} | dict(hyper or {})
    # Decay matrices and embeddings, not biases or norm scales (optax.add_decayed_weights'
    # mask: a function of params, or a pytree of bools).
    kwargs: dict[str, Any] = dict(
        learning_rate=make_schedule(cfg, h["lr"]) if schedule else h["lr"],
        weight_decay=cfg.weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    )
    if cfg.optimizer in get_args(AdamFamily):
        kwargs |= dict(b1=h["b1"], b2=h["b2"], eps=h["eps"], max_grad_norm=h["max_grad_norm"])
        if h["eps_root"] is not None:  # None: not even a 0 (a traced 0 would change rounding)
            kwargs["eps_root"] = h["eps_root"]
    else:
        kwargs |= {} if h["momentum"] is None else {"momentum": h["momentum"]}
    if cfg.optimizer in ("micro_sign_sgd", "sign_sgd") and h["max_grad_norm"] is not None:
        raise ConfigError(f"--max-grad-norm: {cfg.optimizer} is invariant to gradient scale")
    if cfg.optimizer == "sign_ema":
        kwargs["max_grad_norm"] = h["max_grad_norm"]
    if cfg.optimizer == "micro_adam_msq" and cfg.msq_block != "none":
        kwargs["block"] = cfg.msq_block
    try:
        return getattr(optimizers, cfg.optimizer)(**kwargs)
    except ValueError as err:  # e.g. b1 outside [0, 1)
        raise ConfigError(str(err)) from None


def diagnostics(
    stats: dict[str, Any], precondition: PyTree | None = None
) -> dict[str, Float[Array, ""]]:
    """SPEC §4 diagnostics from ḡ ("mean"), q ("sq_mean") and the number of units B, where
    μ̂² > σ̂²/B  ⇔  (B·ḡ² − q)/(B−1) > (q − ḡ²)/(B−1)  ⇔  (B+1)·ḡ² > 2q; and the gradient
    noise scale from the same three, the global numbers of `pegrad.gradient_noise_scale`:
    trace_cov = tr Σ = B/(B−1)·Σ(q − ḡ²), grad_sq = |G|² = Σḡ² − tr Σ/B (each unbiased) and
    noise_scale_batch = their ratio on this one batch (which is not; `NoiseScale` smooths each
    part before dividing, the "noise_scale" a run logs). Formed here from the flat vectors the
    other diagnostics use, in float32 like them: two sums that fuse with theirs (no measurable
    cost; pegrad's per-leaf form cost ~5 % of the default LM's step in small reductions).
    With a diagonal `precondition` P (`adam_preconditioner`), the preconditioned noise scale's
    parts as well, tr(PΣ) and |G|²_P (`pegrad.gradient_noise_scale(stats, P)`): trace_cov_p,
    grad_sq_p, noise_scale_p_batch."""
    flat = lambda tree: jnp.concatenate(
        [x.astype(jnp.float32).ravel() for x in jax.tree.leaves(tree)]
    )
    g2, q = flat(stats["mean"]) ** 2, flat(stats["sq_mean"])
    b = stats["batch_size"].astype(jnp.float32)
    trace_cov = b / (b - 1.0) * jnp.sum(q - g2)
    grad_sq = jnp.sum(g2) - trace_cov / b
    extra = {}
    if precondition is not None:
        p = flat(precondition)
        trace_p = b / (b - 1.0) * jnp.sum(p * (q - g2))
        grad_sq_p = jnp.sum(p * g2) - trace_p / b
        extra = {"trace_cov_p": trace_p, "grad_sq_p": grad_sq_p}
        extra["noise_scale_p_batch"] = trace_p / grad_sq_p
    return extra | {
        "grad_norm": jnp.sqrt(jnp.sum(g2)),
        "frac_snr_gt_1_over_B": jnp.mean((b + 1.0) * g2 > 2.0 * q, dtype=jnp.float32),
        # ḡ² ≤ q always (Jensen); coordinates with q = 0 (no gradient at all) are left out.
        "nu_adam_over_nu_micro": jnp.sum(jnp.where(q > 0, g2 / jnp.where(q > 0, q, 1.0), 0.0))
        / jnp.maximum(jnp.sum(q > 0, dtype=jnp.float32), 1.0),
        "trace_cov": trace_cov,
        "grad_sq": grad_sq,
        "noise_scale_batch": trace_cov / grad_sq,
    }


NOISE_EMA = 0.9  # decay per logged step of the averages whose ratio is the logged noise_scale


class NoiseScale:
    """The gradient noise scale B_simple = tr Σ / |G|² as a run logs it ("noise_scale"): each
    part averaged first, an exponential moving average over the logged steps (decay NOISE_EMA;
    both start at 0, so their ratio needs no bias correction), then divided, as
    `pegrad.gradient_noise_scale` says (each part is unbiased, their ratio is not, and one
    batch's |G|² can be ≤ 0). None while the averaged |G|² is ≤ 0 (noise outweighs the signal
    so far). A resumed run replays the records it keeps, so it logs what an uninterrupted one
    does; `python plots.py OUT` draws the same average."""

    def __init__(self, decay: float = NOISE_EMA, suffix: str = ""):
        self.decay, self.trace, self.grad, self.suffix = decay, 0.0, 0.0, suffix

    def add(self, record: Mapping[str, Any]) -> dict[str, float | None]:
        """Fold one logged record's trace_cov and grad_sq in; the averages and their ratio.
        With `suffix` "_p", the preconditioned parts (trace_cov_p, ...: B_P): {} for a record
        without them (a rule with no preconditioner); null parts (the first step, before the
        rule has a v̂) leave the averages as they are."""
        a, x = self.decay, self.suffix
        if f"trace_cov{x}" not in record:
            return {}
        trace, grad = record[f"trace_cov{x}"], record[f"grad_sq{x}"]
        if trace is not None and grad is not None:
            self.trace = a * self.trace + (1 - a) * float(trace)
            self.grad = a * self.grad + (1 - a) * float(grad)
        out = {f"trace_cov{x}_ema": self.trace, f"grad_sq{x}_ema": self.grad}
        return out | {f"noise_scale{x}": self.ratio()}

    def ratio(self) -> float | None:
        return self.trace / self.grad if self.grad > 0 else None


def make_step(
    cfg: Config,
    task: Task,
    opt: optax.GradientTransformationExtraArgs,
    hyper: Mapping[str, Any] | None = None,
) -> Callable[[PyTree, Any, Any], tuple[PyTree, Any, Array, dict]]:
    """The pure training step `step(params, opt_state, batch) -> (params, opt_state, loss,
    diagnostics)`: `optimizers.make_train_step`'s step (the one step of this repository), asked
    also for "sq_mean", which the diagnostics read, and followed by them (with B_P's parts for
    the Adam family, P from the state the step starts from) and a "params_finite" flag. `hyper`:
    the values `opt` was made with (`make_optimizer`), which P reads. Not jitted: main jits it
    with shardings (`jit_step`), sweeps vmap it first."""
    core = optimizers.make_train_step(
        task.loss_fn, opt, impl=cfg.impl, chunk_size=cfg.chunk_size, extra_stats=("sq_mean",),
        jit=False, granularity=cfg.granularity,
    )  # fmt: skip

    def step(params: PyTree, state: Any, batch: Any) -> tuple[PyTree, Any, Array, dict]:
        precondition = adam_preconditioner(cfg, state, hyper)  # before the update
        params, state, loss, st = core(params, state, batch)
        # An update can overflow while the loss it came from is finite: flag it at its step.
        finite = jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]).all()
        return params, state, loss, {**diagnostics(st, precondition), "params_finite": finite}

    return step


def adam_preconditioner(
    cfg: Config, state: Any, hyper: Mapping[str, Any] | None = None
) -> PyTree | None:
    """P = 1/(√(⟨v̂⟩ + ε_root) + ε), the diagonal the run's Adam-family rule divides by
    (`optimizers.adam_preconditioner` with the rule's b2, eps, eps_root and, for
    micro_adam_msq, its ReLU and block; `hyper` as in `make_optimizer`), from the optimizer
    state before a step's update, so P does not depend on that step's batch and B_P's parts
    stay unbiased: v̂ = ν/(1 − β₂^t) of the one `optax.ScaleByAdamState`. NaN before the first
    update (v̂ undefined). None for a rule without a second moment (the sign family)."""
    if cfg.optimizer not in get_args(AdamFamily):
        return None
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    (adam,) = [x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x)]
    h = {name: getattr(cfg, name) for name in HYPERPARAMETERS} | dict(hyper or {})
    msq = cfg.optimizer == "micro_adam_msq"
    return optimizers.adam_preconditioner(
        adam, b2=h["b2"], eps=h["eps"], eps_root=0.0 if h["eps_root"] is None else h["eps_root"],
        block=None if cfg.msq_block == "none" else cfg.msq_block, relu=msq,
    )  # fmt: skip


class Run(NamedTuple):
    """A run before any device or file: what train.main and experiments.py's vectorized sweeps
    are both made of."""

    task: Task
    opt: optax.GradientTransformationExtraArgs
    step: Callable[[PyTree, Any, Any], tuple[PyTree, Any, Array, dict]]  # make_step's, pure
    train_key: PRNGKeyArray  # the batch of step s: task.sample(data, key=fold_in(train_key, s))
    eval_key: PRNGKeyArray  # held-out batch i: task.sample(eval_data, key=fold_in(eval_key, i))


def numeric_policy(cfg: Config) -> None:
    """The one place that sets JAX's numerics for a run: float64 parameters need 64-bit JAX
    (a process-wide switch; `build` and `main` set it, so train.main, sweep.py and
    experiments.py share it). It is never switched back off: a driver that ran a float64 run
    keeps 64-bit types."""
    if cfg.dtype == "float64":
        jax.config.update("jax_enable_x64", True)


def build(cfg: Config, factory: TaskFactory | None = None) -> Run:
    """The task (model, data, loss), optimizer and pure step of `cfg`, all from cfg.seed, under
    `numeric_policy(cfg)`; the task is `factory(cfg, key=...)`'s when given, else --task's or
    --model's (`make_task`)."""
    numeric_policy(cfg)
    model_key, train_key, eval_key = jax.random.split(jax.random.key(cfg.seed), 3)
    task = make_task(cfg, key=model_key, factory=factory)
    opt = make_optimizer(cfg)
    return Run(task, opt, make_step(cfg, task, opt), train_key, eval_key)


def eval_loss_fn(task: Task) -> Callable[[PyTree, Any], Float[Array, ""]]:
    """The mean loss of one held-out batch."""
    return lambda params, batch: jnp.mean(jax.vmap(task.loss_fn, (None, 0))(params, batch))


def jit_step(run: Run, mesh: Mesh, shardings: PyTree) -> Any:
    """`run.step` jitted with shardings: the batch split along "data", parameters and optimizer
    state as `shardings` says (a tree of {"params", "opt_state"}, from `placement`), losses and
    diagnostics replicated."""
    everywhere, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, state = shardings["params"], shardings["opt_state"]
    return jax.jit(
        run.step,
        in_shardings=(params, state, split),
        out_shardings=(params, state, everywhere, everywhere),
    )


# --------------------------------------------------------------------------------------------
# Checkpoints: leaves keyed by their path in an .npz (no pickle), written atomically.


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write a temp file in the same directory, fsync it, rename it over `path`: a crash at
    any point leaves the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_checkpoint(out: Path, step: int, tree: PyTree, cfg: Config) -> None:
    """checkpoint.npz: every leaf under its key path, plus the metadata, which
    checkpoint.json repeats for people (the .npz alone is what `load_checkpoint` reads)."""
    arrays, leaves = {}, {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name, x = jax.tree_util.keystr(path), np.asarray(leaf)
        leaves[name] = [list(x.shape), str(x.dtype)]
        # bfloat16 is no NumPy dtype: store its bits, `load_checkpoint` views them back.
        arrays[name] = x.view(f"u{x.itemsize}") if x.dtype.name == "bfloat16" else x
    meta = {"step": step, "config": dataclasses.asdict(cfg), "leaves": leaves}
    arrays["__meta__"] = np.array(json.dumps(meta))
    atomic_write(out / "checkpoint.npz", lambda f: np.savez(f, allow_pickle=False, **arrays))
    atomic_write(out / "checkpoint.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))


def checkpoint_step(out: Path) -> int | None:
    """The step of the checkpoint in `out`; None: there is none."""
    path = out / "checkpoint.npz"
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as saved:
            return int(json.loads(str(saved["__meta__"]))["step"])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise ConfigError(f"{path} is not a checkpoint of train.py: {err}") from None


def load_checkpoint(out: Path, template: PyTree) -> tuple[PyTree, int]:
    """(tree, step): leaves matched by path and shape against a freshly initialised template."""
    path = out / "checkpoint.npz"
    if not path.exists():
        raise ConfigError(f"--resume: no checkpoint at {path}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    with np.load(path, allow_pickle=False) as saved:
        leaves = []
        for key_path, like in flat:
            name = jax.tree_util.keystr(key_path)
            x = saved[name] if name in saved.files else None
            if x is None or x.shape != like.shape:
                shape = None if x is None else x.shape
                raise ConfigError(f"{path} does not fit: {name} is {shape}, want {like.shape}")
            bits = x.dtype.kind == "u" and like.dtype.kind != "u"
            leaves.append(x.view(like.dtype) if bits else x)
        step = json.loads(str(saved["__meta__"]))["step"]
    return jax.tree_util.tree_unflatten(treedef, leaves), step


# --------------------------------------------------------------------------------------------
# Progress: one updating line on a terminal, plain lines otherwise (logs, pipes). Every loss is
# labelled as metrics.jsonl labels it: "step N" is the loss of the parameters after N updates.


def logs(cfg: Config, step: int) -> bool:
    """Whether the loss of `step` is logged, in metrics.jsonl and on a console that is no
    terminal: every --log-interval steps, at every evaluation, and at the last step."""
    return step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step + 1 == cfg.steps


class Progress:
    def __init__(self, cfg: Config, start: int, units_per_step: int, unit: str):
        self.cfg, self.start, self.units_per_step, self.unit = cfg, start, units_per_step, unit
        self.tty, self.t0 = sys.stdout.isatty(), 0.0
        self.noise_scale: float | None = None  # the logged noise_scale so far (`NoiseScale`)
        self.quiet = jax.process_index() != 0  # one process speaks for a multi-process run

    def update(self, step: int, loss: float) -> None:
        """`loss`: step `step`'s, measured before its update (metrics.jsonl's "step"), and
        `noise_scale`, the smoothed B_simple logged so far (`NoiseScale`), where there is one."""
        if self.quiet:
            return
        line = f"step {step}/{self.cfg.steps}  loss {loss:.4f}"
        if self.noise_scale is not None:
            line += f"  noise scale {self.noise_scale:.3g}"
        if step == self.start:  # the first step compiles: measure the speed from its end
            self.t0 = time.perf_counter()
        else:
            rate = (step - self.start) / (time.perf_counter() - self.t0)  # steps per second
            line += (
                f"  {rate * self.units_per_step:,.0f} {self.unit}/s  "
                f"ETA {(self.cfg.steps - step - 1) / rate:.0f}s"
            )
        if self.tty:
            print(f"\r{line}\033[K", end="", flush=True)
        elif logs(self.cfg, step):
            print(line, flush=True)

    def note(self, text: str) -> None:
        if not self.quiet:
            print(("\r\033[K" if self.tty else "") + text, flush=True)


# --------------------------------------------------------------------------------------------
# The run.


def main(cfg: Config, task: TaskFactory | None = None) -> dict[str, Any]:
    """Train per `cfg` and return the final metrics: {"out", "steps", "steps_run" (those this
    call ran: fewer when resumed), "loss", "eval_loss", "first_eval_loss" (the run's, from
    before a resume too), "seconds"}.

    `task`: your own model and data, a factory `(cfg, *, key) -> Task` (what --task names on
    the command line; config.json records it as "MODULE:NAME").

    Raises ConfigError on bad input; Diverged on a NaN/Inf loss or parameters, after writing
    {"step", "diverged"} to metrics.jsonl and keeping the last good checkpoint; Interrupted (a
    KeyboardInterrupt) on Ctrl-C, its message naming the last checkpoint."""
    if task is not None:
        if isinstance(task, Task) or not callable(task):
            raise ConfigError("main(cfg, task=...) takes a factory (cfg, *, key) -> Task")
        if cfg.task is not None:
            raise ConfigError(f"a task twice: main's task= and Config.task={cfg.task!r}")
        where, name = getattr(task, "__module__", None), getattr(task, "__qualname__", None)
        cfg = dataclasses.replace(cfg, task=f"{where}:{name}" if where and name else repr(task))
    numeric_policy(cfg)
    cfg = check(cfg)
    try:
        return _train(cfg, task)
    except KeyboardInterrupt:
        raise Interrupted(interrupted(Path(str(cfg.out)))) from None


@contextlib.contextmanager
def ctrl_c_between_steps() -> Iterator[Callable[[], None]]:
    """Within, Ctrl-C is never lost: Python drops an exception raised where it cannot propagate
    (a garbage-collection callback prints "Exception ignored in ..." and goes on), so the
    KeyboardInterrupt of a SIGINT arriving there vanished and the run went on. Here SIGINT only
    marks the request; the `check()` yielded raises it at the next step boundary. A second
    Ctrl-C raises at once (and stays marked). Only where Python's own handler is in place, in
    the main thread."""
    asked: list[bool] = []

    def check() -> None:
        if asked:
            asked.clear()
            raise KeyboardInterrupt

    def handler(signum: int, frame: Any) -> None:
        if asked:  # a second Ctrl-C before the step boundary: at once, the mark kept in case
            raise KeyboardInterrupt  # Python drops this one too
        asked.append(True)

    ours = threading.current_thread() is threading.main_thread()
    ours = ours and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, handler) if ours else None
    try:
        yield check
        check()  # one that came after the last step
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)


def resume_command(out: Path) -> str:
    """The command, to paste where the run was started, that continues the run in `out`:
    `cli_config` reads every knob not typed from its config.json."""
    if __package__:  # installed: python -m pegrad.train
        program = f"python -m {__package__}.train"
    else:
        here = Path(__file__).resolve()
        shown = os.path.relpath(here) if here.parent == Path.cwd().resolve() else str(here)
        program = f"python {shlex.quote(shown)}"
    return f"{program} --resume --out {shlex.quote(str(out))}"


def interrupted(out: Path) -> str:
    """What Ctrl-C says: where the run in `out` stands, and the command that continues it."""
    resume = resume_command(out)
    with contextlib.suppress(ConfigError):
        step = checkpoint_step(out)
        if step is not None:
            return (
                f"the last checkpoint is {out / 'checkpoint.npz'} (step {step}); continue it "
                f"with: {resume}"
            )
    if (out / "config.json").is_file():
        return f"before the first checkpoint of {out}; start it over with: {resume}"
    return f"before anything was written to {out}: nothing to resume, run the command again"


def divergence_fixes(cfg: Config) -> str:
    """What a run that diverged can change (SPEC §4; README, Results: MicroAdamMSQ's divergence
    is an ε artefact): the flags, with this run's values."""
    lr = f"a smaller --lr (this run: {cfg.lr:g}, warmup {cfg.warmup})"
    if cfg.optimizer == "micro_adam_msq" and not (cfg.eps == 0 and cfg.eps_root):
        root = cfg.eps or 1e-8
        return (
            "micro_adam_msq divides by √ReLU(v̂) + ε, and v̂ = μ̂² is ~0 (or below) where the "
            f"noise outweighs the mean: put ε inside the root, --eps 0 --eps-root {root:g} "
            f"(the paper's form, SPEC §4), or --msq-block tensor; else {lr}"
        )
    return f"Try {lr}, or --max-grad-norm" if cfg.max_grad_norm is None else f"Try {lr}"


def start_writing(out: Path, cfg: Config, metrics: str) -> list[Path]:
    """Create --out (and the parents it lacks) and write config.json (the run's config; the
    --resume that started this process is no part of it) and metrics.jsonl (`metrics`: the
    records kept from before a checkpoint). Returns what did not exist before, files first
    and then directories, deepest first: what `removed_on_failure` removes."""
    made = [there for there in (out, *out.parents) if not there.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot create it ({err}); choose another --out") from None
    config, log = out / "config.json", out / "metrics.jsonl"
    new = [path for path in (config, log) if not path.exists()]
    config_json = json.dumps(dataclasses.asdict(dataclasses.replace(cfg, resume=False)), indent=1)
    atomic_write(config, lambda f: f.write(config_json.encode()))
    atomic_write(log, lambda f: f.write(metrics.encode()))
    return new + made


@contextlib.contextmanager
def removed_on_failure(created: list[Path], *, kept: Callable[[], bool]) -> Iterator[None]:
    """Remove `created` (files, and directories left empty) when the block raises an Exception
    while `kept()` is false: a run that failed before its first step leaves nothing behind.
    Ctrl-C (no Exception) keeps them: config.json is what --resume continues."""
    try:
        yield
    except Exception:
        if not kept():
            for path in created:
                with contextlib.suppress(OSError):  # a directory someone else wrote into stays
                    if path.is_dir():
                        path.rmdir()
                    else:
                        path.unlink()
        raise


def _train(cfg: Config, factory: TaskFactory | None) -> dict[str, Any]:
    join_processes(cfg)
    mesh = make_mesh(cfg)
    everywhere = NamedSharding(mesh, P())
    # Process 0 alone writes (--out must be one directory all processes see, to resume) and
    # prints; every process reads the checkpoint, and takes part in every computation.
    lead = jax.process_index() == 0
    say = print if lead else lambda *args, **kwargs: None

    with on_host():
        run = build(cfg, factory)
        task, opt, train_key, eval_key = run.task, run.opt, run.train_key, run.eval_key
        tree = {"params": task.params, "opt_state": opt.init(task.params)}
    out, start = Path(str(cfg.out)), 0
    if cfg.resume and checkpoint_step(out) is not None:
        tree, start = load_checkpoint(out, tree)
    elif cfg.resume:
        say(f"no checkpoint in {out} yet: starting at step 0")
    say("config:", "  ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(
        f"{models.count_params(task.params):,} parameters ({cfg.param_sharding}), "
        f"{mesh.size} x {mesh.devices.flat[0].platform} device(s){processes}, "
        f"steps {start} -> {cfg.steps}"
    )

    shardings = placement(tree, mesh, cfg.param_sharding)
    tree = place(tree, shardings)
    data = (task.train_data, task.eval_data)
    train_data, eval_data = place(data, jax.tree.map(lambda _: everywhere, data))
    train_step = jit_step(run, mesh, shardings)
    sample = make_sampler(task, mesh)
    eval_sets = [
        sample(eval_data, key=jax.random.fold_in(eval_key, i)) for i in range(cfg.eval_batches)
    ]
    eval_loss = jax.jit(eval_loss_fn(task), out_shardings=everywhere)
    agree_across_processes(
        cfg,
        run,
        {
            "train step": (train_step, (tree["params"], tree["opt_state"], eval_sets[0])),
            "eval loss": (eval_loss, (tree["params"], eval_sets[0])),
        },
    )
    schedule = make_schedule(cfg)
    lr = lambda step: float(schedule(jnp.asarray(step, jnp.int32)))

    # A resumed run keeps the metrics of the steps before its checkpoint and redoes the rest.
    metrics_path = out / "metrics.jsonl"
    old = metrics_path.read_text().splitlines() if start > 0 and metrics_path.exists() else []
    earlier = "".join(line + "\n" for line in old if json.loads(line)["step"] < start)
    noise = NoiseScale()  # the noise scale's averages, as the records kept left them
    noise_p = NoiseScale(suffix="_p")  # B_P's, for the Adam family
    for line in earlier.splitlines():
        if "trace_cov" in (kept := json.loads(line)):
            noise.add(kept)
            noise_p.add(kept)
    progress = Progress(cfg, start, cfg.batch_size * task.units_per_example, task.unit)
    result: dict[str, Any] = {"out": str(out), "steps": cfg.steps, "steps_run": cfg.steps - start}
    for line in earlier.splitlines():  # the run's first evaluation, before a resume
        if "eval_loss" in (kept := json.loads(line)):
            result.setdefault("first_eval_loss", kept["eval_loss"])
    last_saved = start if start > 0 else None
    # Nothing was written before here. A run that fails before it logs a step (e.g. its step
    # does not compile) removes what it created; Ctrl-C keeps config.json, to resume from.
    created = start_writing(out, cfg, earlier) if lead else []
    logged = False
    with (
        removed_on_failure(created, kept=lambda: logged),
        open(metrics_path if lead else os.devnull, "a") as metrics,
        ctrl_c_between_steps() as ctrl_c,
    ):

        def write(record: dict[str, Any]) -> None:
            nonlocal logged
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            logged = True

        def diverged(step: int, why: str) -> Diverged:
            """Record the step that diverged in metrics.jsonl; the error that stops the run."""
            write({"step": step, "diverged": why, "lr": lr(step)})
            if last_saved is None:
                kept = "no checkpoint was written yet"
            else:
                kept = (
                    f"kept the last good checkpoint, {out / 'checkpoint.npz'} (step {last_saved})"
                )
            return Diverged(f"{why}; stopped, {kept}. {divergence_fixes(cfg)}")

        def evaluate(step: int) -> float:
            value = float(np.mean([float(eval_loss(tree["params"], b)) for b in eval_sets]))
            if not math.isfinite(value):
                raise diverged(step, f"eval loss is {value} after {step} steps")
            progress.note(f"step {step}: eval loss {value:.4f}")
            result.setdefault("first_eval_loss", value)
            result["eval_loss"] = value
            return value

        t_start = time.perf_counter()
        for step in range(start, cfg.steps):
            ctrl_c()  # a Ctrl-C since the last step ends the run here
            record: dict[str, Any] = {"step": step}
            if step % cfg.eval_interval == 0:
                record["eval_loss"] = evaluate(step)
            batch = sample(train_data, key=jax.random.fold_in(train_key, step))
            params, opt_state, loss, diag = train_step(tree["params"], tree["opt_state"], batch)
            loss = result["loss"] = float(loss)  # waits for the step: NaN stops at its step
            if not math.isfinite(loss):
                raise diverged(step, f"loss is {loss} at step {step}")
            if not diag.pop("params_finite"):
                raise diverged(step, f"the update of step {step} made parameters NaN/Inf")
            tree = {"params": params, "opt_state": opt_state}
            if logs(cfg, step):
                record |= {"loss": loss, "lr": lr(step)}
                record |= {k: float(v) for k, v in diag.items()}
                if step == 0 and "trace_cov_p" in record:  # no v̂ before the first update
                    record |= dict.fromkeys(("trace_cov_p", "grad_sq_p", "noise_scale_p_batch"))
                record |= noise.add(record) | noise_p.add(record)
                record["seconds"] = round(time.perf_counter() - t_start, 3)
                write(record)
            if (step + 1) % cfg.checkpoint_interval == 0 or step + 1 == cfg.steps:
                whole = gather(tree)  # every process takes part; one writes
                if lead:
                    save_checkpoint(out, step + 1, whole, cfg)
                last_saved = step + 1
            progress.noise_scale = noise.ratio()
            progress.update(step, loss)
        write({"step": cfg.steps, "eval_loss": evaluate(cfg.steps)})
    result["seconds"] = time.perf_counter() - t_start
    first = result.get("first_eval_loss", float("nan"))
    ran = f"{cfg.steps} steps" if start == 0 else f"steps {start} -> {cfg.steps} (resumed)"
    say(
        f"done: {ran} in {result['seconds']:.0f}s, eval loss {first:.4f} -> "
        f"{result['eval_loss']:.4f} over the run; wrote {out}"
    )
    return result


def cli(argv: list[str] | None = None) -> None:
    """`python train.py ...` (`python -m pegrad.train ...` installed), the config `cli_config`
    reads (--resume: the run's own): bad input, a NaN/Inf loss and Ctrl-C each end the run with
    one line on stderr and a non-zero exit status."""
    try:
        main(cli_config(sys.argv[1:] if argv is None else argv))
    except (ConfigError, Diverged) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt as err:  # Interrupted, or Ctrl-C before the run began
        print(f"interrupted{f': {err}' if str(err) else ''}", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    cli()
