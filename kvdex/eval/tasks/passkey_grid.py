"""``passkey``: the seed papers' passkey grid -- needle depth 0-95% (step 5%) x context length.

Prompts and the scorer come from :mod:`kvdex.eval.passkey`. Every (depth, length) cell holds
``--samples`` prompts with different keys; a policy's score is its accuracy over all cells, and
:meth:`PasskeyTask.report` draws one depth x length heatmap per (policy, budget) (IceCache Fig. 6).
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvdex.eval import passkey
from kvdex.eval.runner import DecodeContext, RunResult, Sample, Task, greedy, stop_token_ids

DEPTHS = tuple(range(0, 100, 5))  # percent


class PasskeyTask(Task):
    name = "passkey"
    score_name = "accuracy"

    def __init__(self, depths=DEPTHS, max_new_tokens: int = 12):
        depths = sorted(set(depths))
        if not depths or any(not 0 <= d <= 100 for d in depths):
            raise ValueError(f"depths are percentages in [0, 100], got {depths}")
        self.depths, self.max_new_tokens = depths, max_new_tokens

    def options(self) -> dict:
        return {"depths": self.depths, "max_new_tokens": self.max_new_tokens}

    def samples(self, tokenizer, length, n, seed) -> list[Sample]:
        out = []
        for depth in self.depths:
            for i in range(n):
                key_seed = random.Random(f"{seed}-{length}-{depth}-{i}").getrandbits(32)  # str seeds are stable
                text, answer = passkey.make_passkey_prompt(tokenizer, length, depth / 100, key_seed)
                ids = passkey.encode(tokenizer, text)
                out.append(Sample(f"d{depth}-{i}", ids, {"depth": depth, "answer": answer}))
        return out

    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        toks = greedy(ctx, self.max_new_tokens, stop_token_ids(ctx.tokenizer, ctx.model))
        completion = ctx.tokenizer.decode(toks, skip_special_tokens=True)
        answer = sample.meta["answer"]
        return {
            "depth": sample.meta["depth"],
            "prompt_tokens": ctx.prompt_len,
            "answer": answer,
            "completion": completion,
            "correct": passkey.score(answer, completion),
        }

    def metrics(self, records: list[dict]) -> dict:
        by_depth = defaultdict(list)
        for r in records:
            by_depth[r["depth"]].append(r["correct"])
        return {
            "samples": len(records),
            "score": float(np.mean([r["correct"] for r in records])),
            "per_depth": {str(d): float(np.mean(v)) for d, v in sorted(by_depth.items())},
        }

    def report(self, task_dir: Path, results: list[RunResult]) -> list[Path]:
        from kvdex.eval import plots

        lengths = sorted({r.length for r in results})
        paths = []
        for (policy, budget), runs in _by_pair(results).items():
            grid = np.full((len(self.depths), len(lengths)), np.nan)
            for r in runs:
                for d, acc in r.metrics["per_depth"].items():
                    if int(d) in self.depths:
                        grid[self.depths.index(int(d)), lengths.index(r.length)] = acc
            b = "" if budget is None else f"__b{budget}"
            title = f"passkey, {results[0].model}: {policy}" + ("" if budget is None else f", budget {budget}")
            path = plots.heatmap(
                task_dir / f"passkey__{results[0].model}__{policy}{b}.png",
                grid,
                self.depths,
                lengths,
                title,
                "needle depth (%)",
                "context length (tokens)",
            )
            if path is not None:
                paths.append(path)
        return paths


def _by_pair(results) -> dict:
    out = defaultdict(list)
    for r in results:
        out[(r.policy, r.budget)].append(r)
    return out
