"""The README and docs/ point only at files that exist.

For README.md and every docs/*.md: each relative markdown link or image (`[text](path)`, `![alt](path)`)
resolves from the file's own folder, and each repository path named in inline code (`vcpo/...`,
`docs/...`, ...) resolves from the repository root (a path ending in `/` must be a folder). Outputs
(`results/...`) and placeholders (`RUNS`, `OUT`, `PATH`, `<...>`, `{...}`, globs) are not checked.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_PREFIXES = ("vcpo/", "docs/", "recipes/", "tables/", "workflows/", "tests/", "benchmarks/", "eval/", ".ci/")
PLACEHOLDERS = ("RUNS", "OUT", "PATH")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"`([^`\n]+)`")


def prose(path):
    """The file's text without its fenced code blocks (commands there are not links)."""
    return FENCE.sub("", path.read_text())


def link_targets(path):
    for target in LINK.findall(prose(path)):
        if re.match(r"(https?|mailto):", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def repository_paths(path):
    for span in CODE.findall(prose(path)):
        if not span.startswith(REPO_PREFIXES):
            continue
        if any(c in span for c in " *<{") or any(word in span for word in PLACEHOLDERS):
            continue
        yield span.split("::", 1)[0]  # a pytest node id names its file


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_exists(doc):
    missing = [target for target in link_targets(doc) if not (doc.parent / target).exists()]
    assert missing == [], f"{doc.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_in_code_exists(doc):
    missing = []
    for name in repository_paths(doc):
        target = ROOT / name
        if not (target.is_dir() if name.endswith("/") else target.exists()):
            missing.append(name)
    assert missing == [], f"{doc.relative_to(ROOT)} names missing repository paths: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_points_users_at_the_developers_shared_folder(doc):
    assert not re.search(r"(^|[\s`(\"'=])(\.\./)?shared/", doc.read_text()), f"{doc.relative_to(ROOT)} mentions shared/"


def test_the_checks_see_links_and_paths():
    """The patterns find what they are meant to find (a guard against a regex that matches nothing)."""
    readme = list(link_targets(ROOT / "README.md"))
    assert any(target.startswith("docs/") for target in readme)
    assert any(target.endswith(".png") for target in readme)
    assert any(name.startswith("vcpo/") for doc in DOCS for name in repository_paths(doc))
