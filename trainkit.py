"""trainkit.py: the plumbing of train.py, so that train.py reads as training alone.

What is here is no part of what a run computes: the command line, the checks of bad input, the
processes and devices a run spans, checkpoints, the console. It imports nothing of train.py;
what it needs of it comes as arguments (the Config class, the Task class, the schedule).

Command line (`parse_flags`): one --flag-name per field of train.Config, typed from its
annotation (a `Literal` is a choice, `X | None` takes "none"), its help text the field's
`knob(help=...)`; argparse's own errors exit with status 2.

Bad input (SPEC §6, `check`, `check_task`) is a `ConfigError`, which `cli` prints as one line
"error: ..." with exit status 1, before --out is created: a knob below its least value, options
that do not go together, an --out that cannot be a directory, a --task factory that cannot be
called as factory(cfg, *, key), a Task field that is not what train.Task says it must be (the
field named), a loss that is not one scalar per example.

Resume (`resume_config`, `check`): batches depend only on (seed, step), so `--resume` continues
from the last checkpoint to bitwise the parameters of an uninterrupted run on the same devices,
to float rounding on others. `python train.py --resume --out DIR` continues the run in DIR as
it was configured: every knob not typed comes from DIR/config.json (--process-id excepted), so
the command Ctrl-C prints works as printed. A flag typed beside it changes a knob that may
change on resume (how a run is watched, how long it runs, where and with what rounding:
knob(resume=True)); one that may not and differs is refused, naming each with both values
("--lr 0.01 differs from the run's 0.003 in DIR/config.json"). --steps may change only where
the learning rate of every step already taken stays the same (a constant schedule; a cosine one
still in its warmup): a resumed run always equals an uninterrupted run of its final config.
With no checkpoint yet (a run killed before its first) --resume starts the run over at step 0,
as configured; with nothing in DIR (a job preempted before it wrote anything), a new run of the
flags typed, so the same command with --resume restarts a preempted job wherever it stopped. In
Python, `main(Config(..., resume=True))` takes the Config whole: every knob that may not change
must equal the run's, or ConfigError names it; `resume_config(Config, {"out": DIR})` is the
Config the command line would run.

Processes and devices: data-parallel over all devices along the mesh axis "data" (`make_mesh`):
each device draws only its rows of the batch (`make_sampler`); parameters and optimizer state
are replicated, or with --param-sharding fsdp each leaf is split along its longest axis that
the device count divides (`fsdp_axis`, `placement`). Several processes (hosts) run the same
command, each with its --process-id (or --distributed under Slurm, Open MPI, Cloud TPU: JAX
detects the rest); they join through jax.distributed (`join_processes`) and one mesh spans all
their devices. Process 0 prints and writes; checkpoints are gathered to it (`gather`) and resume
on any number of processes and devices. Before step 0 the processes check that they hold the
same config, data, initial state and compiled programs, or stop (`agree_across_processes`).

Files: checkpoint.npz (every leaf under its key path, no pickle; bfloat16 as its bits) with a
human-readable checkpoint.json, config.json and metrics.jsonl, each written atomically
(`atomic_write`: a crash leaves the old file or the new one). A run that fails before it logs
its first step removes what it created (`removed_on_failure`); Ctrl-C keeps config.json, and
ends with one line naming the last checkpoint and the command that continues the run
(`interrupted`), exit status 130.

Console (`Progress`): one updating line on a terminal, plain lines otherwise; "step N" is the
loss of the parameters after N updates, as metrics.jsonl labels it, printed (off a terminal) on
the steps metrics.jsonl logs. No line is longer than `WIDTH` characters but an error's.
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
import os
import re
import shlex
import signal
import sys
import textwrap
import threading
import time
import types
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal, get_args, get_origin

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray, PyTree

# train.Config, train.Task and train.Run: trainkit imports nothing of train.py (train.py run as
# a script is __main__, and an `import train` here would load it a second time).
Config = Any
Task = Any
Run = Any
WIDTH = 100  # the console's lines (`say`) are wrapped to this width


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


def parse_flags(config: type, argv: list[str]) -> dict[str, Any]:
    """The knobs `argv` gives, by field name of the dataclass `config` (train.Config): only the
    flags typed (a knob left at its default is absent), which `--resume` tells from the run's
    own (`resume_config`). --help shows every default; argparse's own errors exit here (2)."""
    parser = argparse.ArgumentParser(
        description="Train with pegrad's optimizers; see train.py's docstring.",
        argument_default=argparse.SUPPRESS,
        epilog="The paper's studies: python experiments.py --help",
    )
    for field in dataclasses.fields(config):
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


def cli_config(config: type, argv: list[str]) -> Config:
    """What `python train.py ARGV` runs: the flags typed, the defaults for the rest, except that
    with --resume the run in --out supplies every knob not typed (`resume_config`), so that
    `--resume --out DIR` alone continues the run in DIR as it was configured."""
    given = parse_flags(config, argv)
    return resume_config(config, given) if given.get("resume") else config(**given)


