"""Triton kernels against their PyTorch twins (decode attention, dense decode, UVA/device gather,
Quest page bounds, ArkVale digests, the rerank's candidate scores).

On a CUDA machine the kernels run compiled on the GPU. On a CPU machine they run through Triton's
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before triton is first imported;
the test session has imported it long before this module, so ``test_interpreter_suite`` re-runs
this file in a subprocess with the variable set. Skipped where triton is not installed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, DEV, INTERP, run_kernels

triton = pytest.importorskip("triton")

from kvdex.kernels import attention as ref  # noqa: E402
from kvdex.kernels import digest_triton as dt  # noqa: E402
from kvdex.kernels import permute_triton as pt  # noqa: E402
from kvdex.kernels import quest_triton as qt  # noqa: E402
from kvdex.kernels import reference as twins  # noqa: E402
from kvdex.kernels import triton_attention as ta  # noqa: E402
from kvdex.kernels import uva  # noqa: E402


@pytest.mark.skipif(CUDA or INTERP, reason="runs the kernels itself")
def test_interpreter_suite(interpreter_suite):
    """This file under TRITON_INTERPRET=1 in a fresh interpreter (tests/conftest.py: one for every such
    file of the session): every kernel test below runs on CPU."""
    interpreter_suite(__file__)


def _tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])  # numpy has no bf16


def _inputs(b, h, g, s, n, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h * g, d, generator=gen)
    k = torch.randn(b, h, s, d, generator=gen)
    v = torch.randn(b, h, s, d, generator=gen)
    idx = torch.randint(0, s, (b, h, n), generator=gen)
    valid = torch.rand(b, h, n, generator=gen) < 0.7
    valid[..., 0] = True
    return [x.to(DEV) for x in (q.to(dtype), k.to(dtype), v.to(dtype), idx, valid)]


# ---- sparse decode attention ---------------------------------------------------------------------


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "b,h,g,s,n,d,splits,block_n",
    [
        (2, 2, 2, 50, 37, 16, None, 16),  # GQA, N not a multiple of the tile, automatic splits
        (1, 1, 8, 90, 70, 32, 3, 16),  # one kv head, 8 query heads, 3 splits
        (3, 2, 3, 40, 33, 16, 1, 16),  # odd group (padded to the 16-row tile), one split
        (2, 3, 1, 30, 20, 64, 2, 16),  # MHA, wider head
    ],
)
def test_sparse_decode_matches_twin(dtype, b, h, g, s, n, d, splits, block_n):
    q, k, v, idx, valid = _inputs(b, h, g, s, n, d, dtype, seed=b * 100 + n)
    scale = d**-0.5
    got = ta.sparse_decode_attention(q, k, v, idx, valid, scale, splits=splits, block_n=block_n)
    want = ref.sparse_decode_attention_reference(q, k, v, idx, valid, scale)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=_tol(dtype), rtol=_tol(dtype))


@run_kernels
def test_sparse_decode_never_reads_invalid_slots_and_any_split_agrees():
    """Invalid entries may hold any index (even out of range): they must not be read. The result
    must not depend on how the selection is split."""
    q, k, v, idx, valid = _inputs(2, 2, 2, 40, 45, 16, torch.float32, seed=7)
    want = ref.sparse_decode_attention_reference(q, k, v, idx, valid, 0.3)
    wild = torch.where(valid, idx, 10**6)  # far past the buffer
    outs = [ta.sparse_decode_attention(q, k, v, wild, valid, 0.3, splits=sp, block_n=16) for sp in (1, 2, 3)]
    for out in outs:
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@run_kernels
def test_full_selection_equals_dense_and_strided_buffers():
    """Selecting every slot is dense attention; a strided view of a larger slot buffer (as stores
    hand out) gives the same result as a contiguous copy."""
    b, h, g, s, d = 2, 2, 2, 48, 16
    q, big_k, big_v, _, _ = _inputs(b, h, g, s + 16, 1, d, torch.float32, seed=3)
    k, v = big_k[:, :, :s], big_v[:, :, :s]  # non-contiguous in dim 1
    idx = torch.arange(s, device=DEV).expand(b, h, s)
    valid = torch.ones(b, h, s, dtype=torch.bool, device=DEV)
    got = ta.sparse_decode_attention(q, k, v, idx, valid, 0.25, block_n=16)
    lengths = torch.full((b,), s, device=DEV)
    dense = ref.dense_attention(q[:, :, None], k, v, (lengths - 1)[:, None], None, 0.25)[:, 0]
    torch.testing.assert_close(got, dense, atol=2e-5, rtol=2e-5)
    contig = ta.sparse_decode_attention(q, k.contiguous(), v.contiguous(), idx, valid, 0.25, block_n=16)
    torch.testing.assert_close(got, contig, atol=0, rtol=0)


@run_kernels
def test_dense_decode_ragged_matches_twin_and_seam_reference():
    b, h, g, s, d = 3, 2, 2, 70, 16
    q, k, v, _, _ = _inputs(b, h, g, s, 1, d, torch.float32, seed=5)
    lengths = torch.tensor([70, 1, 33], device=DEV)
    got = ta.dense_decode_attention(q, k, v, lengths, 0.25, max_len=70, block_n=16)
    torch.testing.assert_close(got, twins.dense_decode_reference(q, k, v, lengths, 0.25), atol=2e-5, rtol=2e-5)
    pos = (lengths - 1)[:, None]
    mask = torch.arange(s, device=DEV)[None, :] < lengths[:, None]
    seam_ref = ref.dense_attention(q[:, :, None], k, v, pos, mask, 0.25)[:, 0]
    torch.testing.assert_close(got, seam_ref, atol=2e-5, rtol=2e-5)
    # max_len only sizes the grid: any value >= every length gives the same answer
    torch.testing.assert_close(ta.dense_decode_attention(q, k, v, lengths, 0.25, block_n=16), got, atol=0, rtol=0)


@run_kernels
@pytest.mark.parametrize("length", [1, 37, 70])
def test_block_table_decode_reads_the_paged_cache_in_place(length):
    """vLLM's layout ([num_blocks, block_size, H, D], a request's blocks scattered and in any order, GQA): the
    Triton kernel over the block table equals the reference that gathers; the bound only sizes the grid."""
    from kvdex.vllm.paged import decode_attention_reference

    g = torch.Generator().manual_seed(length)
    kc, vc = (torch.randn(12, 8, 2, 16, generator=g).to(DEV) for _ in "kv")
    blocks = torch.tensor([7, 2, 11, 0, 5, 9, 3, 1, 4, 10], device=DEV)  # room for 80 positions
    q = torch.randn(1, 4, 16, generator=g).to(DEV)
    lengths = torch.tensor([length], device=DEV)
    want = decode_attention_reference(q, blocks, lengths, 80, kc, vc, 0.25)
    for capacity in (72, 80):
        got = ta.block_table_decode_attention(q, blocks, lengths, capacity, kc, vc, 0.25)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="capacity"):
        ta.block_table_decode_attention(q, blocks, lengths, 81, kc, vc, 0.25)


@run_kernels
def test_bad_inputs_raise_value_error():
    q, k, v, idx, valid = _inputs(1, 2, 2, 20, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="GQA"):
        ta.sparse_decode_attention(q[:, :3], k, v, idx, valid, 1.0)
    with pytest.raises(ValueError, match="idx/valid"):
        ta.sparse_decode_attention(q, k, v, idx[:, :1], valid[:, :1], 1.0)
    with pytest.raises(ValueError, match="max_len"):
        ta.dense_decode_attention(q, k, v, torch.tensor([5], device=DEV), 1.0, max_len=21)
    with pytest.raises(ValueError, match="lengths"):
        ta.dense_decode_attention(q, k, v, torch.tensor([5, 5], device=DEV), 1.0)


@run_kernels
@pytest.mark.parametrize("sink,ps,wp", [(16, 16, 2), (4, 8, 1), (0, 16, 1)])
def test_paged_decode_matches_device_store_attend(sink, ps, wp):
    """The in-kernel slot list == DeviceStore.attend's (sink | window | pages | tokens), ragged lengths,
    -1 padded pages and tokens; and it equals the real store path on a filled DeviceStore."""
    b, h, g, s, d = 2, 2, 2, 200, 16
    q, k, v, _, _ = _inputs(b, h, g, s, 1, d, torch.float32, seed=sink + ps)
    lengths = torch.tensor([190, 57], device=DEV)
    gen = torch.Generator().manual_seed(ps)
    pages = torch.randint(-1, 3, (b, h, 4), generator=gen).to(DEV)
    got = ta.paged_decode_attention(q, k, v, pages, lengths, sink, ps, wp, 0.3, block_n=16)
    want = twins.paged_decode_reference(q, k, v, pages, lengths, sink, ps, wp, 0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

    from kvdex.selection import Selection
    from kvdex.storage import DeviceStore, Grid, TransferStats

    store = DeviceStore(Grid(sink, ps, wp), b, h, d, torch.float32, DEV, TransferStats())
    store.ingest(k[:, :, :190], v[:, :, :190], torch.tensor([190, 57]))
    aset = store.attend(Selection(pages=pages))
    via_store = ref.sparse_decode_attention_reference(q, aset.k, aset.v, aset.idx, aset.valid, 0.3)
    fused = ta.paged_decode_attention(q, store.k, store.v, pages, store.lengths, sink, ps, wp, 0.3, block_n=16)
    torch.testing.assert_close(fused, via_store, atol=2e-5, rtol=2e-5)

    # tokens after the pages (PRKV's static pages + reranked tokens), and tokens alone (an empty page view)
    mid_end = int(store.grid.window_start(torch.tensor([190])))
    toks = torch.randint(sink, mid_end, (b, h, 21), generator=gen)
    toks[:, :, ::4] = -1
    toks = toks.to(DEV)
    for pg in (pages, toks[..., :0]):
        sel = Selection(pages=pg if pg.shape[-1] else None, tokens=toks)
        aset = store.attend(sel)
        via_store = ref.sparse_decode_attention_reference(q, aset.k, aset.v, aset.idx, aset.valid, 0.3)
        fused = ta.paged_decode_attention(q, store.k, store.v, pg, store.lengths, sink, ps, wp, 0.3, tokens=toks,
                                          block_n=16)  # fmt: skip
        torch.testing.assert_close(fused, via_store, atol=2e-5, rtol=2e-5)
        want = twins.paged_decode_reference(q, store.k, store.v, pg, store.lengths, sink, ps, wp, 0.3, tokens=toks)
        torch.testing.assert_close(fused, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="tokens"):
        ta.paged_decode_attention(q, store.k, store.v, pages, store.lengths, sink, ps, wp, 0.3, tokens=toks[0])


@run_kernels
@pytest.mark.parametrize("relocated", [False, True])
def test_paged_decode_through_a_block_table_is_the_paged_store_attend(relocated):
    """``block_table`` (+ ``order``): the fused kernel reads vLLM's paged cache in place through a request's block-
    table row (and PRKV's relocation map) and equals ``PagedStore.attend`` + the reference decode, for pages, pages
    and tokens, tokens alone; the attended slots counted as the twin counts them."""
    from kvdex.selection import Selection
    from kvdex.storage import Grid, TransferStats
    from kvdex.vllm.paged import kv_cache_shape, request_kv
    from kvdex.vllm.store import BlockRow, PagedStore

    gen = torch.Generator().manual_seed(5)
    sink, ps, wp, h, g, d, length = 16, 16, 2, 2, 2, 16, 150
    kv = torch.randn(kv_cache_shape(20, ps, h, d), generator=gen).to(DEV)
    row = BlockRow(torch.randperm(20, generator=gen)[: -(-length // ps)].to(DEV))
    store = PagedStore(Grid(sink, ps, wp), 1, h, d, torch.float32, DEV, TransferStats(), k_cache=kv[0],
                       v_cache=kv[1], row=row)  # fmt: skip
    store.ingest(*request_kv(row.blocks, length, kv[0], kv[1]), torch.tensor([length]))
    if relocated:
        m = int(store.grid.num_middle_pages(torch.tensor([length]))) * ps
        store.permute_middle(torch.stack([torch.randperm(m, generator=gen) for _ in range(h)])[None].to(DEV))
    q = torch.randn(1, h * g, d, generator=gen).to(DEV)
    pages = torch.tensor([[[0, 3, -1], [5, 1, 2]]], device=DEV)
    toks = torch.tensor([[[20, -1, 61], [100, 99, -1]]], device=DEV)
    for pg, tk in ((pages, None), (pages, toks), (pages[..., :0], toks)):
        aset = store.attend(Selection(pages=pg if pg.shape[-1] else None, tokens=tk))
        want = ref.sparse_decode_attention_reference(q, aset.k, aset.v, aset.idx, aset.valid, 0.3)
        count = torch.zeros((), dtype=torch.long, device=DEV)
        got = ta.paged_decode_attention(q, kv[0], kv[1], pg, store.lengths, sink, ps, wp, 0.3, tokens=tk, count=count,
                                        block_table=row.blocks, order=store.order, block_n=16)  # fmt: skip
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert int(count) == int(aset.valid.sum())
    with pytest.raises(ValueError, match="order"):
        ta.paged_decode_attention(q, kv[0], kv[1], pages, store.lengths, sink, ps, wp, 0.3,
                                  block_table=row.blocks, order=torch.zeros(1, h + 1, 4, dtype=torch.long))  # fmt: skip


@run_kernels
@pytest.mark.parametrize("sink,ps,wp", [(4, 16, 1), (16, 32, 2), (0, 8, 1)])
@pytest.mark.parametrize("b,h,p", [(1, 4, 12), (3, 2, 7), (2, 2, 0)])
def test_paged_decode_count_equals_twin(sink, ps, wp, b, h, p):
    """``count=``: the kernel adds the slots it attended (pages x page size, the tokens, sink and window rows
    below each length, every kv head) to the counter in place, as the twin counts them; the output is the
    same with and without it. Lengths below the sink, in the first window, on / off a page boundary, long.
    The many-heads case is 4 kv heads x 12 pages (was 8 x 40: 6x the interpreter time for the same paths):
    still more pages than splits (3) and 2p + 3 = 27 tokens, more than one block (16)."""
    from kvdex.kernels.reference import paged_attended_count_reference as count_twin

    lengths = torch.tensor([2, sink + 3, sink + ps * (wp + 3), sink + ps * (wp + 7) + 5, 900][:b])
    q, k, v, _, _ = _inputs(b, h, 2, 1024, 1, 16, torch.float32, seed=b * 100 + p + sink)
    g = torch.Generator().manual_seed(p + ps)
    pages = torch.randint(-1, 3, (b, h, p), generator=g)
    toks = torch.randint(-1, 40, (b, h, 2 * p + 3), generator=g)  # a token selection after the pages
    for tk in (None, toks):
        acc = torch.tensor(1234, dtype=torch.long, device=DEV)
        want = 1234 + int(count_twin(pages, lengths, sink, ps, wp, tokens=tk))
        args = (q, k, v, pages.to(DEV), lengths.to(DEV), sink, ps, wp, 0.3)
        tkd = None if tk is None else tk.to(DEV)
        got = ta.paged_decode_attention(*args, tokens=tkd, count=acc, block_n=16, splits=3)
        assert int(acc) == want
        ta.paged_decode_attention(*args, tokens=tkd, count=acc, block_n=16)  # other splits; accumulates in place
        assert int(acc) == 2 * want - 1234
        plain = ta.paged_decode_attention(*args, tokens=tkd, block_n=16, splits=3)
        torch.testing.assert_close(got, plain, atol=0, rtol=0)
    assert int(count_twin(pages, lengths, sink, ps, wp, tokens=toks)) == int(
        count_twin(pages, lengths, sink, ps, wp)
    ) + int((toks >= 0).sum())
    with pytest.raises(ValueError, match="count"):
        ta.paged_decode_attention(*args, count=torch.zeros(1, dtype=torch.long, device=DEV))


# ---- gathers (UVA from pinned host memory on CUDA; device gather; interpreter on CPU) ------------


def _host_pages(b=2, h=3, p=9, ps=4, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(b, h, p, 2, ps, d, generator=gen).to(dtype)
    return src.pin_memory() if CUDA else src


@run_kernels
@pytest.mark.parametrize("keys_only", [False, True], ids=["kv", "keys"])
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_gather_pages_matches_twin(on_device, keys_only):
    src = _host_pages()
    if on_device:
        src = src.to(DEV)
    gen = torch.Generator().manual_seed(1)
    pages = torch.randint(-1, src.shape[2], (2, 3, 6), generator=gen).to(DEV)
    got = uva.gather_pages(src, pages, keys_only=keys_only)
    assert got.device.type == DEV and got.shape[3] == (1 if keys_only else 2)
    want = uva.gather_pages_reference(src.cpu(), pages.cpu(), keys_only=keys_only)
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)
    assert bool((got[pages < 0] == 0).all())
    bi, hi, ji = torch.nonzero(pages.cpu() >= 0, as_tuple=True)  # the keys of the pages asked for, K first
    keys = src.cpu()[bi, hi, pages.cpu()[bi, hi, ji], 0]
    torch.testing.assert_close(got.cpu()[bi, hi, ji, 0], keys, atol=0, rtol=0)


@run_kernels
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_store_pages_matches_twin(on_device):
    """The page that leaves an offloaded window, written into the page store by one kernel (pinned host
    memory over UVA on CUDA): rows with page -1 write nothing."""
    from kvdex.storage.host import store_pages_reference

    dst = _host_pages(seed=4)
    if on_device:
        dst = dst.to(DEV)
    want = dst.cpu().clone()
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randn(2, 3, 2, 4, 16, generator=gen)
    pages = torch.tensor([6, -1])
    uva.store_pages(dst, pages.to(DEV), blocks.to(DEV))
    store_pages_reference(want, pages, blocks)
    assert torch.equal(dst.cpu(), want)
    assert torch.equal(want[0, :, 6], blocks[0]) and not torch.equal(want[1, :, 6], blocks[1])


@run_kernels
def test_gather_rows_matches_twin_and_host_layout():
    src = _host_pages(d=32, seed=2)
    sink, ps = 5, src.shape[4]
    gen = torch.Generator().manual_seed(3)
    pos = torch.randint(sink, sink + src.shape[2] * ps, (2, 3, 21), generator=gen)
    pos[0, 1, 4] = 0  # padding (inside the sink): zeros
    got = uva.gather_rows(src, pos.to(DEV), sink).cpu()
    torch.testing.assert_close(got, uva.gather_rows_reference(src.cpu(), pos, sink), atol=0, rtol=0)
    b, h, t = 1, 2, 7  # one row by hand: K and V of position pos at (page, offset)
    rel = int(pos[b, h, t]) - sink
    assert torch.equal(got[b, h, t, 0], src[b, h, rel // ps, 0, rel % ps].cpu())
    assert torch.equal(got[b, h, t, 1], src[b, h, rel // ps, 1, rel % ps].cpu())
    assert bool((got[0, 1, 4] == 0).all())


@run_kernels
def test_gather_bad_inputs():
    src = _host_pages()
    with pytest.raises(ValueError, match="pages must be"):
        uva.gather_pages(src, torch.zeros(2, 2, 3, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="host pages"):
        uva.gather_pages(src[:, :, :, 0], torch.zeros(2, 3, 3, dtype=torch.long, device=DEV))
    if CUDA:
        with pytest.raises(ValueError, match="pinned"):
            uva.gather_pages(torch.zeros(2, 3, 4, 2, 4, 16), torch.zeros(2, 3, 1, dtype=torch.long, device=DEV))


# ---- Quest page scores ------------------------------------------------------------------------------


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,g,p,d", [(2, 2, 2, 45, 16), (1, 1, 7, 33, 32), (2, 3, 1, 70, 16)])
def test_quest_scores_match_twin_and_bound_every_key(dtype, b, h, g, p, d):
    gen = torch.Generator().manual_seed(p)
    ps = 4
    keys = torch.randn(b, h, p, ps, d, generator=gen).to(dtype)
    q = torch.randn(b, h * g, d, generator=gen).to(dtype).to(DEV)
    cap = torch.zeros(b, h, p + 5, d, dtype=dtype)  # a larger index buffer, sliced as the policy does
    kmin, kmax = cap.clone(), cap.clone()
    kmin[:, :, :p], kmax[:, :, :p] = keys.amin(3), keys.amax(3)
    kmin, kmax = kmin.to(DEV)[:, :, :p], kmax.to(DEV)[:, :, :p]
    npages = torch.tensor([p, p - 9][:b], device=DEV)
    got = qt.page_scores(q, kmin, kmax, npages)
    want = qt.page_scores_reference(q, kmin, kmax, npages)
    assert got.shape == (b, h, p) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # the bound is never below the true max of q.k over the page's keys, for every query head of the group
    true = torch.einsum("bhgd,bhpsd->bhgps", q.view(b, h, g, d).float(), keys.to(DEV).float()).amax(-1).amax(2)
    live = torch.isfinite(got)
    assert bool((got[live] >= true[live] - 1e-4).all())
    assert bool((~live[1:, :, p - 9 :]).all()) and bool(live[:, :, : p - 9].all())
    # the same from token lengths: the kernel derives each middle page count (Grid.num_middle_pages)
    from kvdex.storage import Grid

    grid = Grid(16, 16, 2)
    lengths = torch.tensor([700, 333][:b], device=DEV)
    from_len = qt.page_scores(q, kmin, kmax, lengths=lengths, grid=grid)
    torch.testing.assert_close(from_len, qt.page_scores(q, kmin, kmax, grid.num_middle_pages(lengths)), atol=0, rtol=0)
    with pytest.raises(ValueError, match="pass one of"):
        qt.page_scores(q, kmin, kmax, npages, lengths=lengths, grid=grid)
    # from a fill table (semantic pages: a page holding no key, anywhere in the row, gets -inf; the table is
    # wider than P), the twin's scores where the fill is positive
    fill = torch.randint(0, 3, (b, h, p + 3), generator=gen, dtype=torch.int32).to(DEV)
    from_fill = qt.page_scores(q, kmin, kmax, fill=fill)
    full = qt.page_scores_reference(q, kmin, kmax, torch.full((b,), p, device=DEV))
    torch.testing.assert_close(from_fill, torch.where(fill[:, :, :p] > 0, full, float("-inf")), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="fill must be"):
        qt.page_scores(q, kmin, kmax, fill=fill[:, :, : p - 1])


# ---- ArkVale digest scores ----------------------------------------------------------------------------


@run_kernels
@pytest.mark.parametrize("kind", ["cuboid-mean", "sphere-max"])
@pytest.mark.parametrize("b,h,g,p,d", [(2, 2, 2, 45, 16), (1, 1, 7, 33, 32), (2, 3, 1, 70, 16)])
def test_digest_scores_match_twin(kind, b, h, g, p, d):
    """Per kv head the group's max of the digest estimate, -inf outside first <= p < the middle's pages
    (derived from token lengths), over a sliced index buffer as the policies pass it."""
    from kvdex.policies.digest import summarize
    from kvdex.storage import Grid

    gen = torch.Generator().manual_seed(p)
    keys = torch.randn(b, h, p + 5, 4, d, generator=gen)
    c, r = summarize(keys, kind)
    c, r = c.to(DEV)[:, :, :p], r.to(DEV)[:, :, :p]
    q = torch.randn(b, h * g, d, generator=gen).to(DEV)
    grid = Grid(16, 16, 2)
    lengths = torch.tensor([700, 333][:b], device=DEV)  # 40 and 17 middle pages
    for first in (None, torch.tensor([3, 0][:b], device=DEV)):
        got = dt.page_scores(q, c, r, lengths, grid, first)
        want = dt.page_scores_reference(q, c, r, lengths, grid, first)
        assert got.shape == (b, h, p) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        assert bool(torch.isfinite(got[0, :, (0 if first is None else 3) : 40]).all())
    with pytest.raises(ValueError, match="radius"):
        dt.page_scores(q, c, torch.zeros(b, h, p, 2, device=DEV), lengths, grid)


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["cuboid-mean", "cuboid-max", "cuboid-center", "sphere-mean", "sphere-max",
                                  "sphere-center"])  # fmt: skip
@pytest.mark.parametrize("shape", [(2, 3, 9, 16, 32), (1, 2, 6, 5, 24)])  # [B, H, pages, ps, D]; odd ps and D
def test_digest_summary_matches_twin(dtype, kind, shape):
    """The digests of full pages (PRKV's refresh recomputes every middle page's) == the PyTorch twin, from keys
    in the model's dtype, contiguous or a slice of a store's key buffer [B, H, S, D] viewed as pages; an empty
    batch of pages; a bad kind refused."""
    from kvdex.kernels.scoring import digest_summary

    b, h, p, ps, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    buf = (torch.randn(b, h, 3 + p * ps + 7, d, generator=gen) * 3).to(dtype).to(DEV)  # sink 3, 7 spare slots
    sliced = buf[:, :, 3 : 3 + p * ps].reshape(b, h, p, ps, d)  # a view, not contiguous
    for keys in (sliced.contiguous(), sliced):
        c, r = dt.summarize(keys, kind)
        wc, wr = digest_summary(keys, kind)
        assert c.shape == wc.shape and r.shape == wr.shape and c.dtype == r.dtype == torch.float32
        torch.testing.assert_close(c, wc, atol=0, rtol=0)  # the box's centre: exact
        torch.testing.assert_close(r, wr, atol=1e-5, rtol=1e-5)
    c0, r0 = dt.summarize(sliced[:, :, :0], kind)
    assert c0.shape == (*shape[:2], 0, shape[-1]) and r0.shape[:3] == (*shape[:2], 0)
    with pytest.raises(ValueError, match="digest"):
        dt.summarize(sliced, "box-mean")


# ---- rerank: exact scores of candidate tokens ----------------------------------------------------------


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", ["max", "weight"])
@pytest.mark.parametrize("b,h,g,c,d,ps", [(2, 2, 2, 9, 16, 4), (1, 1, 7, 5, 32, 16), (2, 3, 4, 12, 64, 16)])
def test_rerank_candidate_scores_match_twin(dtype, group, b, h, g, c, d, ps):
    """The kernel reads the candidate pages' keys in place (a strided buffer with spare slots, pages
    padded with -1 and repeated) and scores exactly what the twin gathers and scores: the same live
    tokens (page >= 0, below the window, at or past ``first``), -inf elsewhere."""
    from kvdex.kernels import rerank_triton as rt

    gen = torch.Generator().manual_seed(c * d + g)
    sink, s_cap = 4, 4 + 20 * ps + 9
    big = torch.randn(b, h, s_cap + 3, d + 8, generator=gen).to(dtype)  # strided: a view of a wider buffer
    k = big.to(DEV)[:, :, :s_cap, :d]
    q = torch.randn(b, h * g, d, generator=gen).to(dtype).to(DEV)
    pages = torch.randint(-1, 20, (b, h, c), generator=gen)
    pages[:, :, 1] = -1  # padding
    pages = pages.to(DEV)
    ws = torch.tensor([sink + 20 * ps, sink + 13 * ps + 3][:b], device=DEV)  # row 1: past its window: dead
    for first in (None, torch.tensor([sink + 2 * ps + 1, sink][:b], device=DEV)):
        kw = dict(sink=sink, page_size=ps, scale=0.125, group=group, first=first)
        got = rt.candidate_scores(q, k, pages, ws, **kw)
        want = rt.candidate_scores_reference(q, k, pages, ws, **kw)
        n = c * ps
        assert got.shape == ((b, h, n) if group == "max" else (b, h, g, n)) and got.dtype == torch.float32
        assert bool((torch.isfinite(got) == torch.isfinite(want)).all())
        live = torch.isfinite(want)
        assert bool(live.any()) and not bool(live.all())
        torch.testing.assert_close(got[live], want[live], atol=2e-3 if dtype != torch.float32 else 1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="group"):
        rt.candidate_scores(q, k, pages, ws, sink=sink, page_size=ps, scale=1.0, group="sum")


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,g,c,d,ps", [(2, 2, 2, 9, 16, 4), (1, 1, 7, 5, 32, 16), (2, 3, 4, 40, 64, 16)])
def test_rerank_candidate_weights_match_twin(dtype, b, h, g, c, d, ps):
    """``rerank_group="weight"`` in two kernels: each query head's softmax over sink, window (partly past
    the length) and the live candidates, summed over the group, as the twin computes it in PyTorch; the
    weights of a row sum to at most the group size; -inf exactly where the candidate is not live. The
    largest case has 10 tiles of candidates (their statistics combined across programs)."""
    from kvdex.kernels import rerank_triton as rt

    gen = torch.Generator().manual_seed(c * d + g + 1)
    sink, window, s_cap = 4, 8, 4 + 48 * ps + 12
    k = (torch.randn(b, h, s_cap, d + 8, generator=gen) * 2).to(dtype).to(DEV)[..., :d]
    q = (torch.randn(b, h * g, d, generator=gen) * 2).to(dtype).to(DEV)
    pages = torch.randint(-1, 40, (b, h, c), generator=gen)
    pages[:, :, 1] = -1
    pages = pages.to(DEV)
    ws = torch.tensor([sink + 40 * ps, sink + 13 * ps][:b], device=DEV)
    lengths = ws + torch.tensor([window, 3][:b], device=DEV)  # row 1: a window of 3 tokens of 8
    for first in (None, torch.tensor([sink + 2 * ps + 1, sink][:b], device=DEV)):
        kw = dict(sink=sink, window=window, page_size=ps, scale=d**-0.5, first=first)
        got = rt.candidate_weights(q, k, pages, ws, lengths, **kw)
        want = rt.candidate_weights_reference(q, k, pages, ws, lengths, **kw)
        assert got.shape == (b, h, c * ps) and got.dtype == torch.float32
        live = torch.isfinite(want)
        assert bool((torch.isfinite(got) == live).all()) and bool(live.any()) and not bool(live.all())
        assert bool((want[live] > 0).any())
        torch.testing.assert_close(got[live], want[live], atol=1e-5, rtol=2e-3 if dtype != torch.float32 else 1e-4)
        # a candidate page listed twice counts twice in the softmax, in both
        assert float(got.masked_fill(~live, 0).sum(-1).max()) <= g * 2 + 1e-3


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", ["max", "heads"])
@pytest.mark.parametrize("b,h,g,n,d", [(2, 2, 2, 37, 16), (1, 1, 7, 80, 32), (2, 3, 4, 130, 64)])
def test_rerank_slot_scores_match_twin(dtype, group, b, h, g, n, d):
    """IceCache's semantic candidates: keys at arbitrary slots (int32, -1 for none) of a strided buffer."""
    from kvdex.kernels import rerank_triton as rt

    gen = torch.Generator().manual_seed(n + g)
    s_cap = 300
    k = torch.randn(b, h, s_cap, d + 8, generator=gen).to(dtype).to(DEV)[..., :d]
    q = torch.randn(b, h * g, d, generator=gen).to(dtype).to(DEV)
    slots = torch.randint(-1, s_cap, (b, h, n), generator=gen, dtype=torch.int32)
    slots[:, :, 0] = -1
    slots = slots.to(DEV)
    got = rt.slot_scores(q, k, slots, group=group)
    want = rt.slot_scores_reference(q, k, slots, group=group)
    assert got.shape == ((b, h, n) if group == "max" else (b, h, g, n)) and got.dtype == torch.float32
    live = torch.isfinite(want)
    assert bool((torch.isfinite(got) == live).all()) and bool(live.any()) and not bool(live.all())
    torch.testing.assert_close(got[live], want[live], atol=2e-3 if dtype != torch.float32 else 1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="group"):
        rt.slot_scores(q, k, slots, group="weight")


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,g,n,d", [(2, 2, 2, 37, 16), (2, 3, 4, 700, 64)])  # 700: 11 tiles of candidates
def test_rerank_slot_weights_match_twin(dtype, b, h, g, n, d):
    """``rerank_group="weight"`` on IceCache's semantic candidates (slots, -1 for none): each head's softmax over
    sink, window (row 1 shorter than the window) and the candidates, summed over the group, as the twin."""
    from kvdex.kernels import rerank_triton as rt

    gen = torch.Generator().manual_seed(n + d)
    sink, window, s_cap = 4, 8, 900
    k = (torch.randn(b, h, s_cap, d + 8, generator=gen) * 2).to(dtype).to(DEV)[..., :d]
    q = (torch.randn(b, h * g, d, generator=gen) * 2).to(dtype).to(DEV)
    ws = torch.tensor([880, 500][:b], device=DEV)
    lengths = ws + torch.tensor([window, 3][:b], device=DEV)
    slots = torch.randint(sink, 500, (b, h, n), generator=gen, dtype=torch.int32)
    slots[:, :, ::5] = -1
    kw = dict(sink=sink, window=window, scale=d**-0.5)
    got = rt.slot_weights(q, k, slots.to(DEV), ws, lengths, **kw)
    want = rt.slot_weights_reference(q, k, slots.to(DEV), ws, lengths, **kw)
    assert got.shape == (b, h, n) and got.dtype == torch.float32
    live = torch.isfinite(want)
    assert bool((torch.isfinite(got) == live).all()) and bool(live.any()) and not bool(live.all())
    torch.testing.assert_close(got[live], want[live], atol=1e-5, rtol=2e-3 if dtype != torch.float32 else 1e-4)
    assert float(got.masked_fill(~live, 0).sum(-1).max()) <= g + 1e-3  # each head's weights sum to at most 1


