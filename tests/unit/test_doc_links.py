"""Every relative link in the README and docs/ leads to a file of the checkout, and every #anchor to one of its
headings, as GitHub names them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "loadtest" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", FENCED.sub("", text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces as hyphens, repeats
    numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCED.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def links() -> list[tuple[Path, str]]:
    return [
        (page, target)
        for page in PAGES
        for target in LINK.findall(prose(page.read_text()))
        if not target.startswith(("http://", "https://", "mailto:"))
    ]


def test_the_pages_have_links_to_check():
    assert len(links()) > 50


@pytest.mark.parametrize(("page", "target"), links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_a_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    goal = (page.parent / path).resolve() if path else page
    assert goal.exists(), f"{page.relative_to(ROOT)}: {target} leads nowhere"
    if anchor:
        assert goal.suffix == ".md", f"{page.relative_to(ROOT)}: {target}: an anchor into a file that is not markdown"
        assert anchor in anchors(goal), f"{page.relative_to(ROOT)}: {target}: no such heading in {goal.name}"
