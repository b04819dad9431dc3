"""The repository is a product: no work-log words, no paths outside the repository, no binaries.

Checked in README.md, docs/*.md (every folder below docs/), kvdex/**/*.py, scripts/ and tests/ (this file
aside: it holds the examples): no numbered work
periods ("session 7", "lane 2", "queue 1"), no "the lead", no issue numbers (those live in git and the
issue tracker); no path that only exists on the machine kvdex was developed on (``../shared``,
``/work/``): data and models are found through options and environment variables. And no binary
artefact (wheels, model weights, compiled libraries) is tracked by git.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WORK_LOG = re.compile(r"\b(session|lane|queue) ?[0-9]+\b|\bthe lead\b|\bissue [0-9]+\b", re.IGNORECASE)
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/work/")
BINARY_SUFFIXES = (".whl", ".gguf", ".bin", ".pt", ".safetensors", ".so")


def _text_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "kvdex").rglob("*.py"))]
    files += [*sorted((ROOT / "scripts").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


def _hits(pattern: re.Pattern, files: list[Path]) -> list[str]:
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            m = pattern.search(line)
            if m:
                out.append(f"{f.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return out


def test_patterns_catch_what_they_should():
    for bad in ("as in session 7", "Session 6 on the H200", "lane 0", "queue3", "for the lead", "see issue 4"):
        assert WORK_LOG.search(bad), bad
    for fine in ("an inference session", "a priority queue", "the leading digits", "issue-free", "misleading"):
        assert not WORK_LOG.search(fine), fine
    for bad in ("see ../shared/evaldata", "/work/shared/models", "(/work/main)"):
        assert OUTSIDE.search(bad), bad
    for fine in ("kvdex/work/x", "docs/works.md", "framework/worker", "../sharedness"):
        assert not OUTSIDE.search(fine), fine


def test_sources_exist():
    files = _text_files()
    assert (ROOT / "README.md") in files
    assert any(f.suffix == ".py" for f in files) and any(f.parent.name == "docs" for f in files)


def test_no_work_log_words():
    hits = _hits(WORK_LOG, _text_files())
    assert not hits, "work-log words (history belongs in git):\n" + "\n".join(hits)


def test_no_paths_outside_the_repository():
    hits = _hits(OUTSIDE, _text_files())
    assert not hits, "paths outside the repository (use --data / KVDEX_DATA / KVDEX_MODELS):\n" + "\n".join(hits)


def test_no_tracked_binaries():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tracked = out.splitlines()
    assert "README.md" in tracked
    binaries = [p for p in tracked if p.lower().endswith(BINARY_SUFFIXES)]
    assert not binaries, f"binary artefacts tracked by git: {binaries}"
