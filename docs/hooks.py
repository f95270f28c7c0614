"""mkdocs hooks: the pages the site builds from files outside docs/, and links for the paths the pages name.

- ``index.md`` is README.md, its ``docs/`` links made relative to the site.
- ``benchmarks/<name>.md`` is ``bench/results/<name>.md``, as the bench wrote it (its command on top), listed
  under "Benchmarks" in the navigation: a new result file is a new page, no copy by hand.
- A path in backticks that names a page (`` `docs/solver.md` ``, `` `memory-model.md` ``,
  `` `bench/results/hf.md` ``) becomes a link to it, so a renamed page fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FENCE = re.compile(r"^\s*(```|~~~)")
PAGE_PATH = re.compile(r"(?<!\[)`(docs/|bench/results/)?([\w-]+\.md)`")


def _results() -> list[Path]:
    return sorted(RESULTS.glob("*.md"))


def on_config(config):
    """Lists every bench result under the navigation's "Benchmarks" section, after its hand-written pages."""
    for item in config.nav or []:
        if isinstance(item, dict) and isinstance(item.get("Benchmarks"), list):
            item["Benchmarks"] += [{path.stem.replace("_", " "): f"benchmarks/{path.name}"} for path in _results()]
    return config


def on_files(files, config):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = re.sub(r"\]\(bench/results/", "](benchmarks/", re.sub(r"\]\(docs/", "](", readme))
    files.append(File.generated(config, "index.md", content=readme))
    for path in _results():
        files.append(File.generated(config, f"benchmarks/{path.name}", content=path.read_text(encoding="utf-8")))
    return files


def _target(folder: str | None, name: str, files) -> str | None:
    """The page a path in backticks names, as a path in the site's sources, or None when it names no page."""
    if folder == "bench/results/":
        uri = f"benchmarks/{name}"
    elif folder == "docs/" or folder is None:
        uri = name
    else:
        return None
    return uri if files.get_file_from_path(uri) is not None else None


def on_page_markdown(markdown, page, config, files):
    here = posixpath.dirname(page.file.src_uri)

    def link(match: re.Match) -> str:
        uri = _target(match.group(1), match.group(2), files)
        if uri is None or uri == page.file.src_uri:
            return match.group(0)
        return f"[{match.group(0)}]({posixpath.relpath(uri, here or '.')})"

    lines, in_fence = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
        lines.append(line if in_fence or FENCE.match(line) else PAGE_PATH.sub(link, line))
    return "\n".join(lines)
