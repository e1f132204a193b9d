"""Links that hold: every relative link and `#anchor` in README.md and docs/**/*.md resolves, and every
README or docs section a code comment names exists.

Anchors follow GitHub's rule for headings: the heading's text (inline code, emphasis and link
syntax removed) lowercased, every character but letters, digits, spaces, `-` and `_` dropped,
spaces turned into `-`; a repeated slug gets `-1`, `-2`, ... Explicit `<a name="...">` / `id="..."`
anchors count too.

Code comments name a place in the docs by a path from the repository root with an optional anchor,
`docs/bench/history.md#runs-s-and-t-...` or `README.md#library`, or with the section's name quoted
after a comma, `docs/cli.md, "State across requests"` (a heading that starts with that name). A bare
"README" (as in "README, runs S and T") is not allowed: it names no file that holds.
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = ("specfree", "tests", "scripts", "docs", "benchmarks", ".ci")
# every kind of source that can name a docs section in a comment
CODE_SUFFIXES = (".py", ".cpp", ".h", ".yaml", ".sh", ".toml")
# fewer than these found means the search itself broke (a check that finds nothing passes nothing)
MIN_MARKDOWN_FILES, MIN_CODE_FILES, MIN_POINTERS = 15, 150, 20

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:name|id)=\"([^\"]+)\"", re.I)
# the "](target)" of [text](target) and ![alt](target), whose text may start on an earlier line; the
# target up to whitespace or ')'; an optional "title"
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def slug(text: str) -> str:
    """GitHub's anchor for a heading's text (before duplicates get their -1, -2)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline html
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def _lines_outside_code(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    inside = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            if inside is None:
                inside = fence.group(1)
            elif fence.group(1) == inside:
                inside = None
            continue
        if inside is None:
            yield number, line


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Every anchor a markdown file defines."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def markdown_files() -> list[Path]:
    """Every Markdown file of the repository (README.md, docs/, benchmarks/README.md, ...)."""
    return sorted(p for p in REPO.rglob("*.md") if not _ignored(p))


def _ignored(path: Path) -> bool:
    parts = path.relative_to(REPO).parts
    return any(part.startswith(".") and part != ".ci" or part in ("build", "dist", "outputs", "multirun")
               or part.endswith(".egg-info") for part in parts[:-1])


def links(path: Path):
    """(line number, target) of every link in a markdown file, outside code."""
    for number, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        bare = INLINE_CODE.sub("", line)
        for match in LINK.finditer(bare):
            yield number, match.group(1)
        ref = REF_DEF.match(bare)
        if ref:
            yield number, ref.group(1)


def broken(source: Path, target: str) -> str | None:
    """Why `target`, linked from `source`, does not resolve (None when it does)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
        return None
    file_part, _, anchor = target.partition("#")
    file = (source.parent / file_part).resolve() if file_part else source
    if not file.exists():
        return f"no file {file_part}"
    if anchor:
        if file.is_dir() or file.suffix != ".md":
            return f"an anchor into {file_part}, which is not a markdown file"
        if anchor not in anchors(file):
            return f"no heading with anchor #{anchor} in {file_part or source.name}"
    return None


def test_slugs_follow_githubs_rule():
    assert slug("On AVX-512: an Intel Xeon VM (runs AE-AH, 2026-11-26/27)") == \
        "on-avx-512-an-intel-xeon-vm-runs-ae-ah-2026-11-2627"
    assert slug("Inside `model.generate(...)`") == "inside-modelgenerate"
    assert slug("Pricing: every strategy pays") == "pricing-every-strategy-pays"
    assert slug("llama.cpp on the same weights") == "llamacpp-on-the-same-weights"
    assert slug("snake_case and **bold**") == "snake_case-and-bold"


def test_duplicate_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n## Measured\n```\n# not a heading\n```\n## Measured\n### Measured\n")
    assert anchors(page) == {"a", "measured", "measured-1", "measured-2"}


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Here\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#here) [bad](other.md#there) [gone](missing.md) `[code](nowhere.md)`\n")
    reasons = [broken(page, target) for _, target in links(page)]
    assert reasons[0] is None
    assert "#there" in reasons[1] and "missing.md" in reasons[2] and len(reasons) == 3


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(path):
    bad = [f"{path.relative_to(REPO)}:{number}: ({target}) {why}"
           for number, target in links(path) if (why := broken(path, target))]
    assert not bad, "\n".join(bad)


# a path from the repository root to a markdown file, and an optional anchor or quoted section name
DOC_POINTER = re.compile(r"(?<![\w/.-])((?:docs/[\w./-]+?|README)\.md)(?:#([\w-]+)|,\s*(?:section\s+)?"
                         r"[\"']([^\"']+)[\"'])?")
# "README" with no ".md": a pointer nobody can check (a GitHub repository's own README, named as
# owner/name README, is another project's page and is left alone)
BARE_README = re.compile(r"(?<![\w./-])(?<!\w/\w)README(?![\w.])")
ELSEWHERE = re.compile(r"[\w.-]+/[\w.-]+ README")


def code_files() -> list[Path]:
    """Every source file of the project (Python, C++, YAML, shell) but this one, whose examples are
    made to fail."""
    here = Path(__file__).resolve()
    return sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*") if p.suffix in CODE_SUFFIXES
                  and p.is_file() and p.resolve() != here and not _ignored(p)) + [REPO / "pyproject.toml"]


def test_the_checks_find_what_they_check():
    assert len(markdown_files()) >= MIN_MARKDOWN_FILES
    assert REPO / "benchmarks" / "README.md" in markdown_files()
    files = code_files()
    assert len(files) >= MIN_CODE_FILES
    assert {".py", ".cpp", ".h", ".yaml", ".sh"} <= {p.suffix for p in files}
    assert len(list(code_pointers())) >= MIN_POINTERS


def code_pointers():
    """(file, line number, path, anchor) of every docs place a code file names, and the bare READMEs."""
    for path in code_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in DOC_POINTER.finditer(line):
                yield path, number, match.group(1), match.group(2) or (match.group(3) and "~" + match.group(3))
            for match in BARE_README.finditer(ELSEWHERE.sub("", line)):
                yield path, number, "README", None


def test_every_docs_place_named_in_code_exists():
    bad = []
    for path, number, target, anchor in code_pointers():
        where = f"{path.relative_to(REPO)}:{number}"
        if target == "README":
            bad.append(f"{where}: names the README without a file and section (write README.md#anchor)")
            continue
        file = REPO / target
        if not file.is_file():
            bad.append(f"{where}: no file {target}")
        elif anchor and anchor.startswith("~"):  # a quoted section name: a heading starting with it
            if not any(a.startswith(slug(anchor[1:])) for a in anchors(file)):
                bad.append(f"{where}: no section named {anchor[1:]!r} in {target}")
        elif anchor and anchor not in anchors(file):
            bad.append(f"{where}: no heading with anchor #{anchor} in {target}")
    assert not bad, "\n".join(bad)


def test_a_stale_pointer_in_code_is_found(tmp_path, monkeypatch):
    code = tmp_path / "specfree" / "m.py"
    code.parent.mkdir()
    code.write_text("# see README, runs S and T\n# and docs/bench/history.md#no-such-run\n"
                    "# owner/repo README is elsewhere\n# docs/cli.md, \"State across requests\"\n")
    monkeypatch.setattr(sys.modules[__name__], "code_files", lambda: [code])
    found = [(target, anchor) for _, _, target, anchor in code_pointers()]
    assert ("docs/bench/history.md", "no-such-run") in found and ("README", None) in found
    assert ("docs/cli.md", "~State across requests") in found and len(found) == 3
