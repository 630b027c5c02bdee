"""Per-example gradient statistics in JAX: an exact vmap reference and a factorized graph rewrite.

One entry point, `value_and_grad_stats(loss_fn, stats, impl=...)`, returns the mean loss and any
subset of the statistics of the per-example gradients g_i = grad loss_fn(params, example_i):

    mean          (1/B) Σ_i g_i                        (= jax.grad of the mean loss)
    sq_mean       (1/B) Σ_i g_i²
    sign_mean     (1/B) Σ_i sign(g_i)                  (sign(0) = 0)
    var           1/(B-1) Σ_i (g_i - mean)²            (unbiased; B = 1 is an error)
    sq_norms      ‖g_i‖² over all parameters            (shape [B])
    clipped_mean  (1/B) Σ_i g_i · min(1, C/‖g_i‖)      (flat clipping; pass clip_norm=C)

and always "batch_size", the number of units the statistics were taken over (B, or B·T at
token granularity) so that consumers can form unbiased estimators.

Two implementations, proven equal:

* impl="vmap" (the exact reference, the executable definition): materialize
  vmap(grad(loss_fn)) and reduce; `chunk_size` bounds how many per-example gradients exist at
  once (lax.scan over chunks) without changing the result.
* impl="factorized" (the efficient one): trace grad(loss_fn) for ONE example to a jaxpr, inline
  every call (jit, custom_jvp/vjp, remat), and cut it in two. The head (forward and backward
  down to the inputs of each parameter's last gradient operation) runs batched under vmap; the
  per-parameter tails are rewritten. A dense weight used once per example has the rank-one
  gradient g_i = δ_i ⊗ x_i, so for multiplicative φ (square, sign)
  Σ_i φ(g_i) = φ(Δ)ᵀφ(X) is one matmul, ‖g_i‖² = ‖δ_i‖²‖x_i‖² (Goodfellow), and the clipped
  sum is (c∘Δ)ᵀX. A weight applied at T positions (g_i = Δ_iᵀX_i) gets the contraction for
  linear statistics, the Gram identity for norms, and bounded chunks for the rest. Scatters
  into fixed distinct rows (position embeddings) factorize row by row; gradients that do not
  depend on the example are exact constants. Anything else (tied weights, convolutions, scans,
  unknown final operations) takes the exact fallback for that parameter alone: its exclusive
  gradient tail evaluated per example, in chunks. The result is always the reference result;
  only speed and memory differ. `explain` says which path each leaf took.

Granularity "token" treats every position of every example as a unit: the per-token
contribution of a weight applied at position t is δ_t ⊗ x_t (the term of the sum over positions
in its gradient; for a weight used at several places per position, e.g. a tied embedding and
output head, the sum of its terms at t). That is a different quantity from the per-example
statistics; a parameter not used position-wise is a clear error at this granularity.

Exact references: `_reference_stats` (materialize, reduce). Tests proving the factorized path
equal to it and to a naive per-example Python loop, at float64: tests/test_pegrad.py.

This file depends on jax (with numpy), jaxtyping and the standard library only: copy it into
your project.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jaxtyping import Array, Float, PyTree

STATISTICS = ("mean", "sq_mean", "sign_mean", "var", "sq_norms", "clipped_mean")
Impl = Literal["vmap", "factorized"]
Granularity = Literal["example", "token"]
Stats = dict[str, Any]

# Statistics that are (1/units) Σ_units φ(g_unit) for an elementwise φ, and that φ.
_PHI: dict[str, Callable[[Array], Array]] = {
    "mean": lambda x: x,
    "sq_mean": jnp.square,
    "sign_mean": jnp.sign,
}


def stat_dtype(dtype: Any) -> jnp.dtype:
    """Statistics are accumulated in float32 or wider, even for bf16 parameters."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def _widest(dtypes: Sequence[Any]) -> jnp.dtype:
    """The widest statistic dtype: per-example norms add up every leaf in it."""
    return max((stat_dtype(d) for d in dtypes), key=lambda d: d.itemsize)


def value_and_grad_stats(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    stats: Sequence[str] = ("mean",),
    *,
    impl: Impl = "factorized",
    chunk_size: int | None = None,
    granularity: Granularity = "example",
    clip_norm: float | None = None,
) -> Callable[[PyTree, PyTree], tuple[Float[Array, ""], Stats]]:
    """Build `fn(params, batch) -> (mean_loss, {name: statistic, ..., "batch_size": B})`.

    Args:
        loss_fn: `loss_fn(params, example) -> scalar`, the loss of ONE example.
        stats: any subset of `STATISTICS`, computed in one pass.
        impl: "vmap" (exact reference) or "factorized" (graph rewrite, same result).
        chunk_size: at most this many per-example gradients exist at once. None: the reference
            materializes the whole batch; the factorized path picks the largest chunk whose
            materialized per-example gradients hold no more elements than the parameters.
        granularity: "example", or "token" (units are the positions of each example; every
            batch leaf must be shaped [B, T, ...]).
        clip_norm: C for "clipped_mean".

    Statistics have the dtype `stat_dtype(param dtype)`; "sq_norms" has shape [units] where
    units is B, or B·T at token granularity (row-major: unit i·T + t).
    """
    stats = _check_options(stats, impl, granularity, chunk_size, clip_norm)

    def fn(params: PyTree, batch: PyTree) -> tuple[Float[Array, ""], Stats]:
        n_examples, n_positions = _check_inputs(loss_fn, params, batch, stats, granularity)
        if impl == "vmap" and granularity == "example":
            return _reference_stats(loss_fn, stats, chunk_size, clip_norm, params, batch)
        program = _GradientProgram(loss_fn, params, batch, granularity, n_positions)
        if impl == "vmap":
            return _reference_stats(
                loss_fn, stats, chunk_size, clip_norm, params, batch, units=program.per_token
            )
        return program.factorized_stats(stats, chunk_size, clip_norm, params, batch, n_examples)

    return fn


# --------------------------------------------------------------------------------------------
# Input checks (SPEC §6): clear errors naming the offending leaf, raised at trace time.


