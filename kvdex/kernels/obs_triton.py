"""The observation window's attention mass in two Triton kernels: what SnapKV and PRKV's static refresh score.

:func:`attention_mass` is :func:`kvdex.kernels.reference.attention_mass_reference` on CUDA: for the last
``W`` queries of a layer (``q`` [B, Hq, W, D], the query ring), the softmax weight each key gets from each
query, summed over the valid queries, per query head. The PyTorch twin materialises fp32 copies of every
key and a [B, H, G, 16, L] score tensor per chunk of 16 queries, then a softmax and a sum over it: at the
Llama-3.1-8B shape (128k, ``W`` = 64) that was about 7 ms of device time a layer, most of PRKV's refresh
step (``scripts/profile_step.py --policies prkv:refresh=1``). Here, flash-attention style:

1. per (sequence, kv head, tile of ``BLOCK_L`` keys): every query row of the group against the tile, one
   ``tl.dot`` per query head (fp32 accumulation), the tile's max and sum of exponentials per row (in base 2:
   ``exp(s) = 2^(s log2 e)``), stored [tiles, rows] so that a program's rows are written side by side;
2. the rows' log-sum-exp from the tiles' statistics (a few small PyTorch ops over [tiles, rows]);
3. the same products again, each weight ``exp(s - lse)`` of a valid query row summed over the window into
   the key's mass per query head.

Each key is read twice from the layer's buffer, in place; nothing of size [W, L] is written. A key at slot
``j`` has position ``key_pos[b, h, j]`` (PRKV's relocated middle) or ``j``; query ``i`` sees it when that
position is ``<= q_pos[b, i]`` and the slot is below the sequence's length. The result is by slot, as the
twin's. Same values as the twin up to the order of the fp32 sums (bf16 / fp16 products are exact in fp32;
fp32 inputs use IEEE products, not TF32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# keys per program, query rows per product, warps and pipeline stages per program: the fastest launch tried at
# the Llama-3.1-8B shape (128k keys, 64 window queries, groups of 4). Head dims above 128: tiles of 64 keys.
BLOCK_L, BLOCK_W, WARPS, STAGES = 128, 64, 4, 1


@triton.jit
def _mass_kernel(
    Q,
    QPOS,
    QVALID,
    K,
    KPOS,
    LEN,
    LSE,
    PMAX,
    PSUM,
    OUT,
    stride_qb,
    stride_qh,
    stride_qw,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_pb,
    stride_ph,
    H,
    L,
    W,
    ROWS,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HAS_KPOS: tl.constexpr,
    STATS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """STATS: each query row's max and sum of 2^x over this tile of keys (x: the logit times log2 e) -> PMAX /
    PSUM [tiles, rows]. Else: the tile's keys' summed weights ``2^(x - LSE[row])`` over the valid rows, per
    query head -> OUT [B, Hq, L] (accumulated over the window's blocks of rows)."""
    bh = tl.program_id(0)
    nb = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_l = nb * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = offs_l < tl.minimum(L, tl.load(LEN + b))
    if HAS_KPOS:
        kpos = tl.load(KPOS + b * stride_pb + h * stride_ph + offs_l, mask=lmask, other=0)
    else:
        kpos = offs_l.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kp = K + b * stride_kb + h * stride_kh + offs_l[:, None].to(tl.int64) * stride_ks + offs_d[None, :]
    kt = tl.trans(tl.load(kp, mask=lmask[:, None] & dmask[None, :], other=0.0))  # [BLOCK_D, BLOCK_L]
    sc = scale * 1.4426950408889634  # exp(x) = 2^(x log2 e)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        wmask = offs_w < W
        qpos = tl.load(QPOS + b * W + offs_w, mask=wmask, other=-1)
        vis = wmask[:, None] & lmask[None, :] & (kpos[None, :] <= qpos[:, None])
        if not STATS:
            valid = tl.load(QVALID + b * W + offs_w, mask=wmask, other=0) != 0
            vis = vis & valid[:, None]
        for g in tl.static_range(G):
            qp = Q + b * stride_qb + (h * G + g) * stride_qh + offs_w[:, None] * stride_qw + offs_d[None, :]
            q = tl.load(qp, mask=wmask[:, None] & dmask[None, :], other=0.0).to(kt.dtype)  # [BLOCK_W, BLOCK_D]
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(vis, s * sc, float("-inf"))  # [BLOCK_W, BLOCK_L]
            rows = (bh * G + g) * W + offs_w
            if STATS:
                m = tl.max(s, axis=1)
                e = tl.sum(tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), axis=1)
                tl.store(PMAX + nb * ROWS + rows, m, mask=wmask)  # [tiles, rows]: one program's rows side by side
                tl.store(PSUM + nb * ROWS + rows, e, mask=wmask)
            else:
                lse = tl.load(LSE + rows, mask=wmask, other=0.0)
                acc = tl.sum(tl.exp2(s - lse[:, None]), axis=0)
                op = OUT + (bh * G + g) * L + offs_l
                if w0 > 0:
                    acc += tl.load(op, mask=offs_l < L, other=0.0)
                tl.store(op, acc, mask=offs_l < L)


