"""The quick suite: `python -m pytest -m "not slow"` leaves out exactly the tests that
tests/conftest.py's SLOW names, marked before -m selects (here: tests/test_train.py's, collected
in a subprocess)."""

import subprocess
import sys
from pathlib import Path

from conftest import SLOW, is_slow

REPO = Path(__file__).resolve().parent.parent


def test_slow_marks_exactly_the_tests_slow_names():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "slow",
         "tests/test_train.py"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    slow = {line for line in proc.stdout.splitlines() if line.startswith("tests/")}
    # test_train's entries name whole tests, or one case of a test: their node ids.
    named = {entry for entry in SLOW if entry.startswith("tests/test_train.py::")}
    assert len(named) >= 2 and slow == named


def test_slow_names_a_test_all_its_cases_or_a_pattern_of_them():
    pegrad = "tests/test_pegrad.py::test_every_statistic_and_implementation_equals_the_naive_loop"
    assert is_slow(f"{pegrad}[mlp3-example-B5]") and not is_slow(f"{pegrad}[mlp3-example-B2]")
    assert is_slow("tests/test_train.py::test_two_devices_give_the_losses_of_one")
    assert is_slow("tests/test_models.py::test_pegrad_matches_naive_loop[mlp]")
    assert not is_slow("tests/test_train.py::test_cli_round_trip")