def _check_options(
    stats: Sequence[str],
    impl: str,
    granularity: str,
    chunk_size: int | None,
    clip_norm: float | None,
) -> tuple[str, ...]:
    stats = tuple(stats)
    unknown = [s for s in stats if s not in STATISTICS]
    if unknown:
        raise ValueError(f"unknown statistic(s) {unknown}; choose from {STATISTICS}")
    if impl not in ("vmap", "factorized"):
        raise ValueError(f"impl must be 'vmap' or 'factorized', got {impl!r}")
    if granularity not in ("example", "token"):
        raise ValueError(f"granularity must be 'example' or 'token', got {granularity!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if "clipped_mean" in stats:
        if clip_norm is None or not clip_norm > 0:
            raise ValueError(f"'clipped_mean' needs clip_norm > 0, got clip_norm={clip_norm!r}")
    elif clip_norm is not None:
        raise ValueError("clip_norm was given but 'clipped_mean' is not among the statistics")
    return stats


def _check_inputs(
    loss_fn: Callable, params: PyTree, batch: PyTree, stats: tuple[str, ...], granularity: str
) -> tuple[int, int]:
    param_leaves = jax.tree_util.tree_leaves_with_path(params)
    if not param_leaves:
        raise ValueError("params has no array leaves")
    for path, leaf in param_leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {dtype}; every parameter leaf "
                "must be a floating array (for Equinox: eqx.partition(model, eqx.is_inexact_array))"
            )
    batch_leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not batch_leaves:
        raise ValueError("batch has no array leaves")
    shapes = {jax.tree_util.keystr(p): tuple(jnp.shape(x)) for p, x in batch_leaves}
    for name, shape in shapes.items():
        if len(shape) == 0:
            raise ValueError(f"batch{name} is a scalar; every batch leaf needs a leading axis B")
    first_name, first_shape = next(iter(shapes.items()))
    n_examples = first_shape[0]
    for name, shape in shapes.items():
        if shape[0] != n_examples:
            raise ValueError(
                f"batch leaves disagree on the batch size: batch{first_name} has leading axis "
                f"{n_examples} but batch{name} has shape {shape}"
            )
    if n_examples == 0:
        raise ValueError("the batch is empty (B = 0)")
    n_positions = 1
    if granularity == "token":
        for name, shape in shapes.items():
            if len(shape) < 2:
                raise ValueError(
                    f"granularity='token' needs every batch leaf shaped [B, T, ...]; "
                    f"batch{name} has shape {shape}"
                )
        n_positions = first_shape[1]
        for name, shape in shapes.items():
            if shape[1] != n_positions:
                raise ValueError(
                    f"granularity='token': batch{first_name} has T = {n_positions} but "
                    f"batch{name} has shape {shape}"
                )
    if "var" in stats and n_examples * n_positions < 2:
        raise ValueError(
            "'var' is the unbiased variance 1/(B-1) Σ (g_i - mean)² and is undefined for a "
            f"batch of {n_examples * n_positions} unit(s); use B ≥ 2"
        )
    loss_shape = jax.eval_shape(loss_fn, params, _one_example(batch))
    if not (hasattr(loss_shape, "shape") and loss_shape.shape == ()):
        raise ValueError(
            "loss_fn(params, example) must return a scalar loss for ONE example; it returned "
            f"{loss_shape}. Reduce over positions inside loss_fn; the batch mean is taken here."
        )
    if not jnp.issubdtype(loss_shape.dtype, jnp.floating):
        raise TypeError(f"loss_fn must return a floating scalar, got dtype {loss_shape.dtype}")
    return n_examples, n_positions


# --------------------------------------------------------------------------------------------
# Shared reductions.


def _chunked_sum(fn: Callable, xs: PyTree, n: int, chunk_size: int | None) -> tuple[Any, Any]:
    """Run `fn(chunk) -> (sums, per_unit)` over chunks of the leading axis of `xs`.

    Returns the added-up `sums` and the concatenated `per_unit` outputs; at most `chunk_size`
    rows of `xs` are processed at once (lax.scan over full chunks, then the remainder).
    """
    if chunk_size is None or chunk_size >= n:
        return fn(xs)
    n_full, remainder = divmod(n, chunk_size)
    full = jax.tree.map(
        lambda x: x[: n_full * chunk_size].reshape(n_full, chunk_size, *x.shape[1:]), xs
    )

    def body(acc: Any, chunk: Any) -> tuple[Any, Any]:
        sums, per_unit = fn(chunk)
        return jax.tree.map(jnp.add, acc, sums), per_unit

    first = jax.tree.map(lambda x: x[0], full)
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, first)[0])
    sums, per_unit = jax.lax.scan(body, init, full)
    per_unit = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), per_unit)
    if remainder:
        rest_sums, rest_per_unit = fn(jax.tree.map(lambda x: x[n_full * chunk_size :], xs))
        sums = jax.tree.map(jnp.add, sums, rest_sums)
        per_unit = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), per_unit, rest_per_unit)
    return sums, per_unit


def _one_example(batch: PyTree) -> PyTree:
    """The shape of one example (tracing needs no values; batches may be ShapeDtypeStructs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), batch)


def _sum0(x: Array) -> Array:
    """Σ over the leading axis as a dot with ones: XLA:CPU reduces a [B, big] tensor over B
    several times slower than it multiplies it by a vector."""
    return jnp.tensordot(jnp.ones(x.shape[:1], x.dtype), x, axes=1)


def _clip_factors(sq_norms: Array, clip_norm: float) -> Array:
    """min(1, C/‖g‖); a zero gradient is left as it is (factor 1)."""
    return jnp.minimum(1.0, clip_norm / jnp.sqrt(sq_norms)).astype(sq_norms.dtype)


def _finish(
    stats: tuple[str, ...], means: dict[str, Any], sq_norms: Array | None, n_units: int
) -> Stats:
    """Publish the requested statistics from averages over units (keys of `_PHI`, and
    "clipped_mean"; "var" too where it was computed in two passes)."""
    out: Stats = {name: means[name] for name in stats if name in _PHI or name == "clipped_mean"}
    if "var" in stats:
        out["var"] = means.get("var")
        if out["var"] is None:
            # B/(B-1)·(q - ḡ²); rounding can dip below zero, the variance cannot.
            out["var"] = jax.tree.map(
                lambda m, q: jnp.maximum(q - m * m, 0.0) * (n_units / (n_units - 1)),
                means["mean"],
                means["sq_mean"],
            )
    if "sq_norms" in stats:
        out["sq_norms"] = sq_norms
    with jax.ensure_compile_time_eval():  # concrete under jit: consumers can check B at trace time
        out["batch_size"] = jnp.asarray(n_units, jnp.int32)
    return out


def _unseed(stat: str, n_units: int) -> float:
    """What turns Σ_u φ(g_u / units) into (1/units) Σ_u φ(g_u): 1/(units·φ(1/units))."""
    phi_of_seed = {"mean": 1.0 / n_units, "sq_mean": 1.0 / n_units**2, "sign_mean": 1.0}[stat]
    return 1.0 / (n_units * phi_of_seed)


def _needed_means(stats: tuple[str, ...]) -> set[str]:
    """The φ-averages that `stats` are made of."""
    need = {name for name in stats if name in _PHI}
    if "var" in stats:
        need |= {"mean", "sq_mean"}
    return need


# --------------------------------------------------------------------------------------------
# The exact reference: materialize per-unit gradients, apply φ, reduce.


def _reference_stats(
    loss_fn: Callable,
    stats: tuple[str, ...],
    chunk_size: int | None,
    clip_norm: float | None,
    params: PyTree,
    batch: PyTree,
    units: Callable | None = None,
) -> tuple[Float[Array, ""], Stats]:
    """vmap(grad) materialized chunk by chunk. `units(params, example) -> (loss, grads [U, ...])`
    splits one example into U units (default: the example itself, U = 1)."""

    def example_units(example: PyTree) -> tuple[Array, PyTree]:
        if units is not None:
            return units(params, example)
        loss, grads = jax.value_and_grad(loss_fn)(params, example)
        return loss, jax.tree.map(lambda g: g[None], grads)

    def per_unit_grads(chunk: PyTree) -> tuple[Array, PyTree]:
        losses, grads = jax.vmap(example_units)(chunk)
        grads = jax.tree.map(
            lambda g: g.reshape(-1, *g.shape[2:]).astype(stat_dtype(g.dtype)), grads
        )
        return losses, grads

    n_examples = jax.tree.leaves(batch)[0].shape[0]
    need = _needed_means(stats) | {"mean"}

    def first_pass(chunk: PyTree) -> tuple[dict[str, Any], dict[str, Array]]:
        losses, grads = per_unit_grads(chunk)
        sums = {name: jax.tree.map(lambda g, phi=_PHI[name]: _sum0(phi(g)), grads) for name in need}
        sums["loss"] = losses.sum()
        leaves = jax.tree.leaves(grads)
        dtype = _widest([g.dtype for g in leaves])
        sq_norms = jnp.zeros(leaves[0].shape[:1], dtype)
        for g in leaves:
            sq_norms = sq_norms + jnp.sum(g**2, axis=tuple(range(1, g.ndim))).astype(dtype)
        if "clipped_mean" in stats:
            assert clip_norm is not None
            factors = _clip_factors(sq_norms, clip_norm)
            sums["clipped_mean"] = jax.tree.map(
                lambda g: jnp.tensordot(factors.astype(g.dtype), g, axes=1), grads
            )
        return sums, {"sq_norms": sq_norms}

    sums, per_unit = _chunked_sum(first_pass, batch, n_examples, chunk_size)
    n_units = per_unit["sq_norms"].shape[0]
    loss_sum = sums.pop("loss")
    loss = (loss_sum / n_examples).astype(stat_dtype(loss_sum.dtype))
    means = {name: jax.tree.map(lambda s: s / n_units, value) for name, value in sums.items()}
    if "var" in stats:
        # The definition, two passes: Σ_i (g_i - ḡ)² with ḡ from the first pass.
        def second_pass(chunk: PyTree) -> tuple[PyTree, None]:
            _, grads = per_unit_grads(chunk)
            centered = jax.tree.map(
                lambda g, m: jnp.sum((g - m) ** 2, axis=0), grads, means["mean"]
            )
            return centered, None

        centered, _ = _chunked_sum(second_pass, batch, n_examples, chunk_size)
        means["var"] = jax.tree.map(lambda s: s / (n_units - 1), centered)
    return loss, _finish(stats, means, per_unit["sq_norms"], n_units)


# --------------------------------------------------------------------------------------------
# The jaxpr of grad(loss_fn) for one example, flattened.

# Call-like primitives whose body is evaluated in place so that the rewrite sees one flat graph.
_INLINED_CALLS = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "remat",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
}


def _inner_jaxpr(eqn: Any) -> jcore.ClosedJaxpr | None:
    if eqn.primitive.name not in _INLINED_CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, jcore.ClosedJaxpr):
            return inner
        if isinstance(inner, jcore.Jaxpr):
            return jcore.ClosedJaxpr(inner, ())
    return None


def _read(env: dict, var: Any) -> Any:
    return var.val if isinstance(var, jcore.Literal) else env[var]


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
        invals = (*subfuns, *invals)
    out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _eval_eqns(eqns: Sequence[Any], env: dict) -> None:
    """Evaluate `eqns` in order, reading and writing variables in `env`."""
    for eqn in eqns:
        outs = _bind(eqn, [_read(env, v) for v in eqn.invars])
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jcore.DropVar):
                env[var] = val


def _eval_inlined(jaxpr: jcore.Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if inner is None:
            outs = _bind(eqn, invals)
        else:
            outs = _eval_inlined(inner.jaxpr, inner.consts, *invals)
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
    return [_read(env, v) for v in jaxpr.outvars]


# --------------------------------------------------------------------------------------------
# Reading one parameter's gradient tail: layout ops back to its "core" operation.

_LAYOUT = {"transpose", "reshape", "squeeze", "expand_dims", "copy", "copy_p"}


@dataclasses.dataclass(frozen=True)
class _Step:
    """One op after the core: layout (same per unit), or a scaling by an unbatched `factor`."""

    eqn: Any
    factor: Any = None  # the unbatched multiplier variable, for mul/div/neg
    divide: bool = False  # x / factor rather than x * factor
    scalar: bool = True  # the multiplier is a scalar (norms scale by its square)


@dataclasses.dataclass
class _LeafPlan:
    """How the factorized path computes one parameter leaf's statistics."""

    path: str
    shape: tuple[int, ...]
    route: str  # "rank-one" | "sequence" | "per-token" | "rows" | "constant" | "fallback"
    reason: str
    core: Any = None  # the eqn whose output, after `post`, is the per-unit gradient
    post: tuple[_Step, ...] = ()
    out_var: Any = None
    tail: tuple[Any, ...] = ()  # fallback: the leaf's exclusive gradient tail, in order
    terms: tuple["_LeafPlan", ...] = ()  # per-token-sum: per-token parts added up
    methods: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _is_unit_reduce(eqn: Any) -> bool:
    """reduce_sum over axes of size 1 only moves data; it sums nothing."""
    shape = eqn.invars[0].aval.shape
    return all(shape[a] == 1 for a in eqn.params["axes"])


