"""The README and docs/ stay usable: every relative link reaches a file of this repository (and
its heading, where it names one), the README stays a front door (at most 350 lines), and no
file cites one outside the repository. Reads files only: no processes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 350

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks and code spans (links inside them are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _links(page: Path):
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


def test_every_relative_link_reaches_a_file_and_heading():
    problems = []
    for page in PAGES:
        for target in _links(page):
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if ROOT not in path.parents and path != ROOT:
                problems.append(f"{where} points outside the repository")
            elif not path.exists():
                problems.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[a](missing.md) [b](#top) [c](#nowhere) `[d](ignored.md)`\n")
    links = list(_links(page))
    assert links == ["missing.md", "#top", "#nowhere"]
    assert anchors(page) == {"top"}
    assert slug("Context parallelism: pp2 × cp2 (`out/x*`)") == "context-parallelism-pp2--cp2-outx"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


# A path into the development machine's notes, which users do not have (spelled in parts so
# that this file does not match itself).
OUTSIDE = re.compile("|".join([r"\.\./" + "shared/", "shared/" + "notes/"]))
CHECKED = ["README.md", "setup.py", "docs", "examples", "scripts", "megatron_seq1f1b", "tests",
           ".ci"]
SUFFIXES = {".md", ".py", ".sh", ".txt", ".cfg", ".toml", ""}
#: files that still cite one, each to be fixed by its owner (the test fails once it is fixed,
#: so that the exception goes too)
KNOWN: set[str] = set()


def test_nothing_cites_a_file_outside_the_repository():
    citing = set()
    for name in CHECKED:
        base = ROOT / name
        for path in [base] if base.is_file() else base.rglob("*"):
            if not path.is_file() or path.suffix not in SUFFIXES or "__pycache__" in path.parts:
                continue
            if OUTSIDE.search(path.read_text(errors="replace")):
                citing.add(str(path.relative_to(ROOT)))
    assert citing - KNOWN == set(), f"cite files outside the repository: {sorted(citing - KNOWN)}"
    assert KNOWN <= citing, f"no longer cite one: drop them from KNOWN: {sorted(KNOWN - citing)}"
