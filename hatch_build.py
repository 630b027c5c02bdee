"""hatchling's build hook for pyproject.toml: how the flat repo becomes one installed package.

The wheel holds one package, `pegrad`, and nothing else in site-packages: pegrad.py is its
`__init__` (so `import pegrad` means what it means in a checkout) and the other files of
PACKAGE below (models.py, optimizers.py, train.py and trainkit.py, its plumbing, plots.py,
...) are its modules (`from pegrad import models, optimizers, train`; `python -m
pegrad.train`, `python -m pegrad.plots`), so that a user's own models.py or train.py beside
their script never stands in for them;
`pegrad/py.typed` tells type checkers to read its annotations (PEP 561).

An editable install (`pip install -e .`) gets none of these copies, which would go stale, and
exposes the same one name: its `_pegrad.pth` imports `_pegrad_editable`, a finder written here
from PACKAGE, which maps `pegrad` to a package whose `__init__` is the checkout's pegrad.py and
whose modules are the checkout's files PACKAGE lists. Nothing else of the checkout (its
train.py, models.py, bench.py, tests) is importable by its own name. The finder runs before
sys.path's, so `python -m pegrad.plots` works from the checkout too; a different pegrad found
first on sys.path (another checkout, a user's own pegrad.py) is left to win, as it would over
an installed wheel. The tests need none of this: pytest puts the checkout on sys.path
(pyproject's `pythonpath`) and imports the flat modules. Both report the version
`pegrad.__version__` in pegrad.py, pyproject's one source ([tool.hatch.version]).
tests/test_install.py builds both wheels, installs each into a fresh environment and checks
them.
"""

import base64
import csv
import hashlib
import io
import os
import zipfile
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# file in the repo -> its path in the wheel
PACKAGE = {
    "pegrad.py": "pegrad/__init__.py",
    "models.py": "pegrad/models.py",
    "optimizers.py": "pegrad/optimizers.py",
    "train.py": "pegrad/train.py",
    "trainkit.py": "pegrad/trainkit.py",  # train.py's plumbing (flags, checkpoints, processes)
    "plots.py": "pegrad/plots.py",  # python -m pegrad.plots (matplotlib: the "plots" extra)
    "py.typed": "pegrad/py.typed",  # PEP 561: the package's annotations are for type checkers
}

FINDER_MODULE = "_pegrad_editable"  # the editable install's one other top-level name: private


def modules() -> dict[str, str]:
    """The package's modules, by the name they import as, and their files in the repo:
    {"pegrad": "pegrad.py", "pegrad.models": "models.py", ...}, from PACKAGE."""
    names = {}
    for repo_file, wheel_path in PACKAGE.items():
        if wheel_path.endswith(".py"):
            name = wheel_path[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            names[name] = repo_file
    return names


FINDER = '''"""pegrad's editable install, written by hatch_build.py: the name `pegrad` alone,
a package whose __init__ is the checkout's pegrad.py and whose modules are the checkout's files
below; nothing else of the checkout is importable."""

import importlib.machinery
import importlib.util
import os
import sys

ROOT = {root!r}
FILES = {files}


def _same(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


class PegradFinder:
    """Before sys.path's finders (so `pegrad` is a package in the checkout too); a different
    pegrad first on sys.path (another checkout, a user's file) wins, as over a wheel."""

    def find_spec(self, fullname, path=None, target=None):
        file = FILES.get(fullname)
        if file is None:
            return None
        origin, init = os.path.join(ROOT, file), os.path.join(ROOT, FILES["pegrad"])
        if fullname == "pegrad":
            first = importlib.machinery.PathFinder.find_spec(fullname)
            if first is not None and first.origin is not None and not _same(first.origin, init):
                return None
            spec = importlib.util.spec_from_file_location(
                fullname, origin, submodule_search_locations=[]
            )
            if spec is not None:  # a package searched by this finder alone, not the checkout
                spec.submodule_search_locations = []
            return spec
        parent = getattr(sys.modules.get("pegrad"), "__spec__", None)
        if parent is None or parent.origin is None or not _same(parent.origin, init):
            return None
        return importlib.util.spec_from_file_location(fullname, origin)


if not any(type(f).__name__ == "PegradFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, PegradFinder())
'''


def finder_source(root: str) -> str:
    """The editable install's finder for the checkout at `root`."""
    files = "".join(f"    {name!r}: {file!r},\n" for name, file in modules().items())
    return FINDER.format(root=os.path.normpath(root), files="{\n" + files + "}")


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def rewrite_wheel(wheel: str, files: dict[str, bytes]) -> None:
    """Put `files` (name -> content) in the wheel at `wheel`, in place of any of those names,
    before its .dist-info, and rewrite its RECORD (PEP 376/427: every file's hash and size)."""
    with zipfile.ZipFile(wheel) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    record, listed = next((i, d) for i, d in entries if i.filename.endswith(".dist-info/RECORD"))
    dist_info = record.filename.split("/")[0] + "/"
    rows = [
        row
        for row in csv.reader(io.StringIO(listed.decode()))
        if row and row[0] not in files and row[0] != record.filename
    ]
    kept = [(i, d) for i, d in entries if i.filename not in files and i != record]
    new = []
    for name, data in files.items():
        info = zipfile.ZipInfo(name, date_time=record.date_time)
        info.external_attr, info.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
        new.append((info, data))
        rows.append([name, _record_hash(data), str(len(data))])
    rows.append([record.filename, "", ""])
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    package = [e for e in kept if not e[0].filename.startswith(dist_info)]
    metadata = [e for e in kept if e[0].filename.startswith(dist_info)]
    tmp = wheel + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in [*package, *new, *metadata, (record, text.getvalue().encode())]:
            z.writestr(info, data)
    os.replace(tmp, wheel)


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "standard":
            build_data["force_include"].update(PACKAGE)

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        # hatchling's editable wheel (dev-mode-dirs) is a .pth naming the checkout, which would
        # put every file of it on sys.path: its .pth becomes one import of the finder instead.
        if self.target_name == "wheel" and version == "editable":
            pth = f"_{self.metadata.core.name.replace('-', '_')}.pth"
            rewrite_wheel(
                artifact_path,
                {
                    pth: f"import {FINDER_MODULE}\n".encode(),
                    f"{FINDER_MODULE}.py": finder_source(self.root).encode(),
                },
            )
