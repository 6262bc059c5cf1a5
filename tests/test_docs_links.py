"""The user documentation is self-contained: every relative link in README.md and docs/*.md resolves to a
file of the repository (and, for a markdown target with ``#anchor``, to one of its headings), and none of
them points at the design notes that live outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
#: The measurements that code comments point to (the comment keeps the decision, the file the numbers).
RESULTS_NOTES = [ROOT / "benchmarks" / "results" / "kernel-constants.md"]

# Text that only exists outside the repository; users never have it.
FORBIDDEN = ("DESIGN.md", "../shared")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The markdown without fenced code blocks and inline code spans (no links live there)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (lower case, punctuation dropped, spaces
    to hyphens, ``-1``, ``-2`` ... appended to repeats)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(path: Path) -> list[str]:
    return [target for target in _LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z]+:", target)]


def test_user_docs_exist():
    names = {path.name for path in USER_DOCS}
    assert {"README.md", "conventions.md", "ops.md", "performance.md"} <= names


@pytest.mark.parametrize("path", USER_DOCS + RESULTS_NOTES, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved.read_text()):
            broken.append(f"{target} (no heading with anchor #{anchor})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_reference_to_files_outside_the_repository(path: Path):
    text = path.read_text()
    found = [word for word in FORBIDDEN if word in text]
    assert not found, f"{path.relative_to(ROOT)} mentions {found}, which users do not have"


def test_code_points_to_docs_not_outside_files():
    """Docstrings and comments are documentation too (``help()`` shows them): the package, tests and
    benchmarks name ``docs/`` pages, never the design notes outside the repository."""
    found = []
    for folder in ("icrl_kernels", "icrl_models", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}: {word}" for word in FORBIDDEN if word in text]
    found += [
        f"benchmarks/results/README.md: {w}"
        for w in FORBIDDEN
        if w in (ROOT / "benchmarks/results/README.md").read_text()
    ]
    assert not found, found


_RESULTS_POINTER = re.compile(r"benchmarks/results/([\w.\-]+\.md)(?:#([\w\-]+))?")


def test_code_pointers_to_results_resolve():
    """Comments that keep a decision point to the measurements behind it, ``benchmarks/results/<file>.md#anchor``:
    each names a file that exists and, with an anchor, one of its headings."""
    broken = []
    for folder in ("icrl_kernels", "icrl_models", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, anchor in _RESULTS_POINTER.findall(path.read_text()):
                target = ROOT / "benchmarks" / "results" / name
                if not target.exists():
                    broken.append(f"{path.relative_to(ROOT)}: {name} (no such file)")
                elif anchor and anchor not in github_anchors(target.read_text()):
                    broken.append(f"{path.relative_to(ROOT)}: {name}#{anchor} (no such heading)")
    assert not broken, broken


def test_anchor_rules():
    text = "# A `b` (c, d)\n## Value checks never stall the GPU\n## A `b` (c, d)\n```\n# not a heading\n```\n"
    assert github_anchors(text) == {"a-b-c-d", "value-checks-never-stall-the-gpu", "a-b-c-d-1"}


def test_link_rules():
    text = "[a](x.md) `[b](y.md)` [c](https://e.org) [d](#h)\n```\n[e](z.md)\n```\n"
    links = _LINK.findall(_prose(text))
    assert links == ["x.md", "https://e.org", "#h"]
