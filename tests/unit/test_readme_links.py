"""The README's and the changelog's links lead somewhere.

``mkdocs build --strict`` checks the links between the pages of docs/ (and
their anchors); the README and CHANGELOG.md are outside it, read on the
package index and the repository's front page, so they are checked here: every
relative link names a file that exists, and an anchor names a heading of that
page, slugged as Python-Markdown's ``toc`` extension (the one mkdocs uses) slugs it.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "CHANGELOG.md")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    # markdown.extensions.toc.slugify, with its defaults.
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M)}


def _links(page: str) -> list[str]:
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_the_slug_is_python_markdowns() -> None:
    assert _slug("When the broker fills (Redis at maxmemory)") == (
        "when-the-broker-fills-redis-at-maxmemory"
    )
    assert _slug("Stalls: a task waiting while a process is free") == (
        "stalls-a-task-waiting-while-a-process-is-free"
    )


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page: str) -> None:
    links = _links(page)
    if page == "README.md":
        assert len(links) > 10, f"{page}: {len(links)} relative links found (is the pattern right?)"
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / page).parent / path if path else ROOT / page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {path or page}")
    assert not broken, f"{page}: " + "; ".join(broken)


def test_the_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: results go to docs/benchmarks.md"
    assert not [n for n, line in enumerate(lines, 1) if re.search(r"issue #\d", line)]
