"""sweep.py: many training runs as one program, train.py's step vmapped over a leading run axis.

    traces = sweep.run(configs, cache=Path("runs/x"))   # one Trace per train.Config, in order

Runs that differ only in the optimizer's numbers (train.HYPERPARAMETERS: lr, b1, b2, eps,
eps_root, momentum, max_grad_norm) and in the seed share one program: `groups` splits a list
of configs into such groups (a different optimizer, batch size, model, step count, or an option
switched on or off, e.g. clipping None vs a value, starts another). Within a group, everything
a run owns gets a leading run axis: parameters and optimizer state (each seed's `train.build`), the
hyperparameters (arrays, traced: the optimizer is built inside the vmapped function by
`train.make_optimizer(cfg, hyper)`), the PRNG keys of the batches and held-out sets, and the
data where it depends on the seed (the MLP's teacher; the LM's text is shared). One jitted
`lax.scan` over `eval_interval` steps of `train.make_step` (optimizers.make_train_step's step and
the diagnostics), vmapped over runs, advances
all runs at once: the batch of step s is `task.sample(data, key=fold_in(train_key, s))`, as in
train.main, so a run here equals the same config trained by train.main alone (tests: float64,
to 1e-11; the vmapped matmuls may sum in another order).

Divergence: a run whose loss becomes NaN/Inf, or whose update makes a parameter NaN/Inf, at
step s is recorded as diverged at s (train.main would stop there with train.Diverged) and is
frozen: from then on its updates are masked out (`where(alive, new, old)`), so it keeps its
last good parameters, its later losses read NaN, and the other runs of the program go on
unaffected (nothing is shared between runs; vmap keeps them independent).

With `cache=DIR`, each group's traces (every step's loss and diagnostics, the held-out losses,
the final parameters) are saved as DIR/<hash of the code version and the group's configs>.npz
once the group finishes, and a later call loads every run it finds there instead of training
it: an interrupted sweep continues at the group it stopped in; a grid that grows trains only
its new runs. An entry is keyed by its config and by the code that trained it (`code_version`:
a hash of train.py, models.py, optimizers.py, pegrad.py, this file and a --task module), so a
run trained by other code is trained again, never reused. Entries written before code versions
were recorded are still read, and their traces say so (Trace.code None: "unknown"), where no
entry of this code holds the run; experiments.py's summaries count the runs of each version.
"""

import dataclasses
import functools
import hashlib
import inspect
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PyTree

import pegrad
import train

Log = Callable[[str], Any]  # where progress lines go, e.g. print
# train.diagnostics, every step (trace_cov and grad_sq: the gradient noise scale's numerator and
# denominator; trace_cov_p and grad_sq_p: the preconditioned noise scale B_P's, for the Adam
# family only, NaN at step 0 (no v̂ yet) and for a rule without a preconditioner; a cache entry
# written before one was logged reads NaN there)
DIAGNOSTICS = (
    "grad_norm", "frac_snr_gt_1_over_B", "nu_adam_over_nu_micro", "trace_cov", "grad_sq",
    "trace_cov_p", "grad_sq_p",
)  # fmt: skip


@functools.cache
def _source(path: str) -> bytes:
    return Path(path).read_bytes()


def _task_file(spec: str) -> str | None:
    """The source file of the --task factory `spec` names, or None (no file: a builtin)."""
    factory = train.load_factory(spec)
    try:
        return inspect.getsourcefile(factory)
    except TypeError:
        return None


def code_version(cfg: train.Config) -> str:
    """The version of the code that trains `cfg`: sha256 (16 hex digits) of the source files of
    train, models, optimizers and pegrad as imported, of this file (the vectorized loop), and of
    cfg.task's module where it names one (else of its name). Any edit to one of them, comments
    included, is another version: a cache never reuses a run across it."""
    files = [train.__file__, train.models.__file__, train.optimizers.__file__, pegrad.__file__]
    files.append(__file__)
    digest = hashlib.sha256()
    for path in files:
        digest.update(Path(str(path)).name.encode() + b"\0" + _source(str(path)))
    if cfg.task is not None:
        path = _task_file(cfg.task)
        digest.update(b"task\0" + (cfg.task.encode() if path is None else _source(path)))
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class Trace:
    """One run of a sweep, every step of it (NumPy arrays, host memory)."""

    cfg: train.Config
    loss: np.ndarray  # [steps] training loss of step s (on the batch of step s); NaN once diverged
    diagnostics: dict[str, np.ndarray]  # DIAGNOSTICS, each [steps], NaN once diverged
    eval_steps: np.ndarray  # [n] steps at which the held-out loss was measured (before step s)
    eval_loss: np.ndarray  # [n] mean over cfg.eval_batches held-out batches, as train.main
    diverged_step: int | None  # the first step whose loss or update was not finite
    params: PyTree  # the final (for a diverged run: last good) parameters
    seconds: float  # the group's wall time divided by its number of runs
    code: str | None = None  # `code_version` that trained it; None: unknown (an old cache entry)

    @property
    def status(self) -> str:
        return "ok" if self.diverged_step is None else "diverged"


def group_key(cfg: train.Config) -> train.Config:
    """Configs with equal keys can share one program: the seed, the output directory and the
    values (not the presence) of the hyperparameters are blanked."""
    blank = {h: None if getattr(cfg, h) is None else 0.0 for h in train.HYPERPARAMETERS}
    return dataclasses.replace(cfg, seed=0, out=None, **blank)


def groups(configs: Sequence[train.Config]) -> list[list[int]]:
    """Indices into `configs`, grouped by `group_key`, in order of first appearance."""
    found: dict[train.Config, list[int]] = {}
    for i, cfg in enumerate(configs):
        found.setdefault(group_key(cfg), []).append(i)
    return list(found.values())


def stack(trees: Sequence[PyTree]) -> PyTree:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _shared_or_stacked(trees: Sequence[PyTree]) -> tuple[PyTree, int | None]:
    """The data of every run: one copy and vmap axis None where all runs' are equal (the LM's
    text), else stacked along axis 0 (the MLP's teacher, which the seed draws)."""
    first = jax.tree.leaves(trees[0])
    if all(
        all(np.array_equal(a, b) for a, b in zip(first, jax.tree.leaves(t), strict=True))
        for t in trees[1:]
    ):
        return trees[0], None
    return stack(trees), 0


def _hyper_arrays(configs: Sequence[train.Config], dtype: Any) -> dict[str, Array]:
    """One array [runs] per hyperparameter the group sets, in the moment dtype (float32, or
    float64 for float64 parameters), which is what the optimizers compute them in."""
    return {
        h: jnp.asarray(np.array([getattr(c, h) for c in configs], np.float64)).astype(dtype)
        for h in train.HYPERPARAMETERS
        if getattr(configs[0], h) is not None
    }


