"""What ``kvdex demo`` prints under its settings: the table (:func:`format_table`: one row per policy) and the
legend under it (:func:`format_legend`: what each column means, how the device KV figure is made, and why each
row that misses the key misses: by design (:data:`BY_DESIGN`), or at this budget, measured from the run
(:func:`explain_miss`))."""

from __future__ import annotations

from kvdex.demo.decode import Row
from kvdex.hf.model_parts import head_geometry, text_config

# Policies that miss a needle in the middle of the context by design, and why (the legend under the table).
BY_DESIGN = {
    "streaming": "keeps only the sink and the newest tokens (StreamingLLM) by design and drops the middle of the "
    "context, where the needle is",
}

# Policies whose misses at a small budget have a measured cause (the docs page named), added to the legend's
# line for such a row after what the run itself shows (:func:`explain_miss`).
KNOWN_LIMITS = {
    "quest": "Quest ranks pages by an upper bound on q.k from each page's per-channel key min and max: filler "
    "pages with wide key ranges can bound above the needle's page, which a small budget then leaves out "
    "(docs/policies/quest.md)",
}


def _base(policy: str) -> str:
    return policy.split(":")[0]


def _attended(row: Row) -> float | None:
    return row.stats.get("attended_tokens_per_step")


def explain_miss(row: Row, rows: list[Row], context: int | None = None) -> str:
    """Why ``row`` (one of ``rows``, a miss not by design) missed the key, from the run: for ``full``, that the
    model itself does not answer; else the tokens the row attended and their share of the ``context``, then
    whether ``full`` missed too, or which rows answered attending as many tokens (the budget could hold the
    key), or that none did (the budget is too small here); then the policy's :data:`KNOWN_LIMITS` entry."""
    dense = "dense attention over the whole context"
    if _base(row.policy) == "full":
        return f"{dense}: the model does not answer this prompt (try another --model, --length or --depth)"
    att = _attended(row)
    parts = []
    if att is not None:
        of, share = (f" of the {context}", f" ({min(att / context, 1.0):.0%})") if context else ("", "")
        parts.append(f"attends {att:.0f}{of} tokens per step per kv head{share}")
    full = [r for r in rows if _base(r.policy) == "full"]

    def as_few(r: Row) -> bool:  # a sparse row attending as many tokens as the table shows for ``row``, or fewer
        a = _attended(r)
        return _base(r.policy) != "full" and a is not None and att is not None and round(a) <= round(att)

    peers = [
        r.policy + (" (the exact top-k)" if _base(r.policy) == "oracle" else "")
        for r in rows
        if r.correct and as_few(r)
    ]
    if full and not any(r.correct for r in full):
        parts.append(f"full ({dense}) misses too: the model does not answer this prompt")
    elif peers:
        verb = "answers" if len(peers) == 1 else "answer"
        parts.append(
            f"{', '.join(peers)} {verb} attending as many, so the budget can hold the key and "
            f"{row.policy}'s choice of tokens left it out"
        )
    elif att is not None:
        parts.append("no policy here answers attending as few tokens: this prompt needs a larger --budget")
    known = KNOWN_LIMITS.get(_base(row.policy))
    return "; ".join(parts) + (f". {known}" if known else "")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_table(rows: list[Row], context: int | None = None, baseline: Row | None = None) -> str:
    """One row per policy. With a ``baseline`` (transformers' dense cache, CUDA only) the table adds
    decode speed -- ms/token and the speed-up over the baseline -- and each decode's peak device memory."""
    head = ["policy", "correct", "attended/step/head", "device KV", "host KV", "time"]
    if baseline is not None:
        head += ["ms/token", "vs dense", "peak device mem"]
    head.append("completion")
    body = []
    for r in ([baseline] if baseline is not None else []) + list(rows):
        att = r.stats.get("attended_tokens_per_step")
        share = f" ({min(att / context, 1.0):.0%})" if att is not None and context else ""  # decoded tokens add up
        dev = r.stats["kv_bytes_device"]
        cells = [
            r.policy,
            "yes" if r.correct else "NO",
            "-" if att is None else f"{att:.0f}{share}",
            "-" if dev is None else _mib(dev),
            _mib(r.stats["kv_bytes_host"]),
            "-" if r.seconds is None else f"{r.seconds:.1f} s",
        ]
        if baseline is not None:
            ms, ref = r.ms_per_token, baseline.ms_per_token
            cells += [
                "-" if ms is None else f"{ms:.1f}",
                "-" if ms is None or not ref else f"{ref / ms:.2f}x",
                "-" if r.peak_bytes is None else _mib(r.peak_bytes),
            ]
        cells.append(repr(r.completion.strip()[:40]))
        body.append(tuple(cells))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def kv_bytes(model, tokens: int) -> tuple[int, str]:
    """Bytes of the keys and values of ``tokens`` tokens in every layer of ``model``, and the product
    that gives them: layers x kv heads x tokens x head_dim x 2 (keys and values) x dtype bytes."""
    layers = text_config(model).num_hidden_layers
    _, kv_heads, head_dim = head_geometry(model)
    item = model.dtype.itemsize
    total = layers * kv_heads * tokens * head_dim * 2 * item
    return total, f"{layers} layers x {kv_heads} kv heads x {tokens} tokens x {head_dim} x 2 (k, v) x {item} bytes"


