"""The fast suite (issue 50), the README's test command: `python -m pytest -q -m fast` runs the
tests tests/conftest.py's FAST names, and they still take every route of pegrad.ROUTES, compute
every statistic with both implementations, run every optimizer against its formula, and run
train.py in process and as a script; CI runs the README's command verbatim and then the rest
(`-m "not fast"`), so every test runs once. How long each takes is measured, not tested (no
timers in tests): the README says it."""

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import FAST, is_fast, matches
from pieces import PIECES
from zoo import MODELS

import optimizers
import pegrad

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
EVERY = "tests/test_pegrad.py::test_every_statistic_and_implementation_equals_the_naive_loop"
ZOO = "tests/test_zoo.py::test_every_statistic_equals_the_naive_loop"


def _routes(loss, params, batch, granularity: pegrad.Granularity) -> set[str]:
    """The routes explain gives the leaves when every statistic is asked for and every route a
    leaf proves runs (choose="first", as the equality tests run them)."""
    stats, first = pegrad.STATISTICS, "first"
    plan = pegrad.explain(loss, params, batch, stats, granularity=granularity, clip_norm=0.5,
                          choose=first)  # fmt: skip
    return {p.route for p in plan}


def test_the_fast_suite_takes_every_route():
    """The pieces and zoo models whose equality tests the fast suite runs (B = 2), with the
    zero-size leaf of test_zero_size_and_scalar_leaves, take every route there is."""
    taken = set()
    for piece in PIECES:
        granularities: list[pegrad.Granularity] = ["example", "token"]
        for granularity in granularities if piece.sequence else granularities[:1]:
            if is_fast(f"{EVERY}[{piece}-{granularity}-B2]"):
                params = piece.init(jax.random.key(2))
                loss = lambda p, ex, piece=piece: piece.loss(p, ex, False)  # noqa: E731
                taken |= _routes(loss, params, piece.example(jax.random.key(3), 2), granularity)
    for model in MODELS:
        if is_fast(f"{ZOO}[{model}-2]"):
            params, loss = model.build(jax.random.key(0))
            taken |= _routes(loss, params, model.batch(jax.random.key(2), 2), "example")
    assert is_fast("tests/test_pegrad.py::test_zero_size_and_scalar_leaves[2]")
    empty = {"z": jnp.zeros((0, 3)), "w": jnp.ones(3)}
    zero = lambda p, x: jnp.sum(p["w"] * x) + jnp.sum(p["z"])  # noqa: E731
    taken |= _routes(zero, empty, jnp.ones((2, 3)), "example")
    assert {r.name for r in pegrad.ROUTES} <= taken, {r.name for r in pegrad.ROUTES} - taken


def test_the_fast_suite_computes_every_statistic_on_every_piece():
    """check_every_implementation asks for every statistic of pegrad.STATISTICS (var too at
    B = 2), for every implementation, on every piece and granularity."""
    for piece in PIECES:
        for granularity in ["example", "token"] if piece.sequence else ["example"]:
            assert is_fast(f"{EVERY}[{piece}-{granularity}-B2]"), (piece, granularity)
    import helpers

    assert "pegrad.STATISTICS" in inspect.getsource(helpers.check_every_implementation)


def test_the_fast_suite_runs_every_optimizer():
    rules = [n for n in optimizers.__all__ if n in ("adam", "multi_steps") or "sign" in n
             or n.startswith("micro_adam")]  # fmt: skip
    rules = [n for n in rules if not n.startswith("scale_by")]
    assert len(rules) == 8, rules
    for name in rules:
        node = (
            "tests/test_optimizers_compose.py::test_multi_steps_returns_zero_updates_between_updates"
            if name == "multi_steps"
            else f"tests/test_optimizers.py::test_impls_agree_and_match_formula[{name}-mlp]"
        )
        assert is_fast(node), node


@pytest.mark.parametrize(
    "node",
    [
        "tests/test_train.py::test_console_and_metrics_label_each_loss_with_the_same_step",
        "tests/test_train.py::test_cli_failure_is_one_line_naming_the_fix_and_leaves_nothing_behind[factory-signature]",
        "tests/test_plots.py::test_help_is_help",
        "tests/test_readme.py::test_readme_python_blocks_run_as_written",
    ],
    ids=["train-in-process", "train-as-a-script", "plots", "readme"],
)
def test_the_fast_suite_runs_the_scripts_and_the_readme(node: str):
    assert is_fast(node)


def test_the_readme_command_is_the_fast_suite_and_ci_runs_it_then_the_rest():
    (command,) = re.findall(
        r"^(pip install -e \"\.\[test\]\" && python -m pytest [^#\n]*?)\s+#", README, re.M
    )
    assert command.endswith("-m fast"), command
    ci = (REPO / ".ci" / "run").read_text()
    lines = [line.strip() for line in ci.splitlines()]
    first = lines.index(command)  # verbatim
    rest = lines.index('python -m pytest -q -m "not fast"')
    assert first < rest


def test_fast_matches_files_tests_and_cases():
    assert matches("tests/test_plots.py::test_help_is_help", ["tests/test_plots.py"])
    assert matches(f"{EVERY}[mlp3-example-B2]", [f"{EVERY}[*-B2]"])
    assert not matches(f"{EVERY}[mlp3-example-B5]", [f"{EVERY}[*-B2]"])
    assert not matches("tests/test_plots.py::test_help_is_help", ["tests/test_plot.py"])
    assert len(FAST) == len(set(FAST))
