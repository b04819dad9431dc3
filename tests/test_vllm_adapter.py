"""kvdex's vLLM adapter without vLLM (``kvdex.vllm``): the block-table mapping, the per-request state life cycle
and decoding over vLLM's paged layout, against PyTorch references and kvdex's own path.

A small simulated engine (``tests/vllm_sim.py``) plays vLLM's part: per-layer caches in the backend's layout, blocks
handed out from a free list (freed blocks are handed out again), slot mappings, batches whose row order changes
every step, requests that join and finish at different steps, a chunked prefill and a preemption with recompute. Every
request's q / k / v are fixed random tensors per (layer, position), so the same request can be replayed through
kvdex's own path (:class:`~kvdex.storage.DeviceStore`, the engine driven as ``kvdex.Cache`` drives it): the
selections must be the same and the outputs equal within fp32 rounding; with a budget covering the context every
output must equal dense causal attention.
"""

from __future__ import annotations

import pytest
import torch
from vllm_sim import ATOL, GEO, HQ, LAYERS, PS, SCALE, D, H, Req, Sim, replay, run_scenario, settings

from kvdex.config import CacheConfig
from kvdex.storage import DeviceStore
from kvdex.vllm import REFUSED, SUPPORTED, RequestState, RequestTable, forward_layer, settings_from
from kvdex.vllm.paged import (
    check_block_size,
    gather_heads,
    kv_cache_shape,
    page_blocks,
    paged_decode_reference,
    split_kv,
    token_slots,
    write_slots,
)
from kvdex.vllm.store import BlockRow, PagedStore

SMALL = dict(budget=96, page_size=PS, sink=16, window=32, dense_layers=1)  # 3 retrieved pages
FULL = dict(SMALL, budget=1024)
# every policy that runs under vLLM; prkv with a static part refreshed every 8 steps (its relocation, before_step),
# chess rebuilding every 8 steps, quest reusing a selection for 4 steps
VARIANTS = {"prkv": "prkv:static_ratio=0.5:refresh=8", "chess": "chess:interval=8"}
SPECS = [VARIANTS.get(p, p) for p in SUPPORTED] + ["quest:select_every=4"]


