"""Docs that cannot drift: every ``python`` and ``bash`` block of README.md and docs/*.md runs here.

A page's blocks run in order in one namespace, as a reader runs them, in a fresh working directory (holding
``examples/``, a link to the repository's, and an empty ``profiles/``); ``bash`` blocks run there with this
environment's executables first on ``PATH``. A ``python`` block whose first line is ``# <name>.py`` is that file:
it is written there before it runs, so the commands after it find it.

A block that cannot run here has a comment on the line above its fence saying why::

    <!-- docs: skip needs a GPU -->

Reasons are for what a test machine lacks: a GPU, several processes, the network, minutes, the reader's own
files. Output is a ``text`` block. Running a page plans real (tiny) models, so each page is a ``slow`` test; the
checks of the pages' shape (languages, reasons, the README's commands, the benchmark index) are fast.
"""

from __future__ import annotations

import ast
import gc
import importlib
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash"}
LANGUAGES = RUN | {"text", "json", "toml", "yaml"}
"""The languages a fence may name: those that run, and those that are read (output, file formats)."""

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>.*)$")
SKIP = re.compile(r"^\s*<!--\s*docs:\s*skip\b(?P<reason>.*?)-->\s*$")
FILE_BLOCK = re.compile(r"^# (?P<name>[\w-]+\.py)\s*$")
README_LINES = 150
TEST_COMMAND = 'python -m pip install torch==2.13.0 && python -m pip install -e ".[test]" && python -m pytest -q'
MAIN_COMMAND = ("python -m pip install torch==2.13.0 && python -m pip install -e . && "
                "ckplan examples/gpt.py --budget 50%")


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    """One fenced block of a page."""

    page: Path
    line: int
    """Line of the fence's first code line, 1-based."""
    language: str
    code: str
    skip: str | None
    """Why it does not run ("" for a marker without a reason), or None when it runs."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, dedented to their fence, each with the skip marker on the line above."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if opening is None:
            number += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = number + 1
        while end < len(lines) and not re.match(rf"^ {{0,{indent + 3}}}{re.escape(fence)}\s*$", lines[end]):
            end += 1
        above = next((lines[i] for i in range(number - 1, -1, -1) if lines[i].strip()), "")
        marker = SKIP.match(above)
        code = "\n".join(line[indent:] if line.startswith(" " * indent) else line.lstrip()
                         for line in lines[number + 1:end])
        found.append(Block(page=page, line=number + 2, language=(opening["info"].split() or [""])[0], code=code,
                           skip=marker["reason"].strip() if marker else None))
        number = end + 1
    return found


def _runnable_pages() -> list[Path]:
    return [page for page in PAGES if any(b.language in RUN and b.skip is None for b in blocks(page))]


def test_every_fence_names_its_language() -> None:
    unnamed = [f"{b.where}: {b.language or '(none)'}" for page in PAGES for b in blocks(page)
               if b.language not in LANGUAGES]
    assert not unnamed, f"fences must name one of {sorted(LANGUAGES)} (output is text):\n" + "\n".join(unnamed)


def test_every_skipped_block_says_why() -> None:
    problems = [f"{b.where}: a skip marker without a reason" for page in PAGES for b in blocks(page) if b.skip == ""]
    problems += [f"{b.where}: a {b.language} block does not run anyway" for page in PAGES for b in blocks(page)
                 if b.skip and b.language not in RUN]
    fenced = {(page, b.line - 2) for page in PAGES for b in blocks(page)}
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if SKIP.match(line):
                below = next((i for i in range(number + 1, len(lines)) if lines[i].strip()), None)
                if (page, below) not in fenced:
                    problems.append(f"{page.relative_to(ROOT)}:{number + 1}: a skip marker above no fence")
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_front_page_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_LINES, f"README.md is over {README_LINES} lines: move detail to docs/"
    commands = [b.code.strip() for b in blocks(ROOT / "README.md") if b.language == "bash"]
    assert MAIN_COMMAND in commands and TEST_COMMAND in commands, commands


def test_ci_runs_the_readmes_test_command() -> None:
    """.ci/run runs the README's test command, its parts in order (with linters between install and tests)."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    install, pytest_call = TEST_COMMAND.rsplit(" && ", 1)
    assert install in ci and pytest_call in ci.split(install, 1)[1], "the README's test command is not in .ci/run"


def test_every_bench_result_has_its_benchmark_page() -> None:
    """docs/benchmarks.md names every table of bench/results (each is a page of the site, docs/hooks.py)."""
    index = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "bench" / "results").glob("*.md"))
               if f"`bench/results/{p.name}`" not in index]
    assert not missing, f"docs/benchmarks.md does not name: {missing}"


def test_the_api_reference_has_every_public_name() -> None:
    """docs/api.md renders every name ``from planner import ...`` gives, from its home module (mkdocstrings fails the
    build on a name that does not exist; this fails on one that is missing)."""
    import planner

    reference = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    errors = reference[reference.index("::: planner.errors"):]
    missing = [name for name, module in planner._PUBLIC.items()
               if f"::: {module}.{name}\n" not in reference and not (module == "planner.errors" and name in errors)]
    assert not missing, f"docs/api.md does not document: {missing}"


def _skipped_python() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.language == "python" and b.skip is not None]


@pytest.mark.slow
def test_skipped_python_blocks_parse_and_import_what_they_name() -> None:
    """A block that does not run still parses, and every name it imports from ckplan exists."""
    problems = []
    for block in _skipped_python():
        try:
            tree = ast.parse(block.code)
        except SyntaxError as error:
            problems.append(f"{block.where}: {error}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "planner":
                module = importlib.import_module(node.module or "")
                problems += [f"{block.where}: {node.module} has no {alias.name}" for alias in node.names
                             if not hasattr(module, alias.name)]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "planner":
                        importlib.import_module(alias.name)
    assert not problems, "\n".join(problems)


@pytest.fixture
def reader_dir(tmp_path, monkeypatch):
    """A working directory as a reader's clone has it, whose files are the test's own."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "profiles").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    gc.collect()
    gc.freeze()  # ckplan collects garbage around every profiled step: not the imports and pages before this one
    yield tmp_path
    gc.unfreeze()


def _run_python(block: Block, namespace: dict) -> None:
    named = FILE_BLOCK.match(block.code.splitlines()[0]) if block.code else None
    if named:
        Path(named["name"]).write_text(block.code + "\n", encoding="utf-8")
    code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
    try:
        exec(code, namespace)
    except Exception:
        pytest.fail(f"{block.where}: the block raised\n{traceback.format_exc()}", pytrace=False)


def _run_bash(block: Block) -> None:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], capture_output=True, text=True,
                            timeout=300)
    if result.returncode != 0:
        pytest.fail(f"{block.where}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}",
                    pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_page_runs(page: Path, reader_dir: Path) -> None:
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks(page):
        if block.skip is not None or block.language not in RUN:
            continue
        if block.language == "python":
            _run_python(block, namespace)
        else:
            _run_bash(block)
