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

Read top to bottom: the config (every knob, each with its help text), the run (`main`: the
model and data placed on the devices, the step compiled, the loop), then what a run is made of:
the task (random windows of a byte string, or a teacher-student regression whose label noise
`--noise` sets; or your own, `Task`), and the optimizer with one pure training step that asks
pegrad for the optimizer's statistics plus "mean" and "sq_mean" for the gradient diagnostics of
SPEC §4 (`build`, which experiments.py's vectorized sweeps share). What is not training, the
command line, the checks of bad input, processes and devices, checkpoints, resume and the
console, is trainkit.py's (its docstring says how each behaves).

Writes into --out (default runs/<timestamp>), created when training starts: config.json (the
resolved config; the console shows the knobs that differ from the defaults), metrics.jsonl (one
object per logged step: step, loss, lr, grad_norm, frac_snr_gt_1_over_B (the fraction of
coordinates with μ̂² > σ̂²/B), nu_adam_over_nu_micro (ḡ²/q averaged over coordinates), the
gradient noise scale B_simple = tr Σ / |G|² (`pegrad.gradient_noise_scale`): noise_scale, the
one to plot, is the ratio of trace_cov_ema and grad_sq_ema, moving averages over the logged
steps of the step's batch's trace_cov = tr Σ and grad_sq = |G|² (each unbiased; `NoiseScale`;
null while the averaged |G|² is ≤ 0), and noise_scale_batch is one batch's ratio (biased, noisy,
can be negative); for the Adam family the same for B_P = tr(PΣ) / |G|²_P, P = 1/(√v̂ + ε) of the
state before the step: trace_cov_p, grad_sq_p, their _ema and noise_scale_p (null at step 0);
and eval_loss when evaluated), checkpoint.npz (no pickle) with a human-readable
checkpoint.json. "step" counts the optimizer updates applied to the parameters a loss was
measured on, everywhere: the console's `step N/STEPS  loss L  noise scale S` is metrics.jsonl's
{"step": N, "loss": L, "noise_scale": S}.

Your own model and data: a factory `make(cfg, *, key) -> Task` (SPEC §6.1 says each field),
named by `--task MODULE:NAME` or `--task PATH.py:NAME`, or handed to `main(cfg, task=make)` in
Python. It reads what it needs of cfg (batch_size, dtype, data, seed through `key`); --model and
its size knobs are then unused. Every field is checked before any work.