def attention_mass(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    key_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed softmax weights per query head, by key slot: q [B, Hq, W, D] at positions q_pos [B, W] (valid
    rows q_valid [B, W]), keys k [B, H, L, D], ``key_pos`` [B, H, L] the position of the key in each slot
    (None: slot == position) -> [B, Hq, L] fp32. Key slot j is seen by query i iff its position is
    ``<= q_pos[i]`` and ``j < lengths``."""
    b, hq, w, d = q.shape
    h, L = k.shape[1], k.shape[2]
    if k.dim() != 4 or k.shape[0] != b or k.shape[3] != d or hq % h or q_pos.shape != (b, w) or q_valid.shape != (b, w):
        raise ValueError(
            f"expected q [B, Hq, W, D], k [B, H, L, D], q_pos / q_valid [B, W], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(q_pos.shape)}, {tuple(q_valid.shape)}"
        )
    if key_pos is not None and tuple(key_pos.shape) != (b, h, L):
        raise ValueError(f"key_pos must be [B, H, L] = {(b, h, L)}, got {tuple(key_pos.shape)}")
    g = hq // h
    dev = k.device
    out = torch.zeros(b, hq, L, dtype=torch.float32, device=dev)
    if w == 0 or L == 0:
        return out
    if q.stride(3) != 1:
        q = q.contiguous()
    if k.stride(3) != 1:
        k = k.contiguous()
    qpos = q_pos.to(device=dev, dtype=torch.int64).contiguous()
    qvalid = q_valid.to(device=dev, dtype=torch.int8).contiguous()
    lens = lengths.to(device=dev, dtype=torch.int64).contiguous()
    kpos = None if key_pos is None else key_pos.to(device=dev, dtype=torch.int64)
    if kpos is not None and kpos.stride(2) != 1:
        kpos = kpos.contiguous()
    block_l = BLOCK_L if d <= 128 else BLOCK_L // 2
    nb = triton.cdiv(L, block_l)
    rows = b * hq * w
    pmax = torch.empty(nb, rows, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    grid = (b * h, nb)
    args = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        0 if kpos is None else kpos.stride(0), 0 if kpos is None else kpos.stride(1),
        h, L, w, rows, float(scale),
    )  # fmt: skip
    consts = dict(
        G=g, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_W=min(BLOCK_W, max(16, triton.next_power_of_2(w))),
        BLOCK_L=block_l, HAS_KPOS=kpos is not None, IEEE=k.dtype == torch.float32, num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    kp = lens if kpos is None else kpos  # never read without HAS_KPOS
    _mass_kernel[grid](q, qpos, qvalid, k, kp, lens, pmax, pmax, psum, out, *args, STATS=True, **consts)
    top = pmax.amax(0, keepdim=True)  # per row, over the tiles (base 2)
    top = torch.where(torch.isfinite(top), top, 0.0)
    lse = (top + torch.log2((psum * torch.exp2(pmax - top)).sum(0, keepdim=True))).flatten()  # -inf: sees nothing
    _mass_kernel[grid](q, qpos, qvalid, k, kp, lens, lse, pmax, psum, out, *args, STATS=False, **consts)
    return out
