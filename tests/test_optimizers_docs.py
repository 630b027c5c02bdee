"""optimizers.py's docstrings are part of its specification: every public function has Args,
Returns and an Example, and every Example runs and prints what it says (doctest)."""

import doctest
import inspect

import pytest

import optimizers

FUNCTIONS = sorted(
    name
    for name, obj in vars(optimizers).items()
    if not name.startswith("_")
    and inspect.isfunction(obj)
    and obj.__module__ == optimizers.__name__
)
WITH_EXAMPLES = sorted(
    [*FUNCTIONS, "MissingStatistics"]
)  # the one public class a user meets without building it


def test_the_public_functions_are_the_documented_ones():
    assert {"make_train_step", "multi_steps", "scale_by_micro_adam", "trainable"} <= set(FUNCTIONS)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_public_function_has_args_returns_example(name: str):
    doc = inspect.getdoc(getattr(optimizers, name)) or ""
    for section in ("Args:", "Returns:", "Example:"):
        assert f"\n{section}\n" in doc, f"optimizers.{name}: no {section} section"
    # Each parameter is described under Args.
    args = doc.split("Args:\n")[1].split("Returns:")[0]
    for parameter in inspect.signature(getattr(optimizers, name)).parameters.values():
        wanted = (
            "**" + parameter.name if parameter.kind is parameter.VAR_KEYWORD else parameter.name
        )
        assert f"    {wanted}:" in args, f"optimizers.{name}: {wanted} not under Args"


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_example_runs(name: str):
    (test,) = doctest.DocTestFinder(recurse=False).find(
        getattr(optimizers, name), f"optimizers.{name}", globs={}
    )
    assert test.examples, f"optimizers.{name}: its Example has no >>> lines"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    result = runner.run(test)
    assert result.failed == 0, f"optimizers.{name}: {result.failed} example(s) failed (above)"
