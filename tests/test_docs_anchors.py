"""Every docs page and anchor the code cites exists; the code cites no document outside the repository.

Anchors come from rendering each page with Python-Markdown and the id-making extensions of
mkdocs.yml, as MkDocs does: an explicit ``{ #id }`` on a heading wins, otherwise the heading text
is slugified and a repeated slug gets ``_1``, ``_2``, ...; ids set with ``{ #id }`` elsewhere count
too. A heading inside a code fence makes none.
"""

from __future__ import annotations

import re
from pathlib import Path

import markdown

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CITING = ("hybrid_transfer", "examples", "benchmarks", "scripts", "tests")
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".json", ".txt", ".yml", ".yaml", ".cfg", ""}

# An anchor never takes a sentence's final dot.
CITATION = re.compile(r"docs/((?:[\w-]+/)*[\w.-]+\.md)(?:#([\w-]+(?:\.[\w-]+)*))?")
SELF = Path(__file__).resolve()  # its own examples below are not citations
# Built from pieces so this file does not match its own patterns.
FORBIDDEN = {
    "a design-document section": re.compile(r"\b" + "DES" + r"IGN\b"),
    "the shared folder": re.compile(re.escape(".." + "/shared")),
}

# The Markdown extensions of mkdocs.yml that create or hide ids (snippets and mermaid fences only add text).
_EXTENSIONS = ["toc", "attr_list", "md_in_html", "tables", "admonition", "pymdownx.details", "pymdownx.superfences"]
_ID = re.compile(r'\sid="([^"]+)"')


def page_anchors(path: Path) -> set[str]:
    """Every id the page's HTML has: heading anchors (explicit or slugified, ``_1`` for repeats) and attr ids."""
    md = markdown.Markdown(extensions=_EXTENSIONS)
    return set(_ID.findall(md.convert(path.read_text(encoding="utf-8"))))


def _citing_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in CITING:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return files


def _citations() -> list[tuple[str, int, str, str | None]]:
    found = []
    for path in _citing_files():
        if path.resolve() == SELF:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in CITATION.finditer(line):
                found.append((f"{path.relative_to(ROOT)}:{lineno}", lineno, m.group(1), m.group(2)))
    return found


def test_cited_docs_pages_and_anchors_exist():
    cache: dict[str, set[str]] = {}
    broken = []
    for where, _, page, anchor in _citations():
        path = DOCS / page
        if not path.is_file():
            broken.append(f"{where}: docs/{page} does not exist")
            continue
        if page not in cache:  # each page rendered once, however often it is cited
            cache[page] = page_anchors(path)
        anchors = cache[page]
        if anchor is not None and anchor not in anchors:
            broken.append(f"{where}: docs/{page} has no anchor #{anchor}")
    assert not broken, "\n".join(broken)


def test_code_cites_no_outside_document():
    hits = []
    for path in [*_citing_files(), *sorted(DOCS.rglob("*.md"))]:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(lines, 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{lineno}: cites {what}: {line.strip()[:100]}")
    assert not hits, "cite a docs/ page instead:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_should(tmp_path):
    """The patterns themselves: repeated and explicit headings, code fences, citations, forbidden words."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Same\n\n## Same\n\n## Named { #named }\n\n```\n# not a heading\n```\n")
    assert page_anchors(page) == {"title", "same", "same_1", "named"}
    line = "see docs/planner.md#fan-out, docs/layout.md and docs/api/engine.md#x."
    assert [(m.group(1), m.group(2)) for m in CITATION.finditer(line)] == [
        ("planner.md", "fan-out"), ("layout.md", None), ("api/engine.md", "x")]
    assert FORBIDDEN["a design-document section"].search("(" + "DES" + "IGN 2.3)")
    assert FORBIDDEN["the shared folder"].search("see .." + "/shared/VLLM.md")
    assert "fan-out" in page_anchors(DOCS / "planner.md")
    assert "no-such-anchor" not in page_anchors(DOCS / "planner.md")
