"""What users read names real code: every dotted ``planner.…`` path in the README, docs/, bench/, examples/
and the docstrings and comments of planner/ resolves, every repository file the README, docs/ and
bench/results/ name exists, and none of them narrates how the project got here.

Nothing here runs a model: dotted paths are resolved by ``importlib.util.find_spec`` on their longest module
prefix, then ``getattr`` for the rest. A failure lists every dangling name with its file and line.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PLANNER = ROOT / "planner"

DOTTED = re.compile(r"(?<![\w.])planner(?:\.[A-Za-z_]\w*)+")
"""A dotted path under the package: ``planner.rewrite.sac.is_single_op``, ``planner.PlanOptions``."""

FILE_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.*-]*[\w*]|[\w-]+\.(?:py|md|ipynb))(?![\w/])")
"""A path with a folder (``planner/rewrite/graph.py``, ``capture/aten.py``, ``bench/results/*.md``) or a bare
file name (``memory-model.md``, ``chains.py``)."""

TOP_FOLDERS = frozenset({".ci", "bench", "docs", "examples", "planner", "tests"})
USER_FILES = frozenset({
    "model.py", "out.py", "OUT.py", "llama_on_meta.py",  # a user's model file and output in CLI examples
    "profiles/mymodel-h100.json",  # where the README's user keeps a profile
})
"""Bare file names the docs use for the reader's own files, not the repository's."""

HISTORY = re.compile(r"\b(stops? [0-9]+|issue[s]? [0-9]+|until stop|sessions?\b|the issue.s)", re.IGNORECASE)
"""Words that narrate how the project got here rather than what it does (the grep of the docs' rule)."""


def _text_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in suffixes and "__pycache__" not in p.parts)


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(path.read_text(encoding="utf-8").splitlines(), 1)


def _source_text(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and string literal of a Python file (docstrings, messages)."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING) or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for offset, line in enumerate(token.string.split("\n")):
                yield token.start[0] + offset, line


def _dotted_names() -> Iterator[tuple[str, str]]:
    """(``file:line``, dotted name) for every ``planner.…`` path users and maintainers read."""
    for path in [*_docs(), *_text_files(ROOT / "bench", (".py", ".md")),
                 *_text_files(ROOT / "examples", (".py", ".ipynb"))]:
        for number, line in _lines(path):
            for match in DOTTED.finditer(line):
                yield f"{_relative(path)}:{number}", match.group(0)
    for path in _text_files(PLANNER, (".py",)):
        for number, line in _source_text(path):
            for match in DOTTED.finditer(line):
                yield f"{_relative(path)}:{number}", match.group(0)


def _has(owner: Any, name: str) -> bool:
    """An attribute, or a field a class declares without a class-level value (dataclass fields, annotations)."""
    if hasattr(owner, name):
        return True
    if isinstance(owner, type):
        if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
            return True
        return any(name in getattr(klass, "__annotations__", {}) for klass in owner.__mro__)
    return False


def _module_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, AttributeError, ValueError):  # a parent that is a module, not a package
        return None


def unresolved(dotted: str) -> str | None:
    """Why ``dotted`` names nothing, or None when it is a module or an attribute of one."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if _module_spec(".".join(parts[:end])) is None:
            continue
        owner: Any = importlib.import_module(".".join(parts[:end]))
        for depth, part in enumerate(parts[end:], end):
            if not _has(owner, part):
                return f"{'.'.join(parts[:depth])} has no attribute {part!r}"
            owner = getattr(owner, part, None)
        return None
    return "no such module"


def test_every_dotted_planner_path_resolves() -> None:
    verdicts: dict[str, str | None] = {}
    dangling = []
    for where, dotted in _dotted_names():
        if dotted not in verdicts:
            verdicts[dotted] = unresolved(dotted)
        if verdicts[dotted] is not None:
            dangling.append(f"{where}: {dotted} ({verdicts[dotted]})")
    assert not dangling, "dotted paths that name nothing:\n" + "\n".join(dangling)


def _file_exists(name: str, where: Path) -> bool:
    """Whether a path named in ``where`` exists: from the repository root, inside planner/ (``capture/aten.py``),
    beside ``where``, or (a bare file name) anywhere in the repository."""
    if name in USER_FILES:
        return True
    if "/" not in name:
        return any(ROOT.glob(name)) or any(
            any((ROOT / folder).rglob(name)) for folder in TOP_FOLDERS if (ROOT / folder).is_dir())
    first = name.split("/", 1)[0]
    if first in TOP_FOLDERS:
        return any(ROOT.glob(name.rstrip("/")))
    if (PLANNER / first).is_dir():
        return any(PLANNER.glob(name.rstrip("/")))
    return any(where.parent.glob(name.rstrip("/"))) if (where.parent / first).is_dir() else True  # not ours


def test_every_file_the_docs_name_exists() -> None:
    missing = []
    for path in [*_docs(), *_text_files(ROOT / "bench" / "results", (".md",))]:
        for number, line in _lines(path):
            for match in FILE_PATH.finditer(line):
                name = match.group(1)
                if not _file_exists(name, path):
                    missing.append(f"{_relative(path)}:{number}: {name}")
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)


def test_docs_state_the_product_not_its_history() -> None:
    found = [f"{_relative(path)}:{number}: {line.strip()}"
             for path in [*_docs(), *_text_files(ROOT / "bench", (".py", ".md", ".txt", ".json", ".csv"))]
             for number, line in _lines(path) if HISTORY.search(line)]
    assert not found, "lines that narrate history (state what the product does and what was measured):\n" + "\n".join(
        found)


def test_readme_lists_every_plan_option() -> None:
    from planner.options import PlanOptions

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = re.search(r"Every option \(([^)]*)\) is a\s+field of `planner\.PlanOptions`", readme)
    assert listed, "README.md no longer lists the options as 'Every option (...) is a field of planner.PlanOptions'"
    names = re.findall(r"`(\w+)`", listed.group(1))
    assert names == [f.name for f in dataclasses.fields(PlanOptions)], (
        "README.md's option list differs from PlanOptions' fields (same names, same order)")


def test_every_file_the_package_names_exists() -> None:
    """A file a docstring, comment or message of planner/ names (``switch.py``, ``capture/aten.py``,
    ``docs/limits.md``) exists: a bare module name beside the file or elsewhere in the package."""
    missing = []
    for path in _text_files(PLANNER, (".py",)):
        for number, line in _source_text(path):
            for match in FILE_PATH.finditer(line):
                name = match.group(1)
                if not name.endswith((".py", ".md")) or name in USER_FILES:
                    continue
                found = (any(PLANNER.rglob(name)) or any(ROOT.glob(name))) if "/" not in name else _file_exists(name,
                                                                                                                 path)
                if not found:
                    missing.append(f"{_relative(path)}:{number}: {name}")
    assert not missing, "files named in planner/ that do not exist:\n" + "\n".join(missing)