def read_config(config: type, saved: Path) -> dict[str, Any]:
    """A run's config.json, as {field name: value}."""
    try:
        old = json.loads(saved.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{saved} is not a config.json of train.py: {err}") from None
    names = {f.name for f in dataclasses.fields(config)}
    if not isinstance(old, dict) or not old.keys() <= names:
        unknown = ", ".join(sorted(set(old) - names)) if isinstance(old, dict) else "not an object"
        raise ConfigError(f"{saved} is not a config.json of this train.py ({unknown})")
    return old


def refuse_changes(
    config: type, saved: Path, old: Mapping[str, Any], new: Mapping[str, Any]
) -> None:
    """ConfigError unless every knob of `new` that may not change on resume equals the run's
    (`old`, read from `saved`), naming each that differs with both values."""
    same = lambda k, a, b: task_spec(a) == task_spec(b) if k == "task" else a == b  # noqa: E731
    differ = [
        f"{flag(f.name)} {spell(new[f.name])} differs from the run's {spell(old.get(f.name))}"
        for f in dataclasses.fields(config)
        if not f.metadata["resume"]
        and f.name in new
        and not same(f.name, new[f.name], old.get(f.name))
    ]
    if differ:
        raise ConfigError(
            f"--resume: {', '.join(differ)} in {saved}; a resumed run keeps the knobs that "
            "shape its trajectory (to change them, start a new run with another --out)"
        )


def resume_config(config: type, given: Mapping[str, Any]) -> Config:
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
        return config(**{**given, "resume": True})  # check: a checkpoint alone is refused
    old = read_config(config, saved)
    refuse_changes(config, saved, old, given)
    kept = {k: v for k, v in old.items() if k != "process_id"}
    return config(**{**kept, **given, "resume": True})


def check(
    cfg: Config,
    *,
    optimizer: Callable[[Config], Any],
    schedule: Callable[[Config], Callable[[Any], Any]],
) -> Config:
    """Reject bad input before any work; resolve the output directory. With `cfg.resume`, every
    knob that may not change on resume must equal the run's in --out (its config.json): `cfg`
    is the whole config (`resume_config` makes one from the knobs typed). `optimizer(cfg)`
    makes the optimizer, which checks its own knobs (b1, momentum, ...; train.make_optimizer
    with no schedule: no JAX array yet); `schedule(cfg)` is the learning rate of each step
    (train.make_schedule), compared when a resume changes --steps (`check_schedule`)."""
    for field in dataclasses.fields(cfg):
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
    optimizer(cfg)
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
    old = read_config(type(cfg), saved)
    refuse_changes(type(cfg), saved, old, dataclasses.asdict(cfg))
    if step is not None and step > cfg.steps:
        raise ConfigError(f"--resume --steps {cfg.steps}: the checkpoint is at step {step}")
    if step is not None and old["steps"] != cfg.steps:
        check_schedule(dataclasses.replace(cfg, steps=old["steps"]), cfg, step, schedule)
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


def check_schedule(
    old: Config, new: Config, taken: int, schedule: Callable[[Config], Callable[[Any], Any]]
) -> None:
    """A resumed run equals an uninterrupted run of its new config only if the learning rate of
    each of the `taken` steps behind its checkpoint is what the new config gives it: --steps
    may change on resume only where the schedule does not depend on it (a constant schedule;
    a cosine one still in its warmup)."""
    steps = jnp.arange(taken, dtype=jnp.int32)
    before, after = (np.asarray(schedule(c)(steps)) for c in (old, new))
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


def load_factory(spec: str) -> Callable[..., Any]:
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


def is_data(leaf: Any) -> bool:
    """Whether a leaf can be data a jitted function reads: an array or a number."""
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float | complex)


def what(x: Any) -> str:
    """A value as an error names it: its dtype, or its type (a function: its name)."""
    if hasattr(x, "dtype"):
        return str(x.dtype)
    name = getattr(x, "__name__", None)
    return f"a function ({name})" if callable(x) and name else f"a {type(x).__name__}"


