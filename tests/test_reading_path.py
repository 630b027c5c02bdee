"""The reading path (issue 57): one dense layer, ½‖Wx + b − y‖² with ("mean", "sq_mean",
"sq_norms"), traced once, runs a bounded number of lines of pegrad.py's function bodies
(results/readable/dense_path.py measures it: every function entered, docstring included), and
its planner stops at the first route that proves a leaf. The budget moves only down."""

import importlib.util
import sys
from pathlib import Path
from typing import Any

DENSE_PATH_LINES = 974  # results/readable/README.md: 1,707 at e005a02, 1,001 at d6ac9f0
SCRIPT = Path(__file__).resolve().parent.parent / "results" / "readable" / "dense_path.py"


def _dense_path() -> dict[tuple[str, int, int], int]:
    spec = importlib.util.spec_from_file_location("dense_path", SCRIPT)
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    sys.modules["dense_path"] = module
    spec.loader.exec_module(module)
    return module.dense_path()


def test_the_dense_layers_path_stays_within_its_budget_and_stops_at_the_first_proof():
    path = _dense_path()
    names = {name for name, _, _ in path}
    assert {"value_and_grad_stats", "plan", "core_sum"} <= names, sorted(names)  # it was traced
    # W takes outer-product and b head-value: no route after head-value is tried for either
    assert not names & {"_placed_parts", "_split_terms"}, sorted(names)
    assert sum(path.values()) <= DENSE_PATH_LINES, f"{sum(path.values())} lines: {sorted(names)}"
