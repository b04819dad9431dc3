"""The scorecard's task groups and their prompts, all from kvdex's own seeded generators.

* ``retrieval``: RULER-style subtasks (:mod:`kvdex.eval.tasks.ruler`'s generators): needle single,
  multi-key, multi-value, multi-query; variable tracking; common- and frequent-word extraction;
  QA with distractor documents (SQuAD / HotpotQA alternating; needs the data folder). The needles
  sit in Paul Graham's essays when the data folder is there, else in RULER's repeated noise
  sentences (made-up key words then). Scored as RULER does (share of expected strings found).
* ``passkey``: the passkey grid (:mod:`kvdex.eval.passkey`), depths x prompts per depth.
* ``longtext``: long books (the data folder): the first ``recall_steps`` tokens of the text's
  continuation are teacher-forced with attention recall measured at every sparse layer (the true
  attention mass each policy's attended set holds; ``full`` holds all of it), then the rest of the
  continuation is teacher-forced for perplexity.
* ``longbench``: LongBench v1 (the MiniLongBench subset), with ``--with-longbench``.

Prompt ``i`` of a subtask at a length comes from ``random.Random(f"{seed}-{length}-{subtask}-{i}")``
(passkey: ``f"{seed}-{length}-{depth}-{i}"``), so every policy, run and resumed run sees the same
prompts. Generated prompts are cached under the output folder (generation tokenizes each prompt a
dozen times to fit its length).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvdex.eval import data, metrics, passkey, prompting
from kvdex.eval.runner import Sample
from kvdex.eval.tasks import ruler

GROUPS = ("retrieval", "passkey", "longtext", "longbench")

# name -> (spec with data, spec without data); max_new_tokens fit each answer with room to spare
_NIAH = {
    "niah_single": dict(num_keys=1),
    "niah_multikey": dict(num_keys=4),
    "niah_multivalue": dict(num_values=4),
    "niah_multiquery": dict(num_keys=4, num_queries=4),
}
_NIAH_TOKENS = {"niah_single": 32, "niah_multikey": 32, "niah_multivalue": 64, "niah_multiquery": 64}
SUBTASKS = (*_NIAH, "vt", "cwe", "fwe", "qa")


def subtask_spec(name: str, haystack: str, index: int = 0):
    """The :mod:`ruler` generator spec of scorecard subtask ``name`` (QA alternates SQuAD / HotpotQA)."""
    if name in _NIAH:
        return ruler.Niah(haystack, max_new_tokens=_NIAH_TOKENS[name], **_NIAH[name])
    if name == "vt":
        return ruler.VariableTracking(max_new_tokens=30)
    if name == "cwe":
        return ruler.CommonWords(max_new_tokens=96)
    if name == "fwe":
        return ruler.FrequentWords(max_new_tokens=32)
    if name == "qa":
        return ruler.QA("squad" if index % 2 == 0 else "hotpotqa", max_new_tokens=32)
    raise ValueError(f"unknown retrieval subtask {name!r}; choose from {', '.join(SUBTASKS)}")


@dataclass
class Group:
    """One task group at its settings: what it generates and how its prompts are decoded."""

    name: str
    options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def teacher(self) -> bool:
        return self.name == "longtext"

    def digest(self, common: dict) -> str:
        blob = json.dumps({"group": self.name, "options": self.options, **common}, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


def make_groups(cfg, root: Path | None, skipped: list[str] | None = None) -> list[Group]:
    """The groups ``cfg`` asks for, with what the data folder allows: a group left out entirely adds its
    note to ``skipped``; a group run in part carries its notes in ``Group.notes``."""
    out = []
    skipped = [] if skipped is None else skipped
    for name in cfg.tasks:
        if name not in GROUPS:
            raise ValueError(f"unknown scorecard task {name!r}; choose from {', '.join(GROUPS)}")
    for name in cfg.tasks:
        g = Group(name)
        if name == "retrieval":
            have = lambda rel: root is not None and (root / rel).is_file()  # noqa: E731
            essay = have("haystack/PaulGrahamEssays.json") and have("haystack/english_words.json")
            haystack = "essay" if essay else "noise"
            subs = [s for s in cfg.subtasks if s in SUBTASKS]
            bad = [s for s in cfg.subtasks if s not in SUBTASKS]
            if bad:
                raise ValueError(f"unknown retrieval subtask(s) {', '.join(bad)}; choose from {', '.join(SUBTASKS)}")
            if "qa" in subs and not (root is not None and (root / "qa/squad.json").is_file()):
                subs.remove("qa")
                g.notes.append("retrieval: QA skipped (no QA data; set KVDEX_DATA or --data)")
            if haystack == "noise":
                g.notes.append("retrieval: needles in repeated noise sentences (no essays in the data folder)")
            per = cfg.per_subtask or max(25, math.ceil(cfg.prompts / max(1, len(subs))))
            g.options = {"subtasks": subs, "per_subtask": per, "haystack": haystack, "max_new_cap": cfg.max_new_cap}
        elif name == "passkey":
            g.options = {"depths": list(cfg.passkey_depths), "per_depth": cfg.passkey_per_depth}
        elif name == "longtext":
            if root is None or not all((root / b).is_file() for b in data.BOOKS):
                skipped.append("recall / ppl skipped (no long texts; set KVDEX_DATA or --data)")
                continue
            g.options = {
                "prompts": cfg.longtext_prompts,
                "recall_steps": cfg.recall_steps,
                "ppl_tokens": cfg.ppl_tokens,
                "source": "books",
            }
        elif name == "longbench":
            if root is None or not (root / "longbench_v1/minilongbench_237.jsonl").is_file():
                skipped.append("LongBench v1 skipped (no LongBench data; set KVDEX_DATA or --data)")
                continue
            g.options = {"per_dataset": cfg.longbench_per_dataset, "max_new_tokens": cfg.longbench_max_new_tokens}
        out.append(g)
    return out


# ---- generation -------------------------------------------------------------------------------------


def generate(group: Group, tokenizer, length: int, seed: int, root: Path | None) -> tuple[list[Sample], list[str]]:
    """Every prompt of ``group`` at ``length`` (deterministic), in a fixed order, and notes: a retrieval
    subtask whose prompt does not fit ``length`` (e.g. QA documents longer than a short context) is
    left out at that length, with a note."""
    o = group.options
    if group.name == "retrieval":
        jobs = [(s, i) for s in o["subtasks"] for i in range(o["per_subtask"])]

        def one(job, tokenizer):
            sub, i = job
            spec = subtask_spec(sub, o["haystack"], i)
            if o["max_new_cap"]:
                spec = dataclasses.replace(spec, max_new_tokens=min(spec.max_new_tokens, o["max_new_cap"]))
            rng = random.Random(f"{seed}-{length}-{sub}-{i}")
            src = root if (isinstance(spec, ruler.QA) or o["haystack"] == "essay") else None  # None: made-up words
            try:
                text, refs = ruler.generate(spec, tokenizer, length - spec.max_new_tokens, rng, src)
            except ValueError as e:
                return f"retrieval: {sub} left out at {length} tokens ({e})"
            meta = {"subtask": sub, "references": refs, "max_new": spec.max_new_tokens}
            meta["qa"] = isinstance(spec, ruler.QA)
            return Sample(f"{sub}-{i}", prompting.encode(tokenizer, text), meta)

        made = _parallel(one, jobs, tokenizer)
        first = {}  # one note per subtask left out
        for (sub, _), m in zip(jobs, made, strict=True):
            if isinstance(m, str):
                first.setdefault(sub, m)
        notes, bad = list(first.values()), set(first)
        return [m for m in made if isinstance(m, Sample) and m.meta["subtask"] not in bad], notes
    if group.name == "passkey":
        jobs = [(d, i) for d in o["depths"] for i in range(o["per_depth"])]

        def one(job, tokenizer):
            depth, i = job
            key_seed = random.Random(f"{seed}-{length}-{depth}-{i}").getrandbits(32)
            text, answer = passkey.make_passkey_prompt(tokenizer, length, depth / 100, key_seed)
            return Sample(f"d{depth}-{i}", passkey.encode(tokenizer, text), {"answer": answer, "max_new": 12})

        return _parallel(one, jobs, tokenizer), []
    if group.name == "longtext":
        extra = o["recall_steps"] + o["ppl_tokens"] + 1
        return data.long_text_samples(root, o["source"], tokenizer, length, extra, o["prompts"], seed), []
    if group.name == "longbench":
        from kvdex.eval.tasks.longbench import LongBenchTask

        task = LongBenchTask(version="v1", data_root=root)
        out = task.samples(tokenizer, length, o["per_dataset"], seed)
        for s in out:
            s.meta["max_new"] = min(s.meta["max_new_tokens"], o["max_new_tokens"])
        return sorted(out, key=lambda s: (len(s.input_ids), s.id)), []  # similar lengths share a batch
    raise ValueError(f"unknown group {group.name!r}")


def _parallel(fn, jobs, tokenizer) -> list:
    """``[fn(j, tokenizer) for j in jobs]`` on up to 8 threads, each with its own copy of the tokenizer
    (a fast tokenizer encodes outside the GIL; copies keep the threads from sharing its mutable state)."""
    workers = min(8, os.cpu_count() or 1, len(jobs))
    if workers <= 1:
        return [fn(j, tokenizer) for j in jobs]
    local = threading.local()

    def run(job):
        tok = getattr(local, "tok", None)
        if tok is None:
            tok = local.tok = copy.deepcopy(tokenizer)
        return fn(job, tok)

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, jobs))


def load_or_generate(path: Path, group: Group, tokenizer, length: int, seed: int, root) -> list[Sample]:
    """The prompts from ``path`` (``.npz``: token ids, meta, notes) if there, else generated and saved."""
    if not path.is_file():
        samples, notes = generate(group, tokenizer, length, seed, root)
        path.parent.mkdir(parents=True, exist_ok=True)
        off = np.cumsum([0] + [len(s.input_ids) for s in samples])
        ids = np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples]) if samples else np.zeros(0)
        meta = json.dumps([{"id": s.id, "meta": s.meta} for s in samples])
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, ids=ids, offsets=off, meta=np.array(meta), notes=np.array(json.dumps(notes)))
        tmp.replace(path)
    z = np.load(path, allow_pickle=False)
    meta = json.loads(str(z["meta"]))
    ids, off = z["ids"], z["offsets"]
    return [Sample(m["id"], ids[off[i] : off[i + 1]].astype(int).tolist(), m["meta"]) for i, m in enumerate(meta)]


def prompt_info(path: Path) -> tuple[int, list[str], list[str]] | None:
    """(number of prompts, their ids, notes) of a saved prompt file, or None."""
    if not path.is_file():
        return None
    z = np.load(path, allow_pickle=False)
    meta = json.loads(str(z["meta"]))
    return len(meta), [m["id"] for m in meta], json.loads(str(z["notes"]))


# ---- scoring ----------------------------------------------------------------------------------------


def score(group: Group, sample: Sample, prediction: str) -> float:
    """One greedy prediction's score in [0, 1]."""
    m = sample.meta
    if group.name == "retrieval":
        fn = metrics.string_match_part if m["qa"] else metrics.string_match_all
        return float(fn(prediction, m["references"]))
    if group.name == "passkey":
        return float(passkey.score(m["answer"], prediction))
    if group.name == "longbench":
        from kvdex.eval.tasks.longbench import score_v1

        return float(score_v1(m["dataset"], prediction, m["answers"], m.get("all_classes")))
    raise ValueError(f"{group.name} is not scored from a prediction")
