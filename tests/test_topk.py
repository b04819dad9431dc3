"""The Triton top-k (kvdex.kernels.topk) against its twin and against torch.topk.

Invariants: the kernel returns exactly its twin's ids (descending score, ties to the lowest index,
-1 where the score is not finite); the selected set equals torch.topk's whenever the k-th value is
not tied; the ``topk_ids`` seam keeps torch.topk on CPU (and with KVDEX_TRITON=0).

On CPU the kernel runs through Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be
set before triton is imported), as tests/test_triton_kernels.py does; ``-m gpu`` runs it compiled.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, DEV, INTERP, run_kernels

from kvdex.kernels.scoring import topk_ids as seam_topk_ids


def _twin():
    pytest.importorskip("triton")
    from kvdex.kernels import topk

    return topk


def _torch_set_ok(score, ids, k):
    """ids' finite entries == torch.topk's finite entries as sets, per row (no tie at the k-th value)."""
    val, ref = torch.topk(score.float(), min(k, score.shape[-1]), dim=-1)
    ref = torch.where(torch.isfinite(val), ref, -1)
    for a, b in zip(ids.reshape(-1, ids.shape[-1]).tolist(), ref.reshape(-1, ref.shape[-1]).tolist(), strict=True):
        assert sorted(a) == sorted(b)


def _assert_index_ordered_set(got, want):
    """An unordered call's ids against the twin's, row by row: as many -1 entries, and the valid ids are the
    twin's valid ids sorted by index."""
    assert got.shape == want.shape
    n = want.shape[-1]
    for r, (g_row, w_row) in enumerate(zip(got.reshape(-1, n), want.reshape(-1, n), strict=True)):
        assert int((g_row < 0).sum()) == int((w_row < 0).sum()), r
        assert torch.equal(g_row[g_row >= 0], torch.sort(w_row[w_row >= 0]).values), r


# ---- the twin (CPU, always) ------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (100, 100), (100, 150), (1000, 37), (8192, 125)])
def test_twin_equals_torch_topk_without_ties(n, k):
    tk = _twin()
    g = torch.Generator().manual_seed(n + k)
    score = torch.randn(2, 3, n, generator=g)
    score[0, 1, : n // 2] = float("-inf")  # k > finite count in this row for some cases
    ids = tk.topk_ids_reference(score, k)
    assert ids.shape == (2, 3, min(k, n)) and ids.dtype == torch.long
    assert torch.equal(ids, seam_topk_ids(score, k))  # random floats: no ties, same order too


def test_twin_ties_go_to_the_lowest_index_and_nonfinite_is_minus_one():
    tk = _twin()
    score = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0, float("-inf"), 0.0, -0.0, float("nan"), float("inf")]]])
    assert tk.topk_ids_reference(score, 3).tolist() == [[[-1, -1, 1]]]  # nan, +inf, then the first 3.0
    assert tk.topk_ids_reference(score, 5).tolist() == [[[-1, -1, 1, 2, 4]]]
    assert tk.topk_ids_reference(score, 8).tolist() == [[[-1, -1, 1, 2, 4, 3, 0, 6]]]  # 0.0 before -0.0
    assert tk.topk_ids_reference(score, 20).tolist() == [[[-1, -1, 1, 2, 4, 3, 0, 6, 7, -1]]]


def test_seam_keeps_torch_topk_on_cpu():
    score = torch.randn(1, 2, 50)
    val, ids = torch.topk(score, 10, dim=-1)
    assert torch.equal(seam_topk_ids(score, 10), ids)
    assert seam_topk_ids(score, 0).shape == (1, 2, 0)


def test_bad_inputs_raise_value_error():
    tk = _twin()
    with pytest.raises(ValueError):
        tk.topk_ids(torch.zeros(2, 8, dtype=torch.long), 3)
    with pytest.raises(ValueError):
        tk.topk_ids(torch.zeros(2, 3 * tk.MAX_K_BLOCK), 2 * tk.MAX_K_BLOCK)
    with pytest.raises(ValueError):
        tk.topk_ids(torch.zeros(2, 8), 0)


