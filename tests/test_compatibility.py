"""The declared torch and Lightning ranges, the release sets that tests/compat/check_releases.py runs, the results
table of docs/compatibility.md and what the README and the guide say: one story, checked here without installing
anything (the check itself takes an hour of downloads and tests; docs/compatibility.md says how to run it)."""

import ast
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from compat.check_releases import RELEASE_SETS, TABLE_PAGE, failed_tests, pytest_counts, read_rows
from lightning_pipe.integration.lightning_packages import LIGHTNING_RELEASES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "lightning")


def declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(line).name: Requirement(line) for line in project["dependencies"]}
    return {name: requirements[name] for name in PACKAGES}


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def release(release_set, package: str) -> str:
    return getattr(release_set, package)


def in_range_sets():
    return [s for s in RELEASE_SETS if not s.below_range]


def lower_bound(requirement: Requirement) -> Version:
    (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return Version(bound)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_in_range_set_is_declared_and_the_sets_reach_the_lower_bound(package):
    requirement = declared()[package]
    versions = [release(s, package) for s in in_range_sets()]
    assert all(requirement.specifier.contains(v) for v in versions), (requirement, versions)
    assert Version(min(versions, key=Version)) == lower_bound(requirement), (
        f"pyproject.toml declares {requirement}, but the lowest {package} the compatibility check runs is "
        f"{min(versions, key=Version)}: declare what was run, or add a set at the bound")


@pytest.mark.parametrize("package", PACKAGES)
def test_a_set_just_below_each_lower_bound_probes_it(package):
    """The lower bounds are found by running: the release below each one is in the check, and must fail there."""
    requirement = declared()[package]
    probes = [s for s in RELEASE_SETS if s.below_range and not requirement.specifier.contains(release(s, package))]
    assert probes, f"no release set below {requirement}"
    for probe in probes:
        others = [p for p in PACKAGES if p != package]
        assert all(declared()[p].specifier.contains(release(probe, p)) for p in others), probe


def test_results_table_has_every_set_with_its_expected_outcome():
    rows = read_rows(TABLE_PAGE.read_text())
    assert sorted(rows) == sorted(s.name for s in RELEASE_SETS), "run check_releases.py for the missing sets"
    for release_set in RELEASE_SETS:
        row = rows[release_set.name]
        assert row["date"] and row["commit"] and "+changes" not in row["commit"], row  # a result of committed code
        if release_set.below_range:
            assert failed_tests(row) > 0, f"{release_set.name} is below the range but failed nothing: {row}"
        else:
            assert (row["kept"], row["failed"]) == ("yes", "0") and int(row["passed"]) > 0, row


def tested_ranges_sentence() -> str:
    """How the README and the guide put the tested ranges: "torch 2.10 to 2.15 and Lightning 2.4 to 2.6"."""
    def span(package):
        versions = sorted((release(s, package) for s in in_range_sets()), key=Version)
        return f"{minor(versions[0])} to {minor(versions[-1])}"
    return f"torch {span('torch')} and Lightning {span('lightning')}"


@pytest.mark.parametrize("page", ["README.md", "docs/guide.md", "docs/compatibility.md"])
def test_pages_say_the_tested_ranges(page):
    text = re.sub(r"\s+", " ", (ROOT / page).read_text())
    assert tested_ranges_sentence() in text, f"{page} should say {tested_ranges_sentence()!r}"


def test_result_cells_are_read_from_pytest_closing_line():
    counts = pytest_counts("....\n2 failed, 131 passed, 64 deselected, 14 warnings in 186.76s (0:03:06)\n")
    assert (counts["passed"], counts["failed"]) == (131, 2)
    assert pytest_counts("ImportError\n1 error in 2.49s")["failed"] == 1
    assert failed_tests({"failed": "3 (pytest exit 4)"}) == 3 and failed_tests({"failed": "-"}) == 0


def private_names_imported_from_the_stack() -> set[str]:
    names = set()
    for path in (ROOT / "lightning_pipe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            stack = ("lightning", "torch", "pytorch_lightning", "lightning_fabric")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in stack:
                names |= {alias.name for alias in node.names if alias.name.startswith("_")}
    return names


def test_internals_the_package_imports_are_listed_for_the_next_release_check():
    page = (ROOT / "docs" / "compatibility.md").read_text()
    listed = set(re.findall(r"`\.?([A-Za-z_.]+)`", page.split("## What a new release can break")[1]))
    listed = {name.split(".")[-1] for name in listed}
    missing = private_names_imported_from_the_stack() - listed
    assert not missing, f"docs/compatibility.md's table of internals misses {sorted(missing)}"
    assert {"_WorkerOutput", "_destroy_dist_connection", "_BatchNorm"} <= private_names_imported_from_the_stack()


def test_the_pytorch_lightning_releases_accepted_are_the_lightning_releases_declared():
    """The standalone package is the same code under another name: the strategy takes it in lightning's range."""
    assert LIGHTNING_RELEASES == declared()["lightning"].specifier
