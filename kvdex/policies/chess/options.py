"""CHESS's option defaults where the paper is silent, and how a spec's selection options resolve (kvdex's default
selection or the plain hierarchy's): :func:`resolve_selection_options`."""

from __future__ import annotations

from typing import Protocol

from kvdex.policies.rerank import HasNamedOptions, resolve_selection

# CHOICE: the paper does not give N_c and N_g. 4 pages per chunk and 4 chunks per grid (grids of
# 512 tokens at page size 32) keep >= 8 grids at 4k tokens, so the grid quantile is not a coin
# flip between two halves of a short context, and ~60 grids at 32k.
DEFAULT_CHUNK_PAGES = 4
DEFAULT_GRID_CHUNKS = 4
# Appendix C's fixed-interval baseline rebuilds "every 6 pages" of generated tokens.
DEFAULT_INTERVAL_PAGES = 6

# How a build picks pages. kvdex's default (docs/policies/chess.md, "Default configuration"): the hierarchy is
# scored by ArkVale's page digests (chunks and grids by their pages' max), its top pages -- at least a quarter of
# the middle's -- are candidates, and the candidates' best pages by their keys' exact softmax weights are kept
# until the next rebuild. PLAIN_SELECTION: the hierarchy's own top pages by q . mean key (the paper's units).
DEFAULT_SELECTION = {"group": "max", "units": "digest", "rerank": 4, "rerank_group": "weight", "rerank_share": 0.25,
                     "rerank_unit": "page"}  # fmt: skip
PLAIN_SELECTION = {"group": "max", "units": "mean", "rerank": 0, "rerank_group": "max", "rerank_share": 0.0,
                   "rerank_unit": "token"}  # fmt: skip


class _ModeHost(HasNamedOptions, Protocol):
    """What :func:`resolve_selection_options` reads of a ``chess`` policy besides its named options: its mode."""

    @property
    def preset(self) -> str: ...
    @property
    def rho_g(self) -> float | None: ...
    @property
    def rho_c(self) -> float | None: ...
    @property
    def rho_p(self) -> float | None: ...
    @property
    def scope(self) -> str: ...
    @property
    def anchor_from(self) -> str: ...


def resolve_selection_options(policy: _ModeHost) -> None:
    """Set the selection options the spec does not name: none named, in budget mode with ``scope="layer"`` and
    ``anchor_from="query"`` (kvdex's default mode) -> :data:`DEFAULT_SELECTION`; otherwise (any of them named,
    the paper's mode ``anchor_from=window:scope=shared``, a preset or ratios) the others take
    :data:`PLAIN_SELECTION`'s values, so ``chess:rerank=0`` is the hierarchy's own top pages by mean key."""
    ratio_mode = bool(policy.preset) or any(r is not None for r in (policy.rho_g, policy.rho_c, policy.rho_p))
    kvdex_mode = policy.scope == "layer" and policy.anchor_from == "query" and not ratio_mode
    resolve_selection(policy, DEFAULT_SELECTION, PLAIN_SELECTION, allowed=kvdex_mode)


class _Checked(_ModeHost, Protocol):
    """What :func:`check_selection_options` reads of a ``chess`` policy."""

    @property
    def group(self) -> str: ...
    @property
    def units(self) -> str: ...
    @property
    def rerank(self) -> int: ...
    @property
    def rerank_unit(self) -> str: ...
    @property
    def rerank_share(self) -> float: ...
    @property
    def refine(self) -> str: ...


def check_selection_options(policy: _Checked) -> None:
    """ValueError (with the fix) for a combination of selection options that does not go together."""
    if policy.group != "max" and not (policy.scope == "layer" and policy.anchor_from == "query"):
        raise ValueError(
            f"group={policy.group!r} reduces query heads' scores per kv head: it needs scope='layer' and "
            "anchor_from='query' (the shared scope scores with each group's mean query)"
        )
    if policy.units == "digest" and not (policy.scope == "layer" and policy.anchor_from == "query"):
        raise ValueError(
            "units='digest' scores each layer's pages by its decode queries against the pages' digests: it "
            "needs scope='layer' and anchor_from='query'"
        )
    if policy.units == "digest" and policy.group != "max":
        raise ValueError(f"units='digest' reduces a group's digest estimates by their max (ArkVale's rule): "
                         f"drop group={policy.group!r}")  # fmt: skip
    if policy.rerank_unit == "page" and policy.scope != "layer":
        raise ValueError("rerank_unit='page' picks each layer's pages at its build: it needs scope='layer'")
    if policy.rerank_share and policy.rerank_unit != "page":
        raise ValueError(
            "chess keeps its token rerank's candidate pages between rebuilds, sized once by its budget: "
            "rerank_share needs rerank_unit='page' (the candidates sized at each build), or use rerank=N "
            "to widen chess's pool"
        )
    if policy.refine != "none" and not (policy.rerank and policy.rerank_unit == "page"):
        raise ValueError(f"refine={policy.refine!r} picks among a build's candidate pages at every step: it needs "
                         "rerank >= 1 and rerank_unit='page' (kvdex's default selection)")  # fmt: skip
    if policy.refine == "digest" and policy.units != "digest":
        raise ValueError("refine='digest' scores the candidates by their pages' digests: it needs units='digest' "
                         "(kvdex's default selection), or use refine='exact'")  # fmt: skip
