"""The installed package (pyproject.toml, hatch_build.py): the wheel built from this checkout holds
one package, `pegrad` (pegrad.py its __init__; models, optimizers, train its modules; py.typed)
and nothing else, with the LICENSE; it, the editable wheel and the editable install here report
`pegrad.__version__`, pyproject's one source of the version; installed, a user's own models.py,
train.py and optimizers.py beside their script shadow none of them, and `pegrad.train` trains;
the editable wheel is only the checkout on sys.path (no copies to go stale). Built with
hatchling's PEP 517 hooks in a subprocess, nothing downloaded. The README's one import line,
`from pegrad import optimizers`, gives the repository's modules installed, editable (the
checkout on sys.path) or copied, beside a user's own files of those names; pegrad.py copied
alone says which file it lacks.
"""

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pegrad

REPO = Path(__file__).resolve().parent.parent
MODULES = {"pegrad.py": "__init__.py", "models.py": "models.py",
           "optimizers.py": "optimizers.py", "train.py": "train.py",
           "trainkit.py": "trainkit.py", "plots.py": "plots.py"}  # fmt: skip
SHIPPED = {**MODULES, "py.typed": "py.typed"}  # PEP 561: type checkers read the annotations
DIST_INFO = f"pegrad-{pegrad.__version__}.dist-info/"


def metadata(wheel: zipfile.ZipFile) -> dict[str, list[str]]:
    """The wheel's METADATA headers, each name with all its values."""
    headers: dict[str, list[str]] = {}
    for line in wheel.read(DIST_INFO + "METADATA").decode().split("\n\n")[0].splitlines():
        name, _, value = line.partition(": ")
        headers.setdefault(name, []).append(value)
    return headers


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
        package = sorted(n for n in names if not n.startswith(DIST_INFO))
        assert package == sorted(f"pegrad/{name}" for name in SHIPPED.values())
        for flat, name in SHIPPED.items():
            assert z.read(f"pegrad/{name}") == (REPO / flat).read_bytes(), name
        assert z.read(DIST_INFO + "licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        headers = metadata(z)
    assert headers["Version"] == [pegrad.__version__]
    assert headers["License-Expression"] == ["Apache-2.0"]


def test_editable_wheel_is_the_checkout_on_sys_path(tmp_path: Path):
    editable = build("build_editable", tmp_path)
    with zipfile.ZipFile(editable) as z:
        names = [n for n in z.namelist() if not n.startswith(DIST_INFO)]
        assert names == ["_pegrad.pth"]
        assert z.read("_pegrad.pth").decode().strip() == str(REPO)
        assert metadata(z)["Version"] == [pegrad.__version__]


def test_the_editable_install_reports_the_version_of_pegrad_py():
    """`pip install -e .` (the README's and CI's command) of this checkout, where it is the one
    installed: importlib.metadata gives `pegrad.__version__`."""
    try:
        dist = importlib.metadata.distribution("pegrad")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pegrad is not installed in this environment")
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if url.get("url") != REPO.as_uri() or not url.get("dir_info", {}).get("editable"):
        pytest.skip(f"the pegrad installed here is not this checkout, editable: {url}")
    assert dist.version == pegrad.__version__, "installed before a version change: pip install -e ."


README = (REPO / "README.md").read_text(encoding="utf-8")
# What the README tells a user to type for the repository's modules, and a script that runs it
# (argv[1]: where pegrad is) in a directory holding the user's own models.py, optimizers.py and
# train.py: it gets the repository's, and the user's `import optimizers` still gets theirs.
IMPORTS = re.findall(r"^(?:from \S+ )?import .*\b(?:models|optimizers|train)\b.*$", README, re.M)
IMPORT_SCRIPT = """
import sys
import models as mine  # the user's own file, imported before pegrad's
from pegrad import models, optimizers, train  # the README's line, all three
import pegrad

for module in (pegrad, models, optimizers, train):
    assert module.__file__.startswith(sys.argv[1]), module.__file__
assert train.models is models and train.optimizers is optimizers
assert callable(pegrad.value_and_grad_stats) and callable(models.TransformerLM)
import jax.numpy as jnp
params, batch = {"w": jnp.ones(2)}, jnp.ones((2, 2))
opt = optimizers.micro_adam(0.1)
step = optimizers.make_train_step(lambda p, x: jnp.sum(p["w"] * x) ** 2, opt, impl="vmap")
assert step(params, opt.init(params), batch)[0]["w"].shape == (2,)
import optimizers as mine_too, train as mine_also  # the user's own files, after pegrad's
assert (mine.MINE, mine_too.MINE, mine_also.MINE) == ("models", "optimizers", "train")
"""
TRAIN = """
import importlib.metadata, json
assert importlib.metadata.version("pegrad") == pegrad.__version__, pegrad.__version__
cfg = train.Config(model="mlp", size="tiny", steps=2, eval_interval=2, out=sys.argv[2])
result = train.main(cfg)
print(json.dumps({"steps": result["steps"], "loss": result["loss"]}))
"""
USER_SCRIPT = IMPORT_SCRIPT + TRAIN


def _users_project(project: Path, script: str) -> None:
    """`project` holding the user's own models.py, optimizers.py, train.py and script.py."""
    project.mkdir()
    for name in ("models", "optimizers", "train"):
        (project / f"{name}.py").write_text(f"MINE = {name!r}\n")
    (project / "script.py").write_text(script)


def test_the_readme_imports_the_modules_through_pegrad():
    assert IMPORTS, "the README shows no import of models, optimizers or train"
    for line in IMPORTS:
        assert line.startswith("from pegrad import "), f"README: {line!r} (a user's file wins)"


def test_one_import_line_in_a_checkout_beside_a_users_own_files(tmp_path: Path):
    """The checkout on sys.path (an editable install), used from a directory that holds the
    user's own models.py, optimizers.py and train.py."""
    _users_project(tmp_path / "project", IMPORT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "script.py", str(REPO)],
        cwd=tmp_path / "project", env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_pegrad_copied_alone_names_the_file_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    shutil.copy(REPO / "pegrad.py", tmp_path / "pegrad.py")
    spec = importlib.util.spec_from_file_location("pegrad_alone", tmp_path / "pegrad.py")
    assert spec is not None and spec.loader is not None
    alone = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pegrad_alone", alone)  # its dataclasses look it up
    spec.loader.exec_module(alone)
    assert callable(alone.value_and_grad_stats)
    with pytest.raises(ImportError, match=re.escape(str(tmp_path / "optimizers.py"))):
        alone.optimizers  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        alone.nothing  # noqa: B018


def test_installed_modules_are_not_shadowed_by_a_users_own(wheel: Path, tmp_path: Path):
    """The wheel unpacked as site-packages (what pip installs of a pure-Python wheel), used from
    a directory that holds the user's own models.py, optimizers.py and train.py."""
    site, project = tmp_path / "site", tmp_path / "project"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    _users_project(project, USER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "script.py", str(site), str(project / "run")],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert '"steps": 2' in proc.stdout.splitlines()[-1]
    assert (project / "run" / "checkpoint.npz").exists()
