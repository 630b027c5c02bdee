"""Is a change to experiments.py neutral? Every study at `--scale smoke`, before and after.

    python results/recheck/neutral.py DIR              # runs every study below into DIR/runs,
                                                       #   writes DIR/digest.json
    python results/recheck/neutral.py --compare A B    # two digests: identical, or what differs
    python results/recheck/neutral.py --compare results/recheck/neutral-digest.json DIR
                                                       # against the committed one (jax 0.10.2,
                                                       #   XLA:CPU)
    python results/recheck/neutral.py DIR --only critical-batch --only critical-batch-lm
                                                       # the studies a change touches (an
                                                       #   output directory's name below)
    python results/recheck/neutral.py --done DIR       # DIR/digest.json of the studies a run
                                                       #   into DIR has finished so far

Each study runs through experiments.py's command line, in its own fresh cache (nothing trained
before is reused), the protocols each exercised once: held-out (the default), fixed
(`--lrs-from` on unseen seeds), leave-one-seed-out, `--task lm`, `--noise-floor`. The digest
holds, per output file (summary.json, summary.md, summary.csv), its text with everything that
varies from run to run or with the commit removed: the command, the commit and whether the code
differed from it, the date, jax's version and the device, each run's code version and seconds,
timings (overhead's time ratios, vectorize's runs per hour), and the output directory (replaced
by `<OUT>`). What is left (every chosen lr, loss, verdict, fit, table row and sentence) must be
identical before and after a change that only moves code. results/recheck/neutral.md records the
commits compared and the outcome.
"""

import argparse
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# (name of the output directory, experiments.py arguments after the study's name); {R} is the
# directory of the runs, so a later study can read an earlier one's summary.
STUDIES: tuple[tuple[str, str, str], ...] = (
    ("sign", "sign", ""),
    ("sign-fixed", "sign", "--lrs-from {R}/sign/summary.json --seeds 7,8"),
    ("sign-loo", "sign", "--seeds 0-2"),
    ("precond", "precond", ""),
    (
        "noise-floor",
        "noise-floor",
        "--lrs-from {R}/precond/summary.json,{R}/sign/summary.json --seeds 2,3",
    ),
    ("sign-decided", "sign-decided", "--noise-floor {R}/noise-floor/summary.json"),
    ("msq", "msq", ""),
    ("clipping", "clipping", "--noise-floor {R}/noise-floor/summary.json"),
    ("batch-scaling", "batch-scaling", ""),
    ("batch-scaling-lm", "batch-scaling", "--task lm"),
    ("batch-scaling-loo", "batch-scaling", "--seeds 0-2"),
    ("critical-batch", "critical-batch", ""),
    ("critical-batch-lm", "critical-batch", "--task lm"),
    ("windows", "windows", ""),
    ("overhead", "overhead", ""),
    ("vectorize", "vectorize", ""),
)

# Keys whose values vary from run to run or with the commit (anywhere in a summary.json).
VARYING = {
    "command",
    "git_commit",
    "code_differs_from_commit",
    "date_utc",
    "jax",
    "device",
    "code",  # a run's code version, and the summary's record of them
    "seconds",
    "total_seconds",
    "time_ratio",
    "vectorized_seconds",
    "vectorized_runs_per_hour",
    "sequential_seconds_per_run",
    "sequential_runs_per_hour",
    "speedup",
}
CSV_VARYING = ("seconds", "code")
MD_VARYING = re.compile(r"^(Command: |Commit: |Code: |\*\*Mixes runs|\*\*Not this code)")
NO_MD = {"overhead", "vectorize"}  # their summary.md is a timing


def scrub(x: Any, out: str) -> Any:
    if isinstance(x, dict):
        return {k: scrub(v, out) for k, v in x.items() if k not in VARYING}
    if isinstance(x, list):
        return [scrub(v, out) for v in x]
    if isinstance(x, str):
        return x.replace(out, "<OUT>")
    return x


def normalised(path: Path, out: str, study: str) -> str | None:
    """The file's text without what varies (module docstring); None: not digested."""
    if path.name == "summary.json":
        return json.dumps(scrub(json.loads(path.read_text()), out), indent=1, sort_keys=True)
    if path.name == "summary.md" and study not in NO_MD:
        lines = path.read_text().replace(out, "<OUT>").splitlines()
        return "\n".join(x for x in lines if not MD_VARYING.match(x))
    if path.name == "summary.csv" and study not in NO_MD:
        rows = list(csv.DictReader(io.StringIO(path.read_text())))
        text = io.StringIO()
        for r in rows:
            for k in CSV_VARYING:
                r.pop(k, None)
            text.write(json.dumps(r, sort_keys=True) + "\n")
        return text.getvalue().replace(out, "<OUT>")
    return None


