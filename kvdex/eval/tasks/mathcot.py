"""``math``: GSM8K / MATH-500 / AIME chain-of-thought answers decoded through each policy.

The prompt is short; what grows is the generation, so this task's "length" is the generation
budget (``--lengths`` = max new tokens): once the chain of thought outgrows the budget, every
step attends a selection of the model's own earlier reasoning, and decoding drift shows up as
lost accuracy. The final answer is the last ``\\boxed{}`` (else "answer is X", else the last
number), graded with :func:`kvdex.eval.metrics.math_equal` (a normaliser, not a symbolic checker).
"""

from __future__ import annotations

import numpy as np

from kvdex.eval import data, metrics, prompting
from kvdex.eval.runner import DecodeContext, Sample, Task, greedy, stop_token_ids

DATASETS = {  # name -> (file, problem field)
    "gsm8k": ("math/gsm8k.jsonl", "question"),
    "math500": ("math/math500.jsonl", "problem"),
    "aime24": ("math/aime24.jsonl", "problem"),
    "aime25": ("math/aime25.jsonl", "problem"),
}
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class MathTask(Task):
    name = "math"
    score_name = "accuracy"
    summary_keys = ("answered", "mean_tokens")

    def __init__(self, dataset: str = "gsm8k", data_root=None):
        if dataset not in DATASETS:
            raise ValueError(f"unknown math dataset {dataset!r}; choose from {', '.join(DATASETS)}")
        self.dataset = dataset
        self.root = data.data_root(data_root, required=False)
        self.path = data.need(self.root, DATASETS[dataset][0], f"math --dataset {dataset}")

    def label(self) -> str:
        return self.dataset

    def options(self) -> dict:
        return {"dataset": self.dataset}

    def samples(self, tokenizer, length, n, seed) -> list[Sample]:
        """The first ``n`` problems; ``length`` (the generation budget) goes into ``meta``."""
        _, field = DATASETS[self.dataset]
        out = []
        for i, rec in enumerate(data.read_jsonl(self.path)[:n]):
            gold = metrics.gsm8k_gold(rec["answer"]) if self.dataset == "gsm8k" else str(rec["answer"])
            text = prompting.render(tokenizer, f"{rec[field]}\n{INSTRUCTION}")
            meta = {"gold": gold, "max_new_tokens": length}
            out.append(
                Sample(
                    f"{self.dataset}-{rec.get('unique_id', rec.get('id', i))}", prompting.encode(tokenizer, text), meta
                )
            )
        return out

    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        toks = greedy(ctx, sample.meta["max_new_tokens"], stop_token_ids(ctx.tokenizer, ctx.model))
        text = ctx.tokenizer.decode(toks, skip_special_tokens=True)
        pred = metrics.extract_math_answer(text)
        gold = sample.meta["gold"]
        return {
            "gold": gold,
            "prediction": pred,
            "correct": metrics.math_equal(pred, gold),
            "boxed": metrics.last_boxed(text) is not None,
            "tokens": len(toks),
            "completion": text,
        }

    def metrics(self, records: list[dict]) -> dict:
        return {
            "samples": len(records),
            "score": float(np.mean([r["correct"] for r in records])),
            "answered": float(np.mean([r["boxed"] for r in records])),
            "mean_tokens": float(np.mean([r["tokens"] for r in records])),
        }
