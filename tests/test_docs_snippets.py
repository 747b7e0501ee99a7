"""Every python block in README.md and docs/ runs as written, or says why not (issue 21 row 5).

A block is skipped only with the line ``<!-- not run: REASON -->`` right before its fence; every
other block is one test (id: file:line of the fence), run in a fresh interpreter from an empty
directory, so a failing or hanging block fails its test. Snippet includes (``--8<-- "path"``, as
pymdownx.snippets expands them for the site) are expanded first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)```\s*(python|py)\s*$")
MARKER = re.compile(r"^\s*<!-- not run: (?P<reason>.*\S)\s*-->\s*$")
INCLUDE = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')
TIMEOUT_S = 60


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name}:{self.line}"


def python_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The python blocks of one markdown file, includes expanded."""
    lines = path.read_text().splitlines()
    blocks, n = [], 0
    while n < len(lines):
        match = FENCE.match(lines[n])
        if match is None:
            n += 1
            continue
        indent, start = match.group(1), n
        body = []
        n += 1
        while n < len(lines) and lines[n].strip() != "```":
            body.append(lines[n][len(indent):] if lines[n].startswith(indent) else lines[n])
            n += 1
        if n == len(lines):
            raise AssertionError(f"{path}:{start + 1}: python block is never closed")
        marker = MARKER.match(lines[start - 1]) if start else None
        code = "\n".join(_expand(body, root)) + "\n"
        blocks.append(Block(path, start + 1, code, marker.group("reason") if marker else None))
        n += 1
    return blocks


def _expand(body: list[str], root: Path) -> list[str]:
    out = []
    for line in body:
        include = INCLUDE.match(line)
        out.extend((root / include.group("path")).read_text().splitlines() if include else [line])
    return out


def markdown_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", block.code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


BLOCKS = [b for f in markdown_files() for b in python_blocks(f)]
RUN = [b for b in BLOCKS if b.skip_reason is None]


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_python_block_runs(block, tmp_path):
    proc = run_block(block, tmp_path)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stderr[-3000:]}"


def test_every_python_block_either_runs_or_says_why_not():
    assert RUN, "no python block found to run: the collector is broken"
    for block in BLOCKS:
        assert block.skip_reason is None or len(block.skip_reason) >= 10, f"{block.id}: say why it is not run"


# ---- the collector itself ----------------------------------------------------------------------------------


def test_an_unmarked_failing_block_is_collected_and_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```python\nraise SystemExit('broken example')\n```\n\n"
                    "<!-- not run: needs two hosts with GPUs -->\n```python\nraise SystemExit(3)\n```\n")
    unmarked, marked = python_blocks(page, tmp_path)
    assert (unmarked.line, unmarked.skip_reason) == (3, None)
    assert run_block(unmarked, tmp_path).returncode != 0
    assert (marked.line, marked.skip_reason) == (8, "needs two hosts with GPUs")


def test_a_marker_must_be_right_before_the_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- not run: too far away -->\n\n```python\nx = 1\n```\n")
    (block,) = python_blocks(page, tmp_path)
    assert block.skip_reason is None


def test_includes_are_expanded(tmp_path):
    (tmp_path / "ex.py").write_text("print('included')\n")
    page = tmp_path / "page.md"
    page.write_text('```python\n--8<-- "ex.py"\n```\n')
    (block,) = python_blocks(page, tmp_path)
    assert run_block(block, tmp_path).stdout == "included\n"
