"""The package's structure as docs/architecture.md draws it: layers that no import climbs, every module in the map,
no import cycle, files and classes a reader can hold in mind, and no module named like a well-known one."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import itertools
import json
import re
import sys
from pathlib import Path

import pytest

from helpers.call_path import documented_walks, missing_from, walk_entries
from helpers.launch import launch

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


ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_STRATEGY_LINES = 700, 450, 600
# Named like the standard library's ``trace``, kept: ``python -m lightning_pipe.trace`` is a command users call.
KEPT_NAMES = {"trace"}


def layers() -> dict[str, int]:
    """Each part's layer, from the table of docs/architecture.md: ``| 5 | `execution` | ...``."""
    rows = re.findall(r"^\| (\d+) \| `([\w.]+)` \|", ARCHITECTURE, re.M)
    return {part: int(layer) for layer, part in rows}


def part_of(module: str) -> str:
    """The part a module belongs to: its folder (``execution`` for ``execution.engine``), or itself at the top."""
    return module.split(".")[0] or "__init__"


def climbing_imports(graph: dict[str, set[str]], layer_of: dict[str, int]) -> list[str]:
    """Every import from a module to one in a higher layer, as ``importer (layer) -> imported (layer)``."""
    return [
        f"{module} (layer {layer_of[part_of(module)]}) -> {target} (layer {layer_of[part_of(target)]})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of[part_of(target)] > layer_of[part_of(module)]
    ]


def test_no_import_climbs_a_layer():
    graph, layer_of = import_graph(), layers()
    unplaced = sorted({part_of(module) for module in graph} - set(layer_of))
    assert not unplaced, f"parts with no layer in docs/architecture.md's table: {unplaced}"
    assert not climbing_imports(graph, layer_of), "imports that climb a layer:\n" + "\n".join(
        climbing_imports(graph, layer_of)
    )


def test_the_layer_check_finds_an_import_that_climbs():
    """Negative control: the schedules importing the engine is caught and named."""
    graph = {"schedules.actions": {"execution.engine"}, "execution.engine": {"schedules.actions"}}
    assert climbing_imports(graph, layers()) == ["schedules.actions (layer 1) -> execution.engine (layer 5)"]


def test_the_module_map_names_every_module_and_only_modules():
    section = ARCHITECTURE.split("## The modules", 1)[1].split("\n## ", 1)[0]
    first_column = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    mapped = {name for cell in first_column for name in re.findall(r"`([\w.]+)`", cell)}
    found = {name for name, path in modules().items() if path.name != "__init__.py"}
    assert not found - mapped, f"modules missing from docs/architecture.md's map: {sorted(found - mapped)}"
    assert not mapped - found, f"the map names modules that do not exist: {sorted(mapped - found)}"


def test_the_package_top_holds_at_most_six_modules():
    """The rest lives in folders by idea: a newcomer opening the package sees the strategy and what builds it."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 6, f"{len(top)} modules directly under lightning_pipe/: {top}"


def test_every_folder_says_what_it_holds_may_import_and_who_imports_it():
    for name, path in modules().items():
        if path.name == "__init__.py" and "." not in name:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "Holds" in doc and "May import" in doc and "mported by" in doc, f"{path}: docstring incomplete"


def test_no_file_or_class_is_too_long_to_hold_in_mind():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(REPO)
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{where}: {len(text.splitlines())} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                lines = node.end_lineno - node.lineno + 1
                too_long.append(f"{where}: class {node.name} {lines} lines (at most {MAX_CLASS_LINES})")
    strategy = len((PACKAGE / "strategy.py").read_text().splitlines())
    if strategy > MAX_STRATEGY_LINES:  # Lightning's hooks, each handing the work on: nothing more
        too_long.append(f"lightning_pipe/strategy.py: {strategy} lines (at most {MAX_STRATEGY_LINES})")
    assert not too_long, "\n".join(too_long)


def test_no_module_takes_the_name_of_a_standard_or_installed_package():
    """``lightning_pipe.hydra`` read as Hydra, ``profile`` as the standard library's profiler: a name says one thing."""
    taken = set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())
    clashing = sorted(
        name for name in modules() if name.rpartition(".")[2] in taken - KEPT_NAMES
    )
    assert not clashing, f"modules named like a standard or installed package: {clashing}"


