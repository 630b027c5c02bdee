# ruff: noqa: E501 (MODULE holds HLO lines as XLA prints them)
"""hlo_cost.py, the GPU step-time model read from optimized HLO: kernels counted with their
loops' trip counts, dot flops exact, bytes of what a kernel reads and writes, and a calibration
that recovers the costs it was given. Its calibration on the H200's measured rows is
results/bench/gpu-time.md (compiled with the CUDA plugin, not here)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_cost

# A module as XLA:GPU prints one after optimization (names shortened): a gemm custom call, a
# fusion that reads a slice of its parameter, and a loop of 3 iterations whose body runs a
# dot fusion and writes a row in place.
MODULE = """
HloModule jit_step, entry_computation_layout={(f32[64,32]{1,0}, f32[32,16]{1,0})->f32[8,16]{1,0}}

%fused_slice (param_0: f32[64,32]) -> f32[8,32] {
  %param_0 = f32[64,32]{1,0} parameter(0)
  %slice.1 = f32[8,32]{1,0} slice(%param_0), slice={[0:8], [0:32]}
  ROOT %tanh.1 = f32[8,32]{1,0} tanh(%slice.1)
}

%gemm_computation (p0: f32[8,32], p1: f32[32,16]) -> f32[8,16] {
  %p0 = f32[8,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (q0: f32[8,16], q1: f32[1,16], q2: s32[]) -> f32[8,16] {
  %q0 = f32[8,16]{1,0} parameter(0)
  %q1 = f32[1,16]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[8,16]{1,0} dynamic-update-slice(%q0, %q1, %q2, %zero)
}

%body (arg: (s32[], f32[8,32], f32[32,16], f32[8,16])) -> (s32[], f32[8,32], f32[32,16], f32[8,16]) {
  %arg = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8,32]{1,0} get-tuple-element(%arg), index=1
  %w = f32[32,16]{1,0} get-tuple-element(%arg), index=2
  %acc = f32[8,16]{1,0} get-tuple-element(%arg), index=3
  %gemm = f32[8,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_computation
  %row = f32[1,16]{1,0} bitcast(%gemm)
  %upd = f32[8,16]{1,0} fusion(%acc, %row, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}, f32[8,16]{1,0}) tuple(%i, %x, %w, %upd)
}

%cond (carg: (s32[], f32[8,32], f32[32,16], f32[8,16])) -> pred[] {
  %carg = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}, f32[8,16]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %three), direction=LT
}

ENTRY %main (a: f32[64,32], b: f32[32,16]) -> f32[8,16] {
  %a = f32[64,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  %x0 = f32[8,32]{1,0} fusion(%a), kind=kLoop, calls=%fused_slice
  %g0 = f32[8,16]{1,0} custom-call(%x0, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %zero_i = s32[] constant(0)
  %init = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}, f32[8,16]{1,0}) tuple(%zero_i, %x0, %b, %g0)
  %loop = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=3
}
"""


def test_kernels_are_counted_with_their_loops_trip_counts():
    program = hlo_cost.read_hlo(MODULE)
    launches = {k.name: k.launches for k in program.kernels}
    # entry: the slice fusion and the gemm; the body's two fusions 3 times; the condition 4
    assert launches == {"x0": 1, "g0": 1, "gemm": 3, "upd": 3, "lt": 4}
    assert program.launches == 12 and program.loop_iterations == 3
    assert program.unknown_trip_counts == 0
    assert program.count("gemm") == 1 + 3


def test_dot_flops_are_exact_and_bytes_are_what_a_kernel_reads_and_writes():
    kernels = {k.name: k for k in hlo_cost.read_hlo(MODULE).kernels}
    assert kernels["g0"].dot_flops == kernels["gemm"].dot_flops == 2 * 8 * 16 * 32
    # the slice fusion reads its 8 rows of the [64, 32] parameter, not all of it
    assert kernels["x0"].bytes == 4 * (8 * 32 + 8 * 32)
    assert kernels["x0"].other_flops == 8 * 32  # one tanh per element
    # the in-place row update reads the row and the index, writes the row
    assert kernels["upd"].bytes == 4 * 16 + 4 + 4 * 16
    assert kernels["g0"].bytes == 4 * (8 * 32 + 32 * 16 + 8 * 16)


def test_diff_names_the_kernel_groups_whose_launches_differ_and_nothing_else():
    three = hlo_cost.read_hlo(MODULE)
    assert hlo_cost.diff(three, three) == []
    five = hlo_cost.read_hlo(MODULE.replace('{"n":"3"}', '{"n":"5"}'))
    # the body's two kernels run twice more, the condition's compare too; the entry's do not
    assert hlo_cost.diff(three, five) == [
        (("copy", "upd", "f32[8,16]"), 3, 5),
        (("gemm", "gemm", "f32[8,16]"), 3, 5),
        (("other", "lt", "pred[]"), 4, 6),
    ]
    assert sum(hlo_cost.kernel_groups(five).values()) == five.launches


def test_a_loop_without_a_known_trip_count_is_counted_once_and_said():
    program = hlo_cost.read_hlo(
        MODULE.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    )
    assert program.unknown_trip_counts == 1 and program.loop_iterations == 1
    assert {k.name: k.launches for k in program.kernels}["gemm"] == 1


@pytest.mark.parametrize("trips", [1, 5])
def test_xla_cpus_own_hlo_gives_a_loops_dot_flops_times_its_trip_count(trips: int):
    """XLA's cost_analysis() counts a loop's body once; the reader multiplies."""
    step = lambda x, w: jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ w), x)  # noqa: E731
    x, w = jnp.ones((8, 16), jnp.float32), jnp.ones((16, 16), jnp.float32)
    program = hlo_cost.read_hlo(jax.jit(step).lower(x, w).compile().as_text() or "")
    dots = sum(k.launches * k.dot_flops for k in program.kernels)
    assert dots == trips * 2 * 8 * 16 * 16
    if trips > 1:  # XLA removes a loop of one iteration
        assert program.loop_iterations == trips


def test_calibration_recovers_the_costs_that_made_the_times():
    card = dataclasses.replace(hlo_cost.H200_SHEET, step_s=50e-6, launch_s=2e-6)
    card = dataclasses.replace(card, gemm_factor=3.0, other_factor=0.0, loop_s=0.0)
    rng = np.random.default_rng(0)
    programs = []
    for _ in range(8):
        kernels = [
            hlo_cost.Kernel(f"k{j}", str(rng.choice(["gemm", "fusion"])), int(rng.integers(1, 9)),
                            float(rng.uniform(1e6, 1e9)), 0.0, float(rng.uniform(1e4, 1e7)))
            for j in range(int(rng.integers(3, 30)))
        ]  # fmt: skip
        programs.append(hlo_cost.Program(tuple(kernels), 0, 0))
    times = [p.time_s(card) for p in programs]
    fit = hlo_cost.calibrate(programs, times, hlo_cost.H200_SHEET)
    assert max(abs(e) for e in fit.relative_errors) < 1e-9
    assert fit.card.step_s == pytest.approx(50e-6) and fit.card.launch_s == pytest.approx(2e-6)
    assert fit.card.gemm_factor == pytest.approx(3.0)
    assert max(abs(e) for e in fit.loo_errors) < 1e-6