# ---- the kernel (interpreter on CPU, compiled on CUDA) ----------------------------------------------

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])  # numpy has no bf16


@pytest.mark.skipif(CUDA or INTERP, reason="runs the kernels itself")
def test_interpreter_suite(interpreter_suite):
    """This file under TRITON_INTERPRET=1 in a fresh interpreter (tests/conftest.py: one for every such
    file of the session): the kernel tests run on CPU."""
    pytest.importorskip("triton")
    interpreter_suite(__file__)


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "b,h,n,k,block",
    [
        (1, 1, 1, 1, None),
        (1, 8, 100, 7, None),  # N not a power of two
        (2, 3, 1000, 125, None),
        (1, 8, 8192, 125, None),  # Quest at 128k tokens, page 16
        (1, 2, 3000, 64, 512),  # several tiles, last one partial
        (1, 2, 200, 200, 64),  # k == N over tiles, the last one partial
    ],
)
def test_kernel_equals_twin(dtype, b, h, n, k, block):
    tk = _twin()
    g = torch.Generator().manual_seed(n * 7 + k)
    score = torch.randn(b, h, n, generator=g).to(dtype)
    if h > 1:
        score[:, 1, n // 3 :] = float("-inf")  # masked tail (Quest's pages past the middle)
    ids = tk.topk_ids(score.to(DEV), k, block=block).cpu()
    assert torch.equal(ids, tk.topk_ids_reference(score, k))
    if dtype == torch.float32:  # random fp32: no ties, torch.topk's set
        _torch_set_ok(score, ids, k)


@run_kernels
@pytest.mark.parametrize("block,ks", [(None, (1, 40, 500)), (64, (40,))])
def test_kernel_ties_nonfinite_and_k_past_finite_count(block, ks):
    tk = _twin()
    g = torch.Generator().manual_seed(3)
    score = torch.randint(0, 5, (1, 5, 300), generator=g).float()  # many ties at the k-th value
    score[0, 0, :290] = float("-inf")  # 10 finite entries, k = 40
    score[0, 1, 5] = float("nan")
    score[0, 1, 6] = float("inf")
    score[0, 2, 10:20] = -0.0
    score[0, 2, 20:] = 0.0
    score[0, 3] = float("-inf")  # a row with nothing valid
    for k in ks:
        ids = tk.topk_ids(score.to(DEV), k, block=block).cpu()
        assert torch.equal(ids, tk.topk_ids_reference(score, k)), k
        if k == 40:
            assert (ids[0, 0, 10:] == -1).all() and (ids[0, 3] == -1).all()


@run_kernels
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if CUDA else []), ids=str)
@pytest.mark.parametrize("block", [None, 64])
def test_kernel_negative_half_precision_ties(dtype, block):
    """bf16 / fp16 scores below zero, tied at the k-th value: exactly the twin's k ids. (The sign flip of a
    negative score's fp32 image turned its zero low bits into ones; the threshold the passes build has
    them zero, so every tied key counted as above it and the kernel wrote more than k ids, past its row.)"""
    tk = _twin()
    g = torch.Generator().manual_seed(17)
    score = -torch.randint(1, 5, (1, 3, 300), generator=g).to(dtype)
    score[0, 2, 100:] = float("-inf")  # 100 finite entries: k = 150 reaches past them
    for k in (17, 150):
        want = tk.topk_ids_reference(score, k)
        assert torch.equal(tk.topk_ids(score.to(DEV), k, block=block).cpu(), want), k
        _assert_index_ordered_set(tk.topk_ids(score.to(DEV), k, block=block, ordered=False).cpu(), want)


