"""What CHESS's two selection scopes share (kvdex.policies.chess): the settings a scope is built with
(:class:`ScopeSettings`, fixed at ``bind``) and the build counters it adds to (:class:`BuildLog`, read by
the policy's ``stats``).

The scopes: :class:`~kvdex.policies.chess.shared_scope.SharedScope` (the paper's one selection for every
layer and head) and :class:`~kvdex.policies.chess.layer_scope.LayerScope` (kvdex's selection per layer and
kv head). Neither reads the policy: the policy hands each its settings, the hierarchy, the log and, per
call, the layers' stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScopeSettings:
    """The options and cache sizes a scope builds with (from the policy's options and its ``PolicyInfo``)."""

    sparse_layers: tuple[int, ...]
    page_size: int
    retrieval_tokens: int
    retrieval_pages: int
    timing: bool  # the cache's timing=True: builds are timed (BuildLog.rebuild_ms)
    budget_pages: int  # budget mode: the pages a build keeps
    ratio_mode: bool  # a preset or rho_g/rho_c/rho_p: the paper's retention ratios, no budget
    anchor_from: str  # "query" | "window"
    group: str  # the GQA reduction of a group's scores (layer scope, anchor_from="query")
    rerank: int
    rerank_unit: str
    rerank_group: str
    rerank_share: float
    refine: str = "none"  # none | digest | exact: how each step picks among a build's candidates


@dataclass
class BuildLog:
    """Counters of a policy's builds (``stats()``), added to by the policy and its scope."""

    builds: int = 0  # initial selections (one per prompt)
    rebuilds: int = 0  # rebuilds summed over sequences
    decode_steps: int = 0
    rebuild_log: list[tuple[int, int]] = field(default_factory=list)  # (step, sequence) of each rebuild
    rebuild_ms: float = 0.0  # time in builds (measured only with the cache's timing=True)
    selected_pages: list[float] = field(default_factory=list)  # mean selected pages per sequence at each build
    query_builds: int = 0  # builds (and rebuilds) scored by queries instead of the window's keys
