"""CHESS's arithmetic (kvdex.policies.chess): the entropy statistics of the trigger, the top-down
masking rules of Algorithm 1, the window anchor of eq. 3, and the selection bookkeeping helpers.

Pure functions over tensors; the components (``hierarchy``, ``trigger``, the scopes) own the state.
``kvdex.policies.chess`` re-exports the public names (``entropy_varentropy``, ``level_mask``, ``count_mask``,
``window_keys``).
"""

from __future__ import annotations

import math

import torch

# Retention ratios (rho_g, rho_c, rho_p) of the paper's Table 1; their products are the KV budgets
# it reports (0.729 -> "73%", 0.392 -> "40%", 0.01 -> "1%").
PRESETS = {
    "conservative": (0.9, 0.9, 0.9),
    "moderate": (0.8, 0.7, 0.7),
    "aggressive": (0.5, 0.2, 0.1),
}


def entropy_varentropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy H = -sum p log p and varentropy V = sum p (log p + H)^2 (nats) of logits [B, V] -> [B], [B]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    h = -plogp.sum(-1)
    v = (p * (logp + h[:, None]).square()).where(p > 0, torch.zeros_like(p)).sum(-1)
    return h, v


def level_mask(score: torch.Tensor, active: torch.Tensor, rho: float) -> torch.Tensor:
    """Algorithm 1's quantile masking of one level: keep ``score >= Quantile(score, 1 - rho)``.

    score/active [B, N], rho in (0, 1]. CHOICE: the quantile is taken over the *active* units
    only (children of kept parents), as §3.2 says ("from this subset, the top rho_c fraction is
    preserved") and as the reported budgets require (73% = 0.9^3); Algorithm 1 writes it over
    scores with inactive ones zeroed, which would also rank zeros above negative affinities.
    ``torch.nanquantile`` interpolates linearly; a row with no active unit keeps nothing.
    """
    s = torch.where(active, score, torch.full_like(score, float("nan")))
    tau = torch.nanquantile(s, 1.0 - rho, dim=-1)  # [B]
    return active & (score >= tau[:, None])