# ---- IceCache's device page build: every key's nearest promoted point ----------------------------------


@run_kernels
@pytest.mark.parametrize("precision", ["bf16x3", "tf32x3", "ieee"])
@pytest.mark.parametrize(
    "r,n,np_,d", [(3, 200, 13, 16), (2, 70, 64, 64), (1, 130, 65, 128), (2, 9, 1, 12), (1, 90, 40, 256)]
)
def test_nearest_promoted_matches_twin(precision, r, n, np_, d):
    """The kernel picks the twin's point wherever the best two scores are apart (a near tie may go either
    way: they sum in other orders), on unit vectors of D + 1 coordinates as the build makes them; a row's
    points repeated pick the first copy (argmax's tie rule); tiles past Np never win."""
    from kvdex.kernels import parents_triton as pt

    if precision == "bf16x3" and not CUDA:
        pytest.skip("triton 3.6's interpreter misreads bf16 tl.dot operands (the GPU run covers bf16x3)")
    gen = torch.Generator().manual_seed(n * d + np_)
    X = torch.nn.functional.normalize(torch.randn(r, n, d + 1, generator=gen), dim=-1)
    pick = torch.randint(0, n, (r, np_), generator=gen)
    Xp = X.gather(1, pick[:, :, None].expand(-1, -1, d + 1)).clone()
    if np_ > 2:
        Xp[:, 1] = Xp[:, 0]  # an exact duplicate: the first copy wins
    X, Xp = X.to(DEV), Xp.to(DEV)
    got = pt.nearest(X, Xp, precision=precision, **({} if CUDA else dict(block_m=32, block_n=16)))
    want = pt.nearest_reference(X, Xp)
    assert got.shape == (r, n) and got.dtype == torch.long
    assert bool((got >= 0).all()) and bool((got < np_).all())
    s = torch.einsum("rne,rpe->rnp", X.double(), Xp.double())
    top2 = s.topk(min(2, np_), dim=-1).values
    clear = (top2[..., 0] - top2[..., -1] > 1e-4) if np_ > 1 else torch.ones_like(got, dtype=torch.bool)
    assert bool(clear.any())
    assert torch.equal(got[clear], want[clear])
    if np_ > 2:
        assert not bool((got == 1).any())  # the duplicate of point 0 never wins
    with pytest.raises(ValueError, match="precision"):
        pt.nearest(X, Xp, precision="bf16")