WALK_SCHEDULES = ("gpipe", "1f1b")
# Recorded too: a stage holding two chunks, each run by its own calls of the user's step.
RECORDED_SCHEDULES = (*WALK_SCHEDULES, "interleaved_1f1b", "zbv")


@pytest.fixture(scope="module")
def recorded_steps(tmp_path_factory) -> Path:
    """Every call into the package in one training step, on each rank of a 2-stage fit per schedule."""
    out = tmp_path_factory.mktemp("walk")
    launch("step_walk_worker.py", {"out": str(out), "schedules": list(RECORDED_SCHEDULES)}, out)
    return out


def test_the_walks_through_a_step_are_the_recorded_calls(recorded_steps):
    """docs/architecture.md's walks (forward and backward, first stage and loss stage, gpipe and 1f1b) are what a
    real step calls, in that order; following the first stage's forward under gpipe enters no file more than twice."""
    walks = documented_walks(ARCHITECTURE)
    assert set(walks) == {f"{schedule}, {role}" for schedule in WALK_SCHEDULES for role in ("first stage", "loss stage")}
    for title, walk in walks.items():
        schedule, role = (part.strip() for part in title.split(","))
        records = [json.loads(path.read_text()) for path in sorted((recorded_steps / schedule).glob("rank*.json"))]
        record = next(r for r in records if r["loss_stage"] == (role == "loss stage"))
        assert len(walk) >= 15, f"{title}: the walk has {len(walk)} lines: the parser is broken"
        assert not missing_from(walk, record["nodes"]), f"{title}: not called where the walk says: " + ", ".join(
            missing_from(walk, record["nodes"])
        )
    forward = list(itertools.takewhile(lambda line: line[0] > 0, walks["gpipe, first stage"][1:]))
    _, entries = walk_entries(walks["gpipe, first stage"][:1] + forward)
    assert max(entries.values()) <= 2, f"files entered more than twice: {entries.most_common(3)}"


def test_a_warm_step_reads_no_call_stack(recorded_steps):
    """Whether the model calls a block under its own ``torch.utils.checkpoint`` is read from the call stack in the
    first steps only: a warm step (the third) searches no stack, on any stage, under any schedule, also where a
    stage's two chunks are called by separate runs of the user's step."""
    for schedule in RECORDED_SCHEDULES:
        records = sorted((recorded_steps / schedule).glob("rank*.json"))
        assert len(records) == 2, f"{schedule}: {len(records)} ranks recorded"
        for path in records:
            names = [name for _, name in json.loads(path.read_text())["nodes"]]
            assert any(name.endswith(":BlockCalls.model_call") for name in names), f"{schedule}: no block call recorded"
            searches = sum(name.endswith("block_calls.py:_model_checkpoint_phase") for name in names)
            assert searches == 0, f"{schedule}, {path.stem}: {searches} searches of the call stack in a warm step"


def test_the_walk_check_finds_a_call_that_is_not_where_the_walk_says():
    """Negative control: a line under the wrong caller, or out of order, is named."""
    nodes = [[-1, "a.py:step"], [0, "b.py:run"], [1, "c.py:chunk"], [0, "b.py:share"]]
    assert missing_from([(0, "a.py:step"), (1, "b.py:run"), (2, "c.py:chunk"), (1, "b.py:share")], nodes) == []
    assert missing_from([(0, "a.py:step"), (1, "b.py:share"), (2, "c.py:chunk")], nodes) == ["c.py:chunk"]
    assert missing_from([(0, "a.py:step"), (1, "b.py:share"), (1, "b.py:run")], nodes) == ["b.py:run"]
