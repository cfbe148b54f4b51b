"""Runs the fast equivalence and parity tests against the boundary torch and Lightning releases and writes the
results table of docs/compatibility.md.

Each release set gets a fresh virtual environment: first the set's torch and Lightning (and pytorch-lightning, where the
set names it) are installed, as in a project that already has them; then this package is installed with
``pip install -e .[test]``, and its stack must come out unchanged (the same torch, Lightning, torchmetrics and
pytorch-lightning versions); then the tests below run. Too slow for CI: the registry's torch wheels are CUDA builds of
several GB (they run on the CPU); CI runs the whole suite on torch 2.13 CPU.

    python tests/compat/check_releases.py                 # every release set, one after another
    python tests/compat/check_releases.py --only newest   # one set; the table keeps the other rows as they were

pip runs as configured on the machine (its index, PIP_FIND_LINKS, ...): a pip configuration that caps torch below a
set's release makes that set fail to install; lift the cap for the run (e.g. PIP_CONFIG_FILE=/dev/null).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE_PAGE = ROOT / "docs" / "compatibility.md"
# Equivalence with one device, Lightning parity, and what leans on torch's and Lightning's internals the most:
# launchers and signals (test_reliability, test_launchers), distributed checkpoints (test_checkpoints).
# The standalone pytorch-lightning package, where a set installs one: test_pytorch_lightning.
TESTS = ["tests/test_equivalence.py", "tests/test_lightning_parity.py", "tests/test_microbatch.py",
         "tests/test_schedule.py", "tests/test_reliability.py", "tests/test_launchers.py", "tests/test_checkpoints.py",
         "tests/test_pytorch_lightning.py"]
STACK = ("torch", "lightning", "torchmetrics", "pytorch-lightning")
TABLE_START, TABLE_END = "<!-- results: start -->", "<!-- results: end -->"


@dataclass(frozen=True)
class ReleaseSet:
    name: str
    torch: str
    lightning: str
    # A set just below a declared bound shows that the bound is where it is: it must FAIL some test. Its stack cannot
    # come from pyproject.toml (pip would replace it), so the package goes in with --no-deps, its other needs after.
    below_range: bool = False
    # What such an old release needs beside it to import at all in today's environment.
    also: tuple[str, ...] = ()
    # The standalone package (`import pytorch_lightning`) installed beside lightning, at this release.
    pytorch_lightning: str | None = None


# The bounds declared in pyproject.toml, each met by at least one set. torch==2.13.0 is the CPU build wherever pip
# finds it (as CI installs it); the registry's other releases are CUDA builds.
RELEASE_SETS = [
    ReleaseSet("ci-cpu", torch="2.13.0", lightning="2.6.6"),
    ReleaseSet("newest", torch="2.15.0", lightning="2.6.6"),
    ReleaseSet("lowest-torch", torch="2.10.0", lightning="2.6.6"),
    ReleaseSet("lowest-lightning", torch="2.15.0", lightning="2.4.0"),
    ReleaseSet("lowest-both", torch="2.10.0", lightning="2.4.0"),
    ReleaseSet("lightning-2.5-latest", torch="2.13.0", lightning="2.5.6"),
    # A project that imports the standalone pytorch_lightning: its lowest and newest releases in the range, each beside
    # the lightning of the same release (lightning requires pytorch-lightning unpinned: pip would take the newest).
    ReleaseSet("pytorch-lightning-lowest", torch="2.13.0", lightning="2.4.0", pytorch_lightning="2.4.0"),
    ReleaseSet("pytorch-lightning-newest", torch="2.13.0", lightning="2.6.6", pytorch_lightning="2.6.6"),
    ReleaseSet("below-torch", torch="2.9.1", lightning="2.6.6", below_range=True),
    # Lightning 2.3 imports pkg_resources, which setuptools 81 and newer no longer have.
    ReleaseSet("below-lightning", torch="2.13.0", lightning="2.3.3", below_range=True, also=("setuptools<81",)),
    # pytorch-lightning just below the range, beside a lightning in it: the strategy must refuse it by name.
    ReleaseSet("below-pytorch-lightning", torch="2.13.0", lightning="2.6.6", pytorch_lightning="2.3.3",
               below_range=True, also=("setuptools<81",)),
]


def run(command: list[str], log, **kwargs) -> subprocess.CompletedProcess:
    log.write(f"\n$ {' '.join(command)}\n")
    log.flush()
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    log.write(result.stdout)
    log.flush()
    return result


def installed_versions(python: Path) -> dict[str, str]:
    """The installed release of each package of the stack; ``-`` for one that is not installed."""
    script = (
        "import importlib.metadata as m\nfor name in %r:\n    try:\n        print(name, m.version(name))\n"
        "    except m.PackageNotFoundError:\n        print(name, '-')"
    ) % (STACK,)
    output = subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True).stdout
    return dict(line.split() for line in output.splitlines())


def pytest_counts(pytest_output: str) -> dict[str, int]:
    """The counts of pytest's closing line (`3 failed, 69 passed, 12 warnings in 140.2s`)."""
    closing = pytest_output.strip().splitlines()[-1] if pytest_output.strip() else ""
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", closing)}
    counts["failed"] = counts.get("failed", 0) + counts.pop("error", 0) + counts.pop("errors", 0)
    return counts