@run_kernels
@pytest.mark.parametrize("block,k", [(None, 1), (None, 40), (None, 2048), (1024, 500)])
def test_kernel_unordered_is_the_twins_set_in_index_order(block, k):
    """``ordered=False``: the ordered call's entries sorted by index (no sort of the k results), ties to the
    lowest index, -1 for the entries whose score is not finite, wherever they fall."""
    tk = _twin()
    g = torch.Generator().manual_seed(k)
    score = torch.randn(2, 4, 3000, generator=g)
    score[0, 1] = torch.randint(0, 5, (3000,), generator=g).float()  # ties at the k-th value
    score[0, 2, 20:] = float("-inf")  # fewer finite entries than k
    score[1, 0, 7] = float("nan")
    score[1, 0, 9] = float("inf")
    score[1, 3] = float("-inf")
    want = tk.topk_ids_reference(score, k)
    _assert_index_ordered_set(tk.topk_ids(score.to(DEV), k, block=block, ordered=False).cpu(), want)


@run_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernel_one_bit_per_pass_equals_two(dtype):
    tk = _twin()
    g = torch.Generator().manual_seed(11)
    score = torch.randn(1, 3, 2000, generator=g).to(dtype)
    score[0, 1] = torch.randint(0, 4, (2000,), generator=g).to(dtype)  # ties
    score[0, 2, 500:] = float("-inf")
    ref = tk.topk_ids_reference(score, 125)
    for block in (None, 512):  # bits=2 (the default) is what every other test runs
        assert torch.equal(tk.topk_ids(score.to(DEV), 125, block=block, bits=1).cpu(), ref), block


@run_kernels
def test_kernel_long_rows_token_scores():
    """h2o / oracle score tokens: rows of 32k and 131k scores (looped tiles)."""
    tk = _twin()
    g = torch.Generator().manual_seed(5)
    for n, k in ((32768, 1000), (131072, 300 if INTERP else 2000)):
        score = torch.randn(1, 1 if INTERP else 8, n, generator=g)
        score[..., n - 100 :] = float("-inf")
        ids = tk.topk_ids(score.to(DEV), k).cpu()
        assert torch.equal(ids, tk.topk_ids_reference(score, k))
        _torch_set_ok(score, ids, k)


@run_kernels
@pytest.mark.parametrize("block", [None, 256])
def test_kernel_row_k_is_each_rows_own_count(block):
    """``row_k`` (a rerank's share of each sequence's pages): row r keeps the twin's first ``min(row_k, k)``
    ids as a set in index order, -1 in the rest of its k slots; rows share a count per sequence (L < rows);
    a count of 0, one past k, and more than a row's finite scores."""
    tk = _twin()
    g = torch.Generator().manual_seed(21)
    score = torch.randn(4, 2, 700, generator=g)
    score[1, 0] = torch.randint(0, 4, (700,), generator=g).float()  # ties at every count
    score[2, :, 30:] = float("-inf")  # 30 finite scores, count 50
    k = 60
    row_k = torch.tensor([17, 0, 50, 99])
    got = tk.topk_ids(score.to(DEV), k, block=block, ordered=False, row_k=row_k.to(DEV)).cpu()
    want = tk.topk_ids_reference(score, k)
    assert got.shape == (4, 2, k)
    for b in range(4):
        n = min(int(row_k[b]), k)
        keep = torch.where(torch.arange(k) < n, want[b], -1)
        _assert_index_ordered_set(got[b], keep)
        assert (got[b, :, n:] == -1).all()
    for bad in (row_k[:3], row_k.float()):  # L must divide the rows; counts are integers
        with pytest.raises(ValueError, match="row_k"):
            tk.topk_ids(score.to(DEV), k, ordered=False, row_k=bad.to(DEV))
    with pytest.raises(ValueError, match="row_k"):
        tk.topk_ids(score.to(DEV), k, row_k=row_k.to(DEV))  # ordered


