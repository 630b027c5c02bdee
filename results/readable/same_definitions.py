"""Is pegrad.py at one commit the other's definitions in another order? (issue 57's reorder)

Parses both files and compares the multiset of their top-level statements, each as its AST
with string annotations read as expressions ("Graph" and Graph are the same) and comments,
blank lines and positions left out. Equal: the module defines the same things the same way,
so every program traced through it is the same; only where a reader meets them moved.

    python results/readable/same_definitions.py REV_OR_FILE REV_OR_FILE
"""

import ast
import collections
import os
import subprocess
import sys


def source(where: str) -> str:
    if os.path.isfile(where):
        return open(where).read()
    return subprocess.run(
        ["git", "show", f"{where}:pegrad.py"], capture_output=True, text=True, check=True
    ).stdout


class _Annotations(ast.NodeTransformer):
    """String annotations parsed, so that quoting a forward reference changes nothing."""

    def _read(self, node: ast.expr | None) -> ast.expr | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return ast.parse(node.value, mode="eval").body
        return node

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = self._read(node.annotation)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = self._read(node.returns)
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AnnAssign:
        node.annotation = self._read(node.annotation) or node.annotation
        self.generic_visit(node)
        return node


def statements(text: str) -> collections.Counter:
    tree = _Annotations().visit(ast.parse(text))
    return collections.Counter(ast.dump(node) for node in tree.body)


def main() -> None:
    a, b = (statements(source(w)) for w in sys.argv[1:3])
    only_a, only_b = a - b, b - a
    print(
        f"{sum(a.values())} and {sum(b.values())} top-level statements; "
        f"{sum(only_a.values())} only in the first, {sum(only_b.values())} only in the second"
    )
    for dumped in [*only_a, *only_b]:
        print("  differs:", dumped[:160])
    sys.exit(1 if only_a or only_b else 0)


if __name__ == "__main__":
    main()
