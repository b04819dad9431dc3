"""``ruler``: RULER's retrieval, tracing and QA tasks (Hsieh et al., 2024), generated at any length.

Written from the paper's task descriptions; the prompts are RULER-style, not copied.

* NIAH (needle in a haystack): needles "One of the special magic {numbers} for {key} is: {value}."
  hidden in a haystack (``noise``: a repeated filler paragraph; ``essay``: Paul Graham's essays;
  ``needle``: nothing but other needles). Variants: single (1 key), multi-key (distractor keys),
  multi-value (4 values under one key: all must be returned), multi-query (4 keys asked).
  Keys are word pairs from an English word list, values 7-digit numbers or UUIDs.
* VT (variable tracking): a chain ``VAR A = 12345 ... VAR B = VAR A ...`` hidden in noise;
  every variable holding the value must be named.
* CWE (common words extraction): a numbered list of words in which 10 words appear 30 times
  each and every other word 3 times; the 10 common words must be named.
* FWE (frequent words extraction): "coded" words drawn from a Zipf distribution (alpha 2) over a
  random vocabulary, joined by " ... "; the 3 most frequent must be named.
* QA: a SQuAD / HotpotQA question with its gold paragraph(s) among distractor paragraphs of
  other questions, shuffled into "Document i" blocks.

Aggregation tasks (CWE, FWE): RULER prefixes a one-shot example; we ask zero-shot with an answer
prefix (as for every other subtask here), which keeps the whole context the haystack.

Scoring as in RULER: NIAH and VT by the share of the expected strings in the answer
(``string_match_all``), QA by whether any gold answer appears (``string_match_part``). A
policy's score is the mean over subtasks; each subtask is also reported with its ratio to full.
"""

from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdex.eval import data, metrics, prompting
from kvdex.eval.runner import DecodeContext, Sample, Task, greedy, stop_token_ids
from kvdex.eval.tasks.ruler_data import (
    ESSAYS,
    NOISE,  # noqa: F401  (the noise haystack's text, part of this module's names)
    QA_FILES,
    _essay_sentences,
    _noise_sentences,
    _qa_data,
    _words,
    haystack_file,
)


@dataclass(frozen=True)
class Niah:
    haystack: str  # noise | essay | needle
    keys: str = "words"  # words | uuids
    values: str = "numbers"  # numbers | uuids
    num_keys: int = 1  # needles with distinct keys (the queried ones included)
    num_values: int = 1  # values under each queried key
    num_queries: int = 1  # keys asked for
    max_new_tokens: int = 128


@dataclass(frozen=True)
class VariableTracking:
    chains: int = 1
    hops: int = 4
    max_new_tokens: int = 30


@dataclass(frozen=True)
class CommonWords:
    num_common: int = 10
    freq_common: int = 30
    freq_uncommon: int = 3
    max_new_tokens: int = 120


@dataclass(frozen=True)
class FrequentWords:
    alpha: float = 2.0
    vocab: int = 2000
    top: int = 3
    max_new_tokens: int = 50


@dataclass(frozen=True)
class QA:
    dataset: str  # squad | hotpotqa
    max_new_tokens: int = 32


