"""PRKV's query ring pushed in one Triton launch (:func:`ring_push_`, twin
:func:`kvdex.kernels.reference.ring_push_reference`).

PRKV keeps each layer's last queries (``kvdex.policies.observation.QueryRing``: q [B, Hq, S, D], positions
and validity [B, S], oldest first) and pushes the step's query into it on every step, a
``select_every`` reuse step too: in PyTorch a ``cat`` and a ``copy_`` per buffer plus a ``ones``
(~8 kernels per layer and step; a graph-replayed step pays ~2 us per kernel). This kernel shifts the three
buffers by one row and writes the new row in one launch (a program per (sequence, query head) row, with a
barrier between its loads and its stores: the shift is in place); it reads the sequence lengths and writes
``length - 1`` as the new row's position itself (``offset=-1``), so no kernel computes it first. A pure
copy: bit-identical to the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ring_push_kernel(
    RQ,  # [B, Hq, S, D] contiguous
    RP,  # [B, S] int64
    RV,  # [B, S] bool
    Q,  # [B, Hq, D]
    POS,  # [B]
    stride_qb,
    stride_qh,
    HQ,
    S: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OFFSET: tl.constexpr = 0,
):
    r = tl.program_id(0)  # b * HQ + hq
    b = r // HQ
    os, od = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    src = tl.minimum(os + 1, S - 1)
    m = (os[:, None] < S - 1) & (od[None, :] < D)
    old = tl.load(RQ + r * S * D + src[:, None] * D + od[None, :], mask=m)
    new = tl.load(Q + b * stride_qb + (r % HQ) * stride_qh + od, mask=od < D)
    first = r % HQ == 0  # one program per sequence moves its positions and validity
    ms = (os < S - 1) & first
    p_old = tl.load(RP + b * S + src, mask=ms)
    v_old = tl.load(RV + b * S + src, mask=ms)
    tl.debug_barrier()  # every load of the row before any store: the shift is in place
    tl.store(RQ + r * S * D + os[:, None] * D + od[None, :], old, mask=m)
    tl.store(RQ + r * S * D + (S - 1) * D + od, new, mask=od < D)
    tl.store(RP + b * S + os, p_old, mask=ms)
    tl.store(RV + b * S + os, v_old, mask=ms)
    tl.store(RP + b * S + S - 1, tl.load(POS + b).to(tl.int64) + OFFSET, mask=first)
    tl.store(RV + b * S + S - 1, tl.full([], 1, tl.int1), mask=first)


def ring_push_(
    rq: torch.Tensor, rp: torch.Tensor, rv: torch.Tensor, q: torch.Tensor, pos: torch.Tensor, offset: int = 0
) -> None:
    """Shift the ring ``rq`` [B, Hq, S, D], ``rp`` [B, S] (int64), ``rv`` [B, S] (bool) by one row (the oldest
    leaves) and write q [B, Hq, D] at positions ``pos + offset`` [B] as the newest (valid) row, in place
    (``offset=-1`` with the sequence lengths as ``pos``: the new token's position, without a launch for it)."""
    b, hq, size, d = rq.shape
    ring = (rq, rp, rv)
    if not all(t.is_contiguous() for t in ring) or rp.shape != (b, size) or rv.shape != (b, size):
        raise ValueError("expected a contiguous ring q [B, Hq, S, D], positions / validity [B, S] (written in place)")
    if q.shape != (b, hq, d):
        raise ValueError(f"q must be [B, Hq, D] = [{b}, {hq}, {d}], got {tuple(q.shape)}")
    if rp.dtype != torch.long or rv.dtype != torch.bool or pos.shape != (b,) or size < 1:
        raise ValueError("ring positions must be int64, validity bool, pos [B], S >= 1")
    if q.stride(-1) != 1:
        q = q.contiguous()
    _ring_push_kernel[(b * hq,)](
        rq, rp, rv, q, pos.to(rq.device), q.stride(0), q.stride(1), hq,
        S=size, D=d, BLOCK_S=triton.next_power_of_2(size), BLOCK_D=triton.next_power_of_2(d), OFFSET=offset,
    )  # fmt: skip
