"""The README is not part of the docs site, so `mkdocs build --strict` does not see its links: every
relative link in it must name a file that exists, and an anchor a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The ids mkdocs gives a page's headings (`{#id}` when the heading names its own)."""
    ids = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        own = re.search(r"\{#([^}]+)\}\s*$", line)
        ids.add(own.group(1) if own else slugify(line.lstrip("#").strip().replace("`", ""), "-"))
    return ids


def test_every_relative_link_of_the_readme_names_a_file_and_anchor_that_exist():
    broken = []
    for target in LINK.findall((ROOT / "README.md").read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / path
        if not page.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(page):
            broken.append(target)
    assert not broken, f"README links to missing files or anchors: {broken}"
