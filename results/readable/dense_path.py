"""How many lines of pegrad.py a reader follows for one dense layer (issue 57's measure).

½‖Wx + b − y‖² per example, statistics ("mean", "sq_mean", "sq_norms"), impl="factorized",
traced once under jit with sys.settrace on: every function of pegrad.py that runs, and the sum
of their bodies' lines (def to last line, docstring included, nested functions counted once
within the function that holds them). Prints the total, the count, and the largest.

    python results/readable/dense_path.py [--list]
"""

import argparse
import ast
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pegrad  # noqa: E402

SOURCE = os.path.abspath(pegrad.__file__)


def spans() -> dict[int, tuple[str, int, int]]:
    """First line of each function of pegrad.py (its first decorator's, as its code object
    has it) -> (name, first line, last line) of the outermost function that holds it."""
    with open(SOURCE) as f:
        tree = ast.parse(f.read())
    out: dict[int, tuple[str, int, int]] = {}

    def visit(node: ast.AST, outer: tuple[str, int, int] | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                first = min(
                    [child.lineno, *(d.lineno for d in getattr(child, "decorator_list", []))]
                )
                name = getattr(child, "name", "<lambda>")
                mine = outer or (name, first, child.end_lineno or child.lineno)
                out[first] = mine  # a decorated function's code starts at its decorator
                visit(child, mine)
            else:
                visit(child, outer)

    visit(tree, None)
    return out


def dense_path() -> dict[tuple[str, int, int], int]:
    """(name, first line, last line) -> lines, of every function of pegrad.py that one trace of
    the dense layer runs."""

    def loss_fn(p: dict, e: tuple) -> jax.Array:
        x, y = e
        r = p["w"] @ x + p["b"] - y
        return 0.5 * jnp.sum(r * r)

    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (3, 4)), "b": jnp.zeros(3)}
    batch = (jax.random.normal(key, (5, 4)), jax.random.normal(key, (5, 3)))
    fn = pegrad.value_and_grad_stats(loss_fn, ("mean", "sq_mean", "sq_norms"))
    table = spans()
    ran: set[tuple[str, int, int]] = set()

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and os.path.abspath(frame.f_code.co_filename) == SOURCE:
            span = table.get(frame.f_code.co_firstlineno)
            if span is not None:
                ran.add(span)
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        jax.jit(fn).trace(params, batch)
    finally:
        sys.settrace(previous)
    return {span: span[2] - span[1] + 1 for span in ran}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    lines = dense_path()
    print(f"{len(lines)} functions of pegrad.py, {sum(lines.values())} lines")
    if args.list:
        for (name, first, last), n in sorted(lines.items(), key=lambda kv: -kv[1]):
            print(f"{n:5d}  {name} (lines {first}-{last})")


if __name__ == "__main__":
    main()
