"""IceCache's leaf pages built on the device (kvdex/index/leaf_pages.py, ``icecache:build=device``).

The table equals the leaves of host DCI trees built with exhaustive parent searches (same promotions,
same page order); every key's page is a node of its exact nearest promoted point (brute force in float64);
every middle token is in exactly one page; pages never exceed page_size; chunking does not change it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvdex.index import leaf_pages
from kvdex.index.dci import DCIParams, DCITree
from kvdex.index.leaf_pages import leaf_page_table, promoted
from kvdex.index.summary import SemanticPages

EXHAUSTIVE = dict(construction_prop=1.0, construction_fov=10**6)  # the tree's parents are then exact
PS, D, H = 4, 12, 2
LENGTHS = [150, 40, 1, 0, 3, 97]  # ragged rows: one key, none, a single-level tree (3 keys, r = 0.25)


def _rows(lengths, seed=0, dtype=torch.float32):
    """Keys [B, H, N, D] (varied norms), n / first / seeds per row r = b * H + h."""
    g = torch.Generator().manual_seed(seed)
    B, N = len(lengths), max(lengths)
    keys = torch.randn(B, H, N, D, generator=g) * (0.2 + 3 * torch.rand(B, H, N, 1, generator=g))
    n = torch.tensor(lengths).repeat_interleave(H)
    first = torch.tensor([16 + 5 * b for b in range(B)]).repeat_interleave(H)
    seeds = torch.tensor([100 + h for h in range(H)]).repeat(B)
    return keys.to(dtype), n, first, seeds


@pytest.mark.parametrize("kind", ["minmax", "centroid"])
def test_the_table_is_the_leaves_of_trees_with_exact_parents(kind):
    params = DCIParams(promotion_ratio=0.25, page_size=PS, **EXHAUSTIVE)
    keys, n, first, seeds = _rows(LENGTHS)
    B, N = len(LENGTHS), max(LENGTHS)
    got = leaf_page_table(keys.view(B * H, N, D), n, first, seeds, params, kind)
    at = [(b, h, m) for b, m in enumerate(LENGTHS) for h in range(H)]
    seeded = [dataclasses.replace(params, seed=100 + h) for h in range(H)]
    trees = [DCITree.build(keys[b, h, :m], torch.arange(m) + 16 + 5 * b, seeded[h]) if m else None for b, h, m in at]
    pn = (N + PS - 1) // PS
    padded = torch.zeros(B, H, pn * PS, D)
    padded[:, :, :N] = keys
    firsts = first[::H].tolist()
    want = SemanticPages.host_table(trees, padded.view(B, H, pn, PS, D), firsts, kind, PS, torch.float32, H)
    assert trees[4].num_levels == 1 and got["used"] == want["used"]  # row (b=2, h=0): one key, one level
    for name in ("pos", "fill", "npages"):
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(got["row_pages"], want["npages"])
    for name in ("a", "b"):  # min / max exactly; the centroid's sum in another order
        torch.testing.assert_close(got[name], want[name], atol=1e-6 if kind == "centroid" else 0, rtol=0)


@pytest.mark.parametrize("chunk", [1 << 27, 97])  # 97 scores: chunks of one key (and of several rows)
def test_every_key_is_in_one_page_of_its_exact_nearest_promoted_point(chunk, monkeypatch):
    monkeypatch.setattr(leaf_pages, "CHUNK", chunk)
    params = DCIParams(page_size=PS)  # r = 1/16, the policy's default for this page size
    lengths = [700, 333]
    keys, n, first, seeds = _rows(lengths, seed=3, dtype=torch.bfloat16)
    B, N = len(lengths), max(lengths)
    t = leaf_page_table(keys.view(B * H, N, D), n, first, seeds, params, "minmax")
    prom = promoted(params, seeds, n, D)
    for r in range(B * H):
        m, f = int(n[r]), int(first[r])
        k = keys.view(B * H, N, D)[r, :m].double()
        c = float(k.norm(dim=-1).max()) * params.norm_margin
        X = torch.cat([k / c, (1 - (k * k).sum(-1, keepdim=True) / c**2).clamp(min=0).sqrt()], -1)
        up = torch.nonzero(prom[r, :m]).flatten()
        exact = up[(X @ X[up].T).argmax(1)]
        exact[up] = up  # a promoted point is its own parent
        pos, fill = t["pos"][r].long(), t["fill"][r]
        assert int(fill.max()) <= PS and torch.equal(fill.long(), (pos >= 0).sum(1))
        held = pos[pos >= 0]
        assert torch.equal(torch.sort(held).values, torch.arange(f, f + m))  # every middle token exactly once
        live = pos[fill > 0]  # [P, PS]
        par = torch.where(live >= 0, exact[(live - f).clamp(min=0)], -1)
        assert bool((par == par[:, :1]).logical_or(live < 0).all())  # a page holds one node
        nodes, size = torch.unique(exact, return_counts=True)
        pages_of = torch.unique(par[:, 0], return_counts=True)
        assert torch.equal(pages_of[0], nodes) and torch.equal(pages_of[1], (size + PS - 1) // PS)  # node spills
        assert int(t["npages"][r]) == live.shape[0] == int(t["row_pages"][r])


def test_promotions_are_the_trees_and_do_not_depend_on_the_other_rows():
    params = DCIParams(promotion_ratio=0.25, page_size=PS)
    n = torch.tensor([300, 64, 5])
    seeds = torch.tensor([7, 7, 9])
    prom = promoted(params, seeds, n, D)
    for r in range(3):
        m = int(n[r])
        tree = DCITree.build(torch.randn(m, D), torch.arange(m), dataclasses.replace(params, seed=int(seeds[r])))
        assert torch.equal(prom[r, :m], tree.top > 0) and not bool(prom[r, m:].any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_parent_kernel_finds_the_twins_parents_on_cuda(dtype, monkeypatch):
    """On CUDA the parents come from kvdex.kernels.parents_triton (bf16x3 products, no scores in memory): the
    PyTorch matmuls' parent wherever it is ahead of the kernel's by more than the kernel's rounding (1e-4 in
    float64), and the table built from them holds every middle token once."""
    params = DCIParams(page_size=16)
    lengths = [3000, 1211, 40]
    keys, n, first, seeds = _rows(lengths, seed=5, dtype=dtype)
    B, N = len(lengths), max(lengths)
    rows = keys.view(B * H, N, D).cuda()
    prom = promoted(params, seeds, n, D)[:, :N]
    pidx = torch.nn.utils.rnn.pad_sequence([torch.nonzero(p).flatten() for p in prom], batch_first=True).cuda()
    live = (torch.arange(N)[None, :] < n[:, None]).cuda()
    got = leaf_pages._nearest_promoted(rows, live, pidx, params.norm_margin)
    monkeypatch.setenv("KVDEX_TRITON", "0")
    want = leaf_pages._nearest_promoted(rows, live, pidx, params.norm_margin)
    monkeypatch.delenv("KVDEX_TRITON")
    k = rows.double()
    c = k.norm(dim=-1).masked_fill(~live, 0).amax(1) * params.norm_margin
    X = torch.cat(
        [k / c[:, None, None], (1 - (k * k).sum(-1, keepdim=True) / (c * c)[:, None, None]).clamp(0).sqrt()], -1
    )
    score = lambda ids: (X * X.gather(1, ids[..., None].expand(-1, -1, D + 1))).sum(-1)  # noqa: E731
    differ = live & (got != want)
    assert bool((score(want) - score(got))[differ].abs().max() < 1e-4) if bool(differ.any()) else True
    assert float(differ.sum()) <= 0.01 * float(live.sum())
    t = leaf_page_table(rows, n, first, seeds, params, "minmax")
    for r in range(B * H):
        held = t["pos"][r][t["pos"][r] >= 0].long().cpu()
        assert torch.equal(torch.sort(held).values, torch.arange(int(first[r]), int(first[r]) + int(n[r])))
