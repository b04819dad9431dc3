"""Typed, validated configuration of a kvdex cache.

Every user mistake raises ``ValueError`` with the fix in the message (GUIDE practice 7).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Defaults follow the papers: pages of 16 tokens (Quest, IceCache), the first two layers dense
# (Quest §4, IceCache §5.1), a sink page and a short recent window (StreamingLLM, ArkVale).
DEFAULT_PAGE_SIZE = 16
DEFAULT_SINK = 16
DEFAULT_WINDOW = 32
DEFAULT_BUDGET = 256
DEFAULT_DENSE_LAYERS = 2
DEFAULT_PREFILL_CHUNK = 2048


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
    page_cache:    with ``offload``, page slots per sequence and kv head that keep recently selected
                   pages on the device, so a step transfers only the others (>= the pages selected
                   per step; 0 = off). See :mod:`kvdex.storage.offload`.

    Each field's ``metadata["help"]`` is its one-line command-line help (:mod:`kvdex.cli_options`
    turns the fields into ``--budget``, ``--page-size``, ... options of every kvdex command).
    """

    budget: int = field(
        default=DEFAULT_BUDGET,
        metadata={"help": "tokens attended per kv head per decode step, sink and window included"},
    )
    page_size: int = field(default=DEFAULT_PAGE_SIZE, metadata={"help": "tokens per KV page, a power of two"})
    sink: int = field(default=DEFAULT_SINK, metadata={"help": "first tokens of each sequence, always attended"})
    window: int = field(
        default=DEFAULT_WINDOW, metadata={"help": "recent tokens, always attended; a multiple of the page size"}
    )
    offload: bool = field(
        default=False,
        metadata={"help": "keep the middle of the context in host memory, fetch the selected pages per step"},
    )
    dense_layers: int = field(
        default=DEFAULT_DENSE_LAYERS, metadata={"help": "the first N layers attend densely, without selection"}
    )
    prefill_chunk: int = field(
        default=DEFAULT_PREFILL_CHUNK,
        metadata={"help": "query rows per dense-attention call during prefill; bounds its memory"},
    )
    timing: bool = field(
        default=False,
        metadata={"help": "time selection, transfer and attention per step; synchronises the device"},
    )
    page_cache: int = field(
        default=0,
        metadata={
            "help": "with offload: a device page cache of N slots per sequence and kv head (N >= the pages "
            "selected per step, e.g. 2x the budget's pages); only misses cross PCIe; 0 = off"
        },
    )

    def __post_init__(self) -> None:
        for name in ("budget", "page_size", "sink", "window", "dense_layers", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        pc = self.page_cache
        if not isinstance(pc, int) or isinstance(pc, bool) or pc < 0:
            raise ValueError(f"page_cache must be an int >= 0 (page slots per sequence, kv head), got {pc!r}")
        if pc and not self.offload:
            raise ValueError(f"page_cache={pc} keeps offloaded pages on the device: pass offload=True, or page_cache=0")
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
