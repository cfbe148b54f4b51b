"""The package's structure as docs/design.md maps it: every module is in the map, and no import cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_pipe"


def modules() -> dict[str, Path]:
    """Dotted names below the package (``trace.tracer``) and their files; ``__init__`` files name their package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name:
            found[name] = path
    return found


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, wherever in the file (functions too), except under
    ``if TYPE_CHECKING:``, which never runs."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's own package upwards
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                stem = ".".join([*base, node.module] if node.module else base)
                base_name = f"lightning_pipe.{stem}" if stem else "lightning_pipe"
            else:
                base_name = node.module or ""
            targets.add(base_name)
            targets.update(f"{base_name}.{alias.name}" for alias in node.names)
    inside = {t.removeprefix("lightning_pipe.") for t in targets if t.startswith("lightning_pipe.")}
    return {t for t in inside if t in known and t != name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(path, name, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each once (depth-first search for back edges)."""
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_module_imports_a_module_that_imports_it():
    graph = import_graph()
    assert graph["strategy"], "the import graph found no imports at all: the parser is broken"
    assert not cycles(graph), "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles(graph))


def test_the_cycle_check_finds_a_cycle():
    graph = {"engine": {"stage"}, "stage": {"engine"}, "config": set()}
    assert cycles(graph) == [["engine", "stage", "engine"]]


def test_the_design_map_names_every_module_and_only_modules():
    design = (REPO / "docs" / "design.md").read_text()
    section = design.split("## The pieces", 1)[1].split("\n## ", 1)[0]
    first_column = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    mapped = {name for cell in first_column for name in re.findall(r"`([\w.]+)`", cell)}
    # A package's row lists its modules in parentheses: `trace` (package: `timeline`, `tracer`, ...).
    mapped |= {
        f"{package}.{module}"
        for cell in first_column
        for package, inner in re.findall(r"`(\w+)` \(package: ([^)]*)\)", cell)
        for module in re.findall(r"`(\w+)`", inner)
    }
    found = set(modules())
    assert not found - mapped, f"modules missing from docs/design.md's map: {sorted(found - mapped)}"
    submodules = {name.rpartition(".")[2] for name in found if "." in name}
    assert not mapped - found - submodules, f"the map names modules that do not exist: {sorted(mapped - found - submodules)}"
