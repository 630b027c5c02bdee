"""Did issue 58's split of experiments.py into studies/ only move code? Two checks, in seconds.

    python results/recheck/moved.py OLD   # OLD: a copy of c52b4fb (`git archive c52b4fb | tar
                                          #   -x -C OLD`); the new layout is this checkout's

1. Every top-level definition (function, class, assignment) of OLD/experiments.py against the one
   of the same name in experiments.py and studies/*.py: the same AST (ast.dump: the code, its
   docstring and defaults; not its comments or layout), or named as differing.
2. Every name a module of studies/ (or experiments.py) binds refers to the object its defining
   module defines under that name: the old file's one namespace, now spread over modules, binds
   each name to one thing (a module's own USAGE and pick_settings excepted).
"""

import ast
import importlib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OWN = {"USAGE", "pick_settings", "__all__"}  # each study module's own, or the re-export list


def tops(path: Path) -> dict[str, str]:
    """name -> ast.dump of the top-level statement defining it."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out[node.name] = ast.dump(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id: ast.dump(node) for t in targets if isinstance(t, ast.Name)}
    return out


def main() -> None:
    old = tops(Path(sys.argv[1]) / "experiments.py")
    new: dict[str, str] = {}
    for path in [ROOT / "experiments.py", *sorted((ROOT / "studies").glob("*.py"))]:
        if path.name == "__init__.py":  # the registry: new
            continue
        for name, dump in tops(path).items():
            if name in OWN:
                continue
            if name in new and path.name != "experiments.py":
                sys.exit(f"{name} defined twice (again in {path})")
            new.setdefault(name, dump)
    same = [k for k in old if new.get(k) == old[k]]
    print(f"{len(old)} top-level names in the old experiments.py: {len(same)} with the same AST")
    print("different:", [k for k in old if k in new and new[k] != old[k]])
    print("gone:", [k for k in old if k not in new], "new:", [k for k in new if k not in old])
    sys.path.insert(0, str(ROOT))
    import experiments
    import studies

    modules = [importlib.import_module(f"studies.{m}") for m in ["protocol", *studies.modules()]]
    defined: dict[str, Any] = {}
    for m in modules:
        assert m.__file__ is not None
        mine = set(tops(Path(m.__file__))) - OWN
        defined |= {k: v for k, v in vars(m).items() if k in mine}
    other = [
        (m.__name__, k)
        for m in [*modules, experiments]
        for k, v in vars(m).items()
        if k in defined and v is not defined[k]
    ]
    print("names bound to another object than their definition:", other)
    sys.exit(1 if other else 0)


if __name__ == "__main__":
    main()
