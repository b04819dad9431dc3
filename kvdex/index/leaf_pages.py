"""IceCache's leaf pages built on the device (``icecache:build=device``, with ``search="summary"``): the
level-0 nodes of the DCI tree of every (sequence, kv head) of a layer, with *exact* parents, as the page
table of :mod:`kvdex.index.summary` -- no host tree.

The paper (§3.3, B.1, Algorithm 2) defines a leaf node as the level-0 points that share a parent, the parent
of a point being the nearest point promoted to the level above in the transformed space of eq. 2/3; a promoted
point is its own parent, and a node larger than a page spills into more pages (§4.1). This module computes
exactly that, and only that:

* the promotions are :meth:`DCITree.build`'s (:func:`~kvdex.index.dci.sample_tree`, the same seed per tree,
  drawn on the host: a loop over the distinct seeds, i.e. the kv heads; empty levels removed, so the points
  above the lowest level present are the promoted ones, and a tree of one level is one node headed by
  point 0);
* each parent is found by an exact search -- every row's transformed keys against that row's promoted points
  (all (sequence, kv head) rows at once; on CUDA one kernel that keeps the scores in registers, elsewhere
  fp32 batched matmuls chunked over the keys and ``argmax``) -- where the tree uses its own approximate
  M-DCI search (``construction_prop``; measured: about 82 % of its level-0 parents are the exact ones at
  32k keys);
* the pages are the tree's (``DCITree._with_new_leaves``): points sorted by parent (stable, so position
  order inside a node), nodes in the order of their head point, node j's points in ceil(size / ps) pages.

It is not the paper's construction algorithm: the levels above 1 and the M-DCI parent searches exist to
make the tree searchable, and ``search="summary"`` never searches a tree. Only each row's own middle tokens
are indexed (ragged and left-padded batches: row r holds ``n[r]`` keys, the rest is padding).
"""

from __future__ import annotations

import dataclasses

import torch

from kvdex.index.dci import DCIParams, sample_tree
from kvdex.index.summary import page_summaries
from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.scoring import nearest_rows

CHUNK = 1 << 27  # score elements per batched matmul (512 MB in fp32): bounds the build's scratch memory


def promoted(params: DCIParams, seeds: torch.Tensor, n: torch.Tensor, d: int) -> torch.Tensor:
    """[R, N] bool (host, N = max n): point i of row r is promoted above level 0 in the tree
    :meth:`DCITree.build` makes from the row's ``n[r]`` keys of dimension d with seed ``seeds[r]``."""
    R, N = seeds.numel(), int(n.max()) if n.numel() else 0
    top = torch.zeros(R, max(N, 1), dtype=torch.long)
    for s in torch.unique(seeds).tolist():  # the kv heads: the same stream for every sequence of a batch
        rows = torch.nonzero(seeds == s).flatten()
        m = int(n[rows].max())
        if m:
            top[rows, :m] = sample_tree(dataclasses.replace(params, seed=int(s)), m, d)[1]
    live = torch.arange(top.shape[1])[None, :] < n[:, None]
    low = top.masked_fill(~live, 1 << 62).amin(1, keepdim=True)  # the lowest level present (level 0 once compacted)
    return (top > low) & live


