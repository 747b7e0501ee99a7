"""Every docs page and anchor the code cites exists; the code cites no document outside the repository.

Anchors are computed the way MkDocs' Markdown (the ``toc`` and ``attr_list`` extensions) computes
them: an explicit ``{ #id }`` on a heading wins, otherwise the heading text is slugified, and a
repeated slug gets ``_1``, ``_2``, ... A second test holds this computation to Python-Markdown's
own output on every page, so the first one cannot drift from what the site really has.
"""

from __future__ import annotations

import html
import re
import unicodedata
from pathlib import Path

import markdown
import pytest

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

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ATTR_ID = re.compile(r"\s*\{[^}]*#([\w.:-]+)[^}]*\}\s*$")
_ANY_ATTR_ID = re.compile(r"\{:?\s*#([\w.:-]+)[^}]*\}")


def slugify(text: str) -> str:
    """Python-Markdown's default toc slug: ASCII-fold, drop punctuation, lower-case, runs of spaces -> '-'."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _plain(heading: str) -> str:
    """The text a heading renders to: links, code spans and emphasis reduced to their words."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"(\*\*|\*)(.+?)\1", r"\2", text)
    text = re.sub(r"<[^>]+>", "", text)
    return html.unescape(text)


def _unique(anchor: str, used: set[str]) -> str:
    while anchor in used or not anchor:
        m = re.match(r"^(.*)_([0-9]+)$", anchor)
        anchor = f"{m.group(1)}_{int(m.group(2)) + 1}" if m else f"{anchor}_1"
    return anchor


def heading_anchors(text: str) -> list[str]:
    """Anchors of a page's headings, in order (headings inside fenced code blocks are not headings)."""
    explicit, headings, fenced = set(), [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        title = match.group(2)
        attr = _ATTR_ID.search(title)
        if attr:
            explicit.add(attr.group(1))
            headings.append((attr.group(1), True))
        else:
            headings.append((title, False))
    used = set(explicit)
    out = []
    for value, is_id in headings:
        if is_id:
            out.append(value)
        else:
            anchor = _unique(slugify(_plain(value)), used)
            used.add(anchor)
            out.append(anchor)
    return out


def page_anchors(path: Path) -> set[str]:
    """Heading anchors plus any explicit ``{ #id }`` attribute elsewhere on the page."""
    text = path.read_text(encoding="utf-8")
    return set(heading_anchors(text)) | set(_ANY_ATTR_ID.findall(text))


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
        anchors = cache.setdefault(page, page_anchors(path))
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


@pytest.mark.parametrize("page", sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")))
def test_anchor_computation_matches_python_markdown(page):
    text = (DOCS / page).read_text(encoding="utf-8")
    md = markdown.Markdown(extensions=["toc", "attr_list", "tables", "admonition", "pymdownx.superfences"])
    md.convert(text)

    def flatten(tokens):
        for token in tokens:
            yield token["id"]
            yield from flatten(token["children"])

    assert heading_anchors(text) == list(flatten(md.toc_tokens))


def test_the_checks_catch_what_they_should(tmp_path):
    """The patterns themselves: a missing anchor, a duplicate heading, a forbidden citation."""
    page = "# Title\n\n## Same\n\n## Same\n\n## Named { #named }\n\n```\n# not a heading\n```\n"
    assert heading_anchors(page) == ["title", "same", "same_1", "named"]
    line = "see docs/planner.md#fan-out, docs/layout.md and docs/api/engine.md#x."
    assert [(m.group(1), m.group(2)) for m in CITATION.finditer(line)] == [
        ("planner.md", "fan-out"), ("layout.md", None), ("api/engine.md", "x")]
    assert FORBIDDEN["a design-document section"].search("(" + "DES" + "IGN 2.3)")
    assert FORBIDDEN["the shared folder"].search("see .." + "/shared/VLLM.md")
    assert "fan-out" in page_anchors(DOCS / "planner.md")
    assert "no-such-anchor" not in page_anchors(DOCS / "planner.md")
