"""Token-level rerank of a page policy's candidate pages: the ``rerank`` option of ``quest``, ``arkvale``,
``prkv`` and ``chess`` (kvdex options, not in their papers; docs/policies/<name>.md, "Token rerank").

A page policy attends whole pages, so with 16-token pages most of a small budget goes to tokens that do
not matter. With ``rerank=N > 0`` the policy's own page scores (Quest's bound, ArkVale's digest, CHESS's
hierarchy; unchanged) choose ``N x`` the pages its token budget fills -- the *candidates* -- and the exact
``q.k`` of every key of those pages ranks their tokens; the best ``T`` tokens per kv head are attended
(a token :class:`~kvdex.selection.Selection`, as ``oracle`` / ``pariskv`` return). ``T`` is the policy's
retrieval budget in tokens (PRKV: its dynamic part); the candidates number ``N * ceil(T / page_size)``.
Sink and window (and PRKV's static tokens) are attended as before.

The keys are read in place from a GPU-resident store (on CUDA by one Triton kernel,
:mod:`kvdex.kernels.rerank_triton`; its PyTorch twin gathers them with
:meth:`~kvdex.storage.LayerStore.page_keys`), through the fetch path of an offloaded one (``N`` times the
selected pages cross PCIe each step, on top of the attended tokens). Fixed shapes and no host read of a
device value: a captured CUDA graph replays it.

How a kv head's query heads combine (``rerank_group``):

* ``"max"``: a token's score is the largest ``q.k`` over the group (the GQA rule of Quest's and ArkVale's
  page scores);
* ``"weight"``: the sum over the group of each head's softmax weight of the token, normalised over sink,
  window and every candidate token -- the oracle's criterion restricted to the candidates (with every
  middle page a candidate it is the oracle's selection).

``rerank_share`` (quest, arkvale, prkv; IceCache's summary search too) sets a floor on the candidates as a share of
each sequence's middle: ``max(rerank x the budget's pages, ceil(rerank_share x middle pages))``. A pool of a
fixed multiple of the budget covers less of the middle as the context grows (``rerank=4`` at budget 256 is
12.5 % of an 8k middle and 3.1 % of a 32k one), and the scorecard's retrieval follows that share
(docs/results.md, "What the rerank's pool must hold"). Static shapes: the page top-k is as wide as the
share of every page the policy scores (its index capacity under CUDA-graph decoding) and each row keeps its
own count of the best, so captured and eager steps choose the same candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.scoring import candidate_scores, topk_ids
from kvdex.selection import Selection

RERANK_GROUPS = ("max", "weight")


def check_rerank(rerank, group: str, share=0.0) -> None:
    """ValueError unless ``rerank`` is an int >= 0, ``group`` one of :data:`RERANK_GROUPS` and ``share``
    passes :func:`check_share`."""
    if not isinstance(rerank, int) or isinstance(rerank, bool) or rerank < 0:
        raise ValueError(
            f"rerank must be an int >= 0 (0: attend the chosen pages; N > 0: rank the tokens of N x as many "
            f"candidate pages by their exact q.k), got {rerank!r}"
        )
    if group not in RERANK_GROUPS:
        raise ValueError(f"rerank_group must be one of {', '.join(RERANK_GROUPS)}, got {group!r}")
    check_share(rerank, share)


def check_share(rerank, share) -> None:
    """ValueError unless ``share`` (``rerank_share``) is a number in [0, 1], above 0 only with ``rerank`` > 0."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ValueError(f"rerank_share must be a number in [0, 1] (a share of the middle's pages), got {share!r}")
    if share and not rerank:
        raise ValueError(f"rerank_share={share!r} sizes the rerank's candidates: it needs rerank >= 1 (e.g. rerank=4)")


@dataclass
class RerankOption:
    """The ``rerank`` / ``rerank_group`` options of a page policy (a base before :class:`Policy`:
    :class:`~kvdex.policies.base.PageScoringPolicy` and ``chess``): their fields, their check and the
    selection's granularity (tokens with ``rerank``)."""

    rerank: int = 0  # 0: the pages; N > 0: the best tokens of N x as many candidate pages by exact q.k
    rerank_group: str = "max"  # rerank > 0: "max" of the group's q.k, or "weight" (summed softmax weights)
    rerank_share: float = 0.0  # rerank > 0: candidates at least this share of each middle's pages

    def __post_init__(self) -> None:
        check_rerank(self.rerank, self.rerank_group, self.rerank_share)

    @property
    def granularity(self) -> str:
        """``"token"`` with ``rerank`` (the selection names tokens), else ``"page"``."""
        return "token" if self.rerank else "page"


def candidate_pages(tokens: int, page_size: int, rerank: int) -> int:
    """Candidate pages for a token budget of ``tokens``: ``rerank`` x the pages it fills (rounded up)."""
    return rerank * -(-max(tokens, 0) // page_size)


def rerank_tokens(
    q: torch.Tensor,
    view,
    pages: torch.Tensor,
    tokens: int,
    group: str = "max",
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``tokens`` best middle slots [B, H, min(tokens, C * ps)] (``-1`` padded) of the candidate
    ``pages`` [B, H, C] (slot pages, ``-1`` padded) by the exact ``q.k`` of the query heads q [B, Hq, D],
    combined per kv head by ``group``. ``first`` [B] (optional, device): slots below it are not
    candidates (PRKV's static tokens, attended apart). ``view``: the layer's
    :class:`~kvdex.view.LayerView` (its store, scale, grid, lengths)."""
    b, hq, d = q.shape
    h, ps = view.kv_heads, view.page_size
    g = hq // h
    c = pages.shape[-1]
    if c == 0 or tokens <= 0:
        return view.no_ids(q.device)
    pages = pages.to(q.device)
    store = view.store
    slot = view.sink + pages[..., None] * ps + torch.arange(ps, device=q.device)  # [B, H, C, ps]
    fast = triton_kernel("rerank_triton", "candidate_scores", on=q) if store.positional_slots else None
    live = None  # [B, H, N]: the candidate slots that hold a middle key (the kernel applies the same rule itself)
    if fast is None or group == "weight":
        live = (pages[..., None] >= 0) & (slot < view.window_start.to(q.device)[:, None, None, None])
        if first is not None:
            live = live & (slot >= first.to(q.device)[:, None, None, None])
        live = live.flatten(2)
    if fast is not None:  # one kernel reads the candidates' keys in place (kvdex.kernels.rerank_triton)
        s = fast(q, store.k, pages, view.window_start, sink=view.sink, page_size=ps, scale=view.scale,
                 group=group, first=first)  # fmt: skip
    else:
        keys = store.page_keys(pages).to(q.device).flatten(2, 3)  # [B, H, N, D]
        s = candidate_scores(q, keys, live, group, view.scale)
    if group == "max":
        score = s
    else:  # "weight": the group's summed softmax weights over sink + window + the candidates
        score = _weights(q.float().view(b, h, g, d), s, view).sum(2).masked_fill(~live, float("-inf"))
    ids = topk_ids(score, tokens, ordered=False)  # [B, H, min(tokens, N)]: a set (attention sums in any order)
    return torch.where(ids >= 0, slot.flatten(2).gather(2, ids.clamp(min=0)), -1)


def _weights(qg: torch.Tensor, logits: torch.Tensor, view) -> torch.Tensor:
    """Softmax weights of the candidate ``logits`` [B, H, G, N] (scaled, ``-inf`` where not a candidate),
    normalised over the candidates and the sink + window keys that every step attends."""
    fixed = view.store.attend(Selection())  # sink + window slots only: nothing is fetched
    kf = fixed.k.gather(2, fixed.idx[..., None].expand(-1, -1, -1, fixed.k.shape[-1]))  # [B, H, F, D]
    sf = torch.einsum("bhgd,bhfd->bhgf", qg, kf.to(qg.device).float()) * view.scale
    sf = sf.masked_fill(~fixed.valid.to(qg.device)[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([sf, logits], dim=-1), dim=-1, keepdim=True)  # [B, H, G, 1]
    return torch.exp(logits - lse)
