"""The docs point only inside the project: every relative link and every file path they name in
backticks exists in the repository (a clone has nothing beside it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"`((?:optirs|docs|examples|benchmarks|tests)/[\w./-]+?)`")
LINK = re.compile(r"\]\(([^)#\s]+)")


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_doc_names_only_files_of_the_project(doc):
    text = doc.read_text()
    missing = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        if ".." in Path(target).parts and not (doc.parent / target).resolve().is_relative_to(ROOT):
            missing.append(f"link outside the project: {target}")
        elif not (doc.parent / target).exists():
            missing.append(f"link: {target}")
    for path in PATH.findall(text):
        path = path.rstrip(".")
        if not any(c in path for c in "*{<") and not (ROOT / path).exists():
            missing.append(f"path: {path}")
    assert "../shared" not in text
    assert not missing, missing