def checked_task(
    factory: Callable[..., Any], cfg: Config, *, key: PRNGKeyArray, like: type, name: str
) -> Task:
    """`factory(cfg, key=key)`, checked field by field before any work (SPEC §6), each failure
    a ConfigError naming the field of `like` (train.Task) and what it must be: a factory
    callable as factory(cfg, key=key) that returns a Task whose params are floating arrays,
    loss_fn and sample functions, train_data and eval_data arrays, unit a name and
    units_per_example a positive int; whose batches have cfg.batch_size examples, and whose
    loss of one example is a floating scalar. `name`: the task as the errors name it."""
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
    # `python train.py --task ...` runs train.py as __main__; a factory that imported `train`
    # has another copy of the class: the same fields are the same Task.
    if getattr(task, "_fields", None) == like._fields and isinstance(task, tuple):
        task = like(*task)
    if not isinstance(task, like):
        raise ConfigError(f"task {name} returned a {type(task).__name__}, not a train.Task")

    def refuse(field: str, why: str) -> ConfigError:
        return ConfigError(f"task {name}: Task.{field}{'' if why[0] == '(' else ' '}{why}")

    for path, leaf in jax.tree_util.tree_leaves_with_path(task.params):
        if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)):
            raise refuse(
                f"params{jax.tree_util.keystr(path)}",
                f"is {what(leaf)}, not a floating array; Task.params holds the trainable arrays "
                "only (an Equinox model: params, static = eqx.partition(model, "
                "eqx.is_inexact_array), the loss closing over static)",
            )
    if not jax.tree.leaves(task.params):
        raise refuse("params", "holds no array: there is nothing to train")
    for field, signature in [("loss_fn", "(params, example)"), ("sample", "(data, *, key)")]:
        if not callable(getattr(task, field)):
            raise refuse(
                field, f"is {what(getattr(task, field))}, not a function {field}{signature}"
            )
    for field in ("train_data", "eval_data"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(task, field)):
            if not is_data(leaf):
                raise refuse(
                    f"{field}{jax.tree_util.keystr(path)}",
                    f"is {what(leaf)}, not an array; Task.{field} holds arrays and numbers only, "
                    "what `sample` draws a batch from (a model with functions in it, e.g. "
                    "eqx.nn.MLP: data, static = eqx.partition(model, eqx.is_array), sample "
                    "calling eqx.combine(data, static))",
                )
    if not (isinstance(task.unit, str) and task.unit):
        raise refuse("unit", f"is {task.unit!r}; it must be a name, what the speed counts: ex, tok")
    units = task.units_per_example
    if not (isinstance(units, int | np.integer) and not isinstance(units, bool) and units >= 1):
        raise refuse(
            "units_per_example",
            f"is {units!r}; it must be an int >= 1, the units (Task.unit) in one example",
        )
    for field in ("train_data", "eval_data"):
        batch = jax.eval_shape(functools.partial(task.sample, key=key), getattr(task, field))
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            if leaf.shape[:1] != (cfg.batch_size,):
                raise refuse(
                    "sample",
                    f"gives a batch whose batch{jax.tree_util.keystr(path)} (from Task.{field}) "
                    f"has shape {leaf.shape}; every leaf's leading axis must be --batch-size "
                    f"{cfg.batch_size}"
                    + (
                        "; a list of examples? stack them: jax.tree.map(lambda *x: "
                        "jnp.stack(x), *examples)"
                        if isinstance(batch, list)
                        else ""
                    ),
                )
        example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
        loss = jax.eval_shape(task.loss_fn, task.params, example)
        if not (
            isinstance(loss, jax.ShapeDtypeStruct)
            and loss.shape == ()
            and jnp.issubdtype(loss.dtype, jnp.floating)
        ):
            shown = (
                f"shape {loss.shape} {loss.dtype}"
                if isinstance(loss, jax.ShapeDtypeStruct)
                else f"a {type(loss).__name__}"
                + (
                    " (a (loss, aux) pair? return the loss alone)"
                    if isinstance(loss, tuple)
                    else ""
                )
            )
            raise refuse(
                "loss_fn",
                f"(params, example) returned {shown} for one example of Task.{field}; it must "
                "return a scalar, the floating loss of ONE example (reduce inside it, e.g. "
                "jnp.sum over its positions; train.py takes the batch mean)",
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
    cfg: Config, run: Run, programs: Mapping[str, tuple[Any, tuple[Any, ...]]]
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


def changed(cfg: Config) -> str:
    """The knobs of `cfg` that differ from their defaults, as the console shows them (each line
    at most WIDTH characters); config.json holds them all."""
    fields = dataclasses.fields(cfg)
    knobs = [
        f"{f.name}={getattr(cfg, f.name)}" for f in fields if getattr(cfg, f.name) != f.default
    ]
    text = "config (the rest default; all of it in config.json): " + "  ".join(knobs)
    return "\n".join(textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False))


def kept_metrics(out: Path, start: int) -> list[dict[str, Any]]:
    """The records of metrics.jsonl in `out` that a run resumed at step `start` keeps: those of
    the steps before its checkpoint (it redoes the rest)."""
    path = out / "metrics.jsonl"
    if start == 0 or not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] < start]


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
        here = Path(__file__).resolve().with_name("train.py")
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


def run_cli(main: Callable[[], Any]) -> None:
    """`main()` as the command line runs it: bad input, a NaN/Inf loss and Ctrl-C each end it
    with one line on stderr and a non-zero exit status (1; 130 for Ctrl-C)."""
    try:
        main()
    except (ConfigError, Diverged) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt as err:  # Interrupted, or Ctrl-C before the run began
        print(f"interrupted{f': {err}' if str(err) else ''}", file=sys.stderr, flush=True)
        sys.exit(130)
