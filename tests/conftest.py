"""Test-wide settings: float64 everywhere and strict dtype promotion.

jaxtyping's pytest plugin (``--jaxtyping-packages`` in pyproject.toml) checks every annotated
signature in pegrad, models and optimizers with beartype while the tests run.
"""

import fnmatch
import os
from collections.abc import Sequence

import pytest

# Tests compile hundreds of tiny programs; XLA's optimizing passes cost more than they save here,
# and XLA:CPU's new fusion emitters compile them up to twice as slowly (results/ci/README.md).
# Subprocesses (tests/sharded.py, the train.py runs) inherit these flags.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false",
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
    # 8 simulated devices, in a process per case (tests/sharded.py)
    "tests/test_sharding.py::test_a_sharded_batch_gives_one_devices_statistics_at_the_gradients_traffic",
    "tests/test_bench.py::test_bench_records",
    "tests/test_bench.py::test_the_accelerator_script_writes_measured_time_beside_the_estimate",
    "tests/test_experiments.py::test_batch_scaling_arms_and_its_cache",
    "tests/test_experiments.py::test_critical_batch_rechecks_committed_lrs_and_target_on_unseen_seeds",
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
    "tests/test_zoo.py::test_every_benchmarked_family_equals_the_naive_loop[*-1]",
    "tests/test_zoo.py::test_every_benchmarked_family_equals_the_naive_loop[*-3]",
)


