"""The README is a front door: short, and every page of docs/ is one link away; no link in the README
or in docs/ points at a file that is not there."""
import re

from conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
FRONT_DOOR_LINES = 250  # the length the README is kept to (the reference lives in docs/)


def _relative_links(page):
    """Targets of the page's markdown links that name a file in the repository (no scheme, no anchor only)."""
    return [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", page.read_text())
            if "://" not in t and not t.startswith("#")]


def test_the_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= FRONT_DOOR_LINES


def test_every_page_of_docs_is_linked_from_the_readme():
    linked = {(README.parent / t).resolve() for t in _relative_links(README)}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []


def test_every_relative_link_resolves():
    broken = [f"{page.relative_to(REPO_ROOT)} -> {t}" for page in [README, *DOCS]
              for t in _relative_links(page) if not (page.parent / t).exists()]
    assert broken == []
