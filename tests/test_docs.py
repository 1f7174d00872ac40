"""The user docs: the README stays short and every relative link in README.md and docs/ resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", markdown.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def relative_links(markdown: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S)  # links in code are not links
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_readme_is_at_most_10_kb():
    assert (ROOT / "README.md").stat().st_size <= 10240


@pytest.mark.parametrize("markdown", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(markdown):
    broken = []
    for link in relative_links(markdown):
        path, _, anchor = link.partition("#")
        target = (markdown.parent / path).resolve() if path else markdown
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor}")
    assert not broken, f"{markdown.relative_to(ROOT)}: " + "; ".join(broken)