@run_kernels
@pytest.mark.parametrize("kernel", ["one", "one256", "radix256"])
@pytest.mark.parametrize("share,least", [(1.0, 0), (0.3, 0), (0.3, 12), (0.25, 40)])
def test_row_share_and_least_are_each_rows_count(kernel, share, least):
    """``row_k`` with ``row_share`` / ``row_min`` (a rerank's share of each row's pages: ``max(least,
    ceil(share * pages))``, worked out in the kernel): both kernels keep the twin's best ``row_counts`` ids of
    each row as a set in index order, ``-1`` after them; one count per row and one per sequence."""
    from kvdex.kernels.scoring import row_counts

    tk = _twin()
    from kvdex.kernels import topk_radix as tr

    g = torch.Generator().manual_seed(33)
    score = torch.randn(3, 2, 700, generator=g)
    score[1, 0] = torch.randint(0, 4, (700,), generator=g).float()  # ties at every count
    score[2, 1, 30:] = float("-inf")  # 30 finite scores
    k = 90
    for pages in (torch.tensor([17, 0, 130, 299, 10, 400]), torch.tensor([233, 3, 100])):
        rows = pages.repeat_interleave(6 // pages.numel())
        own = dict(row_k=pages.to(DEV), row_share=share, row_min=least)
        if kernel.startswith("one"):
            block = 256 if kernel == "one256" else None
            got = tk.topk_ids(score.to(DEV), k, block=block, ordered=False, **own).cpu()
        else:
            got = tr.topk_ids(score.to(DEV), k, tile=int(kernel[5:]), **own).cpu()
        n = row_counts(rows, share, least, k).view(3, 2)
        assert torch.equal(n.flatten(), torch.ceil(rows * share).long().clamp(min=least).clamp(max=k))
        want = tk.topk_ids_reference(score, k)
        for b in range(3):
            for h in range(2):
                m = int(n[b, h])
                _assert_index_ordered_set(got[b, h : h + 1], torch.where(torch.arange(k) < m, want[b, h], -1)[None])
                assert (got[b, h, m:] == -1).all()


RADIX_CASES = [(3, 300, 17, 64), (3, 3000, 125, 256), (2, 3000, 700, 512), (1, 5, 5, 64), (2, 1000, 999, 128)] + (
    [(8, 59000, 2048, 4096), (8, 32768, 2048, 4096), (2, 131072, 2048, 4096)] if CUDA else []
)


@run_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("r,n,k,tile", RADIX_CASES)
def test_radix_topk_is_the_unordered_kernels_output(dtype, r, n, k, tile):
    """The multi-program radix select (kvdex.kernels.topk_radix) returns exactly the one-program kernel's
    unordered ids (the twin's set in index order, -1 where not finite): ties at the k-th value (lowest index
    first), NaN / +inf / -0.0, a row with fewer finite scores than k, k close to N, tiles over the row."""
    tk = _twin()
    from kvdex.kernels import topk_radix as tr

    g = torch.Generator().manual_seed(n + k)
    score = torch.randn(r, n, generator=g)
    score[0, : n // 2] = torch.randint(0, 4, (n // 2,), generator=g).float()  # ties
    score[-1, 10:] = float("-inf")
    if n > 20:
        score[0, 7], score[0, 8], score[0, 9] = float("nan"), -0.0, float("inf")
    if r > 2:  # exactly k scores above the rest: the k-th is the last key of its digit's bin
        score[1] = torch.where(torch.randperm(n, generator=g) < k, 5.0, 1.0)
    score = score.to(dtype)
    got = tr.topk_ids(score.to(DEV), k, tile=tile).cpu()
    _assert_index_ordered_set(got, tk.topk_ids_reference(score, k))
    if n <= tk.MAX_BLOCK:
        assert torch.equal(got, tk.topk_ids(score.to(DEV), k, ordered=False).cpu())
    with pytest.raises(ValueError, match="radix top-k"):
        tr.topk_ids(score.to(DEV).int(), k)


# The interpreter runs one program at a time, at a fixed cost per program (rows x segments): on CPU, one
# case per branch on short rows of 64-score segments; compiled on CUDA, the longer rows too.
SPLIT_CASES = [
    (180, 20, 64),  # N not a multiple of the segment; every segment holds at least k scores
    (256, 80, 64),  # k > segment (a segment's top k is all of it); N a multiple of the segment
    (132, 20, 64),  # the last segment (4 scores, padded with -inf) holds fewer than k
] + ([(3000, 64, 512), (2048, 300, 256), (1000, 40, 128), (4100, 125, 1024)] if CUDA else [])


@run_kernels
@pytest.mark.parametrize("n,k,segment", SPLIT_CASES)
def test_split_topk_equals_twin(n, k, segment):
    """Two stages (segments' top k, then the candidates' top k) == the one-pass twin: random scores,
    heavy ties across segments, masked tails, a row with fewer finite scores than k, a row with none,
    N not a multiple of the segment."""
    tk = _twin()
    g = torch.Generator().manual_seed(n + k)
    score = torch.randn(1, 5, n, generator=g)
    score[0, 1] = torch.randint(0, 3, (n,), generator=g).float()  # ties at the k-th value in every segment
    score[0, 2, n // 5 :] = float("-inf")
    score[0, 3, 5:] = float("-inf")  # 5 finite < k
    score[0, 4] = float("-inf")
    ids = tk.topk_ids_split(score.to(DEV), k, segment=segment).cpu()
    assert torch.equal(ids, tk.topk_ids_reference(score, k))


# ---- GPU only -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b,n,k", [(1, 8192, 125), (8, 8192, 125), (1, 32768, 125), (1, 131072, 2048), (2, 77, 200)])
def test_gpu_seam_matches_torch_topk_set_and_twin(dtype, b, n, k):
    from kvdex.kernels import topk as tk

    g = torch.Generator().manual_seed(n)
    score = torch.randn(b, 8, n, generator=g)
    score[:, :, n - n // 5 :] = float("-inf")
    score = score.to(dtype).cuda()
    ids = tk.topk_ids(score, k)
    assert torch.equal(ids.cpu(), tk.topk_ids_reference(score.cpu(), k))
    if dtype == torch.float32:
        _torch_set_ok(score, ids, k)
        out = seam_topk_ids(score, k)  # torch.topk by default; Triton up to KVDEX_TOPK_MAX_N where set
        _torch_set_ok(score, out, k)
    unordered = seam_topk_ids(score, k, ordered=False)  # the kernel without its sort up to MAX_BLOCK scores
    if n <= tk.MAX_BLOCK or dtype == torch.float32:  # longer bf16 rows: torch.topk breaks k-th value ties its way
        want = torch.sort(torch.where(ids >= 0, ids, n)).values
        assert torch.equal(torch.sort(torch.where(unordered >= 0, unordered, n)).values, want)
    if n <= tk.MAX_BLOCK:
        assert torch.equal(unordered, tk.topk_ids(score, k, ordered=False))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_capture_and_replay():
    from kvdex.kernels import topk as tk

    score = torch.randn(1, 8, 8192, device="cuda")
    tk.topk_ids(score, 125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.topk_ids(score, 125)
    for seed in range(3):
        score.copy_(torch.randn(1, 8, 8192, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), tk.topk_ids_reference(score.cpu(), 125))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_radix_topk_seam_and_graph_replay():
    """Unordered calls on rows past MAX_BLOCK go to the radix select (the rerank's candidate tokens); it
    replays from a CUDA graph with the eager result."""
    from kvdex.kernels import topk as tk

    score = torch.randn(8, 59000, device="cuda")
    ids = seam_topk_ids(score, 2048, ordered=False)
    _assert_index_ordered_set(ids.cpu(), tk.topk_ids_reference(score.cpu(), 2048))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = seam_topk_ids(score, 2048, ordered=False)
    for seed in range(3):
        score.copy_(torch.randn(8, 59000, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        _assert_index_ordered_set(out.cpu(), tk.topk_ids_reference(score.cpu(), 2048))