def format_legend(
    rows: list[Row],
    answer: str,
    depth: float,
    budget: int,
    offload: bool,
    max_new_tokens: int,
    kv: tuple[int, str] | None = None,
    cuda: bool = False,
    context: int | None = None,
) -> str:
    """What each column of :func:`format_table` means, and why each row that missed the key missed: by design
    (:data:`BY_DESIGN`, a needle in the middle) or, for every other miss, :func:`explain_miss`.
    ``kv``: :func:`kv_bytes` of the context, to show how the device KV figure is made; ``context``: the
    prompt's tokens (the share of it a missing row attended)."""
    device = (
        "bytes of the keys and values held on the device: every token's with --offload off (the same for every "
        "policy: they save attention reads, not memory), the sink, the window and the working set of selected "
        "tokens with --offload"
    )
    if kv is not None:
        device += (
            f". The {rows[0].policy} row's context: {kv[1]} = {_mib(kv[0])} (a row that stopped early holds fewer)"
        )
    lines = [
        "columns:",
        f"  correct             whether the completion holds the pass key {answer}",
        f"  attended/step/head  tokens attended per decode step per kv head in the sparse layers (mean), and their "
        f"share of the context: full attends all of it, the others at most the budget ({budget})",
        f"  device KV           {device}",
        "  host KV             bytes of the keys and values held in host memory: the middle of the context with "
        "--offload, else none",
        f"  time                wall time of the row: forking the prefill (the policy indexes the prompt) and "
        f"decoding {max_new_tokens} tokens" + ("" if cuda else " on this CPU (not kvdex's speed: see `kvdex bench`)"),
        "  completion          the first 40 characters of the answer",
    ]
    middle = 0.05 < depth < 0.95
    expected = [(r.policy, BY_DESIGN[r.policy.split(":")[0]]) for r in rows if r.policy.split(":")[0] in BY_DESIGN]
    if middle and expected:
        lines.append(f"expected to miss the key (the needle is at depth {depth:.2f}):")
        lines += [f"  {name:<18}  {why}" for name, why in expected]
    # every other NO gets its reason, measured in this run: no row misses without a line here
    missed = [r for r in rows if not r.correct and not (middle and _base(r.policy) in BY_DESIGN)]
    if missed:
        lines.append(f"missed the key, not by design (budget {budget}):")
        lines += [f"  {r.policy:<18}  {explain_miss(r, rows, context)}" for r in missed]
    return "\n".join(lines)