def leaf_page_table(keys, n, first, seeds, params: DCIParams, kind: str, prom: torch.Tensor | None = None) -> dict:
    """The leaf pages of the trees of rows ``r`` (keys [R, N, D] on any device: the row's ``n[r]`` keys first,
    token position ``first[r] + i``; n, first, seeds [R] host) as a page table on the keys' device: ``pos``
    [R, C + 1, ps] int32 (-1 empty; page C the trash page), ``fill`` [R, C + 1] int32, the summaries ``a`` /
    ``b`` (``kind``: "minmax" per-channel min / max in the keys' dtype; "centroid" mean key, fp32 radius),
    ``npages`` [R] (device), ``used`` (the most pages of a row) and ``row_pages`` [R] (host). Pages are in
    the tree's order, so the table equals :meth:`SemanticPages.host_table` of trees with exact parents.
    One host sync: the page counts, to size the table. ``prom``: :func:`promoted` of these rows, if drawn
    ahead."""
    R, N, D = keys.shape
    ps, dev = params.page_size, keys.device
    prom = (promoted(params, seeds, n, D) if prom is None else prom)[:, :N]
    nprom = prom.sum(1)
    Np = max(1, int(nprom.max()))
    ar = torch.arange(N)
    rr, cc = torch.nonzero(prom, as_tuple=True)
    pidx = torch.zeros(R, Np, dtype=torch.long)  # each row's promoted points, in order (one level: point 0)
    pidx[rr, (prom.cumsum(1) - 1)[rr, cc]] = cc
    pidx = torch.where(ar[None, :Np] < nprom[:, None], pidx, pidx[:, :1])  # padding repeats the first (a tie)
    live = (ar[None, :] < n[:, None]).to(dev, non_blocking=True)
    prom, pidx = prom.to(dev, non_blocking=True), pidx.to(dev, non_blocking=True)
    parent = _nearest_promoted(keys, live, pidx, params.norm_margin)
    ard = torch.arange(N, device=dev)
    parent = torch.where(prom, ard[None, :], parent)  # a promoted point is its own parent
    parent = torch.where(live, parent, N)  # padding sorts last, in no node

    # pages (DCITree._with_new_leaves): sorted by parent, stable; node j's points in ceil(size / ps) pages
    count = torch.zeros(R, N + 1, dtype=torch.long, device=dev).scatter_add_(1, parent, torch.ones_like(parent))
    count = count[:, :N]
    npg = (count + ps - 1) // ps
    first_page, start = npg.cumsum(1) - npg, count.cumsum(1) - count
    order = torch.argsort(parent, dim=1, stable=True)
    par = parent.gather(1, order)
    ok = par < N
    node = par.clamp(max=N - 1)
    rank = ard[None, :] - start.gather(1, node)
    page, slot = first_page.gather(1, node) + rank // ps, rank % ps
    npages = npg.sum(1)
    row_pages = npages.cpu()  # the one sync: the table's size
    used = int(row_pages.max()) if R else 0
    C = used + max(16, used // 16) + 1  # spare pages for joins (as host_table), then the trash page
    rows = torch.arange(R, device=dev)[:, None]
    dst = torch.where(ok, (rows * C + page) * ps + slot, R * C * ps)  # padding -> one row past the table
    src = order + rows * N
    pos = torch.full((R * C * ps + 1,), -1, dtype=torch.int32, device=dev)
    pos[dst] = torch.where(ok, order + first.to(dev)[:, None], -1).int()
    pos = pos[:-1].view(R, C, ps)
    held = pos >= 0
    kp = torch.zeros(R * C * ps + 1, D, dtype=keys.dtype, device=dev)
    kp[dst.flatten()] = keys.reshape(R * N, D)[src.flatten()]
    a, b = page_summaries(kp[:-1].view(R, C, ps, D), held, kind, keys.dtype)
    return dict(pos=pos, fill=held.sum(2).int(), a=a, b=b, npages=npages, used=used, row_pages=row_pages)


def _nearest_promoted(keys, live, pidx, margin: float) -> torch.Tensor:
    """[R, N]: for every key, the id of its nearest promoted point ``pidx`` [R, Np] of its row in the
    transformed space (eq. 2, c = ``margin`` x the row's largest key norm, as the tree's): the largest
    inner product of the unit vectors: on CUDA one Triton kernel (:mod:`kvdex.kernels.parents_triton`, bf16x3
    products, no score written to memory), elsewhere fp32 matmuls of ``CHUNK`` scores and ``argmax``."""
    R, N, D = keys.shape
    k = keys.float()
    # c as DCITree.build: float(max |k|) * margin (a double), or 1 when every key is 0
    c = k.norm(dim=-1).masked_fill(~live, 0).amax(1).double() * margin
    c = torch.where(c > 0, c, 1.0)
    n2 = (k * k).sum(-1, keepdim=True)
    X = torch.cat([k / c.float()[:, None, None], (1.0 - n2 / (c * c).float()[:, None, None]).clamp(min=0.0).sqrt()], -1)
    del k, n2
    Xp = X.gather(1, pidx[:, :, None].expand(-1, -1, D + 1))
    kernel = triton_kernel("parents_triton", "nearest", on=X)
    best = kernel(X, Xp) if kernel is not None else nearest_rows(X, Xp, CHUNK)
    return pidx.gather(1, best)
