"""CHESS's per-step trigger statistics in one Triton kernel: the entropy and varentropy of each row's
next-token distribution, added into the running sums of the current check window.

:func:`accumulate` is :func:`kvdex.policies.chess.levels.entropy_varentropy` followed by the trigger's
``acc += (H, H^2, V, 1)`` (``kvdex.policies.chess.trigger``). The PyTorch twin runs about fifteen
element-wise and reduction kernels over the [B, vocab] logits after every decode step, outside the
captured graph (about 80 us a step at a 128k vocabulary); here one program per row reads its logits once,
keeping an online softmax (as flash attention does): the running max ``m`` and the sums of ``e = exp(x - m)``,
``e * (x - m)`` and ``e * (x - m)^2``, rescaled whenever ``m`` grows. With ``p = e / s0``:
``H = log s0 - E_p[x - m]`` and ``V = Var_p(log p) = Var_p(x - m)``. Logits of ``-inf`` (masked tokens)
carry no mass, as in the twin. Same values as the twin up to the order of the fp32 sums."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK, WARPS = 4096, 8  # vocabulary entries per iteration, warps per row


@triton.jit
def _accumulate_kernel(X, ACC, n, stride_x, stride_acc, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    neg = float("-inf")
    m = tl.zeros([], tl.float32) + neg
    s0 = tl.zeros([], tl.float32)
    s1 = tl.zeros([], tl.float32)
    s2 = tl.zeros([], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < n, other=neg).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        mn = tl.where(m_new > neg, m_new, 0.0)
        seen = m > neg
        d = tl.where(seen, mn - m, 0.0)  # the old sums' offsets move by -d
        r = tl.where(seen, tl.exp(tl.where(seen, m, 0.0) - mn), 0.0)
        s2 = (s2 - 2.0 * d * s1 + d * d * s0) * r
        s1 = (s1 - d * s0) * r
        s0 = s0 * r
        live = x > neg
        y = tl.where(live, x - mn, 0.0)
        e = tl.where(live, tl.exp(y), 0.0)
        s0 += tl.sum(e, 0)
        s1 += tl.sum(e * y, 0)
        s2 += tl.sum(e * y * y, 0)
        m = m_new
    mean = s1 / s0
    h = tl.log(s0) - mean
    v = tl.maximum(s2 / s0 - mean * mean, 0.0)
    a = ACC + row
    tl.store(a, tl.load(a) + h)
    tl.store(a + stride_acc, tl.load(a + stride_acc) + h * h)
    tl.store(a + 2 * stride_acc, tl.load(a + 2 * stride_acc) + v)
    tl.store(a + 3 * stride_acc, tl.load(a + 3 * stride_acc) + 1.0)


def accumulate(logits: torch.Tensor, acc: torch.Tensor) -> None:
    """``acc`` [4, B] fp32 += (H, H^2, V, 1) of each row of ``logits`` [B, vocab] (nats), in place; both on the
    same device."""
    x = logits.contiguous()
    b, n = x.shape
    if acc.shape != (4, b) or acc.dtype != torch.float32 or acc.stride(1) != 1:
        raise ValueError(f"acc must be a contiguous [4, {b}] fp32 tensor, got {tuple(acc.shape)} {acc.dtype}")
    here = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with here:  # Triton launches on the current device (the logits' under device_map)
        _accumulate_kernel[(b,)](x, acc, n, x.stride(0), acc.stride(0), BLOCK=BLOCK, num_warps=WARPS)