def count_mask(score: torch.Tensor, active: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Keep the ``n[b]`` highest-scoring active units of each row: score/active [B, N], n [B]."""
    s = torch.where(active, score, torch.full_like(score, float("-inf")))
    order = s.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    return active & (rank < n[:, None])


def top_down(s_g, s_c, s_p, npages, *, nc: int, ng: int, ratios, k: int, shape: str):
    """Top-down masking (Alg. 1 l. 5-18) of rows with ``npages`` [R] middle pages; scores [R, G/C/P].

    Ratio mode (``ratios`` = (rho_g, rho_c, rho_p)): quantile masks per level. Budget mode
    (``ratios`` None): the kept fraction f = k / P split over the levels like the ``shape`` preset,
    exactly ``k`` pages. Returns the kept masks (grids, chunks, pages); a chunk is scored only
    under a kept grid and a page only under a kept chunk.
    """
    dev = s_p.device
    npages = npages.to(dev)
    nchunks = -(-npages // nc)
    live_g = torch.arange(s_g.shape[1], device=dev)[None, :] < (-(-nchunks // ng))[:, None]
    live_c = torch.arange(s_c.shape[1], device=dev)[None, :] < nchunks[:, None]
    live_p = torch.arange(s_p.shape[1], device=dev)[None, :] < npages[:, None]
    parent_c = torch.arange(s_c.shape[1], device=dev) // ng
    parent_p = torch.arange(s_p.shape[1], device=dev) // nc
    if ratios is not None:
        rg, rc, rp = ratios
        m_g = level_mask(s_g, live_g, rg)
        m_c = level_mask(s_c, live_c & m_g[:, parent_c], rc)
        return m_g, m_c, level_mask(s_p, live_p & m_c[:, parent_p], rp)
    # Budget mode. CHOICE: the budget fixes the overall kept fraction f = K / P of each
    # sequence; it is split over the levels as in the `shape` preset (rho_l = f^w_l with
    # w_l = log rho_l / log(rho_g rho_c rho_p)), each level keeps at least what can still fill K
    # pages, and the page level keeps exactly the top K pages under the kept chunks.
    f = (k / npages.clamp(min=1).float()).clamp(max=1.0)
    logs = [math.log(r) for r in PRESETS[shape]]
    w = [x / sum(logs) for x in logs]
    n_g = torch.maximum(torch.ceil(f ** w[0] * live_g.sum(1)), torch.tensor(-(-k // (nc * ng)), device=dev))
    m_g = count_mask(s_g, live_g, n_g.long())
    act_c = live_c & m_g[:, parent_c]
    n_c = torch.maximum(torch.ceil(f ** w[1] * act_c.sum(1)), torch.tensor(-(-k // nc), device=dev))
    m_c = count_mask(s_c, act_c, n_c.long())
    return m_g, m_c, count_mask(s_p, live_p & m_c[:, parent_p], torch.full_like(npages, k))


def max_levels(s_p: torch.Tensor, nc: int, ng: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk and grid scores as the max of their pages' and chunks' scores: s_p [..., P] -> (grids [..., ceil(C /
    ng)], chunks [..., C]), C = ceil(P / nc). With page scores that bound their keys' q.k (``units="digest"``),
    a chunk's score bounds every key under it, so the top-down masks never drop the best page's chunk or grid
    for a lower one's."""
    pad = float("-inf")
    cn = -(-s_p.shape[-1] // nc)
    s_c = torch.nn.functional.pad(s_p, (0, cn * nc - s_p.shape[-1]), value=pad).unflatten(-1, (cn, nc)).amax(-1)
    gn = -(-cn // ng)
    s_g = torch.nn.functional.pad(s_c, (0, gn * ng - cn), value=pad).unflatten(-1, (gn, ng)).amax(-1)
    return s_g, s_c


def window_keys(store) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of the recent window: [B, H, window, D] and valid [B, window] (rows past a length are invalid).

    Reads the store's device buffer in place: slot == position on the GPU-resident store; the
    offloaded store keeps the window in a ring of pages (``LayerStore.window_slots``).
    """
    g = store.grid
    pos = g.window_start(store.lengths)[:, None] + torch.arange(g.window, device=store.device)[None, :]
    valid = pos < store.lengths[:, None]
    slots = store.window_slots(pos)
    slots = torch.where(valid, slots, 0)
    b, h, d = store.batch, store.kv_heads, store.head_dim
    k = store.k.gather(2, slots[:, None, :, None].expand(b, h, g.window, d))
    return k, valid


def window_anchor(k: torch.Tensor, valid: torch.Tensor, page_size: int) -> torch.Tensor:
    """Eq. 3 for one layer: the mean of the window's page vectors (a partial page: the mean of its
    tokens), from ``window_keys`` -> [B, H, D] fp32."""
    b, h, w, d = k.shape
    kf = k.float().view(b, h, w // page_size, page_size, d)
    cnt = valid.view(b, w // page_size, page_size).sum(-1)  # tokens per window page
    page_vec = (kf * valid.view(b, 1, w // page_size, page_size, 1)).sum(3) / cnt.clamp(min=1)[:, None, :, None]
    has = (cnt > 0).float()
    return (page_vec * has[:, None, :, None]).sum(2) / has.sum(1).clamp(min=1)[:, None, None]


def mask_to_ids(mask: torch.Tensor) -> torch.Tensor:
    """[B, P] bool -> [B, K] ascending page ids of the True entries, -1 padded (K = max count)."""
    k = int(mask.sum(1).max()) if mask.numel() else 0
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :k]
    return torch.where(mask.gather(1, order), order, -1)


def pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """-1 padding of the last dim to ``width``."""
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-1)


def trim(x: torch.Tensor) -> torch.Tensor:
    """Drop columns that are -1 in every row (ids are left-packed)."""
    k = int((x >= 0).sum(-1).max()) if x.numel() else 0
    return x[..., :k]
