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
