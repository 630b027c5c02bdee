"""Test-wide settings: float64 everywhere and strict dtype promotion.

jaxtyping's pytest plugin (``--jaxtyping-packages`` in pyproject.toml) checks every annotated
signature in pegrad, models and optimizers with beartype while the tests run.
"""

import fnmatch
import os

import pytest

# Tests compile hundreds of tiny programs; XLA's optimizing passes cost more than they save here.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# The quick suite, `python -m pytest -m "not slow"`, leaves out the tests below: each cost more
# than about 5 s of CPU, or launched processes that compile a model, in one full run (-n 2,
# jax 0.10.2, 2-core CPU; tests/test_train.py's docstring and the README name the command).
# CI runs every test. An entry names a test, or some of its cases (see `is_slow`).
SLOW = (
    # Added untimed, by their number of cases, when these files landed after the timed run:
    "tests/test_accumulate.py::test_micro_batches_of_any_sizes_combine_into_the_big_batch",
    "tests/test_api.py::test_a_masked_example_counts_nowhere_even_holding_nan",
    "tests/test_api.py::test_dropping_nonfinite_examples_equals_the_loop_over_the_others",
    "tests/test_slicing.py::test_any_slicing_pattern_equals_the_naive_loop",
    "tests/test_bench.py::test_bench_records",
    "tests/test_bench.py::test_the_accelerator_script_writes_measured_time_beside_the_estimate",
    "tests/test_experiments.py::test_batch_scaling_arms_and_its_cache",
    "tests/test_experiments.py::test_precond_measures_the_mean_to_noise_ratio_per_regime",
    "tests/test_experiments.py::test_sign_and_its_recheck_on_unseen_seeds",
    "tests/test_experiments.py::test_msq_sweeps_eps_and_clipping_has_an_adam_control",
    "tests/test_experiments.py::test_vectorize",
    "tests/test_experiments.py::test_the_accelerator_scales_are_ready_to_run",
    "tests/test_experiments.py::test_vectorized_sweep_equals_runs_one_by_one",
    "tests/test_install.py::test_installed_modules_are_not_shadowed_by_a_users_own",
    "tests/test_models.py::test_causality",
    "tests/test_models.py::test_lm_shapes_dtypes_and_loss[learned-False-float64-None-False]",
    "tests/test_models.py::test_lm_shapes_dtypes_and_loss[rotary-True-bfloat16-1-True]",
    "tests/test_models.py::test_mlp_shapes_losses_and_errors",
    "tests/test_models.py::test_pegrad_matches_naive_loop",
    "tests/test_models.py::test_scanned_blocks_equal_the_list_of_blocks",
    "tests/test_multihost.py::test_each_device_draws_only_its_rows_of_a_batch",
    "tests/test_multihost.py::test_fsdp_on_two_devices_gives_the_replicated_losses",
    "tests/test_multihost.py::test_fsdp_step_keeps_parameters_and_optimizer_state_split",
    "tests/test_multihost.py::test_two_processes_give_the_losses_of_one_and_resume_in_one",
    "tests/test_optimizers.py::test_bitwise_equal_to_optax[multisteps_adam]",
    "tests/test_pegrad.py::test_every_statistic_and_implementation_equals_the_naive_loop[*-B5]",
    "tests/test_pegrad.py::test_scanned_weight_gradients_are_hoisted_out_of_the_backward_scan",
    "tests/test_pegrad.py::test_statistics_obey_their_invariants",
    "tests/test_pegrad.py::test_token_mixing_over_an_axis_of_length_t_is_not_a_position",
    "tests/test_train.py::test_cli_bad_input_is_one_line_and_nonzero_exit[args2-at step]",
    "tests/test_train.py::test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint",
    "tests/test_train.py::test_impls_agree_and_run_writes_its_files",
    "tests/test_train.py::test_own_model_trains_through_the_python_and_the_cli_hook",
    "tests/test_train.py::test_resume_reproduces_an_uninterrupted_run",
    "tests/test_train.py::test_two_devices_give_the_losses_of_one",
    "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop[*-1]",  # B = 2 stays quick
    "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop[*-5]",
    "tests/test_zoo.py::test_per_token_statistics_equal_the_untied_reference[linen_block]",
)


def is_slow(nodeid: str) -> bool:
    """Whether SLOW names the test: its node id, or the test without [...] (every case), or
    the test with a [...] pattern of its cases (fnmatch: "[*-B5]")."""
    test, _, case = nodeid.partition("[")
    for entry in SLOW:
        slow_test, _, slow_cases = entry.partition("[")
        if slow_test == test and (not slow_cases or fnmatch.fnmatchcase(case, slow_cases)):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    # A renamed test must not slip into the quick suite unnoticed.
    modules = {item.nodeid.split("::")[0]: getattr(item, "module", None) for item in items}
    for entry in SLOW:
        path, name = entry.split("[")[0].split("::")
        module = modules.get(path)
        if module is not None and not hasattr(module, name):
            raise pytest.UsageError(f"tests/conftest.py SLOW names {entry}: no such test")
