"""One attention layer of one vLLM step through kvdex, without vLLM: what the backend's ``forward`` runs.

The step's new keys and values are written into the layer's cache at vLLM's ``slot_mapping`` (as vLLM's own
``reshape_and_cache_flash``), then each request of the batch (a :class:`~kvdex.vllm.requests.Row`) runs on its
own state:

* ``prefill`` (prompt tokens, any chunk of a chunked prefill): dense causal attention over the request's tokens
  in the blocks (vLLM's FlashAttention on the paged cache where the backend passes it, else the PyTorch reference,
  which gathers them); the layer's queries are kept for the prompt's observation window (the prompt is indexed
  at the request's first decode step, :meth:`RequestState.adopt <kvdex.vllm.requests.RequestState.adopt>`);
* ``decode`` (one token after the prompt): ``LayerEngine`` appends it, the policy selects, the store gathers sink +
  window + the selection from vLLM's blocks and kvdex's decode attention runs over it;
* ``extend`` (several tokens after the indexed prompt): appended (pages that join the middle are indexed) and
  attended densely, as kvdex's own multi-token step does (``LayerEngine.attention``).

A policy that attends every token (``full``: no index, no selection) keeps no per-request state: its layers run
:func:`forward_dense`, the whole step's batch in one attention call over the blocks (vLLM's FlashAttention where
the backend passes it), as vLLM's own backend does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvdex.vllm.paged import (
    BatchAttention,
    DenseBatch,
    batch_attention_reference,
    prefill_attention_reference,
    write_kv,
)
from kvdex.vllm.requests import Row

#: ``(q [n, Hq, D], block-table row, seq_len, k_cache, v_cache, scale) -> [n, Hq, D]``: a prompt chunk's attention
#: over the paged cache (:func:`~kvdex.vllm.paged.prefill_attention_reference` is its PyTorch form)
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float], torch.Tensor]
#: ``(k_cache, v_cache, slot_mapping [T], key [T, H, D], value [T, H, D]) -> None``: the step's cache write
#: (:func:`~kvdex.vllm.paged.write_kv` is its PyTorch form)
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def forward_layer(
    rows: Sequence[Row],
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    prefill: PrefillAttention | None = None,
    write: CacheWrite | None = None,
) -> torch.Tensor:
    """Layer ``layer`` of a step: query [T, Hq, D], key / value [T, H, D] of the step's T tokens (the rows' tokens
    at ``row.start ...``), k_cache / v_cache [num_blocks, block_size, H, D], slot_mapping [T]. Writes the
    attention output into ``out`` [T, Hq, D] and returns it (rows of tokens no row covers are left as they are).
    ``prefill``: the attention of prompt chunks (default :func:`~kvdex.vllm.paged.prefill_attention_reference`;
    the backend passes vLLM's FlashAttention where vLLM has it); ``write``: the cache write (default
    :func:`~kvdex.vllm.paged.write_kv`; the backend passes vLLM's kernel where it has it)."""
    t = query.shape[0]
    (write or write_kv)(k_cache, v_cache, slot_mapping[:t], key[:t], value[:t])
    for row in rows:
        s, n = row.start, row.query_len
        row.state.caches[layer] = (k_cache, v_cache)
        if row.kind == "prefill":
            q = query[s : s + n]
            row.state.keep_queries(layer, q.transpose(0, 1).unsqueeze(0))
            attend = prefill or prefill_attention_reference
            out[s : s + n] = attend(q, row.state.row.blocks, row.seq_len, k_cache, v_cache, scale).to(out.dtype)
            continue
        q = query[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D], a view
        o = _request(row, layer, q, key[s : s + n], value[s : s + n], k_cache, v_cache, scale)
        out[s : s + n] = o[0].to(out.dtype)
    return out


def _request(
    row: Row,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One request's decode or extend tokens of one layer -> [1, n, Hq, D] (``q`` [1, Hq, n, D], any strides; under
    ``decode_graphs`` the views go straight into the graph's inputs and its output buffer comes back uncopied)."""
    state = row.state
    engine = state.engines[layer]
    if engine.store is None:  # the layer's cache was unknown when the step began: its prompt is indexed now
        state.adopt_layer(layer, row.computed)
    k = key.transpose(0, 1).unsqueeze(0)  # [1, H, n, D], a view
    v = value.transpose(0, 1).unsqueeze(0)
    steps = state.step_graphs if row.decode else None
    if steps is not None and steps.deferred():  # decode_graphs: the layer's append + decode as one graph replay
        lay = state.layers[layer]
        steps.stash(lay, k, v)
        return steps.attend(lay, q, scale, clone=False)  # forward_layer copies it into the step's output at once
    k, v, q = k.contiguous(), v.contiguous(), q.contiguous()
    engine.append(k, v)
    out = engine.attention(q, k, v, None, scale)
    if steps is not None and steps.in_step and layer == len(state.layers) - 1:
        steps.end()  # an eager step the step graphs planned
    return out


def forward_dense(
    batch: DenseBatch,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    attend: BatchAttention | None = None,
    write: CacheWrite | None = None,
) -> torch.Tensor:
    """A layer of a step of a policy that attends every token, for the whole batch at once: the step's keys and
    values written at ``slot_mapping``, then each request's queries attend causally to its tokens in the blocks
    (``attend``: default :func:`~kvdex.vllm.paged.batch_attention_reference`; the backend passes vLLM's
    FlashAttention). Shapes as :func:`forward_layer`; returns ``out``."""
    t = query.shape[0]
    (write or write_kv)(k_cache, v_cache, slot_mapping[:t], key[:t], value[:t])
    (attend or batch_attention_reference)(query, batch, k_cache, v_cache, scale, out)
    return out