# ---- IceCache's rerank on semantic pages: the index arithmetic around the scoring and the top-k -----------


@run_kernels
@pytest.mark.parametrize(
    "r,c,pc,ps,t",
    [(3, 9, 5, 4, 7), (2, 40, 33, 16, 100), (1, 3, 3, 16, 48), (2, 120, 100, 16, 1200)],  # 1200: 3 tiles
)
def test_semantic_candidate_slots_and_pick_tokens_match_twins(r, c, pc, ps, t):
    """Candidates padded with -1 and repeated, partly filled pages: the same int32 slots as the twin; chosen
    columns (-1 padded, any order) map to the same positions and add the same (pages, tokens) counts."""
    from kvdex.kernels import semantic_triton as st

    gen = torch.Generator().manual_seed(r * c + pc)
    pos = torch.randint(0, 10_000, (r, c + 1, ps), generator=gen, dtype=torch.int32)
    fill = torch.randint(0, ps + 1, (r, c + 1, 1), generator=gen)
    pos = torch.where(torch.arange(ps)[None, None, :] < fill, pos, -1)
    big = torch.full((r, c + 1, ps + 3), 7, dtype=torch.int32)  # a strided view, as the table's rows are
    big[..., :ps] = pos
    cand = torch.randint(-1, c, (r, pc), generator=gen)
    cand[:, 0] = -1
    if pc > 2:
        cand[:, 2] = cand[:, 1]
    slots = st.candidate_slots(cand.to(DEV), big.to(DEV)[..., :ps], ps)
    want = st.candidate_slots_reference(cand, pos, ps)
    assert slots.dtype == torch.int32 and torch.equal(slots.cpu(), want)
    ids = torch.stack([torch.randperm(pc * ps, generator=gen)[:t] for _ in range(r)]) if pc * ps >= t else None
    if ids is None:
        ids = torch.randint(0, pc * ps, (r, t), generator=gen)
    ids[:, ::5] = -1
    got_counts = torch.zeros(2, dtype=torch.long, device=DEV)
    want_counts = torch.zeros(2, dtype=torch.long)
    got = st.pick_tokens(ids.to(DEV), slots, ps, got_counts)
    ref = st.pick_tokens_reference(ids, want, ps, want_counts)
    assert got.dtype == torch.long and torch.equal(got.cpu(), ref)
    assert torch.equal(got_counts.cpu(), want_counts) and int(want_counts[1]) == int((ids >= 0).sum())
    with pytest.raises(ValueError, match="counts"):
        st.pick_tokens(ids.to(DEV), slots, ps, torch.zeros(2, dtype=torch.int32, device=DEV))


