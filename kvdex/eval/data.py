"""Where evaluation data comes from, and readers for the parts every task shares.

kvdex ships no benchmark data. A task that needs some reads it from the data folder named by
``--data DIR`` or ``$KVDEX_DATA`` (the relative paths below), from a text file the user names
(``--source FILE`` for the long-text tasks, ``--haystack FILE`` for RULER's essay haystack), or,
for LongBench v2, from the Hugging Face hub through the ``datasets`` library
(``pip install "kvdex[data]"``). Where something is missing the error names the file, where it
comes from and where to put it (:data:`FILES`). Passkey retrieval and RULER's noise / needle
subtasks need no data.
"""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from pathlib import Path

ENV = "KVDEX_DATA"

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
# Other long-text sources selectable with ``--source`` (or any text file: ``--source FILE``).
SOURCES = {
    "books": BOOKS,
    "essays": ("haystack/PaulGrahamEssays.json",),
    "wikitext": ("longtext/wikitext2_test.raw",),
    "kjv": ("longtext/kjv/kjv.txt",),
}

_GUTENBERG = "the plain-text (UTF-8) edition from Project Gutenberg, gutenberg.org"
# relative path in the data folder -> where the file comes from
FILES = {
    "longtext/gutenberg/melville-moby_dick.txt": f"Moby Dick (H. Melville), {_GUTENBERG}",
    "longtext/austen/emma.txt": f"Emma (J. Austen), {_GUTENBERG}",
    "longtext/gutenberg/chesterton-ball.txt": f"The Ball and the Cross (G. K. Chesterton), {_GUTENBERG}",
    "longtext/austen/mansfieldpark.txt": f"Mansfield Park (J. Austen), {_GUTENBERG}",
    "longtext/gutenberg/whitman-leaves.txt": f"Leaves of Grass (W. Whitman), {_GUTENBERG}",
    "longtext/austen/prideprejudice.txt": f"Pride and Prejudice (J. Austen), {_GUTENBERG}",
    "longtext/gutenberg/milton-paradise.txt": f"Paradise Lost (J. Milton), {_GUTENBERG}",
    "longtext/austen/sensesensibility.txt": f"Sense and Sensibility (J. Austen), {_GUTENBERG}",
    "longtext/kjv/kjv.txt": f"the King James Bible, {_GUTENBERG}",
    "longtext/wikitext2_test.raw": "the WikiText-2 raw test split (wiki.test.raw of wikitext-2-raw-v1)",
    "haystack/PaulGrahamEssays.json": '{"text": ...}: Paul Graham\'s essays, the haystack of RULER '
    "(github.com/NVIDIA/RULER, scripts/data/synthetic/json/download_paulgraham_essay.py)",
    "haystack/english_words.json": '{"0": word, ...}: an English word list (e.g. /usr/share/dict/words); '
    "without it RULER's keys and word tasks use made-up words",
    "qa/squad.json": "SQuAD 2.0 dev set, dev-v2.0.json (rajpurkar.github.io/SQuAD-explorer)",
    "qa/hotpotqa.json": "HotpotQA dev set, distractor setting, hotpot_dev_distractor_v1.json (hotpotqa.github.io)",
    "longbench_v1/minilongbench_237.jsonl": "the 237-sample LongBench v1 subset of MiniLongBench, one JSON "
    "object a line with dataset, prompt (template + context), answers, all_classes, index_in_minilongbench",
    "longbench_v1/dataset2maxlen.json": "LongBench v1's answer lengths per dataset (config/dataset2maxlen.json "
    "of github.com/THUDM/LongBench)",
    "longbench_v2/longbench_v2_short.jsonl": 'the "short" items of LongBench v2 (Hugging Face dataset '
    "THUDM/LongBench-v2, length == short), one JSON object a line; or install `kvdex[data]` and stay online",
    "math/gsm8k.jsonl": "GSM8K test set, test.jsonl of github.com/openai/grade-school-math",
    "math/math500.jsonl": "MATH-500 (problem, answer per line; Hugging Face dataset HuggingFaceH4/MATH-500)",
    "math/aime24.jsonl": "AIME 2024 problems (problem, answer per line)",
    "math/aime25.jsonl": "AIME 2025 problems (problem, answer per line)",
}


def data_root(path: str | os.PathLike | None = None, required: bool = True) -> Path | None:
    """The evaluation data folder: ``path`` (``--data``), else ``$KVDEX_DATA``; None if neither is set
    and not ``required``."""
    given = path if path is not None else os.environ.get(ENV) or None
    if given is None:
        if required:
            raise ValueError(f"this task needs an evaluation data folder: pass --data DIR or set {ENV}=DIR")
        return None
    root = Path(given).expanduser()
    if not root.is_dir():
        if path is None and not required:  # an optional folder named by the environment only
            return None
        where = "--data" if path is not None else f"${ENV}"
        raise ValueError(f"evaluation data folder not found: {root} (from {where}); pass an existing folder")
    return root.resolve()


def need(root: Path | None, rel: str, task: str, alternative: str | None = None) -> Path:
    """``root / rel``, or ``ValueError`` naming the file, where it comes from and where it goes
    (and ``alternative``, another way to run the task without the file, where there is one)."""
    if root is not None and (Path(root) / rel).is_file():
        return Path(root) / rel
    origin = FILES.get(rel, "see the task's documentation")
    where = f"{Path(root) / rel}" if root is not None else f"DIR/{rel}, then pass --data DIR (or set {ENV}=DIR)"
    missing = "not found" if root is not None else "needs an evaluation data folder"
    other = f"; or {alternative}" if alternative else ""
    raise ValueError(f"{task}: {rel} {missing}. It is {origin}. Put it at {where}{other}")


def source_files(root: Path | None, source: str, task: str) -> list[Path]:
    """The files of long-text ``source``: a name of :data:`SOURCES` (in the data folder) or a text file."""
    if source in SOURCES:
        return [need(root, rel, f"{task} --source {source}") for rel in SOURCES[source]]
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    raise ValueError(
        f"{task}: --source {source!r} is neither a text file nor a known source ({', '.join(SOURCES)}); "
        "pass any long UTF-8 text file, e.g. a Project Gutenberg book"
    )


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


def long_text_samples(root: Path | None, source: str, tokenizer, length: int, extra: int, n: int, seed: int) -> list:
    """``n`` samples of ``length`` prompt tokens from the long texts of ``source`` (a name of
    :data:`SOURCES` in the data folder ``root``, or a text file), each with the text's next ``extra``
    tokens as ``meta["continuation"]``; text i % len(texts), a seeded random place."""
    from kvdex.eval.runner import Sample

    files = source_files(root, source, "long-text samples")
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}-{length}-{i}")
        path = files[i % len(files)]
        rel = str(path.relative_to(root)) if root is not None and path.is_relative_to(root) else str(path)
        ids = text_span(tokenizer, _read_text(str(path)), length + extra, rng)
        out.append(Sample(f"{path.stem}-{i}", ids[:length], {"source": rel, "continuation": ids[length:]}))
    return out