`--resume --out DIR` continues the run in DIR as configured (its config.json) to bitwise the
parameters of an uninterrupted run. Data-parallel over all devices (mesh axis "data"), the
parameters replicated or split (--param-sharding fsdp), over one process or several (hosts,
jax.distributed). Bad input and a NaN/Inf loss end the run with one line "error: ..." and exit
status 1 (bad input before --out is created; a NaN keeps the last good checkpoint); Ctrl-C with
one line naming the last checkpoint and the command that continues the run, exit status 130.
In-process, `main(Config(...))` returns the final metrics; `build(Config(...))` is what a run
is made of before any device or file (task, optimizer, step), for drivers that run many at
once.
"""

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

# In a checkout these are the files beside this one; installed, they are the modules of the
# package `pegrad` (pegrad/__init__.py is pegrad.py), so that a user's own models.py or
# optimizers.py beside their script never stands in for them.
if __package__:
    from . import models, optimizers
    from . import trainkit as kit
else:
    import models
    import optimizers
    import trainkit as kit

# trainkit's names that drivers and tests know as train's.
ConfigError = kit.ConfigError
Diverged = kit.Diverged
Interrupted = kit.Interrupted
Progress = kit.Progress
load_factory = kit.load_factory
atomic_write = kit.atomic_write
save_checkpoint = kit.save_checkpoint
load_checkpoint = kit.load_checkpoint
checkpoint_step = kit.checkpoint_step


# --------------------------------------------------------------------------------------------
# The config: every knob, a flag each (--help shows their help texts and defaults).

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


TaskFactory = Callable[..., Any]  # factory(cfg, *, key) -> Task


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
        raise Interrupted(kit.interrupted(Path(str(cfg.out)))) from None


def _train(cfg: Config, factory: TaskFactory | None) -> dict[str, Any]:
    kit.join_processes(cfg)
    mesh = kit.make_mesh(cfg)
    everywhere = NamedSharding(mesh, P())
    # Process 0 alone writes (--out must be one directory all processes see, to resume) and
    # prints; every process reads the checkpoint, and takes part in every computation.
    lead = jax.process_index() == 0
    say = functools.partial(print, flush=True) if lead else lambda *args, **kwargs: None
    say(f"building {f'the task {cfg.task}' if cfg.task else f'the {cfg.size} {cfg.model}'} ...")
    with kit.on_host():
        run = build(cfg, factory)
        task, opt, train_key, eval_key = run.task, run.opt, run.train_key, run.eval_key
        tree = {"params": task.params, "opt_state": opt.init(task.params)}
    out, start = Path(str(cfg.out)), 0
    if cfg.resume and checkpoint_step(out) is not None:
        tree, start = load_checkpoint(out, tree)
    elif cfg.resume:
        say(f"no checkpoint in {out} yet: starting at step 0")
    say(kit.changed(cfg))
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(
        f"{models.count_params(task.params):,} parameters ({cfg.param_sharding}), "
        f"{mesh.size} x {mesh.devices.flat[0].platform} device(s){processes}, "
        f"steps {start} -> {cfg.steps}"
    )

    shardings = kit.placement(tree, mesh, cfg.param_sharding)
    tree = kit.place(tree, shardings)
    data = (task.train_data, task.eval_data)
    train_data, eval_data = kit.place(data, jax.tree.map(lambda _: everywhere, data))
    train_step = jit_step(run, mesh, shardings)
    sample = kit.make_sampler(task, mesh)
    say("compiling the training step (the first step waits for it) ...")
    eval_sets = [
        sample(eval_data, key=jax.random.fold_in(eval_key, i)) for i in range(cfg.eval_batches)
    ]
    eval_loss = jax.jit(eval_loss_fn(task), out_shardings=everywhere)
    kit.agree_across_processes(
        cfg,
        run,
        {
            "train step": (train_step, (tree["params"], tree["opt_state"], eval_sets[0])),
            "eval loss": (eval_loss, (tree["params"], eval_sets[0])),
        },
    )
    schedule = make_schedule(cfg)
    lr = lambda step: float(schedule(jnp.asarray(step, jnp.int32)))

    # A resumed run keeps the metrics of the steps before its checkpoint and redoes the rest;
    # the noise scale's averages start where the records kept left them.
    before = kit.kept_metrics(out, start)
    noise, noise_p = NoiseScale(), NoiseScale(suffix="_p")  # B_simple; B_P (the Adam family)
    for record in before:
        if "trace_cov" in record:
            noise.add(record)
            noise_p.add(record)
    result: dict[str, Any] = {"out": str(out), "steps": cfg.steps, "steps_run": cfg.steps - start}
    evaluated = [record["eval_loss"] for record in before if "eval_loss" in record]
    if evaluated:  # the run's first evaluation, before a resume
        result["first_eval_loss"] = evaluated[0]
    progress = Progress(cfg, start, cfg.batch_size * task.units_per_example, task.unit)
    last_saved = start if start > 0 else None
    # Nothing was written before here. A run that fails before it logs a step (e.g. its step
    # does not compile) removes what it created; Ctrl-C keeps config.json, to resume from.
    earlier = "".join(json.dumps(record) + "\n" for record in before)
    created = kit.start_writing(out, cfg, earlier) if lead else []
    logged = False
    with (
        kit.removed_on_failure(created, kept=lambda: logged),
        open(out / "metrics.jsonl" if lead else os.devnull, "a") as metrics,
        kit.ctrl_c_between_steps() as ctrl_c,
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
            return Diverged(f"{why}; stopped, {kept}. {kit.divergence_fixes(cfg)}")

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
            if kit.logs(cfg, step):
                record |= {"loss": loss, "lr": lr(step)}
                record |= {k: float(v) for k, v in diag.items()}
                if step == 0 and "trace_cov_p" in record:  # no v̂ before the first update
                    record |= dict.fromkeys(("trace_cov_p", "grad_sq_p", "noise_scale_p_batch"))
                record |= noise.add(record) | noise_p.add(record)
                record["seconds"] = round(time.perf_counter() - t_start, 3)
                write(record)
            if (step + 1) % cfg.checkpoint_interval == 0 or step + 1 == cfg.steps:
                whole = kit.gather(tree)  # every process takes part; one writes
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


# --------------------------------------------------------------------------------------------
# What a run is made of. Data: a task bundles the model's parameters, the loss of one example,
# and a sampler that draws one batch from `data` with a key. Batches depend on (seed, step)
# only. Your own model and data come in the same way: a factory `(cfg, *, key) -> Task`
# (--task, or main's `task=`).


class Task(NamedTuple):
    """What train.py trains: a model's parameters, its loss, and its data. A factory's Task is
    checked field by field before any work (SPEC §6.1 says what each must be).

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
    train_data: PyTree  # what `sample` draws training batches from (arrays and numbers only)
    eval_data: PyTree  # ...and the held-out batches (the same)
    unit: str = "ex"  # what the throughput counts: "tok" or "ex"
    units_per_example: int = 1  # units (`unit`) in one example: a window's tokens for "tok"


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