@run_kernels
@pytest.mark.parametrize("kind", ["minmax", "centroid"])
@pytest.mark.parametrize("r,n,c,d", [(2, 16, 150, 32), (3, 5, 7, 24)])
@pytest.mark.parametrize("kdtype", [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []), ids=str)
def test_semantic_nearest_pages_match_twin(kind, r, n, c, d, kdtype):
    """A joining key's nearest live page: over several tiles of pages (150 > 64), dead pages (a minmax one
    holds +-inf) never chosen, a row without live pages -> 0, ties -> the first page; the kernel's choice is
    the twin's or within fp32 rounding of its distance. fp32 keys with bf16 summaries (TF32x3 products), and
    16-bit keys with summaries of their dtype (the products of the keys and the summaries themselves)."""
    from kvdex.index.summary import page_summaries
    from kvdex.kernels import semantic_triton as st

    gen = torch.Generator().manual_seed(r * c + d)
    pk = torch.randn(r, c, 4, d, generator=gen)
    held = torch.rand(r, c, 4, generator=gen) < 0.7
    held[:, ::3] = False  # dead pages
    held[-1] = False  # a row with no live page
    a, b = page_summaries(pk, held, kind, torch.bfloat16 if kdtype == torch.float32 else kdtype)
    fill = held.sum(-1).int()
    keys = torch.randn(r, n, d, generator=gen).to(kdtype)
    keys[0, 1] = keys[0, 0]
    fill[0, 4:6] = fill[0, 4:6].clamp(min=1)  # two live pages with the same centre: the first wins
    fill[0, c - 1] = fill[0, c - 1].clamp(min=1)  # and a third in another tile of pages
    if kind == "minmax":  # finite bounds, as a live page has
        a[0, 4], b[0, 4] = a[0, 4].clamp(max=0), b[0, 4].clamp(min=0)
        b[0, 5] = b[0, c - 1] = b[0, 4]
    a[0, 5] = a[0, c - 1] = a[0, 4]
    got = st.nearest_pages(keys.to(DEV), a.to(DEV), b.to(DEV), fill.to(DEV), kind).cpu()
    want = st.nearest_pages_reference(keys, a, b, fill, kind)
    assert got.dtype == torch.long and got.shape == (r, n)
    live = fill > 0
    assert bool(live.gather(1, got[:-1]).all()) and bool((got[-1] == 0).all())
    centre = (a.float() + b.float()) / 2 if kind == "minmax" else a.float()
    dist = ((keys.float()[:, :, None] - centre[:, None]) ** 2).sum(-1).masked_fill(~live[:, None], float("inf"))
    d_got, d_want = dist.gather(2, got[..., None]), dist.gather(2, want[..., None])
    torch.testing.assert_close(d_got[:-1], d_want[:-1], rtol=1e-5, atol=1e-4)
    assert (got == want).float().mean() > 0.95
    centre4 = centre[:1, 4:5].contiguous()  # a key at the centre shared by pages 4 and 5: page 4
    tie = st.nearest_pages(centre4.to(DEV), a[:1].to(DEV), b[:1].to(DEV), fill[:1].to(DEV), kind).cpu()
    assert int(tie) == 4 == int(st.nearest_pages_reference(centre4, a[:1], b[:1], fill[:1], kind))
    with pytest.raises(ValueError, match="expected keys"):
        st.nearest_pages(keys.to(DEV), a[:, :-1].to(DEV), b.to(DEV), fill.to(DEV), kind)


