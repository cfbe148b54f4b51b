"""The documentation's marked commands and snippets run as typed, its links resolve, and its index reaches every page.

A fenced block in README.md or docs/*.md runs when the line before its opening fence is the marker
``<!-- runnable -->``. Its kind decides how:

* ``bash``: the whole block runs in ``bash -e`` from a scratch directory that holds the repository's ``examples/``
  and ``conf/``, as a user in a checkout would type it. A long run gets its short variant from the marker:
  ``<!-- runnable: trainer.max_steps=2 -->`` appends those overrides to every ``python examples/train.py`` line
  (Hydra keeps the last value of a key given twice, so a marker may also replace one of the command's own).
* ``python`` whose first line starts with ``>>>``: a doctest, checked in this process (outputs compared).
* other ``python``: a script, written to a file and run with ``python`` (so Lightning's launcher can re-run it for
  every other rank, as it does for a user's script).

Install commands are never marked: they would reinstall the package the suite is testing.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from helpers.launch import started_together

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- runnable(?::\s*(?P<args>.*?))?\s*-->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
EXAMPLE_COMMAND = re.compile(r"^(\s*python examples/train\.py\b[^#\n]*?)(\s*(#.*)?)$", re.M)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    extra_args: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def marked_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` whose opening fence follows the runnable marker."""
    lines = page.read_text().splitlines()
    blocks = []
    for number, line in enumerate(lines):
        marker = MARKER.match(line.strip())
        if marker is None:
            continue
        fence = FENCE.match(lines[number + 1]) if number + 1 < len(lines) else None
        assert fence, f"{page.name}:{number + 1}: the runnable marker must be followed directly by a ``` fence"
        end = next(i for i in range(number + 2, len(lines)) if lines[i].startswith("```"))
        code = "\n".join(lines[number + 2 : end]) + "\n"
        blocks.append(Block(page, number + 2, fence["lang"], code, marker["args"] or ""))
    return blocks


BLOCKS = [block for page in PAGES for block in marked_blocks(page)]