def make_task(cfg: Config, *, key: PRNGKeyArray, factory: TaskFactory | None = None) -> Task:
    """The task of `cfg`: `factory`'s, else --task's, else --model's built-in one. A factory's
    is checked before any work, field by field (`trainkit.checked_task`, SPEC §6.1)."""
    if factory is None and cfg.task is not None:
        factory = load_factory(cfg.task)
    if factory is None:
        return (lm_task if cfg.model == "transformer" else mlp_task)(cfg, key=key)
    name = cfg.task or getattr(factory, "__qualname__", repr(factory))
    return kit.checked_task(factory, cfg, key=key, like=Task, name=name)


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
    stats: dict[str, Any], precondition: PyTree | None = None, per_leaf: bool = False
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
    grad_sq_p, noise_scale_p_batch. `per_leaf`: each leaf reduced on its own and the sums
    added, where one flat vector would gather the leaves' shards onto every device (FSDP)."""
    flat = lambda tree: [x.astype(jnp.float32).ravel() for x in jax.tree.leaves(tree)]  # noqa: E731
    whole = lambda xs: xs if per_leaf else [jnp.concatenate(xs)]  # noqa: E731
    g2 = [x**2 for x in whole(flat(stats["mean"]))]
    q = whole(flat(stats["sq_mean"]))
    total = lambda f, *xs: sum(jnp.sum(f(*x), dtype=jnp.float32) for x in zip(*xs, strict=True))  # noqa: E731
    b = stats["batch_size"].astype(jnp.float32)
    trace_cov = b / (b - 1.0) * total(lambda g, v: v - g, g2, q)
    grad_sq = total(lambda g: g, g2) - trace_cov / b
    extra = {}
    if precondition is not None:
        p = whole(flat(precondition))
        trace_p = b / (b - 1.0) * total(lambda w, g, v: w * (v - g), p, g2, q)
        grad_sq_p = total(lambda w, g: w * g, p, g2) - trace_p / b
        extra = {"trace_cov_p": trace_p, "grad_sq_p": grad_sq_p}
        extra["noise_scale_p_batch"] = trace_p / grad_sq_p
    size = sum(g.size for g in g2)
    return extra | {
        "grad_norm": jnp.sqrt(total(lambda g: g, g2)),
        "frac_snr_gt_1_over_B": total(lambda g, v: (b + 1.0) * g > 2.0 * v, g2, q) / size,
        # ḡ² ≤ q always (Jensen); coordinates with q = 0 (no gradient at all) are left out.
        "nu_adam_over_nu_micro": total(
            lambda g, v: jnp.where(v > 0, g / jnp.where(v > 0, v, 1.0), 0.0), g2, q
        )
        / jnp.maximum(total(lambda v: v > 0, q), 1.0),
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
        per_leaf = cfg.param_sharding == "fsdp"
        found = diagnostics(st, precondition, per_leaf)
        return params, state, loss, {**found, "params_finite": finite}

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
# The command line (trainkit.py: flags built from Config's fields, checks, resume).


def check(cfg: Config) -> Config:
    """Bad input refused before any work (SPEC §6) and --out resolved: `trainkit.check`, with
    this file's optimizer (its own checks; no JAX array yet) and schedule."""
    optimizer = functools.partial(make_optimizer, schedule=False)
    return kit.check(cfg, optimizer=optimizer, schedule=make_schedule)


def parse_config(argv: list[str]) -> Config:
    """The Config `argv` spells: the flags typed, the defaults for the rest."""
    return Config(**kit.parse_flags(Config, argv))


def cli(argv: list[str] | None = None) -> None:
    """`python train.py ...` (`python -m pegrad.train ...` installed), the config
    `trainkit.cli_config` reads (--resume: the run's own): bad input, a NaN/Inf loss and Ctrl-C
    each end the run with one line on stderr and a non-zero exit status."""
    args = sys.argv[1:] if argv is None else argv
    kit.run_cli(lambda: main(kit.cli_config(Config, args)))


if __name__ == "__main__":
    cli()
