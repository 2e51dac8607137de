"""Plant listed mutations, one at a time, on a copy of the tree and run the tests named for each.

    .venv/bin/python scripts/mutate.py                 # every mutation in scripts/mutations.toml
    .venv/bin/python scripts/mutate.py budget-equality tool-call-without-arguments
    .venv/bin/python scripts/mutate.py --list
    .venv/bin/python scripts/mutate.py --baseline      # the tests on the unmutated copy first

A mutation is a file, an exact piece of its text (it must occur exactly once) and its replacement
(or lists of both: the texts it had as the code moved, the first found is planted), with the tests
meant to catch it (docs/testing.md, "Mutation checks"). The repository is never
touched: the tree (tracked and untracked files git does not ignore, as they are now, or a commit's
with --source) is copied to a temporary folder, and each mutation is planted there, its tests run
with this repository's virtual environment, and the file put back. A mutation is *caught* when its
tests fail (pytest exit 1), *survived* when they pass, *error* when pytest could not run them
(collection error, no tests, timeout), *stale* when its text is no longer in the file (the code
moved on: update the list). The exit status is 1 when any mutation survived or could not be run.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS = ROOT / "scripts" / "mutations.toml"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    # The texts it had over time, each with its replacement; the first one found is planted.
    originals: tuple[str, ...]
    replacements: tuple[str, ...]
    tests: tuple[str, ...]
    breaks: str


@dataclass(frozen=True)
class Outcome:
    mutation: Mutation
    verdict: str  # caught | survived | error | stale
    seconds: float
    detail: str = ""


def mutations_load(path: Path) -> list[Mutation]:
    with path.open("rb") as handle:
        entries = tomllib.load(handle)["mutation"]
    mutations = []
    for entry in entries:
        originals = [entry["original"]] if isinstance(entry["original"], str) else entry["original"]
        replacements = entry["replacement"]
        if isinstance(replacements, str):
            replacements = [replacements] * len(originals)
        if len(replacements) != len(originals):
            raise SystemExit(f"{path}: {entry['name']}: one replacement, or one for each original")
        mutations.append(Mutation(name=entry["name"], file=entry["file"], originals=tuple(originals),
                                  replacements=tuple(replacements), tests=tuple(entry["tests"]),
                                  breaks=entry["breaks"]))
    names = [mutation.name for mutation in mutations]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise SystemExit(f"{path}: mutation names must be unique; repeated: {', '.join(duplicates)}")
    return mutations


def tree_copy(destination: Path, source: str) -> None:
    """The tree into `destination`: the working tree's files git tracks or would track, or `source`'s
    (a commit) with --source. The venv is linked, not copied (its editable install points at this
    repository, but the copy's own packages come first on sys.path: it runs from the copy)."""
    if source == "worktree":
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, check=True, capture_output=True).stdout.decode()
        for relative in filter(None, listed.split("\0")):
            origin = ROOT / relative
            if not origin.is_file():  # deleted in the working tree, still in the index
                continue
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target, follow_symlinks=False)
    else:
        archive = subprocess.run(["git", "archive", "--format=tar", source], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(destination, filter="data")
    (destination / ".venv").symlink_to(ROOT / ".venv")


def bytecode_drop(path: Path) -> None:
    """Delete `path`'s cached bytecode: a file put back within the second its mutant was compiled,
    at the same size, would pass the cache's check (the source's mtime in seconds and its size) and
    the mutant would run on. The rest of the copy keeps its cache, so each run imports it quickly."""
    for cached in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
        cached.unlink()


def pytest_run(copy: Path, tests: tuple[str, ...], timeout_s: float, extra: list[str]) -> tuple[int | None, str]:
    """(pytest's exit status or None on timeout, its output's tail), run in the copy."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    command = [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               *extra, *tests]
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, output[-3000:]
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def mutation_check(copy: Path, mutation: Mutation, timeout_s: float, extra: list[str]) -> Outcome:
    path = copy / mutation.file
    text = path.read_text() if path.is_file() else ""
    counts = [text.count(original) for original in mutation.originals]
    if 1 not in counts:
        return Outcome(mutation, "stale", 0.0, f"no original text occurs exactly once in {mutation.file} "
                                               f"(occurrences: {counts})")
    found = counts.index(1)
    started = time.monotonic()
    bytecode_drop(path)
    path.write_text(text.replace(mutation.originals[found], mutation.replacements[found]))
    try:
        status, output = pytest_run(copy, mutation.tests, timeout_s, extra)
    finally:
        path.write_text(text)
        bytecode_drop(path)
    seconds = time.monotonic() - started
    last = output.strip().splitlines()[-1] if output.strip() else ""
    if status == 1:
        return Outcome(mutation, "caught", seconds, last)
    if status == 0:
        return Outcome(mutation, "survived", seconds, last)
    return Outcome(mutation, "error", seconds, f"pytest exit {status}: {output[-1500:]}")


def baseline_check(copy: Path, mutation: Mutation, timeout_s: float, extra: list[str]) -> str | None:
    """None when the mutation's tests pass on the unmutated copy, else why not."""
    status, output = pytest_run(copy, mutation.tests, timeout_s, extra)
    return None if status == 0 else f"pytest exit {status} without the mutation: {output[-1500:]}"


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutation | where | verdict | s | tests |", "| --- | --- | --- | --- | --- |"]
    for outcome in outcomes:
        mutation = outcome.mutation
        lines.append(f"| {mutation.name} | `{mutation.file}` | {outcome.verdict} | {outcome.seconds:.0f} | "
                     f"{', '.join(f'`{test}`' for test in mutation.tests)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to plant (default: all)")
    parser.add_argument("--file", type=Path, default=MUTATIONS, help="the list (default: scripts/mutations.toml)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--baseline", action="store_true",
                        help="run each mutation's tests on the unmutated copy first (they must pass)")
    parser.add_argument("--source", default="worktree",
                        help="'worktree' (the files as they are now, default) or a commit to copy")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run (default 900)")
    parser.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    parser.add_argument("--pytest-arg", action="append", default=[], help="passed to pytest (repeatable)")
    args = parser.parse_args(argv)

    mutations = mutations_load(args.file)
    if args.list:
        for mutation in mutations:
            print(f"{mutation.name}: {mutation.file}: {mutation.breaks}")
        return 0
    unknown = sorted(set(args.names) - {mutation.name for mutation in mutations})
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(unknown)}")
    chosen = [mutation for mutation in mutations if not args.names or mutation.name in args.names]

    copy = Path(tempfile.mkdtemp(prefix="loraplex-mutate-"))
    try:
        tree_copy(copy, args.source)
        print(f"copy of the tree ({args.source}) at {copy}", flush=True)
        outcomes = []
        for mutation in chosen:
            if args.baseline:
                failed = baseline_check(copy, mutation, args.timeout, args.pytest_arg)
                if failed is not None:
                    outcome = Outcome(mutation, "error", 0.0, failed)
                    outcomes.append(outcome)
                    print(f"{mutation.name}: baseline fails\n{failed}", flush=True)
                    continue
            outcome = mutation_check(copy, mutation, args.timeout, args.pytest_arg)
            outcomes.append(outcome)
            print(f"{mutation.name}: {outcome.verdict} ({outcome.seconds:.0f} s) {outcome.detail}", flush=True)
        print()
        print(table(outcomes))
    finally:
        if args.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)
    return 0 if all(outcome.verdict == "caught" for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
