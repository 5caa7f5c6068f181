"""The documentation site: its reference pages match the code, its pages are readable in sections,
and it builds with --strict."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONCEPTS = DOCS / "concepts"
# A concept page longer than this needs sections, so the theme's table of contents shows them.
SECTIONED_ABOVE_WORDS = 400
# No paragraph may be a wall of text (issue 43: one paragraph of the prediction page had 957).
MAX_PARAGRAPH_WORDS = 300


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_reference_page_matches_the_code() -> None:
    stale = generator().stale_pages()
    assert stale == [], f"run scripts/docs_reference.py: {stale} are stale"


def test_a_stale_page_is_found(tmp_path: Path) -> None:
    docs = generator()
    shutil.copytree(docs.REFERENCE, tmp_path, dirs_exist_ok=True)
    page = tmp_path / "settings.md"
    page.write_text(page.read_text().replace("VRAMTUNE_PORT", "VRAMTUNE_PORT_OLD"))
    assert docs.stale_pages(tmp_path) == ["settings.md"]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "reference" / "study-file" / "index.html").exists()


def _is_fence(line: str) -> bool:
    return line.lstrip().startswith(("```", "~~~"))


def paragraphs(text: str) -> list[str]:
    """The text between blank lines, leaving out fenced code blocks, table rows and indented
    code blocks (a block whose first line is indented four spaces). A list whose items are not
    separated by blank lines is one paragraph, as its source reads."""
    found: list[str] = []
    block: list[str] = []
    in_fence = False
    for line in [*text.splitlines(), ""]:
        if _is_fence(line):
            in_fence = not in_fence
            line = ""  # a fence ends the paragraph before it
        elif in_fence:
            continue
        if not line.strip():
            if block and not block[0].startswith(("    ", "\t")):
                found.append(" ".join(part.strip() for part in block))
            block = []
        elif not line.lstrip().startswith("|"):
            block.append(line)
    return found


def section_headings(text: str) -> list[str]:
    """The page's `## ` headings, outside fenced code blocks."""
    headings: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if _is_fence(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("## "):
            headings.append(line[3:].strip())
    return headings


def unsectioned(text: str) -> bool:
    return len(text.split()) > SECTIONED_ABOVE_WORDS and len(section_headings(text)) < 2


def walls(text: str) -> list[str]:
    """The paragraphs over the limit, each as its word count and first words."""
    return [
        f"{len(paragraph.split())} words: {paragraph[:60]}..."
        for paragraph in paragraphs(text)
        if len(paragraph.split()) > MAX_PARAGRAPH_WORDS
    ]


def test_every_long_concept_page_has_sections() -> None:
    pages = sorted(CONCEPTS.glob("*.md"))
    assert len(pages) >= 9
    bare = [page.name for page in pages if unsectioned(page.read_text())]
    assert bare == [], f"give these concept pages at least two `## ` sections: {bare}"


def test_no_paragraph_of_the_docs_is_a_wall() -> None:
    found = {
        str(page.relative_to(DOCS)): walls(page.read_text()) for page in sorted(DOCS.rglob("*.md"))
    }
    found = {page: long for page, long in found.items() if long}
    assert found == {}, f"split these paragraphs (at most {MAX_PARAGRAPH_WORDS} words): {found}"


def test_a_wall_and_a_page_without_sections_are_found() -> None:
    wall = " ".join(["word"] * (MAX_PARAGRAPH_WORDS + 1))
    code = "\n".join(["```text", *(["code " * 20] * 30), "```"])
    table = "\n".join(["| a | b |", "|---|---|", *(["| " + "cell " * 50 + "| x |"] * 10)])
    page = f"# Title\n\n{wall}\n\n{code}\n\n{table}\n\n## One section\n\nShort.\n"
    assert [len(p.split()) for p in paragraphs(page)] == [2, MAX_PARAGRAPH_WORDS + 1, 3, 1]
    assert walls(page) == [f"{MAX_PARAGRAPH_WORDS + 1} words: {wall[:60]}..."]
    assert unsectioned(page)  # one `## ` heading is not a table of contents
    halves = " ".join(["word"] * 150) + "\n\n" + " ".join(["word"] * 151)
    split = page.replace(wall, halves)
    sectioned = split.replace("\n\n```text", "\n\n## Another section\n\n```text")
    assert walls(sectioned) == []
    assert not unsectioned(sectioned)
    # A tight list is one paragraph, as its source reads; blank lines between items split it.
    items = [f"- item {n}: " + "word " * 40 for n in range(8)]
    assert len(walls("\n".join(items))) == 1
    assert walls("\n\n".join(items)) == []
