"""Typed, validated configuration of a kvdex cache.

Every user mistake raises ``ValueError`` with the fix in the message (GUIDE practice 7).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Defaults follow the papers: pages of 16 tokens (Quest, IceCache), the first two layers dense
# (Quest §4, IceCache §5.1), a sink page and a short recent window (StreamingLLM, ArkVale).
DEFAULT_PAGE_SIZE = 16
DEFAULT_SINK = 16
DEFAULT_WINDOW = 32
DEFAULT_BUDGET = 256
DEFAULT_DENSE_LAYERS = 2


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of one kvdex cache. All sizes are in tokens, per sequence and per kv head.

    budget:        tokens attended per kv head per decoding step, everything included
                   (sink + window + retrieved).
    page_size:     tokens per KV page (a power of two).
    sink:          first tokens of each sequence, always attended (attention sinks).
    window:        recent tokens, always attended; a whole number of pages. The window holds
                   between ``window - page_size + 1`` and ``window`` tokens: when a new page
                   starts, the oldest window page joins the retrievable middle.
    offload:       keep the middle of the context in host memory and fetch selected pages per step.
    dense_layers:  the first layers attend densely (no selection), as in the papers.
    prefill_chunk: query rows per dense-attention call during prefill (bounds memory).
    timing:        record time spent in selection / transfer / attention (synchronises the device).
    """

    budget: int = DEFAULT_BUDGET
    page_size: int = DEFAULT_PAGE_SIZE
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    offload: bool = False
    dense_layers: int = DEFAULT_DENSE_LAYERS
    prefill_chunk: int = 2048
    timing: bool = False

    def __post_init__(self) -> None:
        for name in ("budget", "page_size", "sink", "window", "dense_layers", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        ps = self.page_size
        if ps < 1 or ps & (ps - 1):
            raise ValueError(
                f"page_size must be a power of two (e.g. 16 or 32), got {ps}; pass page_size={_next_pow2(ps)}"
            )
        if self.sink < 0 or self.dense_layers < 0 or self.prefill_chunk < 1:
            raise ValueError("sink and dense_layers must be >= 0 and prefill_chunk >= 1")
        if self.window < ps or self.window % ps:
            raise ValueError(
                f"window must be a positive multiple of page_size ({ps}), got {self.window}; "
                f"pass window={max(ps, -(-self.window // ps) * ps)}"
            )
        if self.budget < ps:
            raise ValueError(
                f"budget ({self.budget}) is smaller than one page ({ps} tokens); "
                f"pass budget >= {ps} or a smaller page_size"
            )
        if self.budget < self.sink + self.window:
            raise ValueError(
                f"budget ({self.budget}) is smaller than sink + window ({self.sink} + {self.window}); "
                f"pass budget >= {self.sink + self.window}, or reduce sink/window "
                f"(e.g. sink=0, window={ps})"
            )

    @property
    def retrieval_tokens(self) -> int:
        """Tokens per kv head left for retrieval from the middle, after sink and window."""
        return self.budget - self.sink - self.window

    @property
    def retrieval_pages(self) -> int:
        """Whole pages per kv head that fit the retrieval budget."""
        return self.retrieval_tokens // self.page_size

    @property
    def window_pages(self) -> int:
        return self.window // self.page_size

    def to_dict(self) -> dict:
        return asdict(self)


def _next_pow2(n: int) -> int:
    p = 1
    while p < max(1, n):
        p <<= 1
    return p
