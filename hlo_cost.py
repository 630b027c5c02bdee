"""A step's time on a GPU estimated from XLA's optimized HLO, with no GPU.

XLA compiles for a card it does not have (deviceless AOT: results/bench/gpu_aot.py); what it
cannot do without one is run the program. This module reads the optimized HLO text of such a
compile (`jax.jit(f).lower(...).compile().as_text()`) and estimates one step's time:

* **kernels** — every fusion, custom call (cuBLAS/cuDNN), copy and other unfused op of the
  entry computation, and of every computation it runs (a `while` body and condition counted by
  the loop's known trip count, a `call` or async wrapper once, a `conditional` by its costliest
  branch). XLA's own `cost_analysis()` counts a loop's body once, whatever its trip count, so
  its flops for chunked programs are wrong; this reader multiplies.
* **per kernel, flops and bytes** — flops: 2·(output elements)·(contracted size) for each dot
  and convolution, one per element for every other arithmetic op; bytes: each operand read
  (only the slice read where a fused parameter is only sliced) plus the result written (only the
  update where the fusion writes a `dynamic-update-slice` in place).
* **the estimate** — time = step_s + launches·launch_s + loop iterations·loop_s + Σ_dots
  roofline·gemm_factor + Σ_other kernels roofline·other_factor, where a kernel's
  roofline is max(dot flops/matmul peak + other flops/vector peak, bytes/bandwidth). The card's
  peaks are its data sheet's (`H200_SHEET`); the five costs are fitted (`calibrate`, each ≥ 0)
  to measured steps of the same programs (results/bench/gpu-time.md gives the fit, its error
  left out row by row, and the ranking it reproduces).

The model is deliberately simple — at the sizes the cost table runs a step is a few hundred
kernels of a few microseconds each, so it is launch-bound and the count of kernels matters as
much as their flops — and it is only as good as its calibration: it cannot see autotuning
(a deviceless compile chooses kernels without timing them) or overlap between kernels.
tests/test_hlo_cost.py checks the reader on a hand-written module and on XLA:CPU's HLO of
programs whose flops and loop trip counts are known exactly.

    python hlo_cost.py PROGRAM.hlo ...       # one line per file: kernels, flops, bytes, estimate
    python hlo_cost.py --diff A.hlo B.hlo    # the estimate's terms, and the kernels that differ
"""

