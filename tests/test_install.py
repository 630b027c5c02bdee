"""The installed package (pyproject.toml, hatch_build.py): the wheel built from this checkout holds
one package, `pegrad` (pegrad.py its __init__; models, optimizers, train its modules) and nothing
else; installed, a user's own models.py, train.py and optimizers.py beside their script shadow
none of them, and `pegrad.train` trains; the editable wheel is only the checkout on sys.path (no
copies to go stale). Built with hatchling's PEP 517 hooks in a subprocess, nothing downloaded.
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODULES = {"pegrad.py": "__init__.py", "models.py": "models.py",
           "optimizers.py": "optimizers.py", "train.py": "train.py"}  # fmt: skip


def build(kind: str, out: Path) -> Path:
    """hatchling's `build_wheel` or `build_editable` (what pip calls) run in the checkout."""
    code = f"from hatchling.build import {kind}; print({kind}({str(out)!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("build_wheel", tmp_path_factory.mktemp("wheel"))


def test_wheel_is_one_package_named_pegrad(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        package = sorted(n for n in names if not n.startswith("pegrad-0.1.0.dist-info/"))
        assert package == sorted(f"pegrad/{name}" for name in MODULES.values())
        for flat, name in MODULES.items():
            assert z.read(f"pegrad/{name}") == (REPO / flat).read_bytes(), name


def test_editable_wheel_is_the_checkout_on_sys_path(tmp_path: Path):
    editable = build("build_editable", tmp_path)
    with zipfile.ZipFile(editable) as z:
        names = [n for n in z.namelist() if not n.startswith("pegrad-0.1.0.dist-info/")]
        assert names == ["_pegrad.pth"]
        assert z.read("_pegrad.pth").decode().strip() == str(REPO)


USER_SCRIPT = """
import json, sys

import models, optimizers, train  # the user's own files, beside this script
import pegrad
from pegrad import models as pegrad_models, optimizers as pegrad_optimizers, train as pegrad_train

assert (models.MINE, optimizers.MINE, train.MINE) == ("models", "optimizers", "train")
site = sys.argv[1]
for module in (pegrad, pegrad_models, pegrad_optimizers, pegrad_train):
    assert module.__file__.startswith(site), module.__file__
assert pegrad_train.models is pegrad_models and pegrad_train.optimizers is pegrad_optimizers
assert callable(pegrad.value_and_grad_stats)
cfg = pegrad_train.Config(model="mlp", size="tiny", steps=2, eval_interval=2, out=sys.argv[2])
result = pegrad_train.main(cfg)
print(json.dumps({"steps": result["steps"], "loss": result["loss"]}))
"""


def test_installed_modules_are_not_shadowed_by_a_users_own(wheel: Path, tmp_path: Path):
    """The wheel unpacked as site-packages (what pip installs of a pure-Python wheel), used from
    a directory that holds the user's own models.py, optimizers.py and train.py."""
    site, project = tmp_path / "site", tmp_path / "project"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    project.mkdir()
    for name in ("models", "optimizers", "train"):
        (project / f"{name}.py").write_text(f"MINE = {name!r}\n")
    (project / "script.py").write_text(USER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "script.py", str(site), str(project / "run")],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert '"steps": 2' in proc.stdout.splitlines()[-1]
    assert (project / "run" / "checkpoint.npz").exists()
