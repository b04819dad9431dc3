"""``needle``: where a policy loses a needle that the oracle keeps, per layer and kv head.

RULER's needle prompts (single, multi-key, multi-value, multi-query) and the answer's tokens are
known, so the needle's token positions in the prompt are known too: they are the positions where the
expected value's tokens occur (found by token search; every occurrence counts, so a value that the
prompt states twice is one needle in two places). The answer is teacher-forced: every decode step
after the first predicts the next token of the right answer, and at each sparse layer a
:class:`NeedleObserver` compares the policy's attended set with the true attention over every
cached token. Per (layer, kv head), averaged over steps and samples:

* ``kept``   -- share of the needle's tokens the policy attended;
* ``mass``   -- share of the true attention weight on the needle that the policy kept (query heads of
                the group summed): 1 when every needle token a head looks at was attended;
* ``oracle`` -- share of the needle's tokens inside the exact top-k of the same size (k = tokens the
                policy attended for that kv head): what the budget allows;
* ``rank``   -- rank (0 = first) of the needle's best page among all middle pages by true attention
                weight; with ``pages`` (the pages the policy attended) it says whether the page was
                within reach of a page policy that scores pages exactly;
* ``weight`` -- the true attention weight on the needle: how much the head looks at it at all.

A policy misses where ``oracle`` is high and ``kept`` low, and it matters where ``weight`` is high
(the retrieval heads). ``kvdex eval needle`` prints the per-policy table and writes one PNG of
``mass`` per policy (layers x kv heads).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from kvdex.eval import data, prompting
from kvdex.eval.recall import SelectAll, true_attention
from kvdex.eval.runner import FULL, DecodeContext, RunResult, Sample, Task, teacher_forced

NEEDLE_SUBTASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multivalue",
    "niah_multiquery",
)
FIELDS = ("kept", "mass", "oracle", "rank", "pages", "weight")


def find_positions(prompt_ids: list[int], value_ids: list[list[int]]) -> list[int]:
    """Every prompt position covered by an occurrence of one of ``value_ids`` (token sequences)."""
    found: set[int] = set()
    n = len(prompt_ids)
    for seq in value_ids:
        m = len(seq)
        if m == 0:
            continue
        first = seq[0]
        for i in range(n - m + 1):
            if prompt_ids[i] == first and prompt_ids[i : i + m] == seq:
                found.update(range(i, i + m))
    return sorted(found)


def value_token_variants(tokenizer, value: str) -> list[list[int]]:
    """The token sequences ``value`` can have inside a text: after a space, a newline or a colon."""
    out = []
    for pre in (" ", "\n", ":", ""):
        ids = tokenizer(pre + value, add_special_tokens=False)["input_ids"]
        pre_ids = tokenizer(pre, add_special_tokens=False)["input_ids"] if pre else []
        if ids[: len(pre_ids)] == pre_ids:
            ids = ids[len(pre_ids) :]
        if ids and ids not in out:
            out.append(ids)
    return out


def needle_metrics(
    q: torch.Tensor, store, aset, needle: torch.Tensor, scale: float, slot_positions=None
) -> dict[str, np.ndarray]:
    """One decode attention of one layer: q [B, Hq, D]; ``needle`` [B, L] bool over token positions.

    ``slot_positions(slots [B, H, L]) -> positions`` maps store slots to token positions for a policy
    that reorders its store (PRKV relocates its static tokens); None: slot == position.
    Returns per (batch row, kv head) arrays [B, H] of :data:`FIELDS`."""
    k, _ = store.dense()
    b, h, L = k.shape[0], k.shape[1], k.shape[2]
    p, live = true_attention(q, k, store.lengths, scale)
    p = p.sum(2)  # [B, H, L]: the group's query heads summed
    if slot_positions is not None:  # true weights from slot order into token-position order
        slots = torch.arange(L, device=k.device).expand(b, h, L)
        p = torch.zeros_like(p).scatter_(2, slot_positions(slots).long().to(k.device), p)
    needle = needle[:, :L].to(k.device) & live
    pos = aset.positions.long().to(k.device)
    if slot_positions is not None:  # the attended slots into token positions too (PRKV's relocated slots)
        pos = slot_positions(torch.where(aset.valid.to(k.device), pos, 0)).long().to(k.device)
    pos = torch.where(aset.valid.to(k.device), pos, L)
    att = torch.zeros(b, h, L + 1, dtype=torch.bool, device=k.device).scatter_(2, pos, True)[:, :, :L] & live[:, None]
    count = att.sum(-1)  # [B, H]
    nd = needle[:, None, :].expand(-1, h, -1)
    n_needle = nd.sum(-1).clamp(min=1).float()
    kept = (att & nd).sum(-1) / n_needle
    weight = (p * nd).sum(-1)
    mass = (p * (att & nd)).sum(-1) / weight.clamp(min=1e-30)
    order = p.argsort(dim=-1, descending=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(L, device=k.device).expand_as(order))
    oracle = ((ranks < count[..., None]) & nd).sum(-1) / n_needle

    grid = store.grid
    ps, sink = grid.page_size, grid.sink
    mid_pages = max(0, (L - sink) // ps)
    if mid_pages:
        pm = p[:, :, sink : sink + mid_pages * ps].reshape(b, h, mid_pages, ps).sum(-1)  # [B, H, P]
        pn = nd[:, :, sink : sink + mid_pages * ps].reshape(b, h, mid_pages, ps).any(-1)
        prank = torch.empty_like(pm, dtype=torch.long).scatter_(
            -1, pm.argsort(-1, descending=True), torch.arange(mid_pages, device=k.device).expand(b, h, -1)
        )
        rank = torch.where(pn, prank, mid_pages).min(-1).values.float()
        rank = torch.where(pn.any(-1), rank, torch.nan)
    else:
        rank = torch.full((b, h), torch.nan, device=k.device)
    pages = count.float() / ps
    out = {"kept": kept, "mass": mass, "oracle": oracle, "rank": rank, "pages": pages, "weight": weight}
    return {name: v.float().cpu().numpy() for name, v in out.items()}


class NeedleObserver:
    """A ``cache.observer`` recording :func:`needle_metrics` at every sparse layer of every step."""

    def __init__(self, needle: torch.Tensor, slot_positions=None):
        self.needle = needle  # [B, L] bool over token positions
        self.slot_positions = slot_positions  # (layer, slots [B, H, L]) -> positions, or None (slot == position)
        self.rows: dict[int, list[dict[str, np.ndarray]]] = {}

    def __call__(self, layer, q, store, aset, scale) -> None:
        if self.needle.shape[1] < store.dense()[0].shape[2]:
            pad = store.dense()[0].shape[2] - self.needle.shape[1]
            self.needle = torch.nn.functional.pad(self.needle, (0, pad))
        remap = None if self.slot_positions is None else (lambda slots: self.slot_positions(layer, slots))
        self.rows.setdefault(layer, []).append(needle_metrics(q, store, aset, self.needle, scale, remap))

    def table(self) -> tuple[list[int], dict[str, np.ndarray]]:
        """(layers, {field: [layers, heads]}) for batch row 0, averaged over steps."""
        layers = sorted(self.rows)
        return layers, {
            f: np.stack([np.nanmean(np.stack([r[f][0] for r in self.rows[x]]), 0) for x in layers]) for f in FIELDS
        }


class NeedleTask(Task):
    """Needle diagnostics over RULER's needle subtasks (``--subtasks``)."""

    name = "needle"
    score_name = "mass"
    summary_keys = ("kept", "oracle", "missed", "retrieval_mass")

    def __init__(self, subtasks=None, data_root=None):
        from kvdex.eval.tasks.ruler import SUBTASKS

        self.subtasks = list(subtasks or NEEDLE_SUBTASKS)
        bad = [s for s in self.subtasks if s not in SUBTASKS or not s.startswith("niah")]
        if bad:
            raise ValueError(f"needle diagnostics take RULER's niah_* subtasks; not {', '.join(bad)}")
        # word keys and essay haystacks need the data folder; uuid needles among needles do not
        self.root = data.data_root(data_root, required=False)

    def options(self) -> dict:
        return {"subtasks": self.subtasks}

    def policy(self, name: str):
        return SelectAll() if name == FULL else name

    def samples(self, tokenizer, length, n, seed) -> list[Sample]:
        from kvdex.eval.tasks.ruler import SUBTASKS, generate

        out = []
        for sub in self.subtasks:
            for i in range(n):
                rng = random.Random(f"{seed}-{length}-{sub}-{i}")
                text, refs = generate(SUBTASKS[sub], tokenizer, length - 32, rng, self.root)
                ids = prompting.encode(tokenizer, text)
                variants = [v for ref in refs for v in value_token_variants(tokenizer, ref)]
                positions = find_positions(ids, variants)
                if not positions:
                    continue  # the value's tokens merge with their neighbours here: no known position
                answer = tokenizer(refs[0], add_special_tokens=False)["input_ids"]
                meta = {"subtask": sub, "references": refs, "positions": positions, "answer": answer}
                out.append(Sample(f"{sub}-{i}", ids, meta))
        if not out:
            raise ValueError("no needle prompt had its value's tokens found in the prompt; try another --seed")
        return out

    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        needle = torch.zeros(1, ctx.prompt_len + 64, dtype=torch.bool)
        needle[0, sample.meta["positions"]] = True
        # a policy that reorders its store's slots says where each slot's token sits (PRKV's relocation)
        pol = ctx.cache.policy
        obs = NeedleObserver(needle, pol.positions if pol.relocates else None)
        ctx.cache.observer = obs
        tokens = sample.meta["answer"]
        nll = teacher_forced(ctx, tokens) if len(tokens) > 1 else []
        ctx.cache.observer = None
        layers, t = obs.table()
        rec = {"subtask": sample.meta["subtask"], "layers": layers, "answer_nll": [round(x, 4) for x in nll]}
        rec.update({f: np.round(t[f], 5).tolist() for f in FIELDS})
        return rec

    def metrics(self, records: list[dict]) -> dict:
        recs = [r for r in records if r["layers"]]
        out = {"samples": len(records), "measured": len(recs)}
        if not recs:
            return {**out, "score": None}
        arr = {f: np.array([r[f] for r in recs], dtype=float) for f in FIELDS}  # [samples, layers, heads]
        w = arr["weight"]
        for f in ("kept", "oracle", "rank", "pages"):
            out[f] = float(np.nanmean(arr[f]))
        # attention-weighted: the share of all needle attention (over heads, layers, samples) kept
        out["mass"] = float(np.nansum(arr["mass"] * w) / max(np.nansum(w), 1e-30))
        # the retrieval heads: per sample, the (layer, head) pairs holding the top 10 % of needle weight
        top = w >= np.nanpercentile(w, 90, axis=(1, 2), keepdims=True)
        out["retrieval_mass"] = float(np.nanmean(np.where(top, arr["mass"], np.nan)))
        # (layer, head) pairs where the oracle of the same size keeps half the needle and the policy none
        out["missed"] = float(np.mean((arr["oracle"] >= 0.5) & (arr["kept"] == 0)))
        out["per_layer_head_mass"] = np.round(np.nanmean(arr["mass"], 0), 4).tolist()
        out["layers"] = recs[0]["layers"]
        out["score"] = out["mass"]
        return out

    def report(self, task_dir: Path, results: list[RunResult]) -> list[Path]:
        return plot_mass(task_dir, results)


