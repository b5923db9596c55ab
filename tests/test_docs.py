"""The documentation's shape: a short README, no dead relative links, every page in the site's nav.
(`make docs` builds the site with mkdocs --strict; this test does not build it.)"""
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text: str):
    """Targets of the Markdown links and images outside code, without their #anchor, that are
    neither URLs nor same-page anchors."""
    text = _CODE.sub("", _FENCE.sub("", text))
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def test_links_are_found_outside_code():
    text = "[a](x.md#s) ![i](img/p.png) [u](https://e.org) [h](#top)\n```\n[c](no.md)\n```\n`[d](no.md)`"
    assert list(relative_links(text)) == ["x.md", "img/p.png"]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    dead = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not dead, f"{page.relative_to(ROOT)} links to missing files: {dead}"


def _nav_pages(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_pages(value)
    elif isinstance(node, list):
        for item in node:
            yield from _nav_pages(item)


def test_nav_lists_every_page():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = set(_nav_pages(nav))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - listed == set(), f"docs pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"