def user_environment() -> dict[str, str]:
    """This checkout first on the path, and no rank variables (they would make a script think it is a child rank)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for variable in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    return env


def shortened(code: str, extra_args: str) -> str:
    """``code`` with ``extra_args`` appended to every ``python examples/train.py`` command (before its comment)."""
    if not extra_args:
        return code
    return EXAMPLE_COMMAND.sub(lambda m: f"{m[1].rstrip()} {extra_args}{m[2]}", code)


def checkout_like(directory: Path) -> Path:
    """A scratch directory where ``python examples/train.py`` works as in a checkout and writes nothing into it, with
    ``bin/lightning-pipe``: the console script as installing the package writes it (pyproject's ``[project.scripts]``),
    for this checkout's package."""
    for name in ("examples", "conf"):
        (directory / name).symlink_to(REPO / name)
    script = directory / "bin" / "lightning-pipe"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "from lightning_pipe.commands import main; main()" "$@"\n')
    script.chmod(0o755)
    return directory


def test_docs_mark_runnable_blocks_of_every_kind():
    """A broken marker must not make the check pass by finding nothing to run."""
    kinds = {(block.lang, block.code.lstrip().startswith(">>>")) for block in BLOCKS}
    assert {("bash", False), ("python", False), ("python", True)} <= kinds, f"marked blocks found: {BLOCKS}"
    for block in BLOCKS:
        assert block.lang in ("bash", "python"), f"{block.name}: cannot run a ```{block.lang} block"
        assert "pip install" not in block.code, f"{block.name}: an install command must not be marked runnable"


def run_block(block: Block, directory: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run a marked block that is a script or shell commands, as a user would, in a checkout-like ``directory``."""
    cwd = checkout_like(directory)
    if block.lang == "python":
        (cwd / "snippet.py").write_text(block.code)
        command = [sys.executable, "snippet.py"]
    else:
        command = ["bash", "-e", "-c", shortened(block.code, block.extra_args)]
    env = {**user_environment(), "PATH": os.pathsep.join([str(cwd / "bin"), os.environ.get("PATH", "")])}
    return command, subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def is_doctest(block: Block) -> bool:
    return block.lang == "python" and block.code.lstrip().startswith(">>>")


@pytest.fixture(scope="module", autouse=True)
def block_runs(request, tmp_path_factory) -> dict:
    """Every marked script and command, three at a time from the file's first test (each is mostly start-up and
    waits between the processes it starts)."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if item.module is request.module and "block" in getattr(getattr(item, "callspec", None), "params", ())]
    return started_together({block.name: partial(run_block, block, tmp_path_factory.mktemp("block"))
                             for block in selected if not is_doctest(block)}, at_most=3)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_marked_block_runs_as_documented(block: Block, block_runs):
    if is_doctest(block):
        test = doctest.DocTestParser().get_doctest(block.code, {}, block.name, str(block.page), block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        assert runner.failures == 0, f"{block.name}: the doctest's output differs from the page (see above)"
        return
    command, result = block_runs[block.name].result()
    assert result.returncode == 0, (
        f"{block.name} failed (exit {result.returncode}):\n{' '.join(command)}\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )


def test_short_variant_appends_overrides_before_the_comment():
    code = "python examples/train.py 'strategy.trace_steps=[20]'   # a trace\npython -m other x\n"
    assert shortened(code, "trainer.max_steps=2") == (
        "python examples/train.py 'strategy.trace_steps=[20]' trainer.max_steps=2   # a trace\npython -m other x\n"
    )


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_relative_links_reach_existing_pages_and_headings():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name} -> {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name} -> {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_index_reaches_every_page():
    index = (REPO / "docs" / "index.md").read_text()
    missing = [page.name for page in PAGES[1:] if page.name != "index.md" and f"]({page.name}" not in index]
    assert not missing, f"docs/index.md links none of {missing}"
    assert "](docs/index.md)" in (REPO / "README.md").read_text()


def test_no_table_appears_on_two_pages():
    """A table lives on one page; the others link to it. Two pages sharing a table row of real content is a copy."""
    seen: dict[str, str] = {}
    copies = []
    separator = set("|-: ")
    for page in PAGES:
        lines = [line.strip() for line in page.read_text().splitlines()] + [""]
        headers = {line for line, below in zip(lines, lines[1:]) if below.startswith("|") and set(below) <= separator}
        rows = {line for line in lines if line.startswith("|")} - headers
        for row in rows:
            if len(row) < 60 or set(row) <= separator:
                continue  # separators, headers and short rows say nothing on their own: two tables may share them
            if row in seen and seen[row] != page.name:
                copies.append(f"{seen[row]} and {page.name}: {row[:100]}")
            seen.setdefault(row, page.name)
    assert not copies, "\n".join(copies)


# The Llama-3-70B tables of the docs, each printed by the `plan` command shown above it: (page, the command's start).
PLAN_TABLES = [
    ("docs/memory.md", "lightning-pipe plan --layouts 8x8 16x4"),
    ("docs/guide.md", "python -m lightning_pipe.plan --transformers-config llama:hidden_size=8192"),
]


@pytest.mark.parametrize("page, command_start", PLAN_TABLES)
def test_a_plan_table_is_what_its_command_prints(page, command_start, capsys):
    from lightning_pipe.commands.plan import main as plan_command

    text = (REPO / page).read_text()
    command = text[text.index(command_start):]
    words = command[: command.index("```")].replace("\\\n", " ").split()
    table = text[text.index("| layout | data_parallel |", text.index(command_start)):]
    table = table[: min(table.index(end) for end in ("\n\n", "```") if end in table)].strip()
    plan_command(words[words.index(next(w for w in words if w.endswith("plan"))) + 1 :])
    assert table in capsys.readouterr().out
