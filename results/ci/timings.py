"""Where CI's time goes: a pytest plugin that shuffles the tests (seed 0, the same order on
every xdist worker) and appends each test's call time to a file as it ends, so that a run cut
short is still a fair sample of every file; `python results/ci/timings.py FILE` sums it up per
file, with each file's whole (its test count × the sample's mean) estimated.

    PYTHONPATH=results/ci python -m pytest -q -m "not fast" -p timings   # TIMINGS=/tmp/t.tsv
    python results/ci/timings.py /tmp/t.tsv
"""

import collections
import os
import random
import subprocess
import sys
import time

OUT = os.environ.get("TIMINGS", "/tmp/timings.tsv")


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ANN001
    random.Random(0).shuffle(items)


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001
    # on the controller only (xdist's workers report there too): one line per test
    if report.when == "call" and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(OUT, "a") as f:
            f.write(
                f"{time.time():.1f}\t{report.duration:.2f}\t{report.outcome}\t{report.nodeid}\n"
            )


def main() -> None:
    with open(sys.argv[1]) as f:
        rows = [line.rstrip("\n").split("\t") for line in f]
    seen: dict[str, float] = {}
    for _, seconds, _, node in rows:
        seen[node] = float(seconds)
    counts = collections.Counter(
        line.split("::")[0]
        for line in subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "not fast", "--collect-only", "-n", "0"],
            capture_output=True, text=True,
        ).stdout.splitlines()
        if "::" in line
    )  # fmt: skip
    files: dict[str, list[float]] = collections.defaultdict(list)
    for node, seconds in seen.items():
        files[node.split("::")[0]].append(seconds)
    total = 0.0
    print(f"{len(seen)} tests timed of {sum(counts.values())}")
    for name, times in sorted(
        files.items(), key=lambda kv: -sum(kv[1]) / len(kv[1]) * counts[kv[0]]
    ):
        whole = sum(times) / len(times) * counts[name]
        total += whole
        mean = sum(times) / len(times)
        print(
            f"{name:40s} {len(times):4d} of {counts[name]:4d}  mean {mean:6.1f} s  ≈ {whole:7.0f} s"
        )
    print(f"all ≈ {total:.0f} s of test time (2 workers: ≈ {total / 2 / 60:.0f} min)")


if __name__ == "__main__":
    main()
