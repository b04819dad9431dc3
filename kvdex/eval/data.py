"""Where the offline evaluation data lives, and readers for the parts every task shares.

The data is not part of kvdex (see ``../shared/evaldata/README.md``): it is found through
``$KVDEX_DATA``, else ``../shared/evaldata`` relative to the working directory, else
``/work/shared/evaldata``.
"""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from pathlib import Path

ENV = "KVDEX_DATA"
_CANDIDATES = ("../shared/evaldata", "/work/shared/evaldata")

# Long public-domain books for recall / perplexity (each >= 60k tokens with common tokenizers).
BOOKS = (
    "longtext/gutenberg/melville-moby_dick.txt",
    "longtext/austen/emma.txt",
    "longtext/gutenberg/chesterton-ball.txt",
    "longtext/austen/mansfieldpark.txt",
    "longtext/gutenberg/whitman-leaves.txt",
    "longtext/austen/prideprejudice.txt",
    "longtext/gutenberg/milton-paradise.txt",
    "longtext/austen/sensesensibility.txt",
)
# Other long-text sources selectable with ``--source``.
SOURCES = {
    "books": BOOKS,
    "essays": ("haystack/PaulGrahamEssays.json",),
    "wikitext": ("longtext/wikitext2_test.raw",),
    "kjv": ("longtext/kjv/kjv.txt",),
}


def data_root(path: str | os.PathLike | None = None, required: bool = True) -> Path | None:
    """The evaluation data folder: ``path``, ``$KVDEX_DATA``, ``../shared/evaldata``, ``/work/shared/evaldata``."""
    if path is not None:
        candidates = [Path(path)]
    elif os.environ.get(ENV):
        candidates = [Path(os.environ[ENV])]
    else:
        candidates = [Path(c) for c in _CANDIDATES]
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    if required:
        raise ValueError(
            f"evaluation data not found (looked in {', '.join(map(str, candidates))}); "
            f"set {ENV}=/path/to/evaldata or pass --data"
        )
    return None


def read_text(root: Path, rel: str) -> str:
    """One long text; ``.json`` files hold ``{"text": ...}``."""
    return _read_text(str(Path(root) / rel))


@lru_cache(maxsize=16)
def _read_text(path: str) -> str:
    p = Path(path)
    if p.suffix == ".json":
        return json.loads(p.read_text(encoding="utf-8"))["text"]
    return p.read_text(encoding="utf-8", errors="replace")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def text_span(tokenizer, text: str, n_tokens: int, rng: random.Random, chars_per_token: float = 6.0) -> list[int]:
    """``n_tokens`` token ids of a passage of ``text`` starting at a random line.

    Only a slice of the text is tokenized (books are hundreds of thousands of tokens); the slice
    grows until it yields enough tokens. Raises ``ValueError`` when the text is too short.
    """
    want = int(n_tokens * chars_per_token) + 256
    if want >= len(text):
        start = 0
    else:
        start = rng.randrange(0, len(text) - want)
        nl = text.find("\n", start)
        start = nl + 1 if 0 <= nl < start + 2000 else start
    while True:
        chunk = text[start : start + want]
        ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        if start + want >= len(text):
            if start == 0:
                raise ValueError(f"text too short: {len(ids)} tokens < {n_tokens}")
            start = max(0, len(text) - 2 * want)  # retry from earlier in the text
        want *= 2


def long_text_samples(root: Path, source: str, tokenizer, length: int, extra: int, n: int, seed: int) -> list:
    """``n`` samples of ``length`` prompt tokens from the long texts of ``source``, each with the text's
    next ``extra`` tokens as ``meta["continuation"]``; book i % len(books), a seeded random place."""
    from kvdex.eval.runner import Sample

    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose from {', '.join(SOURCES)}")
    files = SOURCES[source]
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}-{length}-{i}")
        rel = files[i % len(files)]
        ids = text_span(tokenizer, read_text(root, rel), length + extra, rng)
        out.append(Sample(f"{Path(rel).stem}-{i}", ids[:length], {"source": rel, "continuation": ids[length:]}))
    return out
