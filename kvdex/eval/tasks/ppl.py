"""``ppl``: perplexity of long natural text decoded through the policy (teacher forced).

The first ``length`` tokens of a passage are prefilled densely; the next ``tokens`` tokens are fed
one at a time through the policy's cache, each predicting the next, so every scored token is
predicted by a sparse decode step. Perplexity = exp(mean NLL); lower is better, and the ratio to
``full`` is ``ppl / ppl_full`` (1.0 = no loss).
"""

from __future__ import annotations

import numpy as np

from kvdex.eval import data
from kvdex.eval.runner import DecodeContext, Sample, Task, teacher_forced


class PerplexityTask(Task):
    name = "ppl"
    score_name = "ppl"
    higher_is_better = False
    summary_keys = ("nll", "ppl_last_quarter")

    def __init__(self, tokens: int = 256, source: str = "books", data_root=None):
        if tokens < 4:
            raise ValueError(f"tokens must be >= 4, got {tokens}")
        self.tokens, self.source = tokens, source
        self.root = data.data_root(data_root, required=False)
        data.source_files(self.root, source, "ppl")  # a missing file fails here, before the model loads

    def options(self) -> dict:
        return {"tokens": self.tokens, "source": self.source}

    def samples(self, tokenizer, length, n, seed) -> list[Sample]:
        return data.long_text_samples(self.root, self.source, tokenizer, length, self.tokens + 1, n, seed)

    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        nll = teacher_forced(ctx, sample.meta["continuation"])
        return {"source": sample.meta["source"], "nll": [round(x, 5) for x in nll]}

    def metrics(self, records: list[dict]) -> dict:
        nll = np.array([r["nll"] for r in records], dtype=float)  # [samples, tokens]
        last = nll[:, -max(1, nll.shape[1] // 4) :]
        return {
            "samples": len(records),
            "tokens": int(nll.size),
            "nll": float(nll.mean()),
            "ppl_last_quarter": float(np.exp(last.mean())),
            "score": float(np.exp(nll.mean())),
        }
