"""studies: experiments.py's studies, one module each, and what they share (studies/protocol.py:
the selection protocol, the seeds, the lr grids, the verdicts, the summary files, the scales).

Adding a study is one file and one test: studies/NAME.py defines its settings dataclass and its
presets at every scale of protocol.SHARED, its runner (`run_NAME(ctx: Context) -> summary`),
its usage lines, and ends with its `register` call:

    register("name", run_name, order=..., usage=USAGE, presets=NAME)

`discover` imports every module of this folder (but protocol), so `python experiments.py name`,
`experiments.run("name", ...)`, experiments.SCALES and the usage text of `--help` find it; a
test that runs it at `--scale smoke` is its one test (tests/test_experiments.py checks that every
registered study has one, its usage line and its settings at every scale).
"""

import dataclasses
import importlib
import pkgutil
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from studies.protocol import SHARED, Context, Shared

# A study's choice among its presets at a scale by the task asked for (batch-scaling and
# critical-batch hold settings per task): (presets[scale], shared with --task applied, --task,
# scale) -> its settings; raises ValueError where it has none for that task.
Pick = Callable[[Any, Shared, str | None, str], Any]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered study: its name on the command line, its runner, its place in the list of
    studies (`order`: "all" runs them in it, --help lists them in it), its usage lines, its
    settings per scale (experiments.SCALES holds them; None: it has none of its own), whether it
    trains seeds (`seeded`: experiments.TRAINING), whether "all" runs it (`in_all`) and its
    choice among its settings by task (`pick`: experiments.study_settings applies it)."""

    name: str
    runner: Callable[[Context], dict[str, Any]]
    order: int
    usage: str
    presets: Mapping[str, Any] | None
    seeded: bool = True
    in_all: bool = True
    pick: Pick | None = None
    module: str = ""


REGISTRY: dict[str, Entry] = {}


def register(
    name: str,
    runner: Callable[[Context], dict[str, Any]],
    *,
    order: int,
    usage: str,
    presets: Mapping[str, Any] | None,
    seeded: bool = True,
    in_all: bool = True,
    pick: Pick | None = None,
) -> Entry:
    """Add study `name` (a module's last statement); a name or an order taken twice is an
    error."""
    if name in REGISTRY:
        raise ValueError(f"study {name!r} registered twice ({REGISTRY[name].module})")
    if taken := [e.name for e in REGISTRY.values() if e.order == order]:
        raise ValueError(f"study {name!r}: order {order} is {taken[0]!r}'s")
    entry = Entry(
        name,
        runner,
        order,
        textwrap.dedent(usage).strip("\n"),
        presets,
        seeded,
        in_all,
        pick,
        runner.__module__,
    )
    REGISTRY[name] = entry
    return entry


def modules() -> list[str]:
    """The study modules of this folder (every module but protocol and private ones)."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if m.name != "protocol" and not m.name.startswith("_")
    )


def discover() -> dict[str, Entry]:
    """Import every study module; the registered studies by name, in their order."""
    for m in modules():
        importlib.import_module(f"{__name__}.{m}")
    return dict(sorted(REGISTRY.items(), key=lambda kv: kv[1].order))


def scales(registry: Mapping[str, Entry]) -> dict[str, dict[str, Any]]:
    """`{scale: {study: settings}}`: per scale, what its studies share ("shared") and each
    study's presets there (noise-floor has none of its own: it measures the optimizers of sign
    and precond)."""
    return {
        scale: {
            "shared": shared,
            **{n: e.presets[scale] for n, e in registry.items() if e.presets is not None},
        }
        for scale, shared in SHARED.items()
    }
