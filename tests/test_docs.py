"""The README and the docs describe kvdex as it is: every reference resolves, no history in prose.

Checked in README.md and docs/**/*.md. The generated reports under docs/data/ (``kvdex scorecard``'s
tables, which print the commit they ran at) are data, not prose: only their links are checked.

* Links: every relative markdown link ``[text](target)`` / ``![alt](target)`` points to an existing file or
  folder (relative to the linking file), and a ``#anchor`` on a markdown target names one of its headings
  (GitHub's slugs: lower case, punctuation dropped, spaces to ``-``, ``-1``, ``-2`` for repeats).
* Paths in backticks: an inline code span that is a path under ``scripts/``, ``kvdex/``, ``docs/``,
  ``tests/`` (from the repository root), or ``data/`` / ``figures/`` / ``policies/`` / ``bench/`` (from a
  file in docs/), exists. Spans with a placeholder (``<name>``, ``*``, ``$``, ``{``) are patterns, not paths.
* Commit hashes: a 7-40 character hex word holding a digit and a letter is allowed only on a
  *provenance line* -- a line that starts (after list, quote or table markers) with ``Provenance``,
  ``Measured`` or ``Command`` -- or inside a fenced code block. A hash in a sentence is history; the
  provenance line says which code a figure came from.
* History phrases ("former default", "before this change", "predate", "measured before", "no longer")
  and the words "session" and "lane" do not appear: the docs describe the current code. Numbered work
  periods and issue numbers are checked for every text file by ``tests/test_repository.py``.
* Sizes: README.md at most 120 lines; each docs/policies/*.md at most 250 lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 120
POLICY_PAGE_MAX_LINES = 250

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
ROOT_PATH = re.compile(r"^(?:scripts|kvdex|docs|tests)/[\w./-]*$")
DOCS_PATH = re.compile(r"^(?:data|figures|policies|bench)/[\w./=-]*\.\w+$")
PLACEHOLDER = re.compile(r"[<>*${}]")
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
PROVENANCE = re.compile(r"^\s*(?:[-*>|]\s*)*\**(?:Provenance|Measured|Command)\b")
HISTORY = re.compile(
    r"\bformer defaults?\b|\bbefore this change\b|\bpredat(?:e|es|ed|ing)\b|\bmeasured before\b|\bno longer\b"
    r"|\bsessions?\b|\blanes?\b",
    re.IGNORECASE,
)
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose_files(root: Path = ROOT) -> list[Path]:
    """The files whose prose is checked: README.md and docs/, without the generated reports in docs/data/."""
    return [f for f in doc_files(root) if "data" not in f.relative_to(root).parts[1:2]]


def lines_outside_code(text: str) -> list[tuple[int, str, bool]]:
    """(line number, line, inside a fenced code block) for every line."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            out.append((n, line, True))
            fenced = not fenced
            continue
        out.append((n, line, fenced))
    return out


def slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    seen: dict[str, int] = {}
    out = set()
    for _, line, fenced in lines_outside_code(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(1))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for n, line, fenced in lines_outside_code(path.read_text(encoding="utf-8")):
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{n}: {target}"
            if not dest.exists():
                out.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{where} (no heading #{anchor} in {dest.name})")
    return out


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    in_docs = (root / "docs") in path.parents
    for n, line, fenced in lines_outside_code(path.read_text(encoding="utf-8")):
        if fenced:
            continue
        for span in CODE_SPAN.findall(line):
            ref = span.strip().split(" ")[0].split(":")[0].rstrip(".,;")
            if PLACEHOLDER.search(ref):
                continue
            candidates = []
            if ROOT_PATH.match(ref):
                candidates.append(root / ref)
            elif in_docs and DOCS_PATH.match(ref):
                candidates += [path.parent / ref, root / "docs" / ref]
            if candidates and not any(c.exists() for c in candidates):
                out.append(f"{path.relative_to(root)}:{n}: `{span}` does not exist")
    return out


def hashes_in_prose(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for n, line, fenced in lines_outside_code(path.read_text(encoding="utf-8")):
        if fenced or PROVENANCE.match(line):
            continue
        m = HASH.search(line)
        if m:
            out.append(f"{path.relative_to(root)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return out


def history(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for n, line, _ in lines_outside_code(path.read_text(encoding="utf-8")):
        m = HISTORY.search(line)
        if m:
            out.append(f"{path.relative_to(root)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return out


def test_checks_catch_what_they_should(tmp_path):
    docs = tmp_path / "docs"
    (docs / "data").mkdir(parents=True)
    (docs / "data" / "x.json").write_text("{}")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "real.py").write_text("")
    (docs / "a.md").write_text("# A\n\n## Real `heading`, here\n")
    page = docs / "b.md"
    page.write_text(
        "# B\n[ok](a.md) [ok](a.md#real-heading-here) [ok](#b) [web](https://example.com) ![ok](data/x.json)\n"
        "[gone](missing.md) [bad anchor](a.md#nowhere)\n"
        "`scripts/real.py` `data/x.json` `scripts/gone.py` `data/gone.csv` `docs/policies/<name>.md`\n"
        "Measured at kvdex `8e71f19` on one H200.\n"
        "The figures of `8e71f19` differ.\n"
        "```bash\ngit show 8e71f19\n[gone](nowhere.md)\n```\n"
        "Its former default was slower. A 1234567 tokens decade, cafebabe-free.\n"
    )
    links = broken_links(page, tmp_path)
    assert [x.split(": ", 1)[1] for x in links] == [
        "missing.md (no such file)",
        "a.md#nowhere (no heading #nowhere in a.md)",
    ], links
    paths = missing_paths(page, tmp_path)
    assert len(paths) == 2 and "scripts/gone.py" in paths[0] and "data/gone.csv" in paths[1], paths
    hashes = hashes_in_prose(page, tmp_path)
    assert len(hashes) == 1 and ":6:" in hashes[0], hashes
    assert len(history(page, tmp_path)) == 1
    for fine in ("an inference", "a queue of pages", "planes"):
        assert not HISTORY.search(fine), fine
    for bad in ("as measured before the fix", "the former default", "these rows predate it", "session"):
        assert HISTORY.search(bad), bad


@pytest.mark.parametrize("check", [broken_links, missing_paths], ids=["links", "paths"])
def test_references_resolve(check):
    hits = [h for f in doc_files() for h in check(f)]
    assert not hits, "references to nothing:\n" + "\n".join(hits)


def test_no_commit_hashes_in_prose():
    hits = [h for f in prose_files() for h in hashes_in_prose(f)]
    assert not hits, "commit hashes outside provenance lines (start the line with 'Measured'):\n" + "\n".join(hits)


def test_no_history_in_prose():
    hits = [h for f in prose_files() for h in history(f)]
    assert not hits, "history belongs in git; describe the current code:\n" + "\n".join(hits)


def test_sizes():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines (at most {README_MAX_LINES})"
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted((ROOT / "docs" / "policies").glob("*.md"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > POLICY_PAGE_MAX_LINES
    ]
    assert not long, f"policy pages over {POLICY_PAGE_MAX_LINES} lines:\n" + "\n".join(long)
