"""``longbench``: LongBench v1 (the 237-sample MiniLongBench subset) and LongBench v2 "short".

v1 (Bai et al., 2023): each sample's full prompt (template + context) is given; prompts longer
than the context length are truncated in the middle (first and last halves kept), as LongBench
does, and then wrapped in the chat template -- except for the few-shot and code-completion tasks,
which LongBench feeds raw. Answers are scored with the task's official metric family
(:mod:`kvdex.eval.metrics`, written from LongBench's descriptions): token F1 for QA, ROUGE-L
for summaries, class match, paragraph retrieval, passage count, code edit similarity; a
sample's score is its best over the gold answers. Scores are in [0, 1] (LongBench prints x100).

v2 (Bai et al., 2024): 4-way multiple choice over long contexts, zero-shot, the answer read from
"The correct answer is (X)"; score = accuracy.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import numpy as np

from kvdex.eval import data, metrics, prompting
from kvdex.eval.runner import DecodeContext, Sample, Task, greedy, stop_token_ids

V1_FILE = "longbench_v1/minilongbench_237.jsonl"
V1_MAXLEN = "longbench_v1/dataset2maxlen.json"
V2_FILE = "longbench_v2/longbench_v2_short.jsonl"
V2_HUB = "THUDM/LongBench-v2"  # Hugging Face dataset (split "train"; the "short" items are length == "short")

# dataset -> (category, metric)
V1_TASKS = {
    "narrativeqa": ("single_doc_qa", "qa_f1"),
    "qasper": ("single_doc_qa", "qa_f1"),
    "multifieldqa_en": ("single_doc_qa", "qa_f1"),
    "multifieldqa_zh": ("single_doc_qa", "qa_f1_zh"),
    "hotpotqa": ("multi_doc_qa", "qa_f1"),
    "2wikimqa": ("multi_doc_qa", "qa_f1"),
    "musique": ("multi_doc_qa", "qa_f1"),
    "dureader": ("multi_doc_qa", "rouge_l_zh"),
    "gov_report": ("summarization", "rouge_l"),
    "qmsum": ("summarization", "rouge_l"),
    "multi_news": ("summarization", "rouge_l"),
    "vcsum": ("summarization", "rouge_l_zh"),
    "trec": ("few_shot", "classification"),
    "triviaqa": ("few_shot", "qa_f1"),
    "samsum": ("few_shot", "rouge_l"),
    "lsht": ("few_shot", "classification"),
    "passage_count": ("synthetic", "count"),
    "passage_retrieval_en": ("synthetic", "retrieval"),
    "passage_retrieval_zh": ("synthetic", "retrieval"),
    "lcc": ("code", "code_sim"),
    "repobench-p": ("code", "code_sim"),
}
CATEGORIES = ("single_doc_qa", "multi_doc_qa", "summarization", "few_shot", "synthetic", "code")
# Few-shot and completion prompts are fed without the chat template; few-shot answers are scored on
# their first line (the model may go on to write the next example).
NO_CHAT = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}

V2_TEMPLATE = (
    "Please read the following text and answer the question below.\n\n<text>\n{context}\n</text>\n\n"
    "What is the correct answer to this question: {question}\nChoices:\n(A) {A}\n(B) {B}\n(C) {C}\n(D) {D}\n\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)


def score_v1(dataset: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """A v1 sample's score: its dataset's metric, best over the gold answers."""
    _, name = V1_TASKS[dataset]
    if dataset in FIRST_LINE:
        prediction = metrics.first_line(prediction)
    if name == "classification":
        return max(metrics.classification_score(prediction, a, all_classes or []) for a in answers)
    fn = {
        "qa_f1": metrics.qa_f1,
        "qa_f1_zh": metrics.qa_f1_zh,
        "rouge_l": metrics.rouge_l,
        "rouge_l_zh": metrics.rouge_l_zh,
        "count": metrics.count_score,
        "retrieval": metrics.retrieval_score,
        "code_sim": metrics.code_sim_score,
    }[name]
    return max(fn(prediction, a) for a in answers)


def extract_choice(response: str) -> str | None:
    """The letter of "The correct answer is (X)" (or "... is X"), else None."""
    response = response.replace("*", "")
    m = re.search(r"The correct answer is \(([A-D])\)", response) or re.search(
        r"The correct answer is:?\s*([A-D])\b", response
    )
    return m.group(1) if m else None


def _require_datasets(root):
    """The ``datasets`` module for loading v2 from the hub; else say what to install or download."""
    try:
        import datasets
    except ImportError:
        data.need(
            root, V2_FILE, "longbench --version v2", f"online, pip install 'kvdex[data]' to load {V2_HUB} from the hub"
        )
    return datasets


def v2_records(root) -> list[dict]:
    """LongBench v2's "short" items: ``V2_FILE`` in the data folder, else the hub dataset ``V2_HUB``."""
    if root is not None and (root / V2_FILE).is_file():
        return data.read_jsonl(root / V2_FILE)
    datasets = _require_datasets(root)
    try:
        ds = datasets.load_dataset(V2_HUB, split="train")
    except Exception as e:  # offline, hub errors: say what to download instead
        raise ValueError(
            f"longbench --version v2: loading {V2_HUB} from the Hugging Face hub failed ({type(e).__name__}: {e}). "
            f"Offline, put {V2_FILE} in the data folder: {data.FILES[V2_FILE]}; pass --data DIR"
        ) from None
    return [dict(r) for r in ds if r.get("length") == "short"]