def needs_beside_the_stack() -> list[str]:
    """What ``pip install -e .[test]`` asks for besides torch, Lightning and pytorch-lightning (for the sets below the
    range: pip would replace their release of one of them)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needs = project["dependencies"] + project["optional-dependencies"]["test"]
    stack = ("torch", "lightning", "pytorch-lightning")
    return [need for need in needs if re.match(r"[\w-]+", need).group() not in stack]


def tested_commit() -> str:
    """The commit the tests ran on, ``+changes`` if tracked files differ from it (this script's table aside)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){TABLE_PAGE.relative_to(ROOT)}")
    return (git("rev-parse", "--short", "HEAD") or "?") + ("+changes" if changes else "")


def check(release: ReleaseSet, envs: Path, keep: bool) -> dict[str, str]:
    """One table row: what pip installed, whether installing this package kept it, and what the tests did."""
    venv = envs / release.name
    shutil.rmtree(venv, ignore_errors=True)
    try:
        with open(envs / f"{release.name}.log", "w") as log:
            print(f"[{release.name}] building {venv} (log: {log.name})", flush=True)
            row = check_in(venv, release, log)
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    print(f"[{release.name}] {row['passed']} passed, {row['failed']} failed", flush=True)
    return row


def check_in(venv: Path, release: ReleaseSet, log) -> dict[str, str]:
    row = {"set": release.name, "date": datetime.date.today().isoformat(), "commit": tested_commit()}
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install"]
    standalone = [f"pytorch-lightning=={release.pytorch_lightning}"] if release.pytorch_lightning else []
    stack = run(pip + [f"torch=={release.torch}", f"lightning=={release.lightning}", *standalone, *release.also], log,
                env=environment)
    if stack.returncode != 0:
        return row | {"installed": "install failed, see the log", "kept": "-", "passed": "0", "failed": "-"}
    before = installed_versions(python)
    if release.below_range:
        package = run(pip + ["--no-deps", "-e", str(ROOT)], log, env=environment)
        package = run(pip + needs_beside_the_stack(), log, env=environment) if package.returncode == 0 else package
    else:
        package = run(pip + ["-e", f"{ROOT}[test]"], log, env=environment)
    after = installed_versions(python)
    changed = [f"{name} {before[name]} → {after[name]}" for name in STACK if before[name] != after[name]]
    row["installed"] = ", ".join(f"{name} {after[name]}" for name in STACK if after[name] != "-")
    row["kept"] = "yes" if package.returncode == 0 and not changed else "NO: " + (", ".join(changed) or "failed")
    if release.below_range and row["kept"] == "yes":
        row["kept"] = "below the range: installed with --no-deps"
    print(f"[{release.name}] {row['installed']}; installing lightning-pipe kept them: {row['kept']}", flush=True)
    if release.pytorch_lightning:
        # tests/test_pytorch_lightning.py skips itself where pytorch_lightning does not import: in a set that installs
        # it, that is a failure, not a skip.
        imported = run([str(python), "-c", "import pytorch_lightning"], log, env=environment, cwd=ROOT)
        if imported.returncode != 0:
            return row | {"passed": "0", "failed": "- (import pytorch_lightning failed, see the log)"}
    start = time.monotonic()
    tests = run([str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow", *TESTS], log,
                env=environment, cwd=ROOT)
    counts = pytest_counts(tests.stdout)
    row |= {"passed": str(counts.get("passed", 0)), "failed": str(counts["failed"]),
            "minutes": f"{(time.monotonic() - start) / 60:.1f}"}
    if tests.returncode not in (0, 1):  # 1: some tests failed (counted); anything else: pytest itself failed
        row["failed"] += f" (pytest exit {tests.returncode})"
    return row


def failed_tests(row: dict[str, str]) -> int:
    """The number in the row's "failed" cell ("2", "0 (pytest exit 4)"); 0 when nothing ran ("-")."""
    number = re.match(r"\d+", row["failed"])
    return int(number.group()) if number else 0


COLUMNS = [("set", "Release set"), ("installed", "Installed (pip)"), ("kept", "Installing lightning-pipe kept them"),
           ("passed", "Passed"), ("failed", "Failed"), ("minutes", "Test minutes"), ("date", "Date"),
           ("commit", "Commit")]


def read_rows(page: str) -> dict[str, dict[str, str]]:
    rows = {}
    for line in page.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == len(COLUMNS) and cells[0] in {r.name for r in RELEASE_SETS}:
            rows[cells[0]] = dict(zip((key for key, _ in COLUMNS), cells))
    return rows


def write_table(new_rows: list[dict[str, str]]) -> None:
    """Replaces the rows of the sets just checked in the page's table; the other rows stay as they were."""
    page = TABLE_PAGE.read_text()
    rows = read_rows(page) | {row["set"]: row for row in new_rows}
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(rows[r.name].get(key, "") for key, _ in COLUMNS) + " |"
              for r in RELEASE_SETS if r.name in rows]
    head, rest = page.split(TABLE_START)
    _, tail = rest.split(TABLE_END)
    TABLE_PAGE.write_text(head + TABLE_START + "\n" + "\n".join(lines) + "\n" + TABLE_END + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="release sets to check (default: all)")
    parser.add_argument("--envs", type=Path, default=ROOT / "build" / "compat-envs",
                        help="where the virtual environments and their logs go (default: build/compat-envs)")
    parser.add_argument("--keep", action="store_true", help="keep the environments (each takes up to 6 GB)")
    args = parser.parse_args()
    names = {r.name for r in RELEASE_SETS}
    unknown = set(args.only or ()) - names
    if unknown:
        parser.error(f"unknown release set(s) {sorted(unknown)}; the sets are {sorted(names)}")
    args.envs.mkdir(parents=True, exist_ok=True)
    rows = [check(r, args.envs, args.keep) for r in RELEASE_SETS if not args.only or r.name in args.only]
    write_table(rows)
    below = {r.name for r in RELEASE_SETS if r.below_range}
    failing = [row["set"] for row in rows if row["set"] not in below and (row["kept"], row["failed"]) != ("yes", "0")]
    # A set below the range must fail some test; if it passes, the bound may move (widen pyproject.toml, add a set).
    not_failing = [row["set"] for row in rows if row["set"] in below and failed_tests(row) == 0]
    print(f"{TABLE_PAGE.relative_to(ROOT)} updated; in the range: "
          f"{'every set passed' if not failing else 'FAILED: ' + ', '.join(failing)}; below it: "
          f"{'every set failed, as it must' if not not_failing else 'NOT FAILING: ' + ', '.join(not_failing)}")
    return 0 if not failing and not not_failing else 1


if __name__ == "__main__":
    sys.exit(main())
