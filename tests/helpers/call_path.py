"""The package's call path through one step, recorded from a real run, and docs/architecture.md's walk checked on it.

:class:`CallRecorder` (a ``sys.setprofile`` function) records every call into ``lightning_pipe``, each under the
nearest ``lightning_pipe`` frame that called it (the user's code and torch's in between are left out). The record is
a list of nodes ``[parent index or -1, "lightning_pipe/file.py:Qualified.name"]``, in call order.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_pipe"

Node = tuple[int, str]  # (parent index, or -1 for a call from outside the package; "path:qualname")


class CallRecorder:
    """A ``sys.setprofile`` function recording the calls into files under ``root`` (by default this tree's package)."""

    def __init__(self, root: Path = PACKAGE) -> None:
        self.root = str(root)
        self.base = str(root.parent) + "/"
        self.nodes: list[list[Any]] = []
        self._open: dict[Any, int] = {}  # a live frame of the package -> its node

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if not code.co_filename.startswith(self.root):
                return
            caller = frame.f_back
            while caller is not None and caller not in self._open:
                caller = caller.f_back
            parent = self._open[caller] if caller is not None else -1
            self._open[frame] = len(self.nodes)
            self.nodes.append([parent, f"{code.co_filename.removeprefix(self.base)}:{code.co_qualname}"])
        elif event == "return":
            self._open.pop(frame, None)


@dataclass
class Tree:
    """A call tree, with the calls of the same function under the same caller merged: the path a reader follows,
    once, however many micro-batches took it."""

    name: str
    children: dict[str, Tree] = field(default_factory=dict)

    @classmethod
    def of(cls, nodes: list[Node], root_name: str) -> Tree:
        """The merged tree under the first recorded call of ``root_name``."""
        trees: dict[int, Tree] = {}
        root: Tree | None = None
        for index, (parent, name) in enumerate(nodes):
            if root is None and name == root_name:
                root = trees[index] = Tree(name)
            elif parent in trees:
                trees[index] = trees[parent].children.setdefault(name, Tree(name))
        assert root is not None, f"no call of {root_name} recorded"
        return root

    def file(self) -> str:
        return self.name.partition(":")[0]

    def walk(self) -> list[tuple[Tree, Tree | None]]:
        """Every (node, its parent) below and including this one, depth first."""
        found: list[tuple[Tree, Tree | None]] = [(self, None)]
        for child in self.children.values():
            found += [(node, parent if parent is not None else self) for node, parent in child.walk()]
        return found

    def hops(self) -> int:
        """The calls from one file into another along the merged tree."""
        return sum(1 for node, parent in self.walk() if parent is not None and parent.file() != node.file())

    def entries(self) -> Counter[str]:
        """How many times the merged tree enters each file from another."""
        return Counter(node.file() for node, parent in self.walk() if parent is None or parent.file() != node.file())


def documented_walks(architecture: str) -> dict[str, list[tuple[int, str]]]:
    """docs/architecture.md's walks of one step: ``{"gpipe, first stage": [(depth, "path:qualname"), ...]}``, from
    the section's ``text`` blocks, each opening with ``# <schedule>, <stage>``; depth is the indentation by two."""
    section = architecture.split("## One training step, walked through", 1)[1].split("\n## ", 1)[0]
    walks = {}
    for block in re.findall(r"```text\n(.*?)```", section, re.S):
        title, *lines = block.splitlines()
        walk = []
        for line in lines:
            found = re.match(r"^( *)(lightning_pipe/[\w/]+\.py:[\w.<>]+)", line)
            if found:
                walk.append((len(found.group(1)) // 2, found.group(2)))
        walks[title.lstrip("# ").strip()] = walk
    return walks


def missing_from(walk: list[tuple[int, str]], nodes: list[Node]) -> list[str]:
    """The documented lines the recorded calls do not show where the walk puts them: each line must be a call made
    (directly or through code the walk does not show) from inside the line above it at one depth less, after the
    line's documented elder siblings; a top-level line is any call of its function. Each line is matched to a call
    under which all its documented lines are found, if there is one."""
    children: dict[int, list[int]] = {}
    for index, (parent, _) in enumerate(nodes):
        children.setdefault(parent, []).append(index)

    def descendants(index: int) -> list[int]:
        found, stack = [], list(reversed(children.get(index, [])))
        while stack:
            node = stack.pop()
            found.append(node)
            stack += reversed(children.get(node, []))
        return found

    def subtrees(lines: list[tuple[int, str]]) -> list[tuple[str, list[tuple[int, str]]]]:
        """The lines at the first line's depth, each with the lines below it."""
        found: list[tuple[str, list[tuple[int, str]]]] = []
        for depth, name in lines:
            if depth == lines[0][0]:
                found.append((name, []))
            else:
                found[-1][1].append((depth, name))
        return found

    def unmatched(lines: list[tuple[int, str]], candidates: list[int]) -> list[str]:
        """The lines (siblings in order, with what is below them) not found among ``candidates`` (in call order)."""
        missing, floor = [], -1
        for name, below in subtrees(lines):
            best: tuple[int, list[str]] | None = None
            for node in (i for i in candidates if i > floor and nodes[i][1] == name):
                left = unmatched(below, descendants(node)) if below else []
                if best is None or len(left) < len(best[1]):
                    best = (node, left)
                if not left:
                    break
            if best is None:
                missing += [name] + [f"{n} (below {name})" for _, n in below]
                continue
            floor = best[0]
            missing += best[1]
        return missing

    everywhere = list(range(len(nodes)))
    return [name for top in subtrees(walk) for name in unmatched([(0, top[0]), *top[1]], everywhere)]


def walk_entries(walk: list[tuple[int, str]]) -> tuple[int, Counter[str]]:
    """A documented walk's hops (a line in another file than the line it is called from) and how many times it
    enters each file."""
    entries: Counter[str] = Counter()
    hops, stack = 0, []
    for depth, name in walk:
        del stack[depth:]
        file = name.partition(":")[0]
        if not stack or stack[-1] != file:
            entries[file] += 1
            hops += bool(stack)
        stack.append(file)
    return hops, entries