def run_group(configs: Sequence[train.Config], *, log: Log | None = None) -> list[Trace]:
    """Train `configs` (one group: equal `group_key`s) as one vectorized program."""
    cfg0 = configs[0]
    if any(group_key(c) != group_key(cfg0) for c in configs):
        raise ValueError("run_group: the configs differ in more than hyperparameters and seed")
    for c in configs:
        train.check(dataclasses.replace(c, out=None))
    t0 = time.perf_counter()
    seeds = sorted({c.seed for c in configs})
    built = {s: train.build(dataclasses.replace(cfg0, seed=s)) for s in seeds}
    runs = [built[c.seed] for c in configs]
    task = runs[0].task
    dtype = max((jnp.dtype(jnp.float32), *(x.dtype for x in jax.tree.leaves(task.params))),
                key=lambda d: d.itemsize)  # fmt: skip
    params = stack([r.task.params for r in runs])
    state = stack([r.opt.init(r.task.params) for r in runs])
    hyper = _hyper_arrays(configs, dtype)
    train_keys = jnp.stack([r.train_key for r in runs])
    train_data, data_axis = _shared_or_stacked([r.task.train_data for r in runs])
    # The held-out batches of each run, as train.main draws them.
    sample = jax.jit(task.sample)
    eval_sets = stack(
        [
            stack(
                [
                    sample(r.task.eval_data, key=jax.random.fold_in(r.eval_key, i))
                    for i in range(cfg0.eval_batches)
                ]
            )
            for r in runs
        ]
    )

    def segment(
        params: PyTree,
        state: PyTree,
        alive: Bool[Array, ""],
        hyper: dict[str, Float[Array, ""]],
        key: Any,
        data: PyTree,
        steps: Array,
    ) -> tuple[PyTree, PyTree, Array, Array, dict[str, Array], Array]:
        """One run through the steps `steps`: its optimizer built from its own (traced)
        hyperparameters, its divergence masked."""
        step = train.make_step(cfg0, task, train.make_optimizer(cfg0, hyper), hyper)

        def body(carry: tuple, s: Array) -> tuple[tuple, tuple]:
            params, state, alive = carry
            batch = task.sample(data, key=jax.random.fold_in(key, s))
            new_params, new_state, loss, diag = step(params, state, batch)
            ok = alive & jnp.isfinite(loss) & diag.pop("params_finite")
            keep = lambda new, old: jnp.where(ok, new, old)
            params = jax.tree.map(keep, new_params, params)
            state = jax.tree.map(keep, new_state, state)
            return (params, state, ok), (loss, diag, alive, ok)

        (params, state, alive), (loss, diag, was_alive, ok) = jax.lax.scan(
            body, (params, state, alive), steps
        )
        nan = jnp.asarray(jnp.nan, loss.dtype)
        loss = jnp.where(was_alive, loss, nan)  # after divergence: NaN, not the frozen run's
        diag = {k: jnp.where(was_alive, v, jnp.asarray(jnp.nan, v.dtype)) for k, v in diag.items()}
        return params, state, alive, loss, diag, was_alive & ~ok

    vsegment = jax.jit(jax.vmap(segment, in_axes=(0, 0, 0, 0, 0, data_axis, None)))
    evaluate = train.eval_loss_fn(task)
    veval = jax.jit(jax.vmap(lambda p, sets: jnp.stack([evaluate(p, b) for b in _unstack(sets)])))

    n, steps = len(configs), cfg0.steps
    alive = jnp.ones((n,), bool)
    losses = np.full((n, steps), np.nan)
    diags = {k: np.full((n, steps), np.nan) for k in DIAGNOSTICS}
    eval_steps: list[int] = []
    evals: list[np.ndarray] = []
    diverged: list[int | None] = [None] * n
    start = 0
    while True:
        if start % cfg0.eval_interval == 0 or start == steps:
            # The mean of the per-batch means, in float64 on the host, as train.main.
            per_batch = np.asarray(veval(params, eval_sets), np.float64)
            mean = per_batch.mean(axis=1)
            mean[[d is not None for d in diverged]] = np.nan
            eval_steps.append(start)
            evals.append(mean)
        if start == steps:
            break
        length = min(cfg0.eval_interval - start % cfg0.eval_interval, steps - start)
        at = jnp.arange(start, start + length, dtype=jnp.int32)
        params, state, alive, loss, diag, died = vsegment(
            params, state, alive, hyper, train_keys, train_data, at
        )
        losses[:, start : start + length] = np.asarray(loss, np.float64)
        for k in DIAGNOSTICS:
            if k in diag:  # B_P's parts: the Adam family's only
                diags[k][:, start : start + length] = np.asarray(diag[k], np.float64)
        for i, row in enumerate(np.asarray(died)):
            if row.any():
                diverged[i] = start + int(np.argmax(row))
        start += length
        if log is not None:
            log(f"  {start}/{steps} steps, {int(np.asarray(alive).sum())}/{n} runs alive")
    seconds = (time.perf_counter() - t0) / n
    final = jax.device_get(params)
    eval_loss = np.stack(evals, axis=1)
    return [
        Trace(
            cfg=c,
            loss=losses[i],
            diagnostics={k: v[i] for k, v in diags.items()},
            eval_steps=np.array(eval_steps),
            eval_loss=eval_loss[i],
            diverged_step=diverged[i],
            params=jax.tree.map(lambda x, i=i: x[i], final),
            seconds=seconds,
            code=code_version(c),
        )
        for i, c in enumerate(configs)
    ]


def _unstack(tree: PyTree) -> list[PyTree]:
    n = jax.tree.leaves(tree)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