SUBTASKS = {
    "niah_single_1": Niah("noise"),
    "niah_single_2": Niah("essay"),
    "niah_single_3": Niah("essay", values="uuids"),
    "niah_multikey_1": Niah("essay", num_keys=4),
    "niah_multikey_2": Niah("needle"),
    "niah_multikey_3": Niah("needle", keys="uuids", values="uuids"),
    "niah_multivalue": Niah("essay", num_values=4),
    "niah_multiquery": Niah("essay", num_keys=4, num_queries=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
    "qa_1": QA("squad"),
    "qa_2": QA("hotpotqa"),
}


class RulerTask(Task):
    name = "ruler"
    score_name = "score"

    def __init__(self, subtasks=None, data_root=None, max_new_tokens: int | None = None, haystack=None):
        subtasks = list(subtasks or SUBTASKS)
        unknown = [s for s in subtasks if s not in SUBTASKS]
        if unknown:
            raise ValueError(f"unknown RULER subtask(s) {', '.join(unknown)}; choose from {', '.join(SUBTASKS)}")
        self.subtasks = subtasks
        self.summary_keys = tuple(subtasks)
        self.max_new_tokens = max_new_tokens
        self.root = data.data_root(data_root, required=False)
        essay = any(isinstance(SUBTASKS[s], Niah) and SUBTASKS[s].haystack == "essay" for s in subtasks)
        self.haystack = haystack_file(self.root, haystack, essay)
        for s in subtasks:  # QA needs its dataset in the data folder: fail before the model loads
            if isinstance(SUBTASKS[s], QA):
                data.need(self.root, QA_FILES[SUBTASKS[s].dataset], f"ruler {s}")

    def options(self) -> dict:
        return {"subtasks": self.subtasks, "max_new_tokens": self.max_new_tokens}

    def samples(self, tokenizer, length, n, seed) -> list[Sample]:
        out = []
        for sub in self.subtasks:
            for i in range(n):
                rng = random.Random(f"{seed}-{length}-{sub}-{i}")
                # As RULER: the length holds the prompt and the answer (prompt <= length - max new tokens).
                room = length - (self.max_new_tokens or SUBTASKS[sub].max_new_tokens)
                text, refs = generate(SUBTASKS[sub], tokenizer, room, rng, self.root, self.haystack)
                meta = {"subtask": sub, "references": refs}
                out.append(Sample(f"{sub}-{i}", prompting.encode(tokenizer, text), meta))
        return out

    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        spec = SUBTASKS[sample.meta["subtask"]]
        n = self.max_new_tokens or spec.max_new_tokens
        toks = greedy(ctx, n, stop_token_ids(ctx.tokenizer, ctx.model))
        pred = ctx.tokenizer.decode(toks, skip_special_tokens=True).strip()
        refs = sample.meta["references"]
        score = (metrics.string_match_part if isinstance(spec, QA) else metrics.string_match_all)(pred, refs)
        return {"subtask": sample.meta["subtask"], "prediction": pred, "references": refs, "score": score}

    def metrics(self, records: list[dict]) -> dict:
        out = {"samples": len(records)}
        for sub in self.subtasks:
            vals = [r["score"] for r in records if r["subtask"] == sub]
            out[sub] = float(np.mean(vals)) if vals else None
        out["score"] = float(np.mean([out[s] for s in self.subtasks if out[s] is not None]))
        return out


# ---- generators -----------------------------------------------------------------------------------


def generate(spec, tokenizer, length: int, rng: random.Random, root: Path | None, haystack=None) -> tuple:
    """(prompt text of at most ``length`` tokens, expected answer strings). ``root``: the data folder
    (or None); ``haystack``: the text file of the essay haystack (default: the data folder's essays)."""
    if isinstance(spec, Niah):
        return _niah(spec, tokenizer, length, rng, root, haystack)
    if isinstance(spec, VariableTracking):
        return _vt(spec, tokenizer, length, rng)
    if isinstance(spec, CommonWords):
        return _cwe(spec, tokenizer, length, rng, root)
    if isinstance(spec, FrequentWords):
        return _fwe(spec, tokenizer, length, rng)
    return _qa(spec, tokenizer, length, rng, root)


def _word_key(rng: random.Random, root: Path | None) -> str:
    words = _words(root)
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(spec: Niah, tokenizer, length, rng, root, haystack=None) -> tuple[str, list[str]]:
    new_key = (lambda: _uuid(rng)) if spec.keys == "uuids" else (lambda: _word_key(rng, root))
    new_value = (lambda: _uuid(rng)) if spec.values == "uuids" else (lambda: str(rng.randint(10**6, 10**7 - 1)))
    kind = "numbers" if spec.values == "numbers" else "uuids"
    keys = []
    while len(keys) < spec.num_keys:
        k = new_key()
        if k not in keys:
            keys.append(k)
    values = {k: [new_value() for _ in range(spec.num_values)] for k in keys}
    needles = [_needle(k, v, kind) for k in keys for v in values[k]]
    queried = rng.sample(keys, spec.num_queries)
    refs = [v for k in queried for v in values[k]]

    what = "special magic " + (kind if len(refs) > 1 else kind[:-1])
    if spec.num_queries == 1:
        q = queried[0]
        ask = f"What {'are all the' if len(refs) > 1 else 'is the'} {what} for {q} mentioned in the provided text?"
        prefix = f" The {what} for {q} mentioned in the provided text {'are' if len(refs) > 1 else 'is'}"
    else:
        q = ", ".join(queried[:-1]) + f", and {queried[-1]}"
        ask = f"What are all the special magic {kind} for {q} mentioned in the provided text?"
        prefix = f" The special magic {kind} for {q} mentioned in the provided text are"
    intro = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards."
    )

    if spec.haystack == "needle":  # the haystack is made of other keys' needles
        extra = []

        def unit(i: int) -> str:
            while len(extra) <= i:
                extra.append(_needle(new_key(), new_value(), kind))
            return extra[i]
    else:
        if spec.haystack == "noise":
            sentences = _noise_sentences()
        else:
            sentences = _essay_sentences(str(haystack or data.need(root, ESSAYS, "ruler (essay haystack)")))
        offset = 0 if spec.haystack == "noise" else rng.randrange(len(sentences))
        unit = lambda i: sentences[(offset + i) % len(sentences)]
    depths = sorted(rng.random() for _ in needles)
    rng.shuffle(needles)

    def build(n: int) -> str:
        units = [unit(i) for i in range(n)]
        for d, needle in zip(reversed(depths), reversed(needles), strict=True):  # back to front: indices hold
            units.insert(round(d * n), needle)
        return prompting.render(tokenizer, f"{intro}\n{' '.join(units)}\n{ask}", prefix)

    text, _ = prompting.fit(tokenizer, build, length, start=max(1, length // 32))
    return text, refs


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _vt(spec: VariableTracking, tokenizer, length, rng) -> tuple[str, list[str]]:
    names = set()

    def new_name() -> str:
        while True:
            n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if n not in names:
                names.add(n)
                return n

    chains, refs, query = [], [], None
    for c in range(spec.chains):
        value = str(rng.randint(10000, 99999))
        chain = [new_name() for _ in range(spec.hops + 1)]
        lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:], strict=False)]
        chains.append(lines)
        if c == 0:
            refs, query = chain, value
    statements = [s for chain in chains for s in chain]  # chains in order, each chain's hops in order
    depths = sorted(rng.random() for _ in statements)
    sentences = _noise_sentences()
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    ask = f"Question: Find all variables that are assigned the value {query} in the text above."
    prefix = (
        f" Answer: According to the chain(s) of variable assignment in the text above, {len(refs)} variables "
        f"are assigned the value {query}, they are:"
    )

    def build(n: int) -> str:
        units = [sentences[i % len(sentences)] for i in range(n)]
        for d, s in zip(reversed(depths), reversed(statements), strict=True):
            units.insert(round(d * n), s)
        return prompting.render(tokenizer, f"{intro}\n\n{' '.join(units)}\n{ask}", prefix)

    text, _ = prompting.fit(tokenizer, build, length, start=max(1, length // 32))
    return text, refs


def _cwe(spec: CommonWords, tokenizer, length, rng, root) -> tuple[str, list[str]]:
    words = rng.sample(_words(root), 6000)
    common, uncommon = words[: spec.num_common], words[spec.num_common :]
    order_seed = rng.random()
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    ask = f"Question: What are the {spec.num_common} most common words in the above list?"
    prefix = f" Answer: The top {spec.num_common} words that appear most often in the list are:"

    # A numbered word costs ~5 tokens; short contexts get fewer repeats of the common words so that
    # they fill at most a third of the prompt (RULER's 30 repeats need ~1.5k tokens on their own).
    freq = min(spec.freq_common, max(spec.freq_uncommon + 2, length // (15 * spec.num_common)))

    def build(n: int) -> str:  # n distinct uncommon words, each freq_uncommon times
        if n > len(uncommon):
            raise ValueError(f"{length} tokens need more than {len(uncommon)} distinct words for cwe")
        seq = common * freq + uncommon[:n] * spec.freq_uncommon
        random.Random(f"{order_seed}-{n}").shuffle(seq)
        body = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(seq))
        return prompting.render(tokenizer, f"{intro}\n{body}\n{ask}", prefix)

    text, _ = prompting.fit(tokenizer, build, length, start=max(1, length // 64))
    return text, common


def _fwe(spec: FrequentWords, tokenizer, length, rng) -> tuple[str, list[str]]:
    vocab = set()
    while len(vocab) < spec.vocab:
        vocab.add("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    nprng = np.random.default_rng(rng.getrandbits(32))
    draws = []

    def sample(n: int) -> list[str]:  # a prefix of one Zipf stream: n grows, earlier draws stay
        while len(draws) < n:
            z = nprng.zipf(spec.alpha, size=max(n, 256))
            draws.extend(int(x) - 1 for x in z if x <= spec.vocab)
        return [vocab[i] for i in draws[:n]]

    intro = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words."
    )
    ask = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
        "frequently appeared words in the above coded text?"
    )
    prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"
    build = lambda n: prompting.render(tokenizer, f"{intro}\n\n{' .... '.join(sample(n))}\n{ask}", prefix)
    text, n = prompting.fit(tokenizer, build, length, start=max(1, length // 16))
    counts: dict[str, int] = {}
    for w in sample(n):
        counts[w] = counts.get(w, 0) + 1
    # Zipf with alpha 2: ranks 1..3 are far apart, so the top 3 are unambiguous at any useful length.
    return text, [w for w, _ in sorted(counts.items(), key=lambda kv: -kv[1])[: spec.top]]


def _qa(spec: QA, tokenizer, length, rng, root) -> tuple[str, list[str]]:
    items, pool = _qa_data(str(data.need(root, QA_FILES[spec.dataset], f"ruler qa ({spec.dataset})")), spec.dataset)
    item = items[rng.randrange(len(items))]
    gold = set(item["docs"])
    distractors = [d for d in rng.sample(range(len(pool)), min(len(pool), 4000)) if d not in gold]
    order_seed = rng.random()
    ask = "Answer the question based on the given documents. Only give me the answer and do not output any other words."

    def build(n: int) -> str:
        docs = list(item["docs"]) + distractors[:n]
        random.Random(f"{order_seed}-{n}").shuffle(docs)
        body = "\n\n".join(f"Document {i + 1}:\n{pool[d]}" for i, d in enumerate(docs))
        user = f"{ask}\n\nThe following are given documents.\n\n{body}\n\n{ask}\n\nQuestion: {item['question']}"
        return prompting.render(tokenizer, user, " Answer:")

    text, n = prompting.fit(tokenizer, build, length, start=4)
    if n >= len(distractors):
        raise ValueError(f"not enough distractor paragraphs for {length} tokens")
    return text, item["answers"]
