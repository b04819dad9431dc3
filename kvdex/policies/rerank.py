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

``rerank_unit`` (quest, arkvale, prkv): ``"token"`` (default) attends the best tokens as above; ``"page"`` attends
the best ``P`` candidate pages instead (``P``: the pages the policy attends without rerank), each page scored
by its tokens' exact scores combined as the group's are (``max``: the page's largest ``q.k``; ``weight``: the
softmax weight its tokens hold, the oracle's mass of the page). A page selection keeps each chosen token's
neighbours, which a later query may want: with ``select_every`` it keeps its accuracy where a token selection
loses some (docs/results.md, "Selecting every N steps").

``rerank_share`` (quest, arkvale, prkv; IceCache's summary search too) sets a floor on the candidates as a share of
each sequence's middle: ``max(rerank x the budget's pages, ceil(rerank_share x middle pages))``. A pool of a
fixed multiple of the budget covers less of the middle as the context grows (``rerank=4`` at budget 256 is
12.5 % of an 8k middle and 3.1 % of a 32k one), and the scorecard's retrieval follows that share
(docs/results.md, "What the rerank's pool must hold"). Static shapes: the page top-k is as wide as the
share of every page the policy scores (its index capacity under CUDA-graph decoding) and each row keeps its
own count of the best, so captured and eager steps choose the same candidates.

``pool_every=N`` (quest, arkvale, prkv; ``rerank_unit="token"``; IceCache's summary search has its own): the
page scores choose the candidates every ``N`` decode steps and whenever a page joins the middle (the
``select_every`` schedule, :mod:`kvdex.engine.reuse`), and the layer holds them; every step, refresh or not,
ranks the held candidates' tokens by its own query. What a step between refreshes saves is the page
scoring and the candidates' top-k; the rerank, the step's main cost with ``rerank_share``, runs every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.reference import rerank_slots_reference
from kvdex.kernels.scoring import candidate_scores, slot_scores, topk_ids
from kvdex.policies.reuse import check_select_every
from kvdex.selection import Selection


def check_rerank(rerank: int, share: float = 0.0, unit: str = "token") -> None:
    """ValueError unless ``rerank`` is an int >= 0, ``unit`` is ``"page"`` only with ``rerank`` > 0 and ``share``
    passes :func:`check_share` (``rerank_group`` / ``rerank_unit``'s choices: ``Literal`` options, checked by
    :func:`kvdex.policies.base.check_choices`)."""
    if not isinstance(rerank, int) or isinstance(rerank, bool) or rerank < 0:
        raise ValueError(
            f"rerank must be an int >= 0 (0: attend the chosen pages; N > 0: rank the tokens of N x as many "
            f"candidate pages by their exact q.k), got {rerank!r}"
        )
    if unit == "page" and not rerank:
        raise ValueError("rerank_unit='page' ranks candidate pages by their keys' exact scores: it needs rerank >= 1")
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
    :class:`~kvdex.policies.page_scoring.PageScoringPolicy` and ``chess``): their fields, their check and the
    selection's granularity (tokens with ``rerank``)."""

    rerank: int = 0  # 0: the pages; N > 0: the best tokens of N x as many candidate pages by exact q.k
    rerank_group: Literal["max", "weight"] = (
        "max"  # rerank > 0: "max" of the group's q.k, or "weight" (summed softmax weights)
    )
    rerank_share: float = 0.0  # rerank > 0: candidates at least this share of each middle's pages
    rerank_unit: Literal["token", "page"] = (
        "token"  # rerank > 0: attend the best "token"s of the candidates, or their best "page"s
    )

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # the policy's own checks (kvdex.policies.base.Policy: the option choices)
            parent()
        check_rerank(self.rerank, self.rerank_share, self.rerank_unit)

    @property
    def granularity(self) -> str:
        """``"token"`` with ``rerank`` and the token unit (the selection names tokens), else ``"page"``."""
        return "token" if self.rerank and self.rerank_unit == "token" else "page"


class _PoolHost(Protocol):
    """What :meth:`PoolOption.check_pool` reads: its own option and its policy's rerank and select options."""

    @property
    def pool_every(self) -> int: ...
    @property
    def rerank(self) -> int: ...
    @property
    def rerank_unit(self) -> str: ...
    @property
    def select_every(self) -> int: ...


@dataclass
class PoolOption:
    """The ``pool_every`` option of a page policy with ``rerank`` (a base before
    :class:`~kvdex.policies.base.Policy`); the candidate pages a refresh step chose are held in the policy's
    :class:`~kvdex.policies.reuse.HeldPools` (``pools``, made in ``bind``)."""

    pool_every: int = 1  # 1: choose the candidates every step; N: every N steps (and at page joins)

    def check_pool(self: _PoolHost) -> None:
        """ValueError unless ``pool_every`` is an int >= 1, above 1 only with the token rerank, no ``select_every``."""
        check_select_every(self.pool_every, "pool_every")
        if self.pool_every > 1 and not (self.rerank and self.rerank_unit == "token" and self.select_every == 1):
            raise ValueError(
                "pool_every=N ranks the tokens of held candidate pages every step: it needs rerank=N (e.g. 4) with "
                "rerank_unit=token, and select_every=1 (it replaces select_every)"
            )


_Named = TypeVar("_Named", bound="NamedOptions")


class NamedOptions:
    """A base of a policy dataclass whose options' values depend on which of them a constructor call names
    (:func:`resolve_selection`): ``named_options`` holds the names of the options the call passed (keyword or
    positional; :func:`dataclasses.replace` and ``make_policy(policy, ...)`` pass every option), recorded before
    ``__init__`` runs, so ``__post_init__`` can tell an option left at its default from one named with that
    value."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # a base of dataclasses only
    named_options: frozenset[str]

    def __new__(cls: type[_Named], *args: Any, **kwargs: Any) -> _Named:
        policy = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        policy.named_options = frozenset(names[: len(args)]).union(kwargs)
        return policy


class HasNamedOptions(Protocol):
    """What :func:`resolve_selection` reads: the options a constructor call named (:class:`NamedOptions`)."""

    @property
    def named_options(self) -> frozenset[str]: ...


def resolve_selection(
    policy: HasNamedOptions, default: Mapping[str, object], other: Mapping[str, object], allowed: bool = True
) -> None:
    """Set ``policy``'s selection options (the keys of ``default``) that its constructor call did not name: none
    of them named and ``allowed`` -> ``default``'s values; otherwise the unnamed ones take ``other``'s, so a spec
    means what it names on top of ``other`` (``prkv``'s and ``chess``'s defaults are kvdex's selections, ``other``
    the papers')."""
    named = policy.named_options & default.keys()
    for key, value in (default if allowed and not named else other).items():
        if key not in named:
            setattr(policy, key, value)


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
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``tokens`` best middle slots [B, H, min(tokens, C * ps)] (``-1`` padded) of the candidate
    ``pages`` [B, H, C] (slot pages, ``-1`` padded) by the exact ``q.k`` of the query heads q [B, Hq, D],
    combined per kv head by ``group``. ``first`` [B] (optional, device): slots below it are not
    candidates (PRKV's static tokens, attended apart). ``prefix`` [B, 1 or H, S] (optional): positions put
    before them (PRKV's static tokens). ``view``: the layer's :class:`~kvdex.view.LayerView` (its store, scale,
    grid, lengths)."""
    if pages.shape[-1] == 0 or tokens <= 0:
        none = view.no_ids(q.device)
        return none if prefix is None else prefix.to(q.device).expand(view.batch, view.kv_heads, -1)
    pages = pages.to(q.device)
    score = _candidate_scores(q, view, pages, group, first)
    ids = topk_ids(score, tokens, ordered=False)  # [B, H, min(tokens, N)]: a set (attention sums in any order)
    slots = triton_kernel("slots_triton", "rerank_slots", on=q) or rerank_slots_reference  # one launch on CUDA
    return slots(ids, pages, view.sink, view.page_size, None if prefix is None else prefix.to(q.device))


def rerank_pages(
    q: torch.Tensor, view, pages: torch.Tensor, n: int, group: str = "max", first: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``n`` best of the candidate ``pages`` [B, H, C] (``-1`` padded) by their keys' exact scores: page
    ids [B, H, min(n, C)] (a set; best first on the CPU), ``-1`` padded (``rerank_unit="page"``). A page's score
    is its tokens' combined as the group's are: ``"max"`` the largest ``q.k`` of the group over its tokens,
    ``"weight"`` the sum of its tokens' group-summed softmax weights (the page's attention mass). Arguments
    as :func:`rerank_tokens`'."""
    b, c, ps = pages.shape[0], pages.shape[-1], view.page_size
    if c == 0 or n <= 0:
        return view.no_ids(q.device)
    pages = pages.to(q.device)
    score = _candidate_scores(q, view, pages, group, first)
    score = score.reshape(b, view.kv_heads, c, ps)
    if group == "max":
        page = score.amax(-1)
    else:  # the mass of a page's candidate tokens; a page without one (padding, past the middle) is never chosen
        held = torch.isfinite(score)
        page = score.masked_fill(~held, 0.0).sum(-1).masked_fill(~held.any(-1), float("-inf"))  # no scalar tensors
    ids = topk_ids(page, n, ordered=not page.is_cuda)  # [B, H, min(n, C)]: a set (best first on the CPU)
    return torch.where(ids >= 0, pages.gather(2, ids.clamp(min=0)), -1)


def _candidate_scores(q, view, pages, group, first) -> torch.Tensor:
    """score [B, H, C * ps] of every slot of the candidate ``pages`` [B, H, C] on q's device, ``-inf`` where no
    candidate middle key."""
    ps = view.page_size
    store = view.store
    if store.positional_slots and triton_kernel("rerank_triton", on=q) is not None:
        # the candidates' keys read in place by kvdex.kernels.rerank_triton; "weight": logits, each tile's
        # softmax statistics and the group's weights in two kernels
        kw = dict(sink=view.sink, page_size=ps, scale=view.scale, first=first)
        if group == "max":
            return triton_kernel("rerank_triton", "candidate_scores")(q, store.k, pages, view.window_start, **kw)
        weights = triton_kernel("rerank_triton", "candidate_weights")
        return weights(q, store.k, pages, view.window_start, view.lengths, window=view.window, **kw)
    slot = view.sink + pages[..., None] * ps + torch.arange(ps, device=q.device)  # [B, H, C, ps]
    live = (pages[..., None] >= 0) & (slot < view.window_start.to(q.device)[:, None, None, None])
    if first is not None:
        live = live & (slot >= first.to(q.device)[:, None, None, None])
    live = live.flatten(2)  # [B, H, N]: the candidate slots that hold a middle key
    keys = store.page_keys(pages).to(q.device).flatten(2, 3)  # [B, H, N, D]
    s = candidate_scores(q, keys, live, group, view.scale)
    if group == "max":
        return s
    # "weight": the group's summed softmax weights over sink + window + the candidates
    return group_weights(q, s, view).masked_fill(~live, float("-inf"))


def slot_weights(q: torch.Tensor, view, slots: torch.Tensor) -> torch.Tensor:
    """``rerank_group="weight"`` scores [B, H, N] of the tokens at ``slots`` [B, H, N] (positions in the layer's
    positional store, ``-1``: none; IceCache's semantic pages): :func:`group_weights` of their scaled ``q.k``,
    ``-inf`` where none. On CUDA two Triton kernels (``kvdex.kernels.rerank_triton.slot_weights``)."""
    store = view.store
    fast = triton_kernel("rerank_triton", "slot_weights", on=q)
    if fast is not None:
        return fast(q, store.k, slots, view.window_start, view.lengths, sink=view.sink, window=view.window,
                    scale=view.scale)  # fmt: skip
    return _slot_weights(q, view, store.k, slots)


def _slot_weights(q: torch.Tensor, view, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """:func:`group_weights` [B, H, N] of the keys at ``slots`` [B, H, N] of ``keys`` [B, H, S, D] (``-1``: none,
    ``-inf``): the PyTorch path of :func:`slot_weights` and :func:`fetched_token_scores`."""
    logits = slot_scores(q, keys, slots, "heads") * view.scale  # [B, H, G, N]
    return group_weights(q, logits, view).masked_fill(~torch.isfinite(logits[:, :, 0]), float("-inf"))


def fetched_token_scores(q: torch.Tensor, view, slots: torch.Tensor, group: str = "max") -> torch.Tensor:
    """Scores [B, H, N] of the middle tokens at ``slots`` [B, H, N] (``-1``: none, ``-inf``) of a store whose keys
    are not on the device (offloaded), their keys read through its fetch path (:meth:`LayerStore.slot_keys`):
    ``group="max"`` the group's largest ``q.k``, ``"weight"`` :func:`group_weights`; the values the resident
    store's keys give (IceCache's token rerank offloaded)."""
    keys = view.store.slot_keys(slots).to(q.device)  # [B, H, N, D]
    slots = slots.to(q.device)
    local = torch.where(slots >= 0, torch.arange(slots.shape[-1], device=q.device), -1)
    return slot_scores(q, keys, local, "max") if group == "max" else _slot_weights(q, view, keys, local)


def group_weights(q: torch.Tensor, logits: torch.Tensor, view) -> torch.Tensor:
    """``rerank_group="weight"``: each candidate's softmax weights summed over its kv head's query heads q
    [B, Hq, D], [B, H, N], from the candidates' ``logits`` [B, H, G, N] (scaled ``q.k``, ``-inf`` where not a
    candidate), each head's softmax over the candidates and the sink + window keys that every step attends."""
    b, hq, d = q.shape
    h = view.kv_heads
    return _weights(q.float().view(b, h, hq // h, d), logits, view).sum(2)


def _weights(qg: torch.Tensor, logits: torch.Tensor, view) -> torch.Tensor:
    """Softmax weights of the candidate ``logits`` [B, H, G, N] (scaled, ``-inf`` where not a candidate),
    normalised over the candidates and the sink + window keys that every step attends."""
    fixed = view.store.attend(Selection())  # sink + window slots only: nothing is fetched
    kf = fixed.k.gather(2, fixed.idx[..., None].expand(-1, -1, -1, fixed.k.shape[-1]))  # [B, H, F, D]
    sf = torch.einsum("bhgd,bhfd->bhgf", qg, kf.to(qg.device).float()) * view.scale
    sf = sf.masked_fill(~fixed.valid.to(qg.device)[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([sf, logits], dim=-1), dim=-1, keepdim=True)  # [B, H, G, 1]
    return torch.exp(logits - lse)