def _is_layout(eqn: Any) -> bool:
    name = eqn.primitive.name
    if name in _LAYOUT:
        return True
    if name == "convert_element_type":
        return jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
    if name == "broadcast_in_dim":
        return math.prod(eqn.invars[0].aval.shape) == math.prod(eqn.outvars[0].aval.shape)
    if name == "reduce_sum":
        return _is_unit_reduce(eqn)
    return False


def _dot_parts(eqn: Any) -> tuple[tuple[int, ...], ...]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _is_row_scatter(eqn: Any) -> bool:
    """scatter-add(zeros, idx[T, k], upd[T, ...]) writing one window per row of `upd`: the
    backward pass of a gather such as an embedding lookup `table[tokens]`."""
    if eqn.primitive.name != "scatter-add":
        return False
    dn = eqn.params["dimension_numbers"]
    _, indices, updates = (v.aval for v in eqn.invars)
    return (
        tuple(dn.update_window_dims) == tuple(range(1, updates.ndim))
        and not tuple(dn.operand_batching_dims)
        and indices.ndim == 2
        # Out-of-range rows are clamped, never dropped, so a row's norm is its update's norm.
        and str(eqn.params["mode"]).endswith(("CLIP", "PROMISE_IN_BOUNDS"))
    )


def _scatter_rows(core: Any, operand_shape: tuple, indices: Array, updates: Array) -> Array:
    """Σ over rows of their scattered updates, into zeros shaped like the core's operand."""
    zeros = jnp.zeros(operand_shape, updates.dtype)
    dn = core.params["dimension_numbers"]
    return jax.lax.scatter_add(zeros, indices, updates, dn, mode=core.params["mode"])


