"""Chunked prefill (``kvdex.hf.prefill.chunked_prefill``) == one forward over the prompt:
same last logits, same stored K/V (device and host), same decode afterwards; and the bulk
multi-token append of the offloaded store == token-by-token appends, exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded, prompt

import kvdex
from kvdex import cache_kwargs
from kvdex.hf.prefill import chunked_prefill
from kvdex.selection import Selection
from kvdex.storage import Grid, OffloadStore, TransferStats


def _kv(cache):
    """Every layer's whole K/V, left-aligned on the device, and the host pages of offloaded layers."""
    out = []
    for lay in cache.layers:
        k, v = lay.store.dense()
        n = int(lay.store.lengths_host.max())
        out.append((k[:, :, :n], v[:, :, :n], lay.store.lengths_host.clone()))
    return out


def _decode(model, cache, nxt, steps):
    toks, logits = [], []
    for _ in range(steps):
        lg = model(input_ids=nxt, **cache_kwargs(cache), use_cache=True).logits[:, -1]
        nxt = lg.argmax(-1, keepdim=True)
        toks.append(nxt)
        logits.append(lg)
    return torch.cat(toks, 1), torch.stack(logits)


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "device"])
@pytest.mark.parametrize("chunk", [64, 50])
@torch.no_grad()
def test_chunked_prefill_equals_one_shot(llama, offload, chunk):
    model = llama[0]
    ids = torch.cat([prompt(300, 11), prompt(300, 12)])
    one = kvdex.Cache(model, "quest", 96, offload=offload, dense_layers=1)
    ref = model(input_ids=ids, **cache_kwargs(one), use_cache=True, logits_to_keep=1).logits
    many = kvdex.Cache(model, "quest", 96, offload=offload, dense_layers=1)
    got = chunked_prefill(model, many, ids, chunk)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for (k0, v0, n0), (k1, v1, n1) in zip(_kv(one), _kv(many), strict=True):
        assert torch.equal(n0, n1)
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)
    if offload:
        h0, h1 = one.layers[-1].store.host, many.layers[-1].store.host
        p = int(one.grid.num_middle_pages(one.layers[-1].store.lengths_host).max())
        assert p > 10
        torch.testing.assert_close(h1.data[:, :, :p], h0.data[:, :, :p], atol=1e-5, rtol=1e-5)
    assert many.step == 0 and many.stats()["decode_steps"] == 0
    nxt = ref[:, -1].argmax(-1, keepdim=True)
    t0, l0 = _decode(model, one, nxt, 20)
    t1, l1 = _decode(model, many, nxt, 20)
    assert torch.equal(t0, t1)
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_chunked_prefill_left_padded_batch(llama):
    model = llama[0]
    ids, mask, _ = left_padded([230, 97, 160], seed=5)  # the first chunk must widen to reach row 2's tokens
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    one = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(one), logits_to_keep=1).logits
    many = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    got = chunked_prefill(model, many, ids, 48, attention_mask=mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for (k0, v0, n0), (k1, v1, n1) in zip(_kv(one), _kv(many), strict=True):
        assert torch.equal(n0, n1) and n0.tolist() == [230, 97, 160]
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_bad_input(llama):
    cache = kvdex.Cache(llama[0], "quest", 96)
    with pytest.raises(ValueError, match="chunk"):
        chunked_prefill(llama[0], cache, prompt(10, 1), 0)
    with pytest.raises(ValueError, match="attention_mask"):
        chunked_prefill(llama[0], cache, prompt(10, 1), 4, attention_mask=torch.ones(1, 9))
    snap = kvdex.Cache(llama[0], "snapkv", 96)
    with pytest.raises(ValueError, match="observation window"):
        chunked_prefill(llama[0], snap, prompt(100, 1), 32)


@pytest.mark.parametrize("t", [2, 7, 16, 45, 200])
def test_bulk_append_equals_token_by_token(t):
    grid = Grid(sink=4, page_size=4, window_pages=2)
    b, h, d = 3, 2, 8
    g = torch.Generator().manual_seed(t)
    lengths = torch.tensor([2, 13, 30])  # one sequence still inside its sink
    k = torch.randn(b, h, 30, d, generator=g)
    v = torch.randn(b, h, 30, d, generator=g)
    stores = [OffloadStore(grid, b, h, d, torch.float32, "cpu", TransferStats(), work_tokens=64) for _ in range(2)]
    for st in stores:
        st.ingest(k, v, lengths)
    nk, nv = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    bulk = stores[0].append(nk, nv)
    singles = [stores[1].append(nk[:, :, j : j + 1], nv[:, :, j : j + 1]) for j in range(t)]
    # the same pages join the middle, with the same contents
    for bi in range(b):
        pages = {}
        for u in singles:
            for j in range(int(u.count[bi])):
                pages[int(u.start[bi]) + j] = (u.keys[bi, :, j], u.values[bi, :, j])
        assert sorted(pages) == list(range(int(bulk.start[bi]), int(bulk.start[bi] + bulk.count[bi])))
        for j in range(int(bulk.count[bi])):
            pk, pv = pages[int(bulk.start[bi]) + j]
            assert torch.equal(bulk.keys[bi, :, j], pk) and torch.equal(bulk.values[bi, :, j], pv)
    a, c = stores[0], stores[1]
    assert torch.equal(a.lengths_host, c.lengths_host) and torch.equal(a.lengths, c.lengths)
    ka, va = a.dense()
    kc, vc = c.dense()
    assert torch.equal(ka, kc) and torch.equal(va, vc)
    sa, sc = a.attend(Selection(everything=True)), c.attend(Selection(everything=True))
    assert torch.equal(sa.valid, sc.valid)
    pick = lambda s: torch.where(s.valid[..., None], s.k.gather(2, s.idx[..., None].expand(-1, -1, -1, d)), 0)  # noqa: E731
    assert torch.equal(pick(sa), pick(sc))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_cuda_chunked_prefill_offloaded_equals_one_shot(llama):
    """CUDA (pinned host pages, fused lower-right causal SDPA for the chunks), fp32."""
    import copy

    model = copy.deepcopy(llama[0]).cuda()
    ids = torch.cat([prompt(400, 21), prompt(400, 22)]).cuda()
    one = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    ref = model(input_ids=ids, **cache_kwargs(one), use_cache=True, logits_to_keep=1).logits
    many = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    got = chunked_prefill(model, many, ids, 64)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for (k0, v0, n0), (k1, v1, n1) in zip(_kv(one), _kv(many), strict=True):
        assert torch.equal(n0, n1)
        torch.testing.assert_close(k1, k0, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1, v0, atol=1e-4, rtol=1e-4)
    assert many.layers[-1].store.host.data.is_pinned()
    nxt = ref[:, -1].argmax(-1, keepdim=True)
    t0, _ = _decode(model, one, nxt, 20)
    t1, _ = _decode(model, many, nxt, 20)
    assert torch.equal(t0, t1)


@torch.no_grad()
def test_chunked_prefill_holds_one_layers_dense_kv_at_a_time(llama, monkeypatch):
    """The memory invariant behind 512k: when an offloaded layer rebuilds its dense K/V for a chunk, no
    earlier layer's (or chunk's) rebuilt K/V is still alive."""
    import gc
    import weakref

    real = OffloadStore.dense
    alive, calls = [], []

    def tracked(self):
        gc.collect()
        calls.append(sum(r() is not None for r in alive))
        k, v = real(self)
        alive.extend([weakref.ref(k), weakref.ref(v)])
        return k, v

    monkeypatch.setattr(OffloadStore, "dense", tracked)
    model = llama[0]
    cache = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    chunked_prefill(model, cache, torch.cat([prompt(300, 11), prompt(300, 12)]), 64)
    assert len(calls) == 4 * 2  # 300 tokens in chunks of 64: every later chunk, both offloaded layers
    assert max(calls) == 0


def test_full_graph_key_counts_the_pages_its_offloaded_step_attends():
    """``full``'s graph key (taken before a step) is the middle page count the step's ``attend`` fetches after its
    token joins: in a ragged batch a join of the shortest row and a join of the longest row start from the same
    count, and a graph keyed by the count before the step would replay the first one for the second (H200)."""
    from kvdex.policies.full import FullPolicy

    grid = Grid(sink=4, page_size=4, window_pages=2)
    b, h, d = 2, 1, 4
    k, v = torch.randn(b, h, 24, d), torch.randn(b, h, 24, d)
    st = OffloadStore(grid, b, h, d, torch.float32, "cpu", TransferStats(), work_tokens=64)
    st.ingest(k, v, torch.tensor([24, 19]))  # row 0's next token joins a page, and the batch's page count grows
    key = FullPolicy().graph_key([st])
    st.append_join(torch.randn(b, h, 1, d), torch.randn(b, h, 1, d))
    attended = st.attend(Selection(everything=True))
    middle = attended.idx.shape[-1] - grid.sink - grid.window
    assert key == (middle // grid.page_size,)