class LongBenchTask(Task):
    name = "longbench"

    def __init__(self, version: str = "v1", datasets=None, data_root=None, max_new_tokens: int | None = None):
        if version not in ("v1", "v2"):
            raise ValueError(f"version must be 'v1' or 'v2', got {version!r}")
        self.version, self.max_new_tokens = version, max_new_tokens
        self.root = data.data_root(data_root, required=False)
        if version == "v1":  # the v1 subset and its answer lengths come from the data folder
            self.v1_file = data.need(self.root, V1_FILE, "longbench --version v1")
            self.v1_maxlen = data.need(self.root, V1_MAXLEN, "longbench --version v1")
        elif self.root is None or not (self.root / V2_FILE).is_file():
            _require_datasets(self.root)
        if version == "v1":
            datasets = list(datasets or V1_TASKS)
            unknown = [d for d in datasets if d not in V1_TASKS]
            if unknown:
                raise ValueError(
                    f"unknown LongBench v1 dataset(s) {', '.join(unknown)}; choose from {', '.join(V1_TASKS)}"
                )
            self.datasets = datasets
            cats = {V1_TASKS[d][0] for d in datasets}
            self.summary_keys = tuple(c for c in CATEGORIES if c in cats)
            self.score_name = "avg_score"
        else:
            self.datasets = None
            self.summary_keys = ("easy", "hard")
            self.score_name = "accuracy"

    def label(self) -> str:
        return self.version

    def options(self) -> dict:
        return {"version": self.version, "datasets": self.datasets, "max_new_tokens": self.max_new_tokens}

    # ---- samples ------------------------------------------------------------------------------------
    def samples(self, tokenizer, length, n, seed) -> list[Sample]:
        """The first ``n`` samples of each dataset (v1) or of the file (v2), in file order."""
        return (
            self._v1_samples(tokenizer, length, n) if self.version == "v1" else self._v2_samples(tokenizer, length, n)
        )

    def _v1_samples(self, tokenizer, length, n) -> list[Sample]:
        maxlen = json.loads(self.v1_maxlen.read_text())
        taken = defaultdict(int)
        out = []
        for rec in data.read_jsonl(self.v1_file):
            ds = rec["dataset"]
            if ds not in self.datasets or taken[ds] >= n:
                continue
            taken[ds] += 1
            ids = _fit_prompt(tokenizer, rec["prompt"], length, chat=ds not in NO_CHAT)
            meta = {
                "dataset": ds,
                "answers": rec["answers"],
                "all_classes": rec.get("all_classes"),
                "max_new_tokens": maxlen[ds],
            }
            out.append(Sample(f"{ds}-{rec['index_in_minilongbench']}", ids, meta))
        return out

    def _v2_samples(self, tokenizer, length, n) -> list[Sample]:
        out = []
        for rec in v2_records(self.root)[:n]:
            text = V2_TEMPLATE.format(
                context=rec["context"],
                question=rec["question"],
                A=rec["choice_A"],
                B=rec["choice_B"],
                C=rec["choice_C"],
                D=rec["choice_D"],
            )
            ids = _fit_prompt(tokenizer, text, length, chat=True)
            meta = {"answer": rec["answer"], "difficulty": rec["difficulty"], "domain": rec["domain"]}
            out.append(Sample(rec["_id"], ids, {**meta, "max_new_tokens": 128}))
        return out

    # ---- decode and score ---------------------------------------------------------------------------
    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        n = self.max_new_tokens or sample.meta["max_new_tokens"]
        toks = greedy(ctx, n, stop_token_ids(ctx.tokenizer, ctx.model))
        pred = ctx.tokenizer.decode(toks, skip_special_tokens=True)
        m = sample.meta
        if self.version == "v1":
            score = score_v1(m["dataset"], pred, m["answers"], m["all_classes"])
            return {"dataset": m["dataset"], "prediction": pred, "answers": m["answers"], "score": score}
        choice = extract_choice(pred)
        return {
            "difficulty": m["difficulty"],
            "domain": m["domain"],
            "prediction": pred,
            "choice": choice,
            "answer": m["answer"],
            "score": float(choice == m["answer"]),
        }

    def metrics(self, records: list[dict]) -> dict:
        out = {"samples": len(records)}
        if self.version == "v1":
            per = defaultdict(list)
            for r in records:
                per[r["dataset"]].append(r["score"])
            datasets = {d: float(np.mean(v)) for d, v in per.items()}
            for cat in self.summary_keys:
                vals = [s for d, s in datasets.items() if V1_TASKS[d][0] == cat]
                out[cat] = float(np.mean(vals)) if vals else None
            out["per_dataset"] = datasets
            out["score"] = float(np.mean(list(datasets.values())))  # LongBench's average over tasks
            out["zh_tokenizer"] = metrics.ZH_TOKENIZER
            return out
        for level in ("easy", "hard"):
            vals = [r["score"] for r in records if r["difficulty"] == level]
            out[level] = float(np.mean(vals)) if vals else None
        out["unanswered"] = sum(r["choice"] is None for r in records)
        out["score"] = float(np.mean([r["score"] for r in records]))
        return out


def _fit_prompt(tokenizer, text: str, length: int, chat: bool) -> list[int]:
    """Truncate the raw prompt in the middle so that the final (chat-wrapped) prompt fits ``length``."""
    chat = chat and prompting.has_chat_template(tokenizer)
    overhead = len(prompting.encode(tokenizer, prompting.render(tokenizer, "", chat=chat), chat))
    budget = max(16, length - overhead)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > budget:
        text = tokenizer.decode(prompting.truncate_middle(ids, budget), skip_special_tokens=True)
    final = prompting.encode(tokenizer, prompting.render(tokenizer, text, chat=chat), chat)
    # decode/encode round trips can merge or split a few tokens: trim the middle again if needed
    return prompting.truncate_middle(final, length) if len(final) > length else final
