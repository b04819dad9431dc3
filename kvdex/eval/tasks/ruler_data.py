"""The data RULER's generators read (:mod:`kvdex.eval.tasks.ruler`): the noise and essay haystacks,
the word list (or made-up words without one) and the SQuAD / HotpotQA paragraphs. Files come from
the data folder (``--data`` / ``KVDEX_DATA``) or, for the essay haystack, any text file (``--haystack``).
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from pathlib import Path

from kvdex.eval import data

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _noise_sentences() -> list[str]:
    return [s if s.endswith(".") else s + "." for s in NOISE.split(". ")]


ESSAYS = "haystack/PaulGrahamEssays.json"
WORDS = "haystack/english_words.json"
QA_FILES = {"squad": "qa/squad.json", "hotpotqa": "qa/hotpotqa.json"}


def haystack_file(root: Path | None, haystack, needed: bool) -> Path | None:
    """The essay haystack: ``haystack`` (any text file, ``.json`` with ``{"text": ...}``) or the data
    folder's essays; ``ValueError`` saying what to pass when one is ``needed`` and none is there."""
    if haystack is not None:
        path = Path(haystack).expanduser()
        if not path.is_file():
            raise ValueError(f"--haystack {haystack}: no such file (pass any long UTF-8 text file)")
        return path
    if root is not None and (root / ESSAYS).is_file():
        return root / ESSAYS
    if needed:
        data.need(
            root, ESSAYS, "ruler (essay haystack)", "pass --haystack FILE, any long text file (e.g. a Gutenberg book)"
        )
    return None


@lru_cache(maxsize=2)
def _essay_sentences(path: str) -> list[str]:
    text = data._read_text(path)
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def _words(root: Path | None) -> list[str]:
    """Keys and CWE words: the English word list of the data folder, or made-up words without one."""
    return _english_words(str(root)) if root is not None and (root / WORDS).is_file() else _made_up_words()


@lru_cache(maxsize=1)
def _made_up_words(n: int = 12000) -> list[str]:
    """``n`` distinct pronounceable lower-case words of 2-3 syllables (deterministic)."""
    rng = random.Random("kvdex-words")
    onsets, vowels = "bcdfghjklmnprstvwz", "aeiou"
    out, seen = [], set()
    while len(out) < n:
        w = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(2, 3)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


@lru_cache(maxsize=2)
def _english_words(root: str) -> list[str]:
    words = json.loads((Path(root) / WORDS).read_text())
    return [w for w in words.values() if w.isalpha() and w.islower() and 3 <= len(w) <= 10]


@lru_cache(maxsize=4)
def _qa_data(path: str, dataset: str) -> tuple[list[dict], list[str]]:
    """(questions with answers and gold doc ids, paragraph pool) of SQuAD 2.0 dev or HotpotQA dev."""
    items, pool, index = [], [], {}

    def doc(text: str) -> int:
        if text not in index:
            index[text] = len(pool)
            pool.append(text)
        return index[text]

    if dataset == "squad":
        raw = json.loads(Path(path).read_text())["data"]
        for article in raw:
            for para in article["paragraphs"]:
                d = doc(para["context"])
                for qa in para["qas"]:
                    answers = sorted({a["text"] for a in qa["answers"]})
                    if not qa.get("is_impossible") and answers:
                        items.append({"question": qa["question"], "answers": answers, "docs": [d]})
    elif dataset == "hotpotqa":
        raw = json.loads(Path(path).read_text())
        for q in raw:  # gold: the paragraphs of the supporting facts; the question's other ones join the pool
            support = {title for title, _ in q["supporting_facts"]}
            docs = [doc(f"{title}\n{''.join(sents)}") for title, sents in q["context"]]
            gold = [d for d, (title, _) in zip(docs, q["context"], strict=True) if title in support]
            items.append({"question": q["question"], "answers": [q["answer"]], "docs": gold})
    else:
        raise ValueError(f"unknown QA dataset {dataset!r}")
    return items, pool
