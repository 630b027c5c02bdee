"""The public API is declared (issue 50): `__all__` in pegrad.py and optimizers.py lists it,
`from pegrad import *` brings exactly those names and no module of theirs (jax, numpy), and
every `pegrad.X` / `optimizers.X` the README, SPEC.md and DESIGN.md name is among them."""

import re
import types
from pathlib import Path

import pytest

import optimizers
import pegrad

REPO = Path(__file__).resolve().parent.parent
MODULES = {"pegrad": pegrad, "optimizers": optimizers}
SUBMODULES = ("models", "optimizers", "train", "plots")  # `python -m pegrad.plots`, installed


@pytest.mark.parametrize("name", sorted(MODULES))
def test_star_import_brings_exactly_the_public_api(name: str) -> None:
    module = MODULES[name]
    namespace: dict = {}
    exec(f"from {module.__name__} import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(module.__all__), set(namespace) ^ set(module.__all__)
    assert len(module.__all__) == len(set(module.__all__)), "a name listed twice"
    assert not [n for n, v in namespace.items() if isinstance(v, types.ModuleType)]
    assert not [n for n in module.__all__ if n.startswith("_")]


@pytest.mark.parametrize("doc", ["README.md", "SPEC.md", "DESIGN.md"])
def test_every_name_the_documents_use_is_public(doc: str) -> None:
    text = (REPO / doc).read_text(encoding="utf-8")
    for name, module in MODULES.items():
        used = set(re.findall(rf"\b{name}\.([A-Za-z_]\w*)", text)) - {"py", *SUBMODULES}
        assert used <= set(module.__all__), f"{doc}: {sorted(used - set(module.__all__))}"
