"""The README and ``docs/`` stay short, linked and free of history; their code parses.

The README is the front page (at most 250 lines; the reference is in ``docs/``, the history in
``CHANGELOG.md``), so neither it nor a docs page names a tracker issue or a date. Every
relative link resolves to a file, and a ``#fragment`` to a heading of it; every docs page is
linked from the README; every ``python`` block compiles. That each block also *runs* is
``tests/dist/test_docs_code.py``'s job, and that each ``syncline`` command runs,
``tests/dist/test_readme_commands.py``'s; both read the pages through :func:`code_blocks`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: the pages whose code blocks are run by tests: the README first, then docs/ in name order
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

_NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    """The fence's info string (``python``, ``bash``, ``console``, or empty)."""
    code: str
    not_run: str | None
    """The reason of a ``<!-- not run: reason -->`` comment right before the block."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order; an unclosed fence is an error."""
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    start: int | None = None
    for i, raw in enumerate(lines):
        if not raw.startswith("```"):
            continue
        if start is None:
            start = i
            continue
        before = next((x for x in reversed(lines[:start]) if x.strip()), "")
        note = _NOT_RUN.search(before)
        lang = lines[start].removeprefix("```").strip()
        code = "\n".join(lines[start + 1 : i]) + "\n"
        blocks.append(Block(page, start + 1, lang, code, note.group(1) if note else None))
        start = None
    assert start is None, f"{page.name}:{start + 1 if start is not None else 0}: unclosed fence"
    return blocks


def python_blocks() -> list[Block]:
    """Every ``python`` block of the README and docs/."""
    return [b for page in PAGES for b in code_blocks(page) if b.lang == "python"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _prose(page: Path) -> list[str]:
    """The lines of ``page`` outside its code blocks."""
    inside = False
    lines = []
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(page) if line.startswith("#")}


def test_pages_exist_and_readme_is_short() -> None:
    names = {p.name for p in PAGES}
    for topic in (
        "cli.md",
        "your-model-and-data.md",
        "data-parallelism.md",
        "pipelines.md",
        "checkpoints-and-failures.md",
        "planner.md",
        "large-batches.md",
        "extending.md",
        "benchmarks.md",
        "compatibility.md",
        "testing.md",
    ):
        assert topic in names, f"docs/{topic} is missing"
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move the detail to docs/ (at most 250)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_issue_numbers_or_dates(page: Path) -> None:
    """History (which issue, which day) belongs in CHANGELOG.md, not in the reference."""
    text = page.read_text()
    for pattern in (r"[Ii]ssues?\s*#?\s*[0-9]", r"20[0-9][0-9]-[0-9][0-9]"):
        hits = [line for line in text.splitlines() if re.search(pattern, line)]
        assert not hits, f"{page.name}: {hits}"


@pytest.mark.parametrize("page", [*PAGES, REPO / "CHANGELOG.md"], ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", "\n".join(_prose(page)))
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: link {link!r} names no file"
        if fragment and target.suffix == ".md":
            assert fragment in _anchors(target), f"{page.name}: {link!r}: no such heading"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    text = README.read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name}" not in text]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_python_blocks_compile_and_few_are_skipped() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 10, [b.where for b in blocks]
    for block in blocks:
        compile(block.code, block.where, "exec")
    skipped = [b.where for b in blocks if b.not_run is not None]
    assert all(b.not_run for b in blocks if b.not_run is not None), "a skip needs a reason"
    assert len(skipped) <= 2, f"keep '<!-- not run -->' rare: {skipped}"


def test_code_blocks_parse_as_written(tmp_path: Path) -> None:
    """The parser: fences, languages, the skip note right before a block, unclosed fences."""
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n<!-- not run: needs two nodes -->\n\n"
        "```bash\nsyncline train\n```\n```\nplain\n```\n"
    )
    blocks = code_blocks(page)
    assert [(b.line, b.lang, b.code, b.not_run) for b in blocks] == [
        (2, "python", "x = 1\n", None),
        (7, "bash", "syncline train\n", "needs two nodes"),
        (10, "", "plain\n", None),
    ]
    page.write_text("```python\nx = 1\n")
    with pytest.raises(AssertionError, match="unclosed fence"):
        code_blocks(page)
