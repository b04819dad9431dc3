"""Attention recall: how much of the true attention each policy's attended set captures.

Per query head, at sampled layers and decode steps (PRKV §3.1; the true weights are the softmax
over every cached token, sink and window included):

* ``recall``     -- the sum of the true softmax weights of the attended tokens;
* ``topk_hit``   -- the share of the oracle top-k tokens (k = tokens attended by the head's kv
                    head) that were attended;
* ``ceiling``    -- the recall of those oracle top-k tokens (the best any set of that size can do
                    for this query head alone);
* ``rel_l2``     -- ``|o - o_dense| / |o_dense|`` of the attention output, where ``o`` is computed
                    by the decode kernel from the slots the store handed out (so a store returning
                    wrong K/V shows up here even when the positions are right).

:class:`RecallObserver` is a ``cache.observer``; :class:`RecallTask` runs it teacher-forced on the
real continuation of long books (``mode="teacher"``, which also gives the perplexity) or
free-running (``mode="free"``, the model's own greedy continuation: recall drift over a long
generation). With ``probe=True`` the decode is dense and each policy's selection is scored against
the dense model's queries (:class:`Probe`): selection quality without compounding error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvdex.eval import data
from kvdex.eval.runner import FULL, DecodeContext, RunResult, Sample, Task, greedy, teacher_forced
from kvdex.kernels import sparse_decode_attention
from kvdex.policies import make_policy
from kvdex.policies.full import FullPolicy
from kvdex.selection import Selection
from kvdex.view import LayerView

METRICS = ("recall", "topk_hit", "ceiling", "rel_l2")


def true_attention(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float):
    """The dense softmax weights over every cached token: q [B, Hq, D], k [B, H, L, D] (store slots),
    ``lengths`` [B] -> (p [B, H, G, L] fp32, live [B, L] bool), G = Hq // H query heads per kv head."""
    b, hq, d = q.shape
    h, L = k.shape[1], k.shape[2]
    s = torch.einsum("bhgd,bhld->bhgl", q.view(b, h, hq // h, d).float(), k.float()) * scale
    live = torch.arange(L, device=k.device)[None, :] < lengths.to(k.device)[:, None]
    return torch.softmax(s.masked_fill(~live[:, None, None, :], float("-inf")), dim=-1), live


def attention_metrics(q: torch.Tensor, store, aset, scale: float) -> dict[str, torch.Tensor]:
    """Metrics of one decode attention: q [B, Hq, D] -> {name: [B, Hq]} (fp32) plus ``attended`` [B, H]."""
    k, v = store.dense()
    b, hq, d = q.shape
    h, L = k.shape[1], k.shape[2]
    p, live = true_attention(q, k, store.lengths, scale)  # [B, H, G, L], [B, L]

    # attended positions -> a [B, H, L] mask (invalid entries are sent to a spare column L)
    pos = torch.where(aset.valid, aset.positions.long(), L).to(k.device)
    att = torch.zeros(b, h, L + 1, dtype=torch.bool, device=k.device)
    att.scatter_(2, pos, True)
    att = att[:, :, :L] & live[:, None, :]
    kcount = att.sum(-1)  # [B, H]

    recall = (p * att[:, :, None, :]).sum(-1)
    sp, order = p.sort(dim=-1, descending=True)
    in_topk = (torch.arange(L, device=k.device) < kcount[:, :, None, None]).expand_as(p)  # by rank
    topk = torch.zeros_like(in_topk).scatter_(-1, order, in_topk)
    hit = (topk & att[:, :, None, :]).sum(-1).float() / kcount[:, :, None].clamp(min=1)
    ceiling = (sp * in_topk).sum(-1)

    o_dense = torch.einsum("bhgl,bhld->bhgd", p, v.float()).reshape(b, hq, d)
    o = sparse_decode_attention(q, aset.k, aset.v, aset.idx, aset.valid, scale).float()
    rel = (o - o_dense).norm(dim=-1) / o_dense.norm(dim=-1).clamp(min=1e-30)
    flat = lambda x: x.reshape(b, hq)
    return {"recall": flat(recall), "topk_hit": flat(hit), "ceiling": flat(ceiling), "rel_l2": rel, "attended": kcount}


class RecallObserver:
    """A ``cache.observer`` that measures :func:`attention_metrics` at sampled layers and steps.

    ``step`` must be set by the decode loop before each step (:meth:`set_step`); only steps with
    ``(step - 1) % every == 0`` and layers in ``layers`` (None: all sparse layers) are measured.
    Results: ``self.rows`` -- one (step, layer, {metric: [Hq] numpy}) per measurement (batch row 0).
    """

    def __init__(self, layers=None, every: int = 1, probe: Probe | None = None):
        self.layers = None if layers is None else set(layers)
        self.every = max(1, every)
        self.probe = probe
        self.step = 0
        self.rows: list[tuple[int, int, dict[str, np.ndarray]]] = []

    def set_step(self, step: int) -> None:
        self.step = step

    def measuring(self, layer: int) -> bool:
        return (self.step - 1) % self.every == 0 and (self.layers is None or layer in self.layers)

    def __call__(self, layer, q, store, aset, scale) -> None:
        if self.probe is not None:  # score the probed policy's choice, not the (dense) set decoded with
            target = self.probe.target_policy  # asked every step: policies keep state
            sel = target.select(q, LayerView.of(layer, store, scale, target.cfg))
            if not self.measuring(layer):
                return
            aset = store.attend(sel)
        elif not self.measuring(layer):
            return
        m = attention_metrics(q, store, aset, scale)
        self.rows.append((self.step, layer, {k: v[0].cpu().numpy() for k, v in m.items()}))

    def table(self, metric: str) -> tuple[list[int], list[int], np.ndarray]:
        """(steps, layers, values [steps, layers, heads]) of one metric."""
        steps = sorted({s for s, _, _ in self.rows})
        layers = sorted({lay for _, lay, _ in self.rows})
        si = {s: i for i, s in enumerate(steps)}
        li = {x: i for i, x in enumerate(layers)}
        heads = len(self.rows[0][2][metric]) if self.rows else 0
        out = np.full((len(steps), len(layers), heads), np.nan)
        for s, lay, m in self.rows:
            out[si[s], li[lay]] = m[metric]
        return steps, layers, out


@dataclass
class SelectAll(FullPolicy):
    """``full`` through the sparse path: selects every middle token explicitly.

    ``full`` returns ``Selection(everything=True)``, which a device store serves by dense attention
    without calling the observer; this twin attends the same set through ``store.attend`` and the
    decode kernel, so ``full`` is measured like every other policy (recall 1, rel-L2 ~0).
    """

    def select(self, q, view) -> Selection:
        end = view.window_start  # [B]
        pos = torch.arange(view.sink, int(end.max()), device=end.device)
        pos = torch.where(pos[None, :] < end[:, None], pos[None, :], -1)
        return Selection(tokens=pos[:, None, :].expand(-1, view.kv_heads, -1).contiguous())


@dataclass
class Probe(SelectAll):
    """Decode densely while probing ``target``: the recall harness's ``--probe`` mode.

    The model attends every token (so no layer's query carries an upstream selection error), while
    a ``target`` policy bound to the same cache sizes is indexed with every update and asked to
    select at every sparse-layer step; :class:`RecallObserver` scores that selection against the
    dense attention. This isolates selection quality, as a standalone script that scores selections
    against prompt queries would; the default mode measures recall inside the policy's own decode.
    """

    target: str = "quest"
    uses_budget = True  # the target's budget sizes the cache (offload work buffers)

    def bind(self, info) -> None:
        super().bind(info)
        self.target_policy = make_policy(self.target)
        if self.target_policy.observes:
            # Such a policy learns from the attention over its own attended set (H2O's accumulated
            # scores); a dense decode would feed it attention it never had. No honest probe exists.
            raise ValueError(
                f"--probe cannot measure {self.target_policy.name!r}: it learns from the attention of its own "
                "attended tokens, which a dense probe decode does not have; measure it without --probe"
            )
        self.target_policy.bind(info)

    @property
    def obs_window(self) -> int:
        """The target's (the prefill keeps the queries it needs); 0 until bound."""
        target = self.__dict__.get("target_policy")
        return target.obs_window if target is not None else 0

    def index(self, layer, update) -> None:
        self.target_policy.index(layer, update)

    def on_step(self, step, logits) -> None:
        self.target_policy.on_step(step, logits)


class RecallTask(Task):
    """Recall of every policy on long real text. ``lengths`` are the prefilled context lengths."""

    name = "recall"
    score_name = "recall"
    summary_keys = ("topk_hit", "ceiling", "rel_l2", "attended", "ppl")

    def __init__(
        self,
        mode: str = "teacher",
        steps: int = 32,
        every: int = 1,
        layers=None,
        source: str = "books",
        probe: bool = False,
        data_root=None,
    ):
        if mode not in ("teacher", "free"):
            raise ValueError(f"mode must be 'teacher' or 'free', got {mode!r}")
        if steps < 1 or every < 1:
            raise ValueError(f"steps and every must be >= 1, got steps={steps}, every={every}")
        self.mode, self.steps, self.every, self.source, self.probe = mode, steps, every, source, probe
        self.layers = None if layers is None else sorted(layers)
        self.root = data.data_root(data_root, required=False)
        data.source_files(self.root, source, "recall")  # a missing file fails here, before the model loads

    def options(self) -> dict:
        return {
            "mode": self.mode,
            "steps": self.steps,
            "every": self.every,
            "layers": self.layers,
            "source": self.source,
            "probe": self.probe,
        }

    def label(self) -> str:
        return self.mode + ("-probe" if self.probe else "")

    def policy(self, name: str):
        if name == FULL:
            return SelectAll()
        return Probe(target=name) if self.probe else name

    def samples(self, tokenizer, length, n, seed) -> list[Sample]:
        extra = self.steps + 1 if self.mode == "teacher" else 0
        return data.long_text_samples(self.root, self.source, tokenizer, length, extra, n, seed)

    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        probe = ctx.cache.policy if isinstance(ctx.cache.policy, Probe) else None
        obs = RecallObserver(self.layers, self.every, probe)
        ctx.cache.observer = obs
        step = obs.set_step
        if ctx.progress and self.steps >= 256:
            step = _progress_steps(obs, self.steps)
        record = {"source": sample.meta["source"]}
        if self.mode == "teacher":
            nll = teacher_forced(ctx, sample.meta["continuation"], before_step=step)
            record["nll"] = [round(x, 5) for x in nll]
        else:
            toks = greedy(ctx, self.steps + 1, before_step=step)
            record["generated"] = ctx.tokenizer.decode(toks)
        ctx.cache.observer = None
        steps, layers, _ = obs.table("recall")
        record.update(steps=steps, layers=layers)
        for metric in (*METRICS, "attended"):
            _, _, t = obs.table(metric)
            record[metric] = np.round(t.mean(-1), 6).tolist()  # [steps, layers], mean over heads
            if metric == "recall":
                record["recall_per_head"] = np.round(t.mean(0), 5).tolist()  # [layers, heads]
        return record

    def metrics(self, records: list[dict]) -> dict:
        out = {"samples": len(records)}
        for metric in (*METRICS, "attended"):
            vals = np.array([r[metric] for r in records], dtype=float)  # [samples, steps, layers]
            out[metric] = float(np.nanmean(vals)) if vals.size else None
            if metric == "recall" and vals.size:
                out["recall_p10"] = float(np.nanpercentile(vals, 10))
                out["per_layer"] = dict(
                    zip(map(str, records[0]["layers"]), np.nanmean(vals, (0, 1)).tolist(), strict=True)
                )
                out["per_step"] = dict(
                    zip(map(str, records[0]["steps"]), np.nanmean(vals, (0, 2)).tolist(), strict=True)
                )
        nll = [x for r in records for x in r.get("nll", [])]
        out["ppl"] = float(np.exp(np.mean(nll))) if nll else None
        out["score"] = out["recall"]
        return out

    def report(self, task_dir: Path, results: list[RunResult]) -> list[Path]:
        from kvdex.eval import plots

        return plots.recall_plots(task_dir, results, self.label())


def _progress_steps(obs: RecallObserver, total: int):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, leave=False, desc="decode", unit="tok")

    def step(i):
        obs.set_step(i)
        bar.update(1)
        if i >= total:
            bar.close()

    return step
