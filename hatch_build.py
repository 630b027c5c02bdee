"""hatchling's build hook for pyproject.toml: how the flat repo becomes one installed package.

The wheel holds one package, `pegrad`, and nothing else in site-packages: pegrad.py is its
`__init__` (so `import pegrad` means what it means in a checkout) and models.py, optimizers.py,
train.py (with trainkit.py, its plumbing), plots.py are its modules (`from pegrad import
models, optimizers, train`; `python -m pegrad.train`, `python -m pegrad.plots`), so that a
user's own models.py or train.py beside their script never stands in for them;
`pegrad/py.typed` tells type checkers to read its annotations (PEP 561). An editable install
gets none of these copies, which would go stale: it puts the checkout itself on sys.path
(`dev-mode-dirs`), the flat modules the tests import, and the same `from pegrad import
optimizers` loads the file beside pegrad.py (pegrad's module `__getattr__`). Both report the
version `pegrad.__version__` in pegrad.py, pyproject's one source ([tool.hatch.version]).
tests/test_install.py builds the wheel and checks both.
"""

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


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "standard":
            build_data["force_include"].update(PACKAGE)