def _insert_table(kind, r, c, ps, d, dtype, gen):
    """A semantic page table of r rows (c pages + the trash page): full, partly filled and empty pages."""
    from kvdex.index.summary import page_summaries

    C = c + 1
    fill = torch.randint(0, ps + 1, (r, C), generator=gen).int()
    fill[:, ::4] = ps  # full pages: keys that pick them spill
    fill[:, -1] = 0  # the trash page
    fill[-1] = 0  # a row without live pages: every key spills into page 0
    npages = torch.full((r,), c - 3, dtype=torch.long)
    npages[-1] = 0
    fill[:, c - 3 :] = 0  # pages past npages are unused
    held = torch.arange(ps)[None, None, :] < fill[..., None]
    pk = torch.randn(r, C, ps, d, generator=gen)
    a, b = page_summaries(pk, held, kind, dtype)
    pos = torch.where(held, torch.randint(0, 10_000, (r, C, ps), generator=gen), -1).int()
    return pos, fill, npages, a, b


@run_kernels
@pytest.mark.parametrize("kind", ["minmax", "centroid"])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []), ids=str)
@pytest.mark.parametrize("B,H,c,ps,d", [(3, 2, 9, 16, 32), (3, 1, 6, 5, 24)])
def test_semantic_insert_pages_match_twin(kind, dtype, B, H, c, ps, d):
    """A window page joining semantic pages in one kernel == the twin: keys choosing one page (in their order),
    full pages (spill into one new page per row), a row without live pages, a sequence not joining (its rows
    unchanged), pages no key joined unchanged; minmax exactly, the centroid within fp32 rounding."""
    from kvdex.kernels import semantic_triton as st

    gen = torch.Generator().manual_seed(B * 100 + c * 10 + ps)
    R = B * H
    pos, fill, npages, a, b = _insert_table(kind, R, c, ps, d, dtype, gen)
    keys = torch.randn(R, ps, d, generator=gen).to(dtype)
    tgt = torch.randint(0, c - 3, (R, ps), generator=gen)
    tgt[0, : ps // 2] = 1  # several keys to one page (partly filled: some join, the rest spill)
    tgt[0, 1] = 0  # a full page
    tgt[-1] = 0  # no live pages (the nearest-page call's 0)
    ok = torch.ones(B, dtype=torch.bool)
    ok[1] = False  # sequence 1 does not join
    positions = torch.arange(B * ps).view(B, ps) + 20_000
    want = [x.clone() for x in (pos, fill, npages, a, b)]
    st.insert_pages_reference(keys, tgt, ok, positions, *want, kind)
    got = [x.clone().to(DEV) for x in (pos, fill, npages, a, b)]
    st.insert_pages(keys.to(DEV), tgt.to(DEV), ok.to(DEV), positions.to(DEV), *got, kind)
    got = [x.cpu() for x in got]
    for name, g, w in zip(("pos", "fill", "npages"), got[:3], want[:3], strict=True):
        assert torch.equal(g, w), name
    changed = (want[1] != fill).any(1)
    assert bool(changed[0]) and not bool(changed[H : 2 * H].any())  # sequence 1's rows untouched
    assert int(want[2][-1]) == 1 and int(want[1][-1, 0]) == ps  # the empty row's keys: one new page
    if kind == "minmax":
        assert torch.equal(got[3], want[3]) and torch.equal(got[4], want[4])
    else:
        tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[3], want[3], **tol)
        torch.testing.assert_close(got[4], want[4], **tol)
    untouched = want[1] == fill  # a page a key joined has a larger fill
    assert torch.equal(got[3][untouched], a[untouched]) and torch.equal(want[3][untouched], a[untouched])
    assert torch.equal(got[4][untouched], b[untouched]) and torch.equal(want[4][untouched], b[untouched])
    with pytest.raises(ValueError, match="expected keys"):
        st.insert_pages(keys.to(DEV), tgt[:, :-1].to(DEV), ok.to(DEV), positions.to(DEV), *got, kind)