# ---- the mapping ---------------------------------------------------------------------------------------------
def test_token_slots_and_page_blocks_match_a_loop():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(50, generator=g)[:9]
    pos = torch.tensor([[0, 5, 15, 16, 31, 100, 143, 144, -1]])
    got = token_slots(blocks, pos, PS)
    want = [int(blocks[p // PS]) * PS + p % PS if 0 <= p < 9 * PS else -1 for p in pos[0].tolist()]
    assert got[0].tolist() == want
    pages = torch.tensor([0, 3, 7, -1, 8])  # sink 16 = one block: middle page g is block g + 1
    assert page_blocks(blocks, pages, 16, PS).tolist() == [int(blocks[1]), int(blocks[4]), int(blocks[8]), -1, -1]
    with pytest.raises(ValueError, match="multiple of page_size"):
        page_blocks(blocks, pages, 8, PS)


def test_layout_write_gather_round_trip():
    kv = torch.zeros(kv_cache_shape(8, PS, H, D))
    k_cache, v_cache = split_kv(kv)
    assert k_cache.shape == (8, PS, H, D) and k_cache.data_ptr() == kv.data_ptr()
    rows = torch.randn(5, H, D)
    slots = torch.tensor([3, -1, 40, 127, 16])
    write_slots(k_cache, slots, rows)
    assert torch.equal(kv[0].view(-1, H, D)[40], rows[2]) and torch.equal(kv[0].view(-1, H, D)[127], rows[3])
    assert kv[1].abs().sum() == 0 and kv[0].view(-1, H, D)[0].abs().sum() == 0  # the padding slot is skipped
    got = gather_heads(k_cache, torch.tensor([[3, 40], [127, 16]]))
    assert torch.equal(got[0, 1], rows[2][0]) and torch.equal(got[1, 0], rows[3][1])
    with pytest.raises(ValueError, match="2, num_blocks"):
        split_kv(torch.zeros(8, PS, H, 2 * D))


def test_block_size_must_equal_page_size():
    check_block_size(16, 16)
    with pytest.raises(ValueError, match="--block-size 16"):
        check_block_size(32, 16)


def test_paged_decode_reference_is_dense_attention_over_all_tokens():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(kv_cache_shape(12, PS, H, D), generator=g)
    blocks = torch.randperm(12, generator=g)[:5]
    L = 70
    q = torch.randn(HQ, D, generator=g)
    out = paged_decode_reference(q, kv[0], kv[1], blocks, torch.arange(L).expand(H, L), SCALE)
    slots = token_slots(blocks, torch.arange(L), PS)
    k, v = kv[0].reshape(-1, H, D)[slots], kv[1].reshape(-1, H, D)[slots]  # [L, H, D]
    kr, vr = k.repeat_interleave(HQ // H, 1), v.repeat_interleave(HQ // H, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q, kr) * SCALE, -1)
    assert torch.allclose(out, torch.einsum("hl,lhd->hd", p, vr), atol=1e-5)


def test_paged_store_relocation_reads_as_a_permuted_device_store():
    """PRKV's permute_middle: the paged store keeps a map, a DeviceStore moves its rows; both read the same."""
    from kvdex.storage import Grid, TransferStats

    g = torch.Generator().manual_seed(2)
    grid, L = Grid(16, PS, 2), 150
    kv = torch.zeros(kv_cache_shape(20, PS, H, D))
    row = BlockRow(torch.randperm(20, generator=g)[: -(-L // PS)])
    k, v = torch.randn(1, H, L, D, generator=g), torch.randn(1, H, L, D, generator=g)
    paged = PagedStore(grid, 1, H, D, torch.float32, "cpu", TransferStats(), k_cache=kv[0], v_cache=kv[1], row=row,
                       writes=True)  # fmt: skip
    dev = DeviceStore(grid, 1, H, D, torch.float32, "cpu", TransferStats())
    for s in (paged, dev):
        s.ingest(k, v, torch.tensor([L]))
    m = int(grid.num_middle_pages(torch.tensor([L]))) * PS
    buffers = []
    for _ in range(2):  # two relocations compose
        order = torch.stack([torch.randperm(m, generator=g) for _ in range(H)])[None]
        paged.permute_middle(order)
        dev.permute_middle(order)
        buffers.append(paged.graph_buffers())
    for a, b in zip(paged.dense(), dev.dense(), strict=True):
        assert torch.equal(a, b)
    assert buffers[0] == buffers[1]  # the map is rewritten in place: a captured step's graphs stay valid
    pages = torch.tensor([[[0, 4, -1], [2, 1, 5]]])
    assert torch.equal(paged.page_keys(pages)[pages >= 0], dev.page_keys(pages)[pages >= 0])


def test_a_selection_over_the_paged_layout_is_the_reference_attention():
    """``PagedStore.attend`` + kvdex's decode kernel == :func:`paged_decode_reference` over sink + window + the
    selection's pages and tokens, per kv head, on a random block table."""
    from kvdex.kernels import sparse_decode_attention
    from kvdex.selection import Selection
    from kvdex.storage import Grid, TransferStats
    from kvdex.vllm.paged import request_kv

    g = torch.Generator().manual_seed(3)
    grid, L = Grid(16, PS, 2), 150
    kv = torch.randn(kv_cache_shape(20, PS, H, D), generator=g)
    row = BlockRow(torch.randperm(20, generator=g)[: -(-L // PS)])
    store = PagedStore(grid, 1, H, D, torch.float32, "cpu", TransferStats(), k_cache=kv[0], v_cache=kv[1], row=row)
    store.ingest(*request_kv(row.blocks, L, kv[0], kv[1]), torch.tensor([L]))
    sel = Selection(pages=torch.tensor([[[0, 3, -1], [5, 1, 2]]]), tokens=torch.tensor([[[20, -1], [100, 99]]]))
    q = torch.randn(HQ, D, generator=g)
    a = store.attend(sel)
    got = sparse_decode_attention(q[None], a.k, a.v, a.idx, a.valid, SCALE)[0]
    ws = int(grid.window_start(torch.tensor([L])))
    fixed = torch.cat([torch.arange(16), torch.arange(ws, L)])
    pos = torch.cat([fixed.expand(H, -1), sel.token_positions(16, PS)[0]], dim=1)
    assert torch.allclose(got, paged_decode_reference(q, kv[0], kv[1], row.blocks, pos, SCALE), atol=1e-5)


@pytest.mark.parametrize("policy", SPECS)
def test_batched_paged_decoding_equals_kvdex_device_path(policy):
    """Join, chunked prefill, reordered rows, a preemption with recompute, freed blocks reused: every output and
    every selection equals kvdex's own path on the same q / k / v (a DeviceStore, one request at a time)."""
    st = settings(policy, SMALL)
    sim, reqs = run_scenario(st)
    for req in reqs:
        for life in range(req.life + 1):
            want, sels = replay(st, req, life)
            got = {key[2:]: o for key, o in sim.out.items() if key[:2] == (req.name, life)}
            assert got.keys() == want.keys()
            for key, o in want.items():
                assert torch.allclose(got[key], o, atol=ATOL, rtol=1e-4), (policy, req.name, life, key)
            sid = id(sim.state_of[(req.name, life)])
            mine = {key[1:]: s for key, s in sim.selections.items() if key[0] == sid}
            assert mine.keys() == sels.keys(), (policy, req.name, life)
            for key, sel in sels.items():
                assert _same_sel(sel, mine[key]), (policy, req.name, life, key)
    assert sim.table.made == 4  # a, b, c and c's recompute: no other state was made
    if policy.startswith("prkv"):  # the relocation ran, as a map over vLLM's blocks
        assert any(s.order is not None for s in sim.state_of[("b", 0)].stores if isinstance(s, PagedStore))


@pytest.mark.parametrize("policy", ["quest", "prkv:static_ratio=0.5:refresh=8", "chess:interval=8"])
def test_the_fused_selection_decode_reads_the_blocks_as_attend_does(policy, monkeypatch):
    """On CUDA a paged store decodes a selection with kvdex's fused kernel over the blocks
    (``PagedStore.selection_decode``: the block-table row and PRKV's relocation map, ``tests/test_triton_kernels.py``
    checks the kernel). Here its arguments go to a PyTorch twin of that kernel, which reads the blocks through
    them: the scenario's outputs equal the gather path's (``attend``), the relocated middle included."""
    from kvdex.kernels import reference as twins  # the resident store's twin (this module's is the blocks' dense one)
    from kvdex.vllm import store as store_mod

    calls = []

    def twin(q, k_cache, v_cache, pages, lengths, sink, ps, wp, scale, tokens=None, count=None, block_table=None,
             order=None):  # fmt: skip
        assert block_table is not None and count is None
        calls.append(order is not None)
        h = k_cache.shape[2]
        pos = torch.arange(block_table.shape[0] * ps).expand(h, -1)  # store slots, per kv head
        if order is not None:  # slot sink + j holds position sink + order[h, j]
            j = pos - sink
            mid = (j >= 0) & (j < order.shape[2])
            pos = torch.where(mid, sink + order[0].gather(1, j.clamp(0, order.shape[2] - 1)), pos)
        flat = token_slots(block_table, pos, ps)  # [H, slots]: their rows in the blocks
        k, v = (gather_heads(c, flat)[None] for c in (k_cache, v_cache))
        return twins.paged_decode_reference(q, k, v, pages, lengths, sink, ps, wp, scale, tokens)

    st = settings(policy, SMALL)
    want, _ = run_scenario(st)
    monkeypatch.setattr(store_mod, "paged_decode_attention", twin)
    got, _ = run_scenario(st)
    assert calls and (any(calls) == policy.startswith("prkv")), (policy, len(calls))
    for key, o in want.out.items():
        assert torch.allclose(got.out[key], o, atol=ATOL, rtol=1e-4), (policy, key)


def _blockwise_prefill(q, blocks, seq_len, k_cache, v_cache, scale):
    """The prefill contract computed another way: block by block into a dense [L, H, D], then a masked softmax in
    float64 per query head (what vLLM's FlashAttention computes on the paged cache)."""
    bs = k_cache.shape[1]
    nb = -(-seq_len // bs)
    k = torch.cat([k_cache[int(b)] for b in blocks[:nb]])[:seq_len].double()
    v = torch.cat([v_cache[int(b)] for b in blocks[:nb]])[:seq_len].double()
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    pos = torch.arange(seq_len - n, seq_len)[:, None]
    mask = torch.arange(seq_len)[None, :] <= pos  # [n, L]
    out = torch.empty(n, hq, q.shape[-1], dtype=torch.float64)
    for h in range(hq):
        s = (q[:, h].double() @ k[:, h // g].T) * scale
        out[:, h] = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[:, h // g]
    return out.to(q.dtype)


@pytest.mark.parametrize("policy", ["quest", "prkv:static_ratio=0.5:refresh=8"])
def test_prefill_attention_is_a_drop_in(policy):
    """forward_layer's ``prefill`` (the backend passes vLLM's FlashAttention there): any attention that keeps the
    contract of paged.prefill_attention_reference -- here one computed block by block in float64 -- gives the
    scenario's every output and selection as the default does (chunked prefill, a recompute into reused blocks)."""
    st = settings(policy, SMALL)
    base, reqs = run_scenario(st)
    other, _ = run_scenario(st, prefill=_blockwise_prefill)
    assert base.out.keys() == other.out.keys()
    for key, o in base.out.items():
        assert torch.allclose(other.out[key], o, atol=ATOL, rtol=1e-4), key
    assert base.selections.keys().__len__() == other.selections.keys().__len__()
    for a, b in zip(base.selections.values(), other.selections.values(), strict=True):
        assert _same_sel(a, b)


def _loop_decode(q, blocks, lengths, capacity, k_cache, v_cache, scale):
    """decode_attention_reference's contract, computed token by token from the blocks in float64."""
    n, bs = int(lengths[0]), k_cache.shape[1]
    assert n <= capacity <= blocks.shape[0] * bs
    slots = [int(blocks[p // bs]) * bs + p % bs for p in range(n)]
    k, v = (c.flatten(0, 1)[slots].double() for c in (k_cache, v_cache))  # [n, H, D]
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    for h in range(q.shape[1]):
        w = torch.softmax(k[:, h // g] @ q[0, h].double() * scale, 0)
        out[0, h] = w @ v[:, h // g]
    _loop_decode.calls += 1
    return out.to(q.dtype)


@pytest.mark.parametrize("policy", ["full", "quest", "prkv:static_ratio=0.5:refresh=8"])
def test_dense_decode_is_a_drop_in(policy):
    """A request state's ``decode`` (the backend passes vLLM's FlashAttention on the blocks): any dense decode that
    keeps the contract of paged.decode_attention_reference -- here one computed token by token in float64 -- gives
    the scenario's every output and selection as kvdex's gather + kernel does; it runs for the dense layers."""
    st = settings(policy, SMALL)
    base, _ = run_scenario(st)
    _loop_decode.calls = 0
    other, _ = run_scenario(st, decode=_loop_decode)
    assert _loop_decode.calls > 0
    assert base.out.keys() == other.out.keys()
    for key, o in base.out.items():
        assert torch.allclose(other.out[key], o, atol=ATOL, rtol=1e-4), key
    for a, b in zip(base.selections.values(), other.selections.values(), strict=True):
        assert _same_sel(a, b)


def test_paged_decode_reference_masks_past_the_length():
    """decode_attention_reference reads at most ``capacity`` tokens of the row and attends the first ``lengths``."""
    from kvdex.vllm.paged import decode_attention_reference

    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(8, 4, 2, 8, generator=g) for _ in range(2))
    q, blocks = torch.randn(1, 4, 8, generator=g), torch.tensor([6, 1, 3])
    for n in (1, 5, 12):
        got = decode_attention_reference(q, blocks, torch.tensor([n]), 12, kc, vc, 0.3)
        torch.testing.assert_close(got, _loop_decode(q, blocks, torch.tensor([n]), 12, kc, vc, 0.3))
    kc2 = kc.clone()
    kc2[3, 1:] = 1e4  # past a length of 9 (block 3 holds positions 8..11): never attended
    got = decode_attention_reference(q, blocks, torch.tensor([9]), 12, kc2, vc, 0.3)
    torch.testing.assert_close(got, _loop_decode(q, blocks, torch.tensor([9]), 12, kc, vc, 0.3))


def test_prefill_attention_setting():
    assert settings_from(None).prefill_attention == "torch"
    assert settings_from({"kvdex": {"prefill_attention": "flash"}}).prefill_attention == "flash"
    with pytest.raises(ValueError, match="prefill_attention must be one of torch, flash, got 'auto'"):
        settings_from({"kvdex": {"prefill_attention": "auto"}})


def _same_sel(a: tuple, b: tuple) -> bool:
    return a[2] == b[2] and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x.cpu(), y.cpu()))
        for x, y in zip(a[:2], b[:2], strict=True)
    )


@pytest.mark.parametrize("policy", SPECS)
def test_budget_covering_the_context_is_dense_attention(policy):
    """With a budget covering every token, each output is dense causal attention over the request's tokens."""
    sim, reqs = run_scenario(settings(policy, FULL))
    want = {r.name: dense_causal(r) for r in reqs}
    for (name, _life, layer, pos), o in sim.out.items():
        assert torch.allclose(o, want[name][layer, pos], atol=ATOL), (policy, name, layer, pos)


def dense_causal(req: Req) -> torch.Tensor:
    """[layers, length, Hq, D]: every position's causal attention over the request's q / k / v."""
    n, g = req.length, HQ // H
    k, v = req.k.repeat_interleave(g, 2), req.v.repeat_interleave(g, 2)  # [layers, n, Hq, D]
    s = torch.einsum("lqhd,lkhd->lhqk", req.q, k) * SCALE
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.einsum("lhqk,lkhd->lqhd", torch.softmax(s, -1), v)


# ---- the life cycle --------------------------------------------------------------------------------------------
def test_states_follow_requests_across_joins_reorders_finishes_and_preemption():
    sim = Sim(settings("quest", SMALL))
    a, b, c = Req("a", 200, 1), Req("b", 200, 2), Req("c", 200, 3)
    ra = sim.step([(a, 100)])[0]
    assert ra.fresh and ra.kind == "prefill" and len(sim.table) == 1
    rows = sim.step([(a, 1), (b, 50)])
    by = {r.state: r for r in rows}
    assert not by[ra.state].fresh and by[ra.state].decode and ra.state.adopted  # a continues, its prompt indexed
    rb = next(r for r in rows if r.state is not ra.state)
    assert rb.fresh and rb.kind == "prefill"
    for _ in range(3):  # rows reordered every step: each keeps its state
        rows = sim.step([(a, 1), (b, 1)])
        assert {r.state for r in rows} == {ra.state, rb.state} and not any(r.fresh for r in rows)
    sim.finish(a)  # a's blocks are freed; c's prompt takes them (the partly filled one among them)
    rows = sim.step([(b, 1), (c, 20)])
    rc = next(r for r in rows if r.state is not rb.state)
    assert rc.fresh and ra.state not in sim.table.held.values()  # a's state is freed: its last block is reused
    sim.preempt(b)
    rows = sim.step([(c, 1)])
    assert rows[0].state is rc.state
    rows = sim.step([(b, b.length - 100)])  # recompute from its first token: a new state
    assert rows[0].fresh and rows[0].state is not rb.state
    assert rb.state not in sim.table.held.values()  # b's old state was freed (its blocks were reassigned)


def test_idle_states_are_freed_after_max_idle_steps():
    sim = Sim(settings_from({"kvdex": {"policy": "quest", **SMALL, "max_idle_steps": 2}}))
    a, b = Req("a", 200, 1), Req("b", 200, 2)
    sim.step([(a, 100), (b, 60)])
    sim.step([(a, 1), (b, 1)])
    kept = next(r.state for r in sim.last_rows if r.seq_len == 61)
    sim.step([(a, 1)])  # b skipped by the scheduler for two steps: its state waits
    sim.step([(a, 1)])
    rows = sim.step([(a, 1), (b, 1)])
    assert any(r.state is kept and not r.fresh for r in rows)
    for _ in range(3):
        sim.step([(a, 1)])
    rows = sim.step([(a, 1), (b, 1)])  # three steps away: freed, re-indexed from the blocks
    rb = next(r for r in rows if r.seq_len == 63)
    assert rb.fresh and rb.decode and rb.state is not kept and rb.state.adopted


def test_a_state_is_claimed_by_one_row_only():
    """Two rows whose whole context is one shared run of blocks (prefix caching): the first keeps the state."""
    st = settings("quest", SMALL)
    table = RequestTable(lambda caches: RequestState(st, GEO, caches=caches), PS)
    kv = [torch.zeros(kv_cache_shape(8, PS, H, D)) for _ in range(LAYERS)]
    blocks = torch.tensor([[0, 1, 2]])
    rows = table.plan(torch.tensor([0, 32]), torch.tensor([32]), blocks)
    for layer in range(LAYERS):
        t = torch.randn(32, H, D)
        forward_layer(rows, layer, torch.randn(32, HQ, D), t, t, kv[layer][0], kv[layer][1],
                      token_slots(blocks[0], torch.arange(32), PS), SCALE, torch.empty(32, HQ, D))  # fmt: skip
    rows = table.plan(torch.tensor([0, 1, 2]), torch.tensor([33, 33]), torch.tensor([[0, 1, 2], [0, 1, 3]]))
    assert not rows[0].fresh and rows[0].state is not rows[1].state and rows[1].fresh


def test_a_last_prompt_token_is_no_decode_step_where_vllm_says_so():
    st = settings("quest", SMALL)
    table = RequestTable(lambda caches: RequestState(st, GEO, caches=caches), PS)
    blocks = torch.tensor([[0, 1, 2]])
    table.plan(torch.tensor([0, 32]), torch.tensor([32]), blocks)
    row = table.plan(torch.tensor([0, 1]), torch.tensor([33]), blocks, torch.tensor([True]))[0]
    assert row.kind == "prefill" and not row.state.adopted


def test_dummy_rows_get_no_state():
    """Rows that start with the null block (vLLM's warm-up and profiling runs) are skipped."""
    table = RequestTable(lambda caches: RequestState(settings("quest", SMALL), GEO, caches=caches), PS)
    rows = table.plan(torch.tensor([0, 4, 8]), torch.tensor([4, 8]), torch.tensor([[0, 0], [3, 0]]), null_block=0)
    assert [r.index for r in rows] == [1] and table.made == 1


# ---- configuration -------------------------------------------------------------------------------------------
def test_settings_parse_and_refuse(monkeypatch):
    s = settings_from({"kvdex": {"policy": "quest:select_every=4", "budget": 2048}})
    assert s.config == CacheConfig(budget=2048) and s.make_policy().select_every == 4
    assert settings_from(None).policy == "quest"
    assert settings("chess", SMALL).make_policy().trigger == "interval"
    assert settings_from({"kvdex": {"policy": "icecache"}}).make_policy().name == "icecache"
    with pytest.raises(ValueError, match="trigger=interval"):
        settings_from({"kvdex": {"policy": "chess:trigger=uncertainty"}})
    with pytest.raises(ValueError, match="unknown policy"):
        settings_from({"kvdex": {"policy": "nope"}})
    with pytest.raises(ValueError, match="no offload"):
        settings_from({"kvdex": {"offload": True}})
    with pytest.raises(ValueError, match="budget must be an integer|must be an integer"):
        settings_from({"kvdex": {"budget": "big"}})
    with pytest.raises(ValueError, match="budget >= 64"):
        settings_from({"kvdex": {"budget": 48}})
    with pytest.raises(ValueError, match="multiple of page_size"):
        settings_from({"kvdex": {"sink": 8}})
    with pytest.raises(ValueError, match="JSON object"):
        settings_from({"kvdex": "quest"})
    with pytest.raises(TypeError, match="no option"):
        settings_from({"kvdex": {"policy": "quest:nope=1"}})
    monkeypatch.setitem(REFUSED, "streaming", "a reason")  # a policy the paged layout could not serve
    with pytest.raises(ValueError, match="'streaming' does not run inside vLLM: a reason. Policies that run: .*quest"):
        settings_from({"kvdex": {"policy": "streaming"}})


def test_check_compares_as_vllms_backend_tests_do():
    """kvdex vllm check: identical tokens match; a first difference where each token is among the other engine's
    top log-probabilities is close (a near-tie, vLLM's check_logprobs_close), with its position and margin; a token
    outside the other's top ones, or a missing one, is not."""
    from kvdex.vllm.check import compare, verdict

    base = [[5, 6, 7], [1, 2, 3]]
    top = [[{5: -0.1}, {6: -0.6, 9: -0.8}, {7: -0.2}], [{1: -0.1}, {2: -0.1}, {3: -0.1}]]
    same = compare(base, top, [[5, 6, 7], [1, 2, 3]], top)
    assert same["match"] and same["close"] and same["agree"] == 6 and same["first_diff"] == [None, None]
    assert verdict(same).startswith("same")
    got_top = [[{5: -0.1}, {9: -0.65, 6: -0.75}, {4: -0.1}], top[1]]
    tie = compare(base, top, [[5, 9, 4], [1, 2, 3]], got_top)
    assert not tie["match"] and tie["close"] and tie["agree"] == 4
    assert tie["first_diff"] == [1, None] and tie["margin"][0] == pytest.approx(0.2)
    assert "prompt 0: token 1 (margin 0.200)" in verdict(tie)
    far = compare(base, top, [[5, 8, 4], [1, 2, 3]], [[{5: -0.1}, {8: -0.1}, {4: -0.1}], top[1]])
    assert not far["close"] and far["margin"] == [None, None] and verdict(far).startswith("DIFFERENT")
    short = compare(base, top, [[5, 6], [1, 2, 3]], [top[0][:2], top[1]])
    assert short["first_diff"] == [2, None] and not short["close"]


@pytest.mark.parametrize("spec", ["quest", "chess", "prkv"])
def test_check_transformers_reference_is_kvdex_generate(spec):
    """kvdex vllm check --reference transformers: each prompt alone through kvdex's transformers path with the policy
    vLLM's requests get (plain chess: trigger=interval) gives kvdex.generate's greedy tokens at the same budget, with
    no end-of-sequence stop, and each token is the top of its own log-probabilities."""
    import kvdex
    from kvdex.hf.testing import tiny_llama
    from kvdex.vllm.check import prompts, transformers_tokens

    model = tiny_llama()
    ids = prompts([200, 150], seed=1, low=10, high=250)
    s = settings_from({"kvdex": {"policy": spec, "budget": 80}})
    tokens, top = transformers_tokens(model, s, ids, max_tokens=10, logprobs=3)
    named = "chess:trigger=interval" if spec == "chess" else spec
    for p, got, tops in zip(ids, tokens, top, strict=True):
        cache = kvdex.Cache(model, named, 80)
        ref = kvdex.generate(model, cache, torch.tensor([p]), max_new_tokens=10, cuda_graph=False, eos_token_id=[],
                             pad_token_id=0)  # fmt: skip
        assert got == ref[0, len(p) :].tolist()
        assert all(len(t) == 3 and max(t, key=t.get) == g for g, t in zip(got, tops, strict=True))


def test_check_teacher_forced_comparison():
    """--reference transformers, teacher-forced: a position counts as the same token, a near-tie (each token among
    the other's top log-probabilities) or another difference; with follow=, the reference is fed the given tokens."""
    from kvdex.hf.testing import tiny_llama
    from kvdex.vllm.check import compare_forced, prompts, transformers_tokens

    got, got_top = [[5, 6, 7]], [[{5: -0.1}, {6: -0.5, 8: -0.6}, {7: -0.1}]]
    ref, ref_top = [[5, 8, 9]], [[{5: -0.1}, {8: -0.5, 6: -0.6}, {9: -0.1}]]
    f = compare_forced(got, got_top, ref, ref_top)
    assert (f["agree"], f["near"], f["far"], f["of"], f["first_far"]) == (1, 1, 1, 3, [2])
    model = tiny_llama()
    ids = prompts([120], seed=2, low=10, high=250)
    s = settings_from({"kvdex": {"policy": "quest", "budget": 80}})
    free, _ = transformers_tokens(model, s, ids, max_tokens=8, logprobs=2)
    forced, _ = transformers_tokens(model, s, ids, max_tokens=8, logprobs=2, follow=free)
    assert forced == free  # fed its own tokens, it predicts them again
    other = [[(t + 1) % 250 for t in free[0]]]
    moved, _ = transformers_tokens(model, s, ids, max_tokens=8, logprobs=2, follow=other)
    assert moved[0][0] == free[0][0] and moved != free  # the first token comes from the prefill alone


def _double(x):
    return 2 * x


def _fail(x):
    raise ValueError(f"bad {x}")


def _lookup(key):
    return {}[key]


def test_check_runs_each_engine_in_its_own_process():
    """kvdex vllm check's engines run through isolated(): the result comes back from a spawned process, and an
    error there is raised here with its message."""
    import os

    from kvdex.vllm.check import isolated

    assert isolated(_double, 21) == 42
    assert isolated(os.getpid) != os.getpid()
    with pytest.raises(ValueError, match="^bad 3$"):  # a settings mistake comes back as it was raised
        isolated(_fail, 3)
    with pytest.raises(RuntimeError, match="KeyError"):  # anything else with the child's traceback
        isolated(_lookup, "missing")


def test_check_stops_before_any_engine_on_a_bad_setup(monkeypatch):
    """kvdex vllm check without vLLM, or with an unknown policy, stops with a ValueError naming the fix."""
    import argparse
    import importlib.util

    from kvdex.vllm import check

    args = argparse.Namespace(prompt_tokens=64, requests=1, seed=0, max_tokens=4, block_size=16, budget=0)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'kvdex\[vllm\]'"):
        check.run_check("model", ["quest"], args)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(check, "_tokens", lambda *a: pytest.fail("an engine started"))
    with pytest.raises(ValueError, match="unknown policy 'qeust'"):
        check.run_check("model", ["quest", "qeust"], args)
    args.settings = '{"prefill_attention": "fast"}'
    with pytest.raises(ValueError, match="prefill_attention"):
        check.run_check("model", ["quest"], args)


def test_many_short_requests_hold_indexes_of_their_size():
    """A serving batch of many short requests: each request's index (here quest's page bounds) holds about its own
    middle pages, not a fixed room of thousands of tokens per layer (memory outside vLLM's KV budget)."""
    from vllm_sim import Req, Sim

    sim = Sim(settings_from({"kvdex": {"policy": "quest", "budget": 96, "page_size": 16, "sink": 16, "window": 32}}))
    reqs = [Req(f"r{i}", 90, 40 + i) for i in range(10)]
    sim.step([(r, 80) for r in reqs])  # sink + window + two middle pages each
    for _ in range(3):
        sim.step([(r, 1) for r in reqs])
    for r in reqs:
        policy = sim.state_of[(r.name, 0)].policy
        assert policy.kmin and all(t.shape[2] <= 8 for t in policy.kmin.values()), r.name  # 3 pages, not 256


def test_check_reports_each_engine_as_it_finishes(monkeypatch):
    """A check stopped part-way (a time limit on a GPU machine) has said how each finished engine did: the callback
    gets each policy's verdict right after its engine, before the next one starts."""
    import argparse
    import importlib.util

    from kvdex.vllm import check

    args = argparse.Namespace(prompt_tokens=32, requests=2, seed=0, max_tokens=3, block_size=16, budget=0, logprobs=2)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    base = [[5, 6, 7], [8, 9, 10]]
    top = [[{t: -0.1, 1: -3.0} for t in row] for row in base]
    served: list[str | None] = []
    lines: list[tuple[str, str]] = []

    def tokens(model, kvdex, ids, a):
        served.append(None if kvdex is None else kvdex["policy"])
        assert len(lines) == max(0, len(served) - 2)  # every earlier policy reported before this engine
        out = [list(r) for r in base]
        if kvdex is not None and kvdex["policy"] == "prkv":
            out[1][2] = 11
        return out, top

    monkeypatch.setattr(check, "_tokens", tokens)
    report = check.run_check("model", ["quest", "prkv"], args, lambda p, line: lines.append((p, line)))
    assert served == [None, "quest", "prkv"]
    assert [p for p, _ in lines] == ["quest", "prkv"]
    assert lines[0][1].startswith("same") and "DIFFERENT" in lines[1][1]
    assert report["quest"]["match"] and not report["prkv"]["match"]


def test_only_the_backend_imports_vllm():
    """Importing kvdex.vllm (and the check command) loads no vLLM: only backend.py reads vLLM at load time (vLLM
    imports that module by the path the plugin registers)."""
    import ast
    from pathlib import Path

    from test_imports import load_time_imports

    root = Path(__file__).resolve().parents[1] / "kvdex" / "vllm"
    for path in sorted(root.glob("*.py")):
        names = []
        for node in load_time_imports(ast.parse(path.read_text())):
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if path.name == "backend.py":  # vLLM's interfaces, looked up when vLLM imports the module
            continue
        assert not any(n == "vllm" or n.startswith("vllm.") for n in names), path.name
        assert "kvdex.vllm.backend" not in names, path.name