def _key(cfg: train.Config) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def save(path: Path, traces: Sequence[Trace]) -> None:
    """One group's traces in an .npz (no pickle; bfloat16 parameters are stored as float32,
    which holds them exactly), with the code version of each, written atomically."""
    arrays: dict[str, np.ndarray] = {
        "configs": np.array(json.dumps([dataclasses.asdict(t.cfg) for t in traces])),
        "code": np.array(json.dumps([t.code for t in traces])),
        "loss": np.stack([t.loss for t in traces]),
        "eval_steps": traces[0].eval_steps,
        "eval_loss": np.stack([t.eval_loss for t in traces]),
        "diverged_step": np.array(
            [-1 if t.diverged_step is None else t.diverged_step for t in traces]
        ),  # fmt: skip
        "seconds": np.array([t.seconds for t in traces]),
    }
    for k in DIAGNOSTICS:
        arrays["diagnostics" + k] = np.stack([t.diagnostics[k] for t in traces])
    paths = jax.tree_util.tree_flatten_with_path(traces[0].params)[0]
    for i, (key_path, _) in enumerate(paths):
        leaves = [np.asarray(jax.tree.leaves(t.params)[i]) for t in traces]
        wide = [x.astype(np.float32) if x.dtype.name == "bfloat16" else x for x in leaves]
        arrays["params" + jax.tree_util.keystr(key_path)] = np.stack(wide)
    path.parent.mkdir(parents=True, exist_ok=True)
    train.atomic_write(path, lambda f: np.savez(f, allow_pickle=False, **arrays))


def load(path: Path, wanted: dict[str, str]) -> list[Trace]:
    """The traces in a file `save` wrote whose configs (`_key`) are in `wanted` and were
    trained by the code version it maps them to; a file written before code versions were
    recorded gives its runs with code None (unknown), another version's none."""
    with np.load(path, allow_pickle=False) as z:
        try:
            configs = [train.Config(**c) for c in json.loads(str(z["configs"]))]
        except TypeError:  # written when Config had a field it no longer has
            return []
        codes = json.loads(str(z["code"])) if "code" in z.files else [None] * len(configs)
        mine = [
            i
            for i, c in enumerate(configs)
            if _key(c) in wanted and codes[i] in (None, wanted[_key(c)])
        ]
        if not mine:
            return []
        missing = np.full(z["loss"].shape[1], np.nan)
        template = train.build(configs[0]).task.params
        flat, treedef = jax.tree_util.tree_flatten_with_path(template)
        stacked = [z["params" + jax.tree_util.keystr(p)].astype(x.dtype) for p, x in flat]
        return [
            Trace(
                cfg=configs[i],
                loss=z["loss"][i],
                diagnostics={
                    k: z["diagnostics" + k][i] if "diagnostics" + k in z.files else missing
                    for k in DIAGNOSTICS
                },
                eval_steps=z["eval_steps"],
                eval_loss=z["eval_loss"][i],
                diverged_step=None if z["diverged_step"][i] < 0 else int(z["diverged_step"][i]),
                params=jax.tree_util.tree_unflatten(treedef, [x[i] for x in stacked]),
                seconds=float(z["seconds"][i]),
                code=codes[i],
            )
            for i in mine
        ]


def run(
    configs: Sequence[train.Config], *, cache: Path | None = None, log: Log | None = None
) -> list[Trace]:
    """Every config trained, each group (`groups`) as one vectorized program; in order. A
    config given twice is trained once. With `cache`, runs found in its files are loaded,
    and only the others are trained (a grid that grows trains only its new points): a run
    trained by this code version (`code_version`), else one cached before versions were
    recorded (its Trace.code None), never one of another version."""
    keys = [_key(c) for c in configs]
    versions = {k: code_version(c) for k, c in zip(keys, configs, strict=True)}
    found: dict[str, Trace] = {}
    for path in sorted(cache.glob("*.npz")) if cache is not None else ():
        todo = {k: v for k, v in versions.items() if k not in found or found[k].code is None}
        for t in load(path, todo) if todo else ():
            if _key(t.cfg) not in found or t.code is not None:  # this version's over unknown
                found[_key(t.cfg)] = t
    todo = list({k: c for k, c in zip(keys, configs, strict=True) if k not in found}.values())
    for idx in groups(todo):
        group = [todo[i] for i in idx]
        if log is not None:
            c = group[0]
            log(f"group of {len(group)} runs: {c.optimizer}, B {c.batch_size}, {c.steps} steps")
        traces = run_group(group, log=log)
        if cache is not None:
            text = code_version(group[0]) + "".join(_key(c) for c in group)
            save(cache / f"{hashlib.sha256(text.encode()).hexdigest()[:20]}.npz", traces)
        found |= {_key(t.cfg): t for t in traces}
    return [found[k] for k in keys]