# ---- GPU only: the seams pick the kernels ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_seams_dispatch_to_triton_on_cuda():
    q, k, v, idx, valid = _inputs(2, 2, 4, 300, 200, 128, torch.bfloat16)
    got = ref.sparse_decode_attention(q, k, v, idx, valid, 0.1)
    torch.testing.assert_close(got, ta.sparse_decode_attention(q, k, v, idx, valid, 0.1), atol=0, rtol=0)
    lengths = torch.tensor([300, 17], device=DEV)
    got = ref.dense_decode_attention(q, k, v, lengths, 0.1, max_len=300)
    torch.testing.assert_close(got, ta.dense_decode_attention(q, k, v, lengths, 0.1), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_host_pages_use_uva_and_match_staging_path():
    from kvdex.storage import TransferStats
    from kvdex.storage.host import HostPages

    hp = HostPages(2, 3, 4, 16, torch.bfloat16, "cuda", TransferStats())
    assert hp._uva is not None
    hp.reserve(9)
    hp.data.copy_(_host_pages(p=hp.capacity, dtype=torch.bfloat16))
    pages = torch.randint(0, 9, (2, 3, 5), device="cuda")
    got = hp.fetch_pages(pages)
    hp._uva = None
    want = hp.fetch_pages(pages)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "spec",
    [
        "quest:rerank=4",
        "quest:rerank=4:rerank_group=weight",
        "prkv:rerank=2:refresh=8",
        "icecache:search=summary:rerank=4:build=device",
        "icecache:search=summary:rerank=4:build=device:rerank_unit=token",
    ],
)
def test_rerank_decodes_alike_with_and_without_its_kernel(monkeypatch, spec):
    """Greedy decode of a tiny fp32 model with a page policy's rerank: the candidates scored by the kernel
    (IEEE fp32 dot) and by the PyTorch twin (that one seam dispatching to nothing) give the same tokens and
    logits within fp32 rounding."""
    import kvdex
    from kvdex.bench import shapes
    from kvdex.bench.decoding import make_prompt
    from kvdex.index import summary
    from kvdex.policies import rerank

    model = shapes.build_model("tiny", torch.float32, "cuda")
    ids = make_prompt(2, 600, model.config.vocab_size, 0, "cuda")
    out = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(rerank, "triton_kernel", lambda *a, **k: None)
            monkeypatch.setattr(summary, "triton_kernel", lambda *a, **k: None)
        cache = kvdex.Cache(model, spec, 128, dense_layers=1)
        got = model.generate(ids, **kvdex.cache_kwargs(cache), max_new_tokens=24, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        out.append(got)
    assert torch.equal(out[0].sequences, out[1].sequences)
    torch.testing.assert_close(torch.stack(out[0].logits), torch.stack(out[1].logits), atol=1e-4, rtol=1e-4)


@run_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 80])
def test_permute_slots_matches_twin(dtype, d):
    """PRKV's relocation of a store's middle: the same buffer as the twin, bit for bit, rows outside the range
    untouched (a buffer with spare capacity, so the range is not contiguous across heads)."""
    gen = torch.Generator().manual_seed(d)
    b, h, cap, start, m = 2, 3, 300, 16, 250
    x = torch.randn(b, h, cap, d, generator=gen).to(DEV, dtype)
    order = torch.stack([torch.randperm(m, generator=gen) for _ in range(b * h)]).view(b, h, m).to(DEV)
    want = x.clone()
    twins.permute_slots_reference(want, order, start)
    pt.permute_slots_(x, order, start)
    assert torch.equal(x, want)
