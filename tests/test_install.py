"""The installed package (pyproject.toml, hatch_build.py): the wheel built from this checkout holds
one package, `pegrad` (pegrad.py its __init__; the other files of hatch_build.PACKAGE its
modules; py.typed) and nothing else, with the LICENSE; it, the editable wheel and the editable
install here report `pegrad.__version__`, pyproject's one source of the version; installed, a
user's own models.py, train.py and optimizers.py beside their script shadow none of them, and
`pegrad.train` trains. The editable wheel is a .pth importing one finder (no copies to go
stale) that exposes `pegrad` alone: each wheel installed into a fresh environment gives
`pegrad.plots`, `python -m pegrad.plots` and every module of PACKAGE from an unrelated directory,
and none of the checkout's other files (train, models, ...) by its own name. Built with
hatchling's PEP 517 hooks in a subprocess, nothing downloaded. The README's one import line,
`from pegrad import optimizers`, gives the repository's modules installed, editable or copied,
beside a user's own files of those names; pegrad.py copied alone says which file it lacks.
"""

import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import hatch_build
import pegrad

REPO = Path(__file__).resolve().parent.parent
# file in the repo -> its name in the package: hatch_build.PACKAGE, which must hold at least these
SHIPPED = {flat: path.removeprefix("pegrad/") for flat, path in hatch_build.PACKAGE.items()}
CORE = {"pegrad.py": "__init__.py", "models.py": "models.py", "optimizers.py": "optimizers.py",
        "train.py": "train.py", "trainkit.py": "trainkit.py", "plots.py": "plots.py",
        "py.typed": "py.typed"}  # fmt: skip
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


def record_is_complete(wheel: zipfile.ZipFile) -> None:
    """Every file of the wheel is in its RECORD with its sha256 and size (PEP 376, 427)."""
    rows = list(csv.reader(io.StringIO(wheel.read(DIST_INFO + "RECORD").decode())))
    listed = {row[0]: row[1:] for row in rows if row}
    assert sorted(listed) == sorted(wheel.namelist())
    for name, (digest, size) in listed.items():
        if name == DIST_INFO + "RECORD":
            assert (digest, size) == ("", "")
            continue
        data = wheel.read(name)
        want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, size) == (f"sha256={want}", str(len(data))), name


def test_wheel_is_one_package_named_pegrad(wheel: Path):
    assert CORE.items() <= SHIPPED.items()
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        package = sorted(n for n in names if not n.startswith(DIST_INFO))
        assert package == sorted(f"pegrad/{name}" for name in SHIPPED.values())
        for flat, name in SHIPPED.items():
            assert z.read(f"pegrad/{name}") == (REPO / flat).read_bytes(), name
        assert z.read(DIST_INFO + "licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        record_is_complete(z)
        headers = metadata(z)
    assert headers["Version"] == [pegrad.__version__]
    assert headers["License-Expression"] == ["Apache-2.0"]


@pytest.fixture(scope="module")
def editable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("build_editable", tmp_path_factory.mktemp("editable"))


def test_editable_wheel_is_one_import_of_its_finder(editable: Path):
    """No copies and no directory on sys.path: a .pth importing the finder hatch_build writes
    for this checkout, which maps `pegrad` and the modules of PACKAGE to the checkout's files."""
    with zipfile.ZipFile(editable) as z:
        names = [n for n in z.namelist() if not n.startswith(DIST_INFO)]
        assert names == ["_pegrad.pth", "_pegrad_editable.py"]
        assert z.read("_pegrad.pth").decode() == "import _pegrad_editable\n"
        assert z.read("_pegrad_editable.py").decode() == hatch_build.finder_source(str(REPO))
        record_is_complete(z)
        assert metadata(z)["Version"] == [pegrad.__version__]
    assert hatch_build.modules() == {
        "pegrad" if path == "pegrad/__init__.py" else path[:-3].replace("/", "."): flat
        for flat, path in hatch_build.PACKAGE.items()
        if path.endswith(".py")
    }


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


# A fresh environment holding one wheel, as pip installs it (a pure-Python wheel unpacked into
# site-packages, whose .pth files run at startup), with this environment's packages (jax, ...)
# on its path but none of its .pth files (an editable pegrad installed here stays out).
ISOLATED_SCRIPT = """
import importlib, importlib.metadata, importlib.util, json, sys
root, modules, others = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
import pegrad
assert pegrad.__file__.startswith(root) and hasattr(pegrad, "__path__"), pegrad.__file__
assert importlib.metadata.version("pegrad") == pegrad.__version__
assert pegrad.plots.__name__ == "pegrad.plots" and callable(pegrad.plots.main)
assert pegrad.train.models is pegrad.models and pegrad.train.optimizers is pegrad.optimizers
for name, file in modules.items():
    module = importlib.import_module(name)
    assert module.__file__.startswith(root) and module.__file__.endswith(file), module.__file__
for name in others:  # the checkout's other files, by their own names: not importable
    assert importlib.util.find_spec(name) is None, (name, importlib.util.find_spec(name))
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    raise AssertionError(f"import {name} succeeded")
print("ok")
"""


def _fresh_environment(base: Path, wheel: Path) -> Path:
    """A venv at `base`/env with `wheel` installed; returns its python."""
    env = base / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(purelib)
    ours = [p for p in site.getsitepackages() if os.path.isdir(p)]
    (purelib / "zz_this_environment.pth").write_text("".join(f"{p}\n" for p in ours))
    return env / "bin" / "python"


def _others() -> list[str]:
    """What a checkout on sys.path would expose: every module at its top but pegrad.py."""
    return sorted(p.stem for p in REPO.glob("*.py") if p.stem != "pegrad")


@pytest.mark.parametrize("kind", ["editable", "wheel"])
def test_an_install_exposes_pegrad_alone_and_runs_python_m_pegrad_plots(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
):
    """From an unrelated directory: `pegrad.plots`, every module of PACKAGE and `python -m
    pegrad.plots --help` work; `import train`, `import models` (any file of the checkout but
    pegrad.py) fail."""
    built: Path = request.getfixturevalue(kind)
    python = _fresh_environment(tmp_path, built)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    if kind == "editable":
        root = str(REPO)
        modules = hatch_build.modules()
    else:
        root = str(python.parent.parent)
        modules = {
            name: "__init__.py" if name == "pegrad" else f"{name.split('.')[-1]}.py"
            for name in hatch_build.modules()
        }
    args = [root, json.dumps(modules), json.dumps(_others())]

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), *argv], cwd=elsewhere, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip

    proc = run("-c", ISOLATED_SCRIPT, *args)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    proc = run("-m", "pegrad.plots", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr
