"""The DCI-trees of one layer, one per (sequence, kv head): built from the keys of the first middle
pages of a sequence, then extended with the keys of each page that leaves the window (IceCache
Algorithm 1, lines 5-10 and 26-36)."""

from __future__ import annotations

import dataclasses

import torch

from kvdex.index.dci import DCIParams, DCITree
from kvdex.index.forest import DCIForest


def update_trees(
    trees: list[DCITree | None],
    keys: torch.Tensor,
    per_b: dict[int, torch.Tensor],
    params: DCIParams,
    seeds: list[int],
    gens: dict[int, torch.Generator],
    stage_pin: bool | None = None,
) -> tuple[list, dict, int, int]:
    """Index the keys [B, heads, pages, page_size, D] (host) of the pages at token positions
    ``per_b[b]`` into tree ``b * heads + h`` of ``trees`` (in place): a missing tree is built (seed
    ``seeds[h]``), an existing one gets the keys inserted with the random stream ``gens[tree]``
    (made from ``seeds[h] + 1`` at the first insertion).

    Returns the placements (b, h, page, slot, position of each new point), the trees staged for a
    device mirror (``stage_pin`` not None: :meth:`DCIForest.stage` of each updated tree from its first
    new point, pinned if ``stage_pin``), the keys of the trees built and the number of trees inserted into."""
    heads = keys.shape[1]
    placements, staged = [], {}
    built = inserted = 0
    for b, pos in per_b.items():
        for h in range(heads):
            t = b * heads + h
            k = keys[b, h, : pos.numel() // params.page_size].reshape(pos.numel(), -1)
            tree = trees[t]
            if tree is None:
                tree, new = DCITree.build(k, pos, dataclasses.replace(params, seed=seeds[h])), torch.arange(pos.numel())
                n0 = 0  # a tree first built after the others (a short sequence of a batch): mirror it whole
                built += pos.numel()
            else:
                gen = gens.setdefault(t, torch.Generator().manual_seed(seeds[h] + 1))
                n0 = tree.n
                tree = tree.insert(k, pos, gen)
                new = torch.arange(n0, tree.n)
                inserted += 1
            trees[t] = tree
            placements.append((b, h, tree.pt_page[new], tree.pt_slot[new], tree.pos[new]))
            if stage_pin is not None:  # the device mirror's copies, prepared here (off the main thread)
                staged[t] = DCIForest.stage(tree, n0, pin=stage_pin)
    return placements, staged, built, inserted
