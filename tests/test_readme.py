"""The README's Python code runs as written: every ```python block of README.md, in order, in one
namespace (a later block may use what an earlier one defined), under the suite's float64 and
strict dtype promotion (conftest)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_python_code():
    assert BLOCKS, "README.md has no ```python block: the Use section must show runnable code"


def test_readme_python_blocks_run_as_written():
    namespace: dict = {"__name__": "readme"}
    for number, block in enumerate(BLOCKS, start=1):
        code = compile(block, f"README.md python block {number}", "exec")
        exec(code, namespace)


def test_readme_adam_is_the_optax_call_it_names():
    """The README's "`adam` (= X)": optimizers.adam(lr) with its defaults equals the optax call X
    (lr as `lr`), bitwise at float64 over a few steps; a bare name is called with lr alone."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from pegrad import optimizers

    found = re.search(r"`adam` \(= `([^`]+)`", README.read_text(encoding="utf-8"))
    assert found, 'README.md: no "`adam` (= `...`)" claim'
    lr, named = 1e-2, found.group(1)
    call = named if "(" in named else f"{named}(lr)"
    params = {"w": jnp.linspace(-1.0, 2.0, 6).reshape(2, 3), "b": jnp.ones(3)}
    out = []
    for opt in (optimizers.adam(lr), eval(call, {"optax": optax, "lr": lr})):
        p, state = params, opt.init(params)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int count and floats
            for t in range(4):
                g = jax.tree.map(lambda x, t=t: jnp.sin((t + 1) * x) + 0.1, p)
                updates, state = opt.update(g, state, p)
                p = optax.apply_updates(p, updates)
        out.append(p)
    for a, b in zip(*(jax.tree.leaves(p) for p in out), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"optimizers.adam(lr) != {call}")


def test_the_cost_figure_reads_every_cell_of_the_readme_cost_table():
    """plots.py --costs draws results/figures/costs.png from the README's one cost table: every
    model and column parses to its time / memory ratios, measured on the CPU and estimated for the
    H200 side by side; the cells that read NaN are exactly those not run or not estimated (the
    MLP's vmap time, the H200 columns of the models the card's estimate left out, GPT-2 small's
    CPU columns), and nothing else."""
    import numpy as np

    import plots

    columns, rows, ratios = plots.cost_table(README.read_text(encoding="utf-8"))
    cpu = ["CPU factorized mean + sq_mean", "CPU vmap mean + sq_mean"]
    h200 = ["H200 est. factorized mean + sq_mean", "H200 est. vmap mean + sq_mean"]
    assert columns == cpu + h200 and len(rows) >= 10, (columns, rows)
    assert ratios.shape == (len(rows), len(columns), 2)
    mlp, gpt2 = "MLP 1024×3, B 128", "GPT-2 small (T 1024, B 8, tied head)"
    cpu_only = [mlp, "CNN (eqx Conv2d 3-64-64, 16×16)", "GRU in `lax.scan` (H 256, T 32)",
                "MoE, top-1 expert read as `experts[choice]`"]  # fmt: skip
    expected = {(mlp, cpu[1], 0)}
    expected |= {(row, column, k) for row in cpu_only for column in h200 for k in (0, 1)}
    expected |= {(gpt2, column, k) for column in cpu for k in (0, 1)}
    missing = {
        (rows[i], columns[j], k) for i, j, k in zip(*np.nonzero(np.isnan(ratios)), strict=True)
    }
    assert missing == expected, missing ^ expected
    assert np.all(ratios[~np.isnan(ratios)] > 0)


def test_the_readme_reads_in_five_minutes():
    """Issue 58: README.md is at most 150 lines, and its "## Use" section starts within the
    first 40 % of them (what and why, then the set-up, then straight to use)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md is {len(lines)} lines (at most 150)"
    use = lines.index("## Use") + 1  # its line number
    assert use <= 0.4 * len(lines), f'"## Use" is line {use} of {len(lines)} (after the first 40 %)'
