"""The project's own documents: every relative link in README.md and docs/ resolves inside
the repository (a clone has nothing outside it), and the architecture page names modules
that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_resolve_inside_the_repository() -> None:
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", doc.read_text()):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
            assert path.exists(), f"{doc.name} links to a missing file: {target}"
    assert "../shared" not in (ROOT / "README.md").read_text()


def test_architecture_page_names_existing_modules() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = set(re.findall(r"\b((?:scheduler|worker|service|loadgen)/[\w/]+\.py)\b", text))
    assert len(modules) >= 8
    missing = sorted(m for m in modules if not (ROOT / m).exists())
    assert not missing, missing