import dataclasses
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
BYTES |= {"f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1}
# Ops that launch nothing where they stand: structure, aliases, and ops that run computations.
STRUCTURE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier"}
STRUCTURE |= {"after-all", "add-dependency", "partition-id", "replica-id", "domain"}
CONTROL = {"while", "call", "conditional", "async-start", "async-update", "async-done"}
# Inside a fusion: ops that move or alias data (their bytes are the kernel's), not arithmetic.
MOVES = STRUCTURE | {"broadcast", "reshape", "transpose", "copy", "slice", "dynamic-slice"}
MOVES |= {"concatenate", "pad", "iota", "reverse", "gather", "dynamic-update-slice", "convert"}
MOVES |= {"bitcast-convert"}
SLICES = {"slice", "dynamic-slice", "gather"}
KINDS = ("gemm", "copy", "fusion", "other")


@dataclasses.dataclass(frozen=True)
class Card:
    """A GPU: its data sheet's peaks, and the costs `calibrate` fits to measured steps."""

    name: str
    matmul_flops: float  # dense matmul peak, per second (f32 at XLA's default precision: TF32)
    vector_flops: float  # elementwise peak, per second (f32 CUDA cores)
    bandwidth: float  # HBM bytes per second
    step_s: float = 0.0  # fixed cost of one step (the host's dispatch of the program)
    launch_s: float = 0.0  # fixed cost of one kernel
    loop_s: float = 0.0  # fixed cost of one loop iteration beyond its kernels
    gemm_factor: float = 1.0  # seconds a dot or convolution takes per second of its roofline
    other_factor: float = 1.0  # the same for every other kernel (0: inside launch_s)


# NVIDIA H200 SXM data sheet: TF32 tensor 494.7 TFLOP/s dense (989 with sparsity), FP32 67,
# HBM3e 4.8 TB/s. The fitted costs are results/bench/gpu-time.md's (`calibrate` on the 18 rows
# the card measured, results/bench/gpu.md).
H200_SHEET = Card("NVIDIA H200", matmul_flops=494.7e12, vector_flops=67e12, bandwidth=4.8e12)
H200 = dataclasses.replace(
    H200_SHEET,
    step_s=199.0e-6,
    launch_s=1.87e-6,
    loop_s=0.40e-6,
    gemm_factor=7.05,
    other_factor=0.0,
)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the program: what it does once, and how often it runs per step."""

    name: str
    kind: str  # "gemm" (a dot or convolution) | "copy" (moves data only) | "fusion" | "other"
    launches: int  # per step: the product of the trip counts of the loops around it
    dot_flops: float  # per launch
    other_flops: float  # per launch
    bytes: float  # per launch: read + written
    shape: str = ""  # the result's first array, e.g. "f32[32,64,256]"

    def roofline_s(self, card: Card) -> float:
        compute = self.dot_flops / card.matmul_flops + self.other_flops / card.vector_flops
        return max(compute, self.bytes / card.bandwidth)


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled program as the model reads it."""

    kernels: tuple[Kernel, ...]
    loop_iterations: int  # iterations of every loop, nested ones multiplied out
    unknown_trip_counts: int  # loops whose trip count XLA did not prove (counted once)

    @property
    def launches(self) -> int:
        return sum(k.launches for k in self.kernels)

    def count(self, kind: str) -> int:
        return sum(k.launches for k in self.kernels if k.kind == kind)

    @property
    def flops(self) -> float:
        return sum(k.launches * (k.dot_flops + k.other_flops) for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.launches * k.bytes for k in self.kernels)

    def roofline_s(self, card: Card, kinds: Iterable[str] = KINDS) -> float:
        return sum(k.launches * k.roofline_s(card) for k in self.kernels if k.kind in kinds)

    def terms(self, card: Card) -> tuple[float, ...]:
        """What each of the card's fitted costs multiplies (`Card`'s order)."""
        gemm = self.roofline_s(card, ("gemm",))
        other = self.roofline_s(card, [k for k in KINDS if k != "gemm"])
        return (1.0, self.launches, self.loop_iterations, gemm, other)

    def time_s(self, card: Card) -> float:
        """The estimate: the step, its launches and loop iterations, each kernel's roofline at
        the card's efficiency for its kind."""
        return float(np.dot(self.terms(card), _costs(card)))

    def summary(self, card: Card) -> dict[str, float | int]:
        return {
            "launches": self.launches,
            "gemms": self.count("gemm"),
            "copies": self.count("copy"),
            "loop_iterations": self.loop_iterations,
            "gflop": self.flops / 1e9,
            "mbytes": self.bytes / 1e6,
            "roofline_ms": self.roofline_s(card) * 1e3,
            "estimate_ms": self.time_s(card) * 1e3,
        }


# --------------------------------------------------------------------------------------------
# Reading the HLO text.


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    shape: str  # the result type as written, e.g. "f32[16,256]{1,0}" or a tuple "(s32[], ...)"
    op: str
    operands: tuple[str, ...]
    args: str  # the operand list as written (a parameter's number)
    attrs: str  # everything after the operand list


def _close(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at `start`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, i = [], start
    while i < len(text):
        c = text[i]
        if c == '"':  # strings in backend configs may hold brackets
            i = text.index('"', i + 1)
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in HLO line: {text[:120]}")


def _parse_op(line: str) -> _Op | None:
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if m is None:
        return None
    rest = line[m.end() :]
    end = _close(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    m_op = re.match(r"([a-z][\w\-]*)\(", rest)
    if m_op is None:
        return None
    args_end = _close(rest, m_op.end() - 1)
    args = rest[m_op.end() : args_end - 1]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    return _Op(m.group(1), shape, m_op.group(1), operands, args, rest[args_end:])


def _computations(text: str) -> tuple[dict[str, list[_Op]], str]:
    comps: dict[str, list[_Op]] = {}
    entry = ""
    current: list[_Op] | None = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            current = comps.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            op = _parse_op(line)
            if op is not None:
                current.append(op)
    if not entry:
        raise ValueError("no ENTRY computation in this HLO text")
    return comps, entry


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array of a (possibly tuple) type: (dtype, dims)."""
    out = []
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
        if dtype in BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in _arrays(shape))


def _size(shape: str) -> int:
    return sum(BYTES[dtype] * math.prod(dims) for dtype, dims in _arrays(shape))


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}})", attrs)
    return m.group(1).lstrip("%") if m else None


def _dims(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _backend_config(attrs: str) -> dict:
    m = re.search(r"backend_config=", attrs)
    if m is None or attrs[m.end()] != "{":
        return {}
    body = attrs[m.end() : _close(attrs, m.end())]
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return {}


def _trip_count(attrs: str) -> int | None:
    n = _backend_config(attrs).get("known_trip_count", {}).get("n")
    return int(n) if n is not None else None


def _dot_flops(op: _Op, shapes: dict[str, str]) -> float:
    """2·(output elements)·(contracted size) of a dot, a convolution or a gemm custom call."""
    out = _elements(op.shape if not op.shape.startswith("(") else _first_array(op.shape))
    lhs = _arrays(shapes.get(op.operands[0], "")) if op.operands else []
    if not lhs:
        return 0.0
    lhs_dims = lhs[0][1]
    if op.op == "dot":
        contracted = _dims(op.attrs, "lhs_contracting_dims")
    elif op.op == "convolution":
        rhs = _arrays(shapes.get(op.operands[1], "")) if len(op.operands) > 1 else []
        labels = re.search(r"dim_labels=\w+_(\w+)->(\w+)", op.attrs)
        if not rhs or labels is None:
            return 0.0
        rhs_dims = rhs[0][1]  # each output element reads the kernel's elements of its feature
        return 2.0 * out * math.prod(rhs_dims) / rhs_dims[labels.group(1).index("o")]
    else:  # a gemm custom call: its dimension numbers are in the backend config
        config = _backend_config(op.attrs)
        numbers = config.get("gemm_backend_config", config).get("dot_dimension_numbers", {})
        contracted = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    return 2.0 * out * math.prod(lhs_dims[d] for d in contracted if d < len(lhs_dims))


def _costs(card: Card) -> np.ndarray:
    return np.array([card.step_s, card.launch_s, card.loop_s, card.gemm_factor, card.other_factor])


def _first_array(shape: str) -> str:
    arrays = _arrays(shape)
    if not arrays:
        return "f32[]"
    dtype, dims = arrays[0]
    return f"{dtype}[{','.join(map(str, dims))}]"


class _Reader:
    def __init__(self, comps: dict[str, list[_Op]]):
        self.comps = comps
        self.kernels: list[Kernel] = []
        self.loop_iterations = 0
        self.unknown = 0

    def run(self, comp: str, times: int) -> None:
        ops = self.comps[comp]
        shapes = {op.name: op.shape for op in ops}
        for op in ops:
            if op.op in STRUCTURE:
                continue
            if op.op == "while":
                trip = _trip_count(op.attrs)
                if trip is None:
                    self.unknown += 1
                    trip = 1
                self.loop_iterations += times * trip
                body, cond = _attr(op.attrs, "body"), _attr(op.attrs, "condition")
                if body:
                    self.run(body, times * trip)
                if cond:
                    self.run(cond, times * (trip + 1))
            elif op.op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", op.attrs.split("branch_computations=")[-1])
                branches = [b for b in branches if b in self.comps][:16] or [
                    c for c in (_attr(op.attrs, "true_computation"),) if c
                ]
                costs = []
                for branch in branches:  # the costliest branch, as if always taken
                    costs.append(_Reader(self.comps))
                    costs[-1].run(branch, times)
                if costs:
                    worst = max(costs, key=lambda r: sum(k.launches for k in r.kernels))
                    self.kernels += worst.kernels
                    self.loop_iterations += worst.loop_iterations
                    self.unknown += worst.unknown
            elif op.op in CONTROL:
                called = _attr(op.attrs, "to_apply") or _attr(op.attrs, "calls")
                if called and called in self.comps:
                    self.run(called, times)
            else:
                self.kernels.append(self.kernel(op, shapes, times))

    def kernel(self, op: _Op, shapes: dict[str, str], times: int) -> Kernel:
        read = [_size(shapes.get(name, "")) for name in op.operands]
        written = _size(op.shape)
        dot = other = 0.0
        kind = "other"
        if op.op == "fusion":
            called = _attr(op.attrs, "calls")
            inner = self.comps.get(called or "", [])
            inner_shapes = {o.name: o.shape for o in inner}
            params = sorted((o for o in inner if o.op == "parameter"), key=lambda o: int(o.args))
            users: dict[str, list[_Op]] = {}
            for o in inner:
                for name in o.operands:
                    users.setdefault(name, []).append(o)
            for i, p in enumerate(params):
                uses = users.get(p.name, [])
                if uses and i < len(read) and all(u.op in SLICES for u in uses):
                    read[i] = sum(_size(u.shape) for u in uses)
            root = inner[-1] if inner else None
            if root is not None and root.op == "dynamic-update-slice":
                written = _size(inner_shapes.get(root.operands[1], ""))
                buffer = root.operands[0]
                for i, p in enumerate(params):
                    if p.name == buffer and i < len(read):
                        read[i] = 0
            for o in inner:
                if o.op in ("dot", "convolution"):
                    dot += _dot_flops(o, inner_shapes)
                elif o.op == "reduce":
                    other += _elements(inner_shapes.get(o.operands[0], "")) if o.operands else 0
                elif o.op not in MOVES:
                    other += _elements(o.shape)
            moves = not other or "dynamic_slice_fusion" in op.attrs  # data moved, nothing computed
            kind = "gemm" if dot else "copy" if moves else "fusion"
        elif op.op == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', op.attrs)
            name = target.group(1) if target else ""
            if any(s in name.lower() for s in ("gemm", "matmul", "conv")):
                dot = _dot_flops(op, shapes)
                kind = "gemm"
        elif op.op in ("dot", "convolution"):
            dot, kind = _dot_flops(op, shapes), "gemm"
        elif op.op in ("copy", "transpose", "copy-start"):
            kind = "copy"
        else:
            other = float(_elements(op.shape))
        shape = _first_array(op.shape)
        return Kernel(op.name, kind, times, dot, other, float(sum(read) + written), shape)


def read_hlo(text: str) -> Program:
    """The kernels one step of this optimized HLO module launches (see the module docstring)."""
    comps, entry = _computations(text)
    reader = _Reader(comps)
    reader.run(entry, 1)
    return Program(tuple(reader.kernels), reader.loop_iterations, reader.unknown)


# --------------------------------------------------------------------------------------------
# Calibration: the fixed costs fitted to measured steps.


@dataclasses.dataclass(frozen=True)
class Fit:
    card: Card
    relative_errors: tuple[float, ...]  # (estimate − measured) / measured, per row
    loo_errors: tuple[float, ...]  # the same, each row predicted by a fit without it


def calibrate(programs: Sequence[Program], measured_s: Sequence[float], card: Card) -> Fit:
    """Fit the card's five costs (each ≥ 0: the step, a launch, a loop iteration, and the
    seconds per roofline second of dots and of every other kernel) to measured step times,
    minimizing the squared relative error; each row's leave-one-out error says how well the
    model predicts a program it was not fitted on."""
    features = np.array([p.terms(card) for p in programs], dtype=float)
    target = np.asarray(measured_s, dtype=float)
    n_terms = features.shape[1]

    def fit(rows: np.ndarray) -> np.ndarray:
        a, b = features[rows] / target[rows, None], np.ones(len(rows))
        best, best_err = np.zeros(n_terms), math.inf
        for mask in range(1, 2**n_terms):  # non-negative least squares: every subset of terms
            cols = [j for j in range(n_terms) if mask >> j & 1]
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(n_terms)
            full[cols] = coef
            err = float(np.sum((a @ full - b) ** 2))
            if err < best_err - 1e-15:
                best, best_err = full, err
        return best

    everything = np.arange(len(target))
    coef = fit(everything)
    relative = features @ coef / target - 1
    loo = [float(features[i] @ fit(np.delete(everything, i)) / target[i] - 1) for i in everything]
    names = ("step_s", "launch_s", "loop_s", "gemm_factor", "other_factor")
    fitted = dataclasses.replace(card, **{n: float(c) for n, c in zip(names, coef, strict=True)})
    return Fit(fitted, tuple(float(r) for r in relative), tuple(loo))


def kernel_groups(program: Program) -> Counter[tuple[str, str, str]]:
    """Launches per group of alike kernels: (kind, name less its ".N", result's first array)."""
    groups: Counter[tuple[str, str, str]] = Counter()
    for k in program.kernels:
        groups[(k.kind, re.sub(r"\.\d+$", "", k.name), k.shape)] += k.launches
    return groups


def diff(a: Program, b: Program) -> list[tuple[tuple[str, str, str], int, int]]:
    """The groups of `kernel_groups` whose launches differ between two programs: (group,
    launches in a, launches in b), the largest difference first, then by group."""
    ga, gb = kernel_groups(a), kernel_groups(b)
    rows = [(g, ga[g], gb[g]) for g in set(ga) | set(gb) if ga[g] != gb[g]]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), r[0]))


def main(paths: Sequence[str]) -> None:
    if paths and paths[0] == "--diff":
        if len(paths) != 3:
            raise SystemExit("usage: python hlo_cost.py --diff A.hlo B.hlo")
        programs = []
        for path in paths[1:]:
            with open(path) as f:
                programs.append(read_hlo(f.read()))
        a, b = programs
        for path, p in zip(paths[1:], programs, strict=True):
            terms = " + ".join(
                f"{c * t * 1e3:.3f}" for c, t in zip(_costs(H200), p.terms(H200), strict=True)
            )
            print(f"{path}: {p.launches} kernels, est {p.time_s(H200) * 1e3:.3f} ms = {terms}"
                  " (step + launches + loop iterations + dots + other kernels)")  # fmt: skip
        print("| kind | kernel | result | launches A | launches B | B - A |")
        print("|---|---|---|---|---|---|")
        for (kind, name, shape), na, nb in diff(a, b):
            print(f"| {kind} | {name} | {shape} | {na} | {nb} | {nb - na:+d} |")
        return
    print("| file | launches | gemms | copies | loop its | GFLOP | MB | roofline ms | est ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            s = read_hlo(f.read()).summary(H200)
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in s.values()]
        print(f"| {path} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