def run_all(dest: Path, only: list[str] | None = None) -> None:
    """Every study of STUDIES (or those `only` names, by output directory) into dest/runs; a
    study another reads (`{R}`) must be among them."""
    if only is not None and (unknown := set(only) - {name for name, _, _ in STUDIES}):
        sys.exit(f"--only: {sorted(unknown)} are not among {[name for name, _, _ in STUDIES]}")
    runs = dest / "runs"
    runs.mkdir(parents=True, exist_ok=False)  # fresh: every study trains from nothing
    digest: dict[str, Any] = {}
    texts = dest / "normalised"
    for out_name, study, args in STUDIES:
        if only is not None and out_name not in only:
            continue
        out = runs / out_name
        argv = [sys.executable, "experiments.py", study, "--scale", "smoke", "--out", str(out)]
        argv += args.format(R=runs).split()
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        print(f"{out_name}: rc {done.returncode} in {time.perf_counter() - t0:.0f}s", flush=True)
        if done.returncode != 0:
            sys.exit(f"{out_name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        for path in sorted(out.glob("summary.*")):
            text = normalised(path, str(runs), out_name)
            if text is None:
                continue
            key = f"{out_name}/{path.name}"
            digest[key] = hashlib.sha256(text.encode()).hexdigest()
            (texts / out_name).mkdir(parents=True, exist_ok=True)
            (texts / out_name / path.name).write_text(text)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    record = {
        "commit": head.stdout.strip(),
        **({} if only is None else {"only": only}),
        "uncommitted_changes": bool(dirty.stdout.strip()),
        "files": digest,
    }
    (dest / "digest.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(digest)} files digested: {dest / 'digest.json'}")


def digest_done(dest: Path) -> None:
    """DIR/digest.json from the studies a run into DIR has finished so far (DIR/normalised: each
    study's files are written there as it ends), marked as a subset (`only`) for --compare; the
    run's own digest.json, when it ends, replaces it."""
    texts, runs = dest / "normalised", dest / "runs"

    def finished(name: str) -> bool:  # every file it digests written (not one in the writing)
        wanted = [
            p.name
            for p in sorted((runs / name).glob("summary.*"))
            if normalised(p, str(runs), name) is not None
        ]
        return bool(wanted) and all((texts / name / w).exists() for w in wanted)

    done = [name for name, _, _ in STUDIES if (texts / name).is_dir() and finished(name)]
    digest = {
        f"{name}/{path.name}": hashlib.sha256(path.read_text().encode()).hexdigest()
        for name in done
        for path in sorted((texts / name).iterdir())
    }
    record = {"commit": None, "only": done, "partial": True, "files": digest}
    (dest / "digest.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(digest)} files of {len(done)} finished studies digested: {dest / 'digest.json'}")


def compare(a: Path, b: Path) -> int:
    """Two digests (each a run's DIR, or a digest's .json such as neutral-digest.json)."""
    da, db = (
        json.loads((p if p.suffix == ".json" else p / "digest.json").read_text()) for p in (a, b)
    )
    fa, fb = da["files"], db["files"]
    print(f"{a}: commit {da['commit']}; {b}: commit {db['commit']}")
    differ = sorted(k for k in fa.keys() & fb.keys() if fa[k] != fb[k])
    only = sorted(fa.keys() ^ fb.keys())
    if "only" in da or "only" in db:  # a subset run (--only): the files both hold
        print(f"a subset: comparing the {len(fa.keys() & fb.keys())} files both digests hold")
        only = []
    for k in differ:
        print(f"differs: {k} (diff {a}/normalised/{k} {b}/normalised/{k})")
    for k in only:
        print(f"in one only: {k}")
    print("identical" if not differ and not only else f"{len(differ) + len(only)} differ")
    return 1 if differ or only else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="DIR to run into, or two to compare")
    parser.add_argument("--compare", action="store_true", help="compare two digests")
    parser.add_argument(
        "--only", action="append", help="run this study (its output directory's name) alone"
    )
    parser.add_argument(
        "--done",
        action="store_true",
        help="digest what a run into DIR (still going, or stopped) has finished so far",
    )
    args = parser.parse_args()
    if args.done:
        if len(args.dirs) != 1:
            sys.exit("--done takes one directory")
        return digest_done(args.dirs[0].resolve())
    if args.compare:
        if len(args.dirs) != 2:
            sys.exit("--compare takes two directories")
        sys.exit(compare(*args.dirs))
    if len(args.dirs) != 1:
        sys.exit("give one directory to run into")
    run_all(args.dirs[0].resolve(), args.only)


if __name__ == "__main__":
    main()
