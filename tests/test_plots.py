"""plots.py as a new user meets it (issue 50): `--help` is help, a folder it cannot draw and a
missing matplotlib are one line "error: ..." and exit status 1 (never "wrote the CSV/JSON
only" when nothing was written), and a run's figure holds its loss curves beside the
gradient noise scale."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import plots

REPO = Path(__file__).resolve().parent.parent
RECORDS = [
    {"step": 0, "eval_loss": 3.0},
    {"step": 0, "loss": 2.0, "trace_cov": 4.0, "grad_sq": 2.0},
    {"step": 1, "loss": 1.9, "trace_cov": 8.0, "grad_sq": 1.0},
    {"step": 2, "eval_loss": 2.5},
]


def run_plots(*args: str, no_matplotlib: bool = False) -> subprocess.CompletedProcess:
    """`python plots.py ARGS`; with `no_matplotlib`, as in an environment without it."""
    hide = "import sys; sys.modules['matplotlib'] = None; " if no_matplotlib else ""
    code = f"{hide}import runpy; runpy.run_path('plots.py', run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_help_is_help():
    proc = run_plots("--help")
    assert proc.returncode == 0 and "usage: plots.py" in proc.stdout and "--costs" in proc.stdout


@pytest.mark.parametrize("matplotlib", ["installed", "absent"])
def test_a_run_is_drawn_or_refused_in_one_line(tmp_path: Path, matplotlib: str):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    if matplotlib == "installed" and plots.pyplot() is None:
        pytest.skip("matplotlib is not installed here")
    proc = run_plots(str(tmp_path), no_matplotlib=matplotlib == "absent")
    if matplotlib == "absent":
        assert proc.returncode == 1 and proc.stderr.strip() == f"error: {plots.NO_FIGURE}"
        assert not (tmp_path / "run.png").exists()
    else:
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "run.png").stat().st_size > 0


def test_a_folder_it_cannot_draw_is_one_line(tmp_path: Path):
    proc = run_plots(str(tmp_path / "nothing"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nothing'} holds no metrics.jsonl (train.py) or summary.json (a study)"
    ]


def test_the_run_figure_has_a_loss_panel_beside_the_diagnostics(tmp_path: Path):
    plt = plots.pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed here")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    drawn = []
    real = plots.save
    plots.save = lambda fig, path, plt: (drawn.append(fig), real(fig, path, plt))  # type: ignore[assignment]
    try:
        assert plots.draw_run(tmp_path) == tmp_path / "run.png"
    finally:
        plots.save = real
    (fig,) = drawn
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0] == "loss" and "noise scale" in titles[1]
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["train (one batch)", "eval (held out)"]
