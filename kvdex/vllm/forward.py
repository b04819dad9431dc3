"""One attention layer of one vLLM step through kvdex, without vLLM: what the backend's ``forward`` runs.

The step's new keys and values are written into the layer's cache at vLLM's ``slot_mapping`` (as vLLM's own
``reshape_and_cache_flash``), then each request of the batch (a :class:`~kvdex.vllm.requests.Row`) runs on its
own state:

* a new state (``row.adopt``: a prompt, or a request kvdex does not hold) stores the request's tokens, read back
  from the blocks, through ``LayerEngine.adopt`` -- the layer's store and the policy's index over the whole
  prompt, with this step's queries as the observation window -- and attends densely (causal, its new tokens
  after the rest);
* a held state with several new tokens (a later chunk of a chunked prefill) appends them (pages that join the
  middle are indexed) and attends densely, as kvdex's own multi-token step does (``LayerEngine.attention``);
* a held state with one new token decodes: ``LayerEngine`` appends it, the policy selects, the store gathers
  sink + window + the selection from vLLM's blocks and kvdex's decode attention runs over it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdex.kernels.attention import causal_chunk_attention
from kvdex.vllm.paged import gather_tokens, token_slots, write_slots
from kvdex.vllm.requests import Row


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
) -> torch.Tensor:
    """Layer ``layer`` of a step: query [T, Hq, D], key / value [T, H, D] of the step's T tokens (the rows' tokens
    at ``row.start ...``), k_cache / v_cache [num_blocks, block_size, H, D], slot_mapping [T]. Writes the
    attention output into ``out`` [T, Hq, D] and returns it (rows of tokens no row covers are left as they are)."""
    t = query.shape[0]
    write_slots(k_cache, slot_mapping[:t], key[:t])
    write_slots(v_cache, slot_mapping[:t], value[:t])
    for row in rows:
        s, n = row.start, row.query_len
        q = query[s : s + n].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, n, D]
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
    """One request's tokens of one layer -> [1, n, Hq, D]."""
    state = row.state
    engine = state.engines[layer]
    state.caches[layer] = (k_cache, v_cache)
    if row.adopt or engine.store is None:
        k, v = request_kv(state.row.blocks, row.seq_len, k_cache, v_cache)
        lengths = torch.tensor([row.seq_len])
        engine.adopt(k, v, lengths, torch.zeros(1, dtype=torch.long), q)
        return causal_chunk_attention(q, k, v, scale)
    k = key.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, n, D]
    v = value.transpose(0, 1).unsqueeze(0).contiguous()
    engine.append(k, v)
    return engine.attention(q, k, v, None, scale)


def request_kv(
    blocks: torch.Tensor, length: int, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` tokens' keys and values [1, H, length, D] of the request whose block-table row is
    ``blocks``, read from the cache."""
    pos = torch.arange(length, device=k_cache.device)
    slots = token_slots(blocks.to(k_cache.device), pos, k_cache.shape[1])
    if bool((slots < 0).any()):
        raise ValueError(f"the request's block-table row ({blocks.shape[0]} blocks) does not cover {length} tokens")
    k = gather_tokens(k_cache, slots).transpose(0, 1).unsqueeze(0)
    v = gather_tokens(v_cache, slots).transpose(0, 1).unsqueeze(0)
    return k, v