class _GradientProgram:
    """grad(loss_fn) for one example as a flat jaxpr, cut into a batched head and per-leaf tails."""

    def __init__(
        self,
        loss_fn: Callable,
        params: PyTree,
        batch: PyTree,
        granularity: str,
        n_positions: int,
    ):
        self.granularity = granularity
        self.n_positions = n_positions
        example = _one_example(batch)
        leaves, self.param_tree = jax.tree.flatten(params)
        self.paths = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
        ]
        example_leaves = jax.tree.leaves(example)
        self.n_params = len(leaves)
        self.n_examples = jax.tree.leaves(batch)[0].shape[0]
        self.param_dtypes = [x.dtype for x in leaves]
        self.param_shapes = [tuple(x.shape) for x in leaves]

        self.n_example = len(example_leaves)

        def flat_value_and_grad(*inputs: Any) -> list[Any]:
            # The backward pass starts from `seed` instead of 1: the factorized path seeds it
            # with 1/units, as the gradient of a mean loss does, so the mean needs no rescaling
            # (a pass over a batch-sized factor or a weight-sized result) afterwards.
            *flat, seed = inputs
            p = jax.tree.unflatten(self.param_tree, flat[: self.n_params])
            e = jax.tree.unflatten(jax.tree.structure(example), flat[self.n_params :])

            def seeded(p: PyTree) -> tuple[Array, Array]:
                loss = loss_fn(p, e)
                return loss * seed.astype(loss.dtype), loss

            (_, loss), grads = jax.value_and_grad(seeded, has_aux=True)(p)
            return [loss, *jax.tree.leaves(grads)]

        self.seed_dtype = jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32
        seed = jnp.ones((), self.seed_dtype)
        nested = jax.make_jaxpr(flat_value_and_grad)(*leaves, *example_leaves, seed)
        flat = jax.make_jaxpr(lambda *a: _eval_inlined(nested.jaxpr, nested.consts, *a))(
            *leaves, *example_leaves, seed
        )
        self.jaxpr: jcore.Jaxpr = flat.jaxpr
        self.consts = flat.consts
        self._index_graph()
        self.plans = [self._plan_leaf(i) for i in range(self.n_params)]

    # -- graph bookkeeping ------------------------------------------------------------------

    def _index_graph(self) -> None:
        jaxpr = self.jaxpr
        self.producer: dict[Any, Any] = {}
        self.users: dict[Any, list[Any]] = {}
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                self.producer[v] = eqn
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    self.users.setdefault(v, []).append(eqn)
        # A variable is batched when it depends on the example.
        self.batched: set[Any] = set(jaxpr.invars[self.n_params : self.n_params + self.n_example])
        for eqn in jaxpr.eqns:
            if any(not isinstance(v, jcore.Literal) and v in self.batched for v in eqn.invars):
                self.batched.update(eqn.outvars)
        self.outvars = list(jaxpr.outvars)
        # Static: computable from constants alone, before any input is known.
        self.static: set[Any] = set(jaxpr.constvars)
        for eqn in jaxpr.eqns:
            if not eqn.effects and all(
                isinstance(v, jcore.Literal) or v in self.static for v in eqn.invars
            ):
                self.static.update(eqn.outvars)

    def _static_value(self, var: Any) -> Any:
        """The concrete value of a static variable (e.g. position indices from iota)."""
        wanted, eqns = {var}, []
        for eqn in reversed(self.jaxpr.eqns):
            if any(v in wanted for v in eqn.outvars):
                eqns.append(eqn)
                wanted.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        with jax.ensure_compile_time_eval():
            _eval_eqns(eqns[::-1], env)
        return env[var]

    def _distinct_rows(self, core: Any) -> bool:
        """A scatter whose indices are static and, after clamping, all different: each
        example's gradient rows are disjoint, so φ applies row by row."""
        indices = core.invars[1]
        if indices not in self.static:
            return False
        idx = np.asarray(self._static_value(indices)).reshape(-1, indices.aval.shape[-1])
        dn = core.params["dimension_numbers"]
        operand, updates = core.invars[0].aval.shape, core.invars[2].aval.shape
        window = iter(updates[1:])
        sizes = [1 if d in dn.inserted_window_dims else next(window) for d in range(len(operand))]
        limits = [operand[d] - sizes[d] for d in dn.scatter_dims_to_operand_dims]
        idx = np.clip(idx, 0, np.asarray(limits))
        return len(np.unique(idx, axis=0)) == len(idx)

    def _is_batched(self, var: Any) -> bool:
        return not isinstance(var, jcore.Literal) and var in self.batched

    def _used_only_by(self, var: Any, eqns: set[int]) -> bool:
        if isinstance(var, jcore.Literal) or var in self.jaxpr.invars:
            return False
        if sum(1 for v in self.outvars if v is var) > 0:
            return False
        return all(id(u) in eqns for u in self.users.get(var, []))

    # -- planning ---------------------------------------------------------------------------

    def _walk_post(self, var: Any) -> tuple[Any, list[_Step]]:
        """Follow layout ops and unbatched scalings back from a leaf's gradient to its core."""
        steps: list[_Step] = []
        while isinstance(var, jcore.Var) and var in self.producer:
            eqn = self.producer[var]
            name = eqn.primitive.name
            if _is_layout(eqn):
                steps.append(_Step(eqn))
                var = eqn.invars[0]
            elif name == "neg":
                steps.append(_Step(eqn, factor=-1.0))
                var = eqn.invars[0]
            elif name in ("mul", "div"):
                a, b = eqn.invars
                if name == "mul" and self._is_batched(b) and not self._is_batched(a):
                    a, b = b, a
                if not self._is_batched(a) or self._is_batched(b):
                    break
                scalar = math.prod(getattr(b.aval, "shape", ())) == 1
                steps.append(_Step(eqn, factor=b, divide=name == "div", scalar=scalar))
                var = a
            else:
                break
        return var, steps[::-1]

    def _plan_leaf(self, i: int) -> _LeafPlan:
        out_var = self.outvars[1 + i]
        path, shape = self.paths[i], self.param_shapes[i]
        plan = self._plan_term(path, shape, out_var)
        if self.granularity == "token" and plan.route == "fallback":
            terms = self._token_terms(path, shape, out_var, ())
            if terms is not None and len(terms) > 1:
                reason = f"{len(terms)} per-position contributions added (e.g. a tied embedding)"
                plan = _LeafPlan(path, shape, "per-token-sum", reason, out_var=out_var)
                plan.terms = tuple(terms)
        if plan.route == "fallback":
            if self.granularity == "token":
                raise ValueError(
                    f"granularity='token': cannot split the gradient of params{path} "
                    f"(shape {shape}) into per-position contributions: {plan.reason}. "
                    "Per-token statistics need every use of a parameter to be position-wise; "
                    "granularity='example' works for any model"
                )
            plan.tail = self._exclusive_tail(out_var)
            if not plan.tail and plan.core is not None and self._is_batched(out_var):
                plan.reason = f"per-example gradient is a backward-pass value (B × {plan.size})"
        return plan

    def _token_terms(
        self, path: str, shape: tuple, var: Any, outer: tuple[_Step, ...]
    ) -> list[_LeafPlan] | None:
        """Split a sum of per-position contributions into its terms (layout and scaling ops
        after the sum are linear, so each term takes them too), or None."""
        core_var, post = self._walk_post(var)
        core = self.producer.get(core_var) if isinstance(core_var, jcore.Var) else None
        post = (*post, *outer)
        if core is not None and core.primitive.name == "add_any":
            terms: list[_LeafPlan] = []
            for operand in core.invars:
                sub = self._token_terms(path, shape, operand, post)
                if sub is None:
                    return None
                terms += sub
            return terms
        term = self._plan_term(path, shape, var)
        if term.route != "per-token":
            return None
        term.post = (*term.post, *outer)
        return [term]

    def _plan_term(self, path: str, shape: tuple, out_var: Any) -> _LeafPlan:
        """Recognize the final operation of a gradient (see the table in the README)."""
        core_var, post = self._walk_post(out_var)
        core = self.producer.get(core_var) if isinstance(core_var, jcore.Var) else None
        plan = _LeafPlan(path, shape, "fallback", "", core=core, post=tuple(post), out_var=out_var)
        name = core.primitive.name if core is not None else None
        if not self._is_batched(out_var):
            plan.reason = "gradient does not depend on the example (every g_i is the same)"
            if self.granularity == "example":
                plan.route = "constant"
        elif core is None:
            plan.reason = "gradient is an input"
        elif name == "add_any":
            plan.reason = "a sum of contributions before φ (e.g. a weight used twice)"
        elif name == "dot_general" and all(self._is_batched(v) for v in core.invars):
            lc, rc, _, _ = _dot_parts(core)
            if not lc and self.granularity == "token":
                plan.reason = "used once per example, not at every position"
            elif not lc:
                plan.route, plan.reason = "rank-one", "dense weight used once: δ ⊗ x"
            elif self.granularity == "token":
                if len(lc) == 1 and core.invars[0].aval.shape[lc[0]] == self.n_positions:
                    plan.route, plan.reason = "per-token", "dense weight over positions: δ_t ⊗ x_t"
                else:
                    plan.reason = f"contracts axes {lc} that are not one position axis"
            else:
                n_terms = math.prod(core.invars[0].aval.shape[a] for a in lc)
                plan.route = "sequence"
                plan.reason = f"dense weight applied at {n_terms} positions: Σ_t δ_t ⊗ x_t"
        elif name == "dot_general":
            plan.reason = "gradient is linear in a single batched factor (no rank-one split)"
        elif self.granularity == "token" and name == "reduce_sum":
            axes = tuple(core.params["axes"])
            operand = core.invars[0].aval.shape
            if len(axes) == 1 and operand[axes[0]] == self.n_positions:
                plan.route, plan.reason = "per-token", "sum over positions of small terms"
            else:
                plan.reason = f"reduce_sum over axes {axes} is not one position axis"
        elif self.granularity == "token" and name == "scatter-add" and _is_row_scatter(core):
            operand, _, updates = core.invars
            if not self._is_batched(operand) and updates.aval.shape[0] == self.n_positions:
                plan.route, plan.reason = "per-token", "embedding rows: onehot(token_t) ⊗ δ_t"
            else:
                plan.reason = "scatter-add that is not one row per position"
        elif name == "scatter-add" and _is_row_scatter(core):
            if not self._is_batched(core.invars[0]) and self._distinct_rows(core):
                plan.route = "rows"
                plan.reason = "embedding rows at fixed distinct indices (positions): disjoint"
            else:
                plan.reason = "embedding rows: repeated tokens add up before φ"
        elif name == "reduce_sum":
            plan.reason = "a sum of small terms (bias, norm scale): exact per example"
        else:
            plan.reason = f"final operation '{name}' has no factorized rule"
        return plan

    def _exclusive_tail(self, out_var: Any) -> tuple[Any, ...]:
        """The ops that only this leaf's gradient needs: evaluated per example in the fallback,
        so that no large per-example intermediate is ever materialized for the whole batch."""
        if out_var not in self.producer or self.users.get(out_var):
            return ()  # the head computes this value anyway: read it
        members: dict[int, Any] = {id(self.producer[out_var]): self.producer[out_var]}
        changed = True
        while changed:
            changed = False
            for eqn in list(members.values()):
                for v in eqn.invars:
                    if isinstance(v, jcore.Var) and v in self.producer:
                        src = self.producer[v]
                        if id(src) in members:
                            continue
                        if all(self._used_only_by(o, set(members)) for o in src.outvars):
                            members[id(src)] = src
                            changed = True
        return tuple(e for e in self.jaxpr.eqns if id(e) in members)

    # -- the head: everything up to the tails' inputs, batched ------------------------------

    def _tail_eqns(self, plan: _LeafPlan) -> tuple[Any, ...]:
        if plan.route == "fallback":
            return plan.tail
        if plan.route == "constant":
            return ()
        if plan.route == "per-token-sum":
            return tuple(e for term in plan.terms for e in self._tail_eqns(term))
        return (plan.core, *(s.eqn for s in plan.post))

    def _leaf_interface(self, plan: _LeafPlan) -> list[Any]:
        """Variables the leaf's tail reads that the head must provide."""
        eqns = self._tail_eqns(plan)
        produced = {v for e in eqns for v in e.outvars}
        found = {
            v: None
            for e in eqns
            for v in e.invars
            if isinstance(v, jcore.Var) and v not in produced
        }
        if not eqns and isinstance(plan.out_var, jcore.Var):
            found[plan.out_var] = None
        return list(found)

    def _run_head(
        self,
        params: PyTree,
        batch: PyTree,
        seed: float,
        on_ready: Callable[[list[int], dict], dict] | None = None,
    ) -> tuple[Array, dict, dict, dict]:
        """Losses [B] and the interface variables: batched ones with a leading B, others once.

        Every gradient-side value is that of the loss scaled by `seed`. With `on_ready`, the head
        runs in segments and `on_ready(leaves, values) -> results` is called as soon as those
        leaves' inputs exist; an optimization barrier then makes the rest of the backward pass
        wait for `results`, so that each leaf's statistics are computed where plain grad computes
        its gradient and the activations they read die as early as they do there. Returns the
        losses, the interface values and all results."""
        interfaces = [self._leaf_interface(plan) for plan in self.plans]
        interface = list(dict.fromkeys(v for vs in interfaces for v in vs))
        needed: set[Any] = {v for v in [self.outvars[0], *interface] if isinstance(v, jcore.Var)}
        head: list[Any] = []
        for eqn in reversed(self.jaxpr.eqns):
            if any(v in needed for v in eqn.outvars):
                head.append(eqn)
                needed.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        head.reverse()

        position = {id(eqn): k for k, eqn in enumerate(head)}
        ready_at = [
            max((position[id(self.producer[v])] for v in vs if v in self.producer), default=-1)
            for vs in interfaces
        ]
        cuts = sorted(set(ready_at)) if on_ready is not None else []
        last_use: dict[Any, int] = {v: len(head) for v in [self.outvars[0], *interface]}
        for k, eqn in enumerate(head):
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    last_use[v] = max(last_use.get(v, -1), k)

        values: dict = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        inputs = [
            *jax.tree.leaves(params),
            *jax.tree.leaves(batch),
            jnp.asarray(seed, self.seed_dtype),
        ]
        values.update(zip(self.jaxpr.invars, inputs, strict=True))
        start = 0
        results: dict = {}
        for cut in sorted({*cuts, len(head) - 1}):
            segment = head[start : cut + 1]
            if segment:
                self._run_segment(segment, values, cut, last_use)
            start = max(start, cut + 1)
            ready = [i for i, r in enumerate(ready_at) if r == cut]
            if on_ready is not None and ready:
                new = on_ready(ready, values)
                live = [v for v in values if last_use.get(v, -1) > cut]
                new, kept = jax.lax.optimization_barrier((new, [values[v] for v in live]))
                values.update(zip(live, kept, strict=True))
                results.update(new)
        return (
            values[self.outvars[0]],
            {v: values[v] for v in interface if v in self.batched},
            {v: _read(values, v) for v in interface if v not in self.batched},
            results,
        )

    def _run_segment(self, segment: list[Any], values: dict, end: int, last_use: dict) -> None:
        """Evaluate head equations batched (vmap over the example axis), adding to `values`
        every result used after position `end`."""
        produced = {v for e in segment for v in e.outvars}
        reads = list(
            dict.fromkeys(
                v
                for e in segment
                for v in e.invars
                if isinstance(v, jcore.Var) and v not in produced
            )
        )
        reads_b = [v for v in reads if v in self.batched]
        reads_u = [v for v in reads if v not in self.batched]
        outs = [v for v in produced if last_use.get(v, -1) > end]
        outs_b = [v for v in outs if v in self.batched]
        outs_u = [v for v in outs if v not in self.batched]

        if not reads_b:  # nothing here depends on the example
            env = {v: values[v] for v in reads_u}
            _eval_eqns(segment, env)
            values.update((v, env[v]) for v in outs)
            return

        def one_example(batched_in: list, unbatched_in: list) -> tuple[list, list]:
            env = dict(zip(reads_b, batched_in, strict=True))
            env.update(zip(reads_u, unbatched_in, strict=True))
            _eval_eqns(segment, env)
            return [env[v] for v in outs_b], [env[v] for v in outs_u]

        got_b, got_u = jax.vmap(one_example, in_axes=(0, None), out_axes=(0, None))(
            [values[v] for v in reads_b], [values[v] for v in reads_u]
        )
        values.update(zip(outs_b, got_b, strict=True))
        values.update(zip(outs_u, got_u, strict=True))

    # -- per-unit gradients of one leaf (the token reference, the chunked fallbacks) -----------

    def _apply_post(self, plan: _LeafPlan, x: Array, env: dict, phi: Callable | None) -> Array:
        """Replay the layout/scaling ops after the core on `x` (one unit's gradient).

        With `phi`, a scaling by m becomes a scaling by phi(m): for multiplicative phi
        Σ_u phi(m·g_u) = phi(m)·Σ_u phi(g_u)."""
        for step in plan.post:
            eqn = step.eqn
            if step.factor is None:
                if eqn.primitive.name != "convert_element_type":
                    params = dict(eqn.params)
                    if eqn.primitive.name == "reduce_sum":
                        params.pop("out_sharding", None)
                        x = jnp.sum(x, axis=tuple(params["axes"]))
                        continue
                    (x,) = _bind(eqn, [x])
                continue
            m = step.factor if isinstance(step.factor, float) else _read(env, step.factor)
            m = jnp.asarray(m, x.dtype)
            if step.divide:
                m = 1.0 / m
            if phi is not None:
                m = phi(m)
            x = x * m
        return x

    def _per_unit(self, plan: _LeafPlan, env: dict) -> Array:
        """One example's per-unit gradients of a leaf, [U, *shape], from its interface values."""
        core = plan.core
        dtype = stat_dtype(self.param_dtypes[self.paths.index(plan.path)])
        if plan.route == "fallback":
            local = dict(env)
            _eval_eqns(plan.tail, local)
            return jnp.asarray(_read(local, plan.out_var), dtype)[None]
        if plan.route == "per-token-sum":
            parts = [self._per_unit(term, env) for term in plan.terms]
            return sum(parts[1:], parts[0])
        operands = [_read(env, v) for v in core.invars]
        if plan.route in ("rank-one", "sequence", "rows"):
            (g,) = _bind(core, operands)
            return self._apply_post(plan, g.astype(dtype), env, None)[None]
        name = core.primitive.name
        if name == "dot_general":
            a, b = operands
            lc, rc, lb, rb = _dot_parts(core)
            dn = (((), ()), ((*lb, lc[0]), (*rb, rc[0])))
            g = jax.lax.dot_general(a.astype(dtype), b.astype(dtype), dn)
            g = jnp.moveaxis(g, len(lb), 0)
        elif name == "reduce_sum":
            g = jnp.moveaxis(operands[0].astype(dtype), core.params["axes"][0], 0)
        else:  # one embedding row per position
            operand, indices, updates = operands
            g = jax.vmap(lambda i, u: _scatter_rows(core, operand.shape, i[None], u[None]))(
                indices, updates.astype(dtype)
            )
        return jax.vmap(lambda u: self._apply_post(plan, u, env, None))(g)

    def per_token(self, params: PyTree, example: PyTree) -> tuple[Array, PyTree]:
        """Token-granularity reference for one example: loss and per-position contributions."""
        batch = jax.tree.map(lambda x: x[None], example)
        losses, batched, unbatched, _ = self._run_head(params, batch, 1.0)
        env = {**{v: x[0] for v, x in batched.items()}, **unbatched}
        grads = [self._per_unit(plan, env) for plan in self.plans]
        return losses[0], jax.tree.unflatten(self.param_tree, grads)

    # -- the factorized statistics ------------------------------------------------------------

    def factorized_stats(
        self,
        stats: tuple[str, ...],
        chunk_size: int | None,
        clip_norm: float | None,
        params: PyTree,
        batch: PyTree,
        n_examples: int,
    ) -> tuple[Float[Array, ""], Stats]:
        token = self.granularity == "token"
        n_units = n_examples * (self.n_positions if token else 1)
        mean_names = _needed_means(stats)
        need_norms = "sq_norms" in stats or "clipped_mean" in stats
        chunked: dict[int, set[str]] = {}  # leaf -> what the chunk loop must compute for it

        def on_ready(leaves: list[int], env: dict) -> dict:
            results = {}
            for i in leaves:
                plan = self.plans[i]
                plan.methods = {}
                for name in mean_names:
                    value = self._factored_mean(plan, env, name, n_units)
                    if value is None:
                        chunked.setdefault(i, set()).add(name)
                    else:
                        results[name, i] = value
                    plan.methods[name] = "chunked" if value is None else "factorized"
                if need_norms:
                    norms = self._factored_norms(plan, env)
                    if norms is None:
                        chunked.setdefault(i, set()).add("norms")
                    else:
                        results["norms", i] = norms
                    plan.methods["norms"] = "chunked" if norms is None else "factorized"
                if "clipped_mean" in stats:
                    linear = plan.route != "fallback"
                    plan.methods["clipped"] = "factorized" if linear else "chunked"
                    if not linear:
                        chunked.setdefault(i, set()).add("clipped")
            return results

        # Everything below sees g_u / units, the per-unit gradients of the mean loss.
        losses, batched, unbatched, results = self._run_head(params, batch, 1.0 / n_units, on_ready)
        env = {**batched, **unbatched}
        means: dict[str, list[Any]] = {
            k: [results.get((k, i)) for i in range(self.n_params)] for k in mean_names
        }
        norm_parts = [results["norms", i] for i in range(self.n_params) if ("norms", i) in results]

        chunk = self._chunk(chunk_size, chunked, n_examples, batched)
        loop_sums, loop_norms = self._chunk_loop(chunked, batched, unbatched, chunk, n_examples)
        for i, parts in loop_sums.items():
            for name, value in parts.items():
                means[name][i] = value * _unseed(name, n_units)
        if loop_norms is not None:
            norm_parts.append(loop_norms)
        sq_norms = None
        if need_norms:
            dtype = _widest(self.param_dtypes)
            sq_norms = jnp.zeros((n_units,), dtype)
            for part in norm_parts:
                sq_norms = sq_norms + part.reshape(n_units).astype(dtype)
            sq_norms = sq_norms * float(n_units) ** 2
        out: dict[str, Any] = {k: jax.tree.unflatten(self.param_tree, v) for k, v in means.items()}
        if "clipped_mean" in stats:
            assert clip_norm is not None and sq_norms is not None
            weights = _clip_factors(sq_norms, clip_norm)  # the 1/units is in the seed
            clipped: list[Any] = [None] * self.n_params
            for i, plan in enumerate(self.plans):
                if plan.route != "fallback":
                    clipped[i] = self._factored_clipped(plan, env, weights)
            weighted, _ = self._chunk_loop(
                chunked, batched, unbatched, chunk, n_examples, factors=weights
            )
            for i, value in weighted.items():
                clipped[i] = value["clipped"]
            out["clipped_mean"] = jax.tree.unflatten(self.param_tree, clipped)
        loss = losses.mean().astype(stat_dtype(losses.dtype))
        return loss, _finish(stats, out, sq_norms, n_units)

    def _scatter_operands(self, core: Any, env: dict) -> tuple[Any, Array, Array]:
        """Operand, indices and updates of a row scatter, indices broadcast over the batch when
        they do not depend on the example (positions)."""
        operand, indices, updates = (_read(env, v) for v in core.invars)
        if not self._is_batched(core.invars[1]):
            indices = jnp.broadcast_to(indices, (updates.shape[0], *indices.shape))
        return operand, indices, updates

    def _factors(self, core: Any, env: dict, dtype: Any, tie: bool = True) -> tuple[Array, Array]:
        """δ and x of a dense weight's gradient, x made to depend on δ.

        x exists from the forward pass, δ only in the backward pass. Left alone, XLA fuses φ(x)
        into the forward pass and holds it until the backward pass needs it (an extra
        activation per layer); adding zero times one entry of δ gives φ(x) a data dependency
        on δ, so φ(x) and φ(δ) live only around their matmul. (XLA:CPU drops optimization
        barriers before it schedules.) A non-finite δ poisons the statistic, as it would
        anyway. Norms and the clipped mean keep every layer's factors until all norms are
        known, so there the tie would only add copies: `tie=False`."""
        a, b = (_read(env, v).astype(dtype) for v in core.invars[:2])
        return (a, b + a.reshape(-1)[0] * 0.0) if tie else (a, b)

    def _leaf_dtype(self, plan: _LeafPlan) -> Any:
        return stat_dtype(self.param_dtypes[self.paths.index(plan.path)])

    def _units_axes(self, plan: _LeafPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Axes of the batched core operands that index units (B, and T per token)."""
        lc, rc, _, _ = _dot_parts(plan.core)
        if plan.route == "rank-one":
            return (0,), (0,)
        return (0, *(a + 1 for a in lc)), (0, *(a + 1 for a in rc))

    def _factored_mean(self, plan: _LeafPlan, env: dict, stat: str, n_units: int) -> Array | None:
        """(1/units) Σ_units phi(g_unit) without materializing per-unit gradients, or None.

        The factors carry the seed 1/units; the correction phi needs for it scales a factor
        that phi already rewrites (so it fuses), never the weight-sized result."""
        phi, scale, linear = _PHI[stat], _unseed(stat, n_units), stat == "mean"

        def phi_scaled(x: Array) -> Array:
            return phi(x) if scale == 1.0 else phi(x) * scale

        if plan.route == "fallback" or (plan.route == "sequence" and not linear):
            return None
        if plan.route == "per-token-sum":  # only a linear statistic splits over the terms
            if not linear:
                return None
            total = jnp.zeros(plan.shape, self._leaf_dtype(plan))
            for term in plan.terms:
                part = self._factored_mean(term, env, stat, n_units)
                assert part is not None  # every term is per-token, so linear stats factorize
                total = total + part
            return total
        dtype = self._leaf_dtype(plan)
        if plan.route == "constant":  # the same g for every unit
            g = _read(env, plan.out_var).astype(dtype) * float(n_units)  # undo the seed
            return jnp.broadcast_to(phi(g), plan.shape)
        core = plan.core
        name = core.primitive.name
        if name == "dot_general":
            a, b = self._factors(core, env, dtype)
            ua, ub = self._units_axes(plan)
            _, _, lb, rb = _dot_parts(core)
            dn = ((ua, ub), (tuple(d + 1 for d in lb), tuple(d + 1 for d in rb)))
            g = jax.lax.dot_general(phi_scaled(a), phi(b), dn, preferred_element_type=dtype)
        elif name == "reduce_sum":
            z = _read(env, core.invars[0]).astype(dtype)
            g = jnp.sum(phi_scaled(z), axis=(0, core.params["axes"][0] + 1))
        else:
            operand, indices, updates = self._scatter_operands(core, env)
            rows = indices.reshape(-1, indices.shape[-1])
            upd = phi_scaled(updates.astype(dtype)).reshape(-1, *updates.shape[2:])
            g = _scatter_rows(core, operand.shape, rows, upd)
        return self._apply_post(plan, g, env, phi)

    def _post_scale_sq(self, plan: _LeafPlan, env: dict, dtype: Any) -> Array | None:
        """Π m² of the scalings after the core, or None when one is not a scalar."""
        scale = jnp.ones((), dtype)
        for step in plan.post:
            if step.factor is None:
                continue
            if not step.scalar:
                return None
            m = step.factor if isinstance(step.factor, float) else _read(env, step.factor)
            scale = scale * jnp.asarray(m, dtype).reshape(()) ** 2
        return scale

    def _factored_norms(self, plan: _LeafPlan, env: dict) -> Array | None:
        """Per-unit ‖g_unit‖² of one leaf, shaped [B] or [B, T], or None."""
        if plan.route in ("fallback", "per-token-sum"):
            return None
        dtype = self._leaf_dtype(plan)
        if plan.route == "constant":
            g = _read(env, plan.out_var).astype(dtype)
            return jnp.full((self.n_examples,), jnp.sum(jnp.broadcast_to(g, plan.shape) ** 2))
        scale = self._post_scale_sq(plan, env, dtype)
        if scale is None:
            return None
        core = plan.core
        name = core.primitive.name
        if name == "dot_general":
            a, b = self._factors(core, env, dtype, tie=False)
            lc, rc, lb, rb = _dot_parts(core)
            if plan.route == "sequence":
                return self._gram_norms(core, a, b, scale)
            # Per unit, ‖δ ⊗ x‖² = ‖δ‖²‖x‖² for every batch-dim slice (Goodfellow); at token
            # granularity the single contracted axis indexes the units.
            na = jnp.sum(_group_axes(a * a, lb, lc), axis=3)  # [B, batch, terms]
            nb = jnp.sum(_group_axes(b * b, rb, rc), axis=3)
            return jnp.sum(na * nb, axis=1) * scale  # [B, 1] or [B, T]
        if name == "reduce_sum":
            z = _read(env, core.invars[0]).astype(dtype)
            axis = core.params["axes"][0] + 1
            return _sum_except(z * z, (0, axis)) * scale
        updates = _read(env, core.invars[2]).astype(dtype)
        keep = (0, 1) if plan.route == "per-token" else (0,)
        return _sum_except(updates * updates, keep) * scale

    def _gram_norms(self, core: Any, a: Array, b: Array, scale: Array) -> Array | None:
        """‖Σ_t a_t ⊗ b_t‖² = ⟨A Aᵀ, B Bᵀ⟩ per example, when the Grams are the smaller tensors."""
        lc, rc, lb, rb = _dot_parts(core)
        n_terms = math.prod(a.shape[d + 1] for d in lc)
        free_a = math.prod(a.shape[1:]) // (n_terms * math.prod(a.shape[d + 1] for d in lb))
        free_b = math.prod(b.shape[1:]) // (n_terms * math.prod(b.shape[d + 1] for d in rb))
        if 2 * n_terms * n_terms >= free_a * free_b:
            return None
        a2 = _group_axes(a, lb, lc)  # [B, batch, terms, free]
        b2 = _group_axes(b, rb, rc)
        gram_a = jnp.einsum("znsf,zntf->znst", a2, a2)
        gram_b = jnp.einsum("znsf,zntf->znst", b2, b2)
        return jnp.sum(gram_a * gram_b, axis=(1, 2, 3)) * scale

    def _factored_clipped(self, plan: _LeafPlan, env: dict, weights: Array) -> Array:
        """Σ_units w_unit g_unit with the unit weights folded into one factor: (w∘Δ)ᵀX."""
        if plan.route == "per-token-sum":
            parts = [self._factored_clipped(term, env, weights) for term in plan.terms]
            return sum(parts[1:], parts[0])
        dtype = self._leaf_dtype(plan)
        if plan.route == "constant":
            g = _read(env, plan.out_var).astype(dtype)
            return jnp.broadcast_to(g * jnp.sum(weights).astype(dtype), plan.shape)
        core = plan.core
        name = core.primitive.name
        n_examples = self.n_examples
        if name == "dot_general":
            a, b = self._factors(core, env, dtype, tie=False)
            lc, _, _, _ = _dot_parts(core)
            weights = weights.astype(dtype)
            if plan.route == "per-token":
                weights = weights.reshape(n_examples, self.n_positions)
                shape = [1] * a.ndim
                shape[0], shape[lc[0] + 1] = a.shape[0], a.shape[lc[0] + 1]
            else:
                shape = [a.shape[0]] + [1] * (a.ndim - 1)
            a = a * weights.reshape(shape)
            ua, ub = self._units_axes(plan)
            _, _, lb, rb = _dot_parts(core)
            dn = ((ua, ub), (tuple(d + 1 for d in lb), tuple(d + 1 for d in rb)))
            g = jax.lax.dot_general(a, b, dn, preferred_element_type=dtype)
        elif name == "reduce_sum":
            z = _read(env, core.invars[0]).astype(dtype)
            axis = core.params["axes"][0] + 1
            weights = weights.astype(dtype).reshape(n_examples, self.n_positions)
            z = jnp.moveaxis(z, axis, 1) * weights.reshape(*weights.shape, *[1] * (z.ndim - 2))
            g = jnp.sum(z, axis=(0, 1))
        else:
            operand, indices, updates = self._scatter_operands(core, env)
            upd = updates.astype(dtype).reshape(-1, *updates.shape[2:])
            # One weight per row: per token, or per example repeated over its rows.
            rows = jnp.broadcast_to(weights.reshape(updates.shape[0], -1), updates.shape[:2])
            upd = upd * rows.reshape(-1, *[1] * (upd.ndim - 1)).astype(dtype)
            g = _scatter_rows(core, operand.shape, indices.reshape(-1, indices.shape[-1]), upd)
        return self._apply_post(plan, g, env, None)

    # -- the chunk loop: exact per-example gradients of the leaves that need them -------------

    def _chunk(
        self, chunk_size: int | None, chunked: dict[int, set[str]], n: int, batched: dict
    ) -> int:
        """Examples per chunk: the largest number whose materialized per-example gradients
        hold no more numbers than the parameters or the batched head values (activations and
        their gradients), whichever is larger — memory the step needs anyway."""
        if chunk_size is not None:
            return min(chunk_size, n)
        parameters = sum(p.size for p in self.plans)
        activations = sum(math.prod(jnp.shape(x)) for x in batched.values())
        materialized = sum(self.plans[i].size for i in chunked) or 1
        return max(1, min(n, max(parameters, activations) // materialized))

    def _loop_inputs(self, leaves: Sequence[int], batched: dict) -> tuple[list, list]:
        """The batched interface variables the tails of `leaves` read, and their values."""
        needed = {v for i in leaves for v in self._leaf_interface(self.plans[i])}
        keys = [v for v in batched if v in needed]
        return keys, [batched[v] for v in keys]

    def _chunk_loop(
        self,
        chunked: dict[int, set[str]],
        batched: dict,
        unbatched: dict,
        chunk: int,
        n: int,
        factors: Array | None = None,
    ) -> tuple[dict[int, dict[str, Array]], Array | None]:
        """Per-unit gradients of the `chunked` leaves, `chunk` examples at a time.

        Returns per leaf the φ-sums it needs, and the per-unit squared norms of those leaves,
        shaped [B, units per example] (None if no leaf needs them). With `factors` (one per
        unit), returns per leaf Σ_u factors_u g_u instead."""
        if factors is None:
            leaves = list(chunked)
        else:
            leaves = [i for i, needs in chunked.items() if "clipped" in needs]
        if not leaves:
            return {}, None
        keys, values = self._loop_inputs(leaves, batched)
        with_norms = factors is None and any("norms" in chunked[i] for i in leaves)
        per_example = self.n_positions if self.granularity == "token" else 1

        def per_chunk(xs: tuple[list, Array]) -> tuple[dict, Array]:
            def one(x: list, weight: Array) -> tuple[dict, Array]:
                env = {**unbatched, **dict(zip(keys, x, strict=True))}
                grads = {i: self._per_unit(self.plans[i], env) for i in leaves}  # [U, ...]
                norms = jnp.zeros(weight.shape, weight.dtype)
                for i, g in grads.items():
                    if "norms" in chunked[i]:
                        norms = norms + _sum_except(g * g, (0,)).astype(weight.dtype)
                if factors is not None:
                    grads = {
                        i: g * weight.astype(g.dtype).reshape(-1, *[1] * (g.ndim - 1))
                        for i, g in grads.items()
                    }
                return grads, norms

            grads, norms = jax.vmap(one)(*xs)
            if factors is not None:
                return {i: {"clipped": _sum0(_merge01(g))} for i, g in grads.items()}, norms
            sums = {
                i: {k: _sum0(_PHI[k](_merge01(g))) for k in chunked[i] if k in _PHI}
                for i, g in grads.items()
            }
            return sums, norms

        if factors is None:
            weights = jnp.ones((n, per_example), _widest(self.param_dtypes))
        else:
            weights = factors.reshape(n, per_example)
        sums, norms = _chunked_sum(per_chunk, (values, weights), n, chunk)
        return sums, (norms if with_norms else None)


def _merge01(x: Array) -> Array:
    """[chunk, units, ...] -> [chunk·units, ...]."""
    return x.reshape(-1, *x.shape[2:])


def _sum_except(x: Array, keep: tuple[int, ...]) -> Array:
    return jnp.sum(x, axis=tuple(a for a in range(x.ndim) if a not in keep))


def _group_axes(x: Array, batch: tuple[int, ...], contract: tuple[int, ...]) -> Array:
    """[B, ...] -> [B, prod(batch dims), prod(contracted dims), prod(free dims)]."""
    batch1 = tuple(d + 1 for d in batch)
    contract1 = tuple(d + 1 for d in contract)
    free1 = tuple(d for d in range(1, x.ndim) if d not in batch1 + contract1)
    x = jnp.transpose(x, (0, *batch1, *contract1, *free1))
    nb = math.prod(x.shape[1 : 1 + len(batch1)])
    nc = math.prod(x.shape[1 + len(batch1) : 1 + len(batch1) + len(contract1)])
    return x.reshape(x.shape[0], nb, nc, -1)


# --------------------------------------------------------------------------------------------
# Reporting.


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """Which path the factorized implementation takes for one parameter leaf, and why."""

    path: str
    shape: tuple[int, ...]
    path_taken: str  # "factorized" | "chunked" | "fallback"
    route: str  # "rank-one" | "sequence" | "per-token" | "rows" | "constant" | "fallback"
    reason: str
    methods: dict[str, str]  # per ingredient ("mean", "sq_mean", "norms", ...): how computed

    def __str__(self) -> str:
        methods = ", ".join(f"{k}: {v}" for k, v in sorted(self.methods.items()))
        return (
            f"{self.path:40s} {str(self.shape):18s} {self.path_taken:10s} {self.reason} [{methods}]"
        )


def explain(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    params: PyTree,
    batch: PyTree,
    stats: Sequence[str] = ("mean",),
    *,
    granularity: Granularity = "example",
    clip_norm: float | None = None,
) -> list[LeafReport]:
    """Per parameter leaf: the path `impl="factorized"` takes for these statistics, and why.

    "factorized": every requested statistic comes from the factors, no per-example gradient
    exists; "chunked": some statistic (e.g. sq_mean of a weight applied at many positions)
    materializes per-example gradients of this leaf in bounded chunks; "fallback": no pattern
    matched, the leaf's own gradient tail runs per example in chunks (exact, slower).
    """
    stats = tuple(stats)
    if "clipped_mean" in stats and clip_norm is None:
        clip_norm = 1.0
    _check_options(stats, "factorized", granularity, None, clip_norm)
    _, n_positions = _check_inputs(loss_fn, params, batch, stats, granularity)
    program = _GradientProgram(loss_fn, params, batch, granularity, n_positions)
    n_examples = jax.tree.leaves(batch)[0].shape[0]
    jax.eval_shape(
        lambda p, b: program.factorized_stats(stats, None, clip_norm, p, b, n_examples),
        params,
        batch,
    )
    reports = []
    for plan in program.plans:
        if plan.route == "fallback":
            taken = "fallback"
        elif any(m == "chunked" for m in plan.methods.values()):
            taken = "chunked"
        else:
            taken = "factorized"
        reports.append(
            LeafReport(plan.path, plan.shape, taken, plan.route, plan.reason, dict(plan.methods))
        )
    return reports


__all__ = [
    "STATISTICS",
    "LeafReport",
    "explain",
    "stat_dtype",
    "value_and_grad_stats",
]