# The fast suite, the README's test command (`python -m pytest -q -m fast`): a few minutes on two
# cores, and still every route of pegrad.ROUTES, every statistic, every optimizer, train.py
# (in process and as a script), plots.py, the README's code and the refusals a new user meets
# (tests/test_fast_suite.py checks that it does). CI runs it, then the rest (-m "not fast"):
# every test once. An entry names a test file, a test, or some of its cases (`matches`).
FAST = (
    # Every statistic and implementation against the naive loop, on every piece at B = 2, and
    # on the zoo's models whose routes the pieces do not take (routed-part, disjoint-parts) or
    # whose framework they do not use (nnx, eqx layers, a custom_jvp).
    "tests/test_pegrad.py::test_every_statistic_and_implementation_equals_the_naive_loop[*-B2]",
    "tests/test_pegrad.py::test_zero_size_and_scalar_leaves[2]",  # the "empty" route
    "tests/test_pegrad.py::test_explain_names_the_route_of_every_leaf",
    "tests/test_pegrad.py::test_explain_runs_nothing",
    "tests/test_pegrad.py::test_mismatched_leading_axes_name_the_leaf",
    "tests/test_pegrad.py::test_non_scalar_loss_is_an_error",
    "tests/test_pegrad.py::test_integer_parameter_leaves_are_named",
    "tests/test_pegrad.py::test_variance_of_one_example_is_an_error",
    "tests/test_pegrad.py::test_unknown_names_and_missing_clip_norm_are_errors",
    "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop[looped_stack-2]",
    "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop[moe_top1_gather-2]",
    "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop[eqx_conv-2]",
    "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop[custom_jvp-2]",
    "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop[nnx_mlp-2]",
    "tests/test_api.py::test_an_equinox_module_as_it_is",
    "tests/test_api.py::test_a_flax_nnx_module_as_it_is",
    "tests/test_api.py::test_a_statistic_named_by_a_string",
    "tests/test_api.py::test_nan_propagates_by_default",
    "tests/test_api.py::test_variance_of_one_kept_example_is_an_error_or_nan_under_jit",
    "tests/test_api.py::test_batch_norm_in_training_mode_is_refused_naming_the_framework",
    "tests/test_api.py::test_has_aux_with_a_scalar_loss_is_an_error",
    "tests/test_accumulate.py::test_accumulation_as_a_scan_carry",
    "tests/test_accumulate.py::test_what_cannot_be_combined_is_refused",
    "tests/test_noise_scale.py",
    # Every optimizer: both implementations against its formula; what each reads.
    "tests/test_optimizers.py::test_impls_agree_and_match_formula[*-mlp]",
    "tests/test_optimizers.py::test_required_stats_of_every_optimizer",
    "tests/test_optimizers.py::test_missing_stats_is_a_clear_error",
    "tests/test_optimizers.py::test_bad_hyperparameters_are_a_clear_error",
    "tests/test_optimizers_compose.py::test_optax_multisteps_is_refused_naming_multi_steps",
    "tests/test_optimizers_compose.py::test_an_elementwise_change_before_a_rule_is_refused",
    "tests/test_optimizers_compose.py::test_required_stats_of_compositions",
    "tests/test_optimizers_compose.py::test_multi_steps_returns_zero_updates_between_updates",
    "tests/test_optimizers_docs.py",
    "tests/test_contracts.py::test_dropout_drawing_the_same_mask_for_every_example_is_refused",
    "tests/test_contracts.py::test_optax_multisteps_around_a_statistics_rule_is_refused_before_it_runs",
    # train.py in process (a run, its metrics and console, bad input) and as a script; plots.py.
    "tests/test_train.py::test_cli_round_trip",
    "tests/test_train.py::test_console_and_metrics_label_each_loss_with_the_same_step",
    "tests/test_train.py::test_diagnostics_hold_the_gradient_noise_scale",
    "tests/test_train.py::test_bad_input_is_a_config_error",
    "tests/test_train.py::test_a_bad_task_is_refused_before_any_work",
    "tests/test_train.py::test_cli_failure_is_one_line_naming_the_fix_and_leaves_nothing_behind[factory-signature]",
    "tests/test_train.py::test_checkpoint_round_trip_keeps_dtypes_and_rejects_another_model",
    "tests/test_train.py::test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint",
    "tests/test_train.py::test_every_flag_is_checked_before_any_work",
    "tests/test_train.py::test_a_refused_resume_prints_learning_rates_with_the_digits_that_differ",
    "tests/test_train.py::test_metrics_log_the_smoothed_noise_scale_and_the_console_shows_it",
    "tests/test_train.py::test_a_divergence_names_the_flags_that_fix_it",
    "tests/test_train_step.py::test_schedule_equals_its_formula",
    "tests/test_train_step.py::test_the_optimizer_decays_matrices_only",
    "tests/test_plots.py",
    # The README's code, the layout, the public API, the package, the refusals of issue 50.
    "tests/test_readme.py",
    "tests/test_layout.py",
    "tests/test_reading_path.py",
    "tests/test_public_api.py",
    "tests/test_refusals.py",
    "tests/test_fast_suite.py",
    "tests/test_install.py::test_wheel_is_one_package_named_pegrad",
    "tests/test_install.py::test_one_import_line_in_a_checkout_beside_a_users_own_files",
)


def matches(nodeid: str, entries: Sequence[str]) -> bool:
    """Whether an entry names the test: its file, its node id, the test without [...] (every
    case), or the test with a [...] pattern of its cases (fnmatch: "[*-B5]")."""
    test, _, case = nodeid.partition("[")
    for entry in entries:
        named, _, cases = entry.partition("[")
        if entry == test.split("::")[0] or (
            named == test and (not cases or fnmatch.fnmatchcase(case, cases))
        ):
            return True
    return False


def is_fast(nodeid: str) -> bool:
    """Whether FAST names the test (`matches`)."""
    return matches(nodeid, FAST)


def is_slow(nodeid: str) -> bool:
    """Whether SLOW names the test (`matches`)."""
    return matches(nodeid, SLOW)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        if is_fast(item.nodeid):
            item.add_marker(pytest.mark.fast)
    # A renamed test must not slip into the quick suite unnoticed.
    modules = {item.nodeid.split("::")[0]: getattr(item, "module", None) for item in items}
    for kind, entries in (("SLOW", SLOW), ("FAST", FAST)):
        for entry in entries:
            path, _, name = entry.split("[")[0].partition("::")
            module = modules.get(path)
            if module is not None and name and not hasattr(module, name):
                raise pytest.UsageError(f"tests/conftest.py {kind} names {entry}: no such test")