def _wrap_spec(spec: str, width: int = 26) -> str:
    """A policy spec broken into lines of at most ``width`` characters at its ``:`` separators (a panel title)."""
    lines: list[str] = []
    for part in spec.split(":"):
        if lines and len(lines[-1]) + 1 + len(part) <= width:
            lines[-1] += ":" + part
        else:
            lines.append(part if not lines else ":" + part)
    return "\n".join(lines)


def plot_mass(task_dir: Path, results: list[RunResult]) -> list[Path]:
    """One PNG per (length, budget): a layers x kv heads heatmap of the kept needle mass per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    runs_ok = [r for r in results if r.metrics.get("per_layer_head_mass")]
    groups: dict[tuple, list[RunResult]] = {}
    for r in runs_ok:  # one figure per (length, budget); full (no budget) heads each of its length's figures
        if r.budget is not None:
            full = [x for x in runs_ok if x.length == r.length and x.budget is None]
            groups.setdefault((r.length, r.budget), full[:1]).append(r)
    for (length, budget), runs in groups.items():
        lines = max(_wrap_spec(r.policy).count("\n") for r in runs) + 2  # the tallest panel title
        height = 3.6 + 0.15 * lines
        fig, axes = plt.subplots(1, len(runs), figsize=(2.2 * len(runs) + 1, height), squeeze=False)
        fig.subplots_adjust(top=1 - (0.3 + 0.15 * lines) / height, bottom=0.45 / height)
        for ax, r in zip(axes[0], runs, strict=True):
            m = np.array(r.metrics["per_layer_head_mass"])
            im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_title(f"{_wrap_spec(r.policy)}\nmass {r.metrics['mass']:.2f}", fontsize=8)
            ax.set_xlabel("kv head")
            ax.set_yticks(range(len(r.metrics["layers"])), r.metrics["layers"], fontsize=6)
        axes[0][0].set_ylabel("layer")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, fraction=0.03, pad=0.01, label="needle attention kept")
        title = f"needle attention kept per layer and kv head, {length} tokens, budget {budget}"
        fig.suptitle(title, fontsize=9, y=0.99)
        path = task_dir / f"needle_mass_L{length}_b{budget}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
