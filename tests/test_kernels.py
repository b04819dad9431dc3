"""The PyTorch attention kernels against an explicit float64 softmax."""

from __future__ import annotations

import pytest
import torch

from kvdex.kernels import dense_attention, sparse_decode_attention


def _ref_attend(q, k, v, scale):
    """q [G, D] over k/v [N, D] in float64 -> [G, D]."""
    p = torch.softmax(q.double() @ k.double().T * scale, dim=-1)
    return p @ v.double()


@pytest.mark.parametrize("hq,h", [(4, 2), (4, 4), (8, 1)])
def test_sparse_decode_matches_reference_and_ignores_invalid_slots(hq, h):
    g = torch.Generator().manual_seed(hq * 10 + h)
    b, s, n, d = 3, 40, 12, 16
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    idx = torch.stack([torch.stack([torch.randperm(s, generator=g)[:n] for _ in range(h)]) for _ in range(b)])
    valid = torch.rand(b, h, n, generator=g) < 0.7
    valid[..., 0] = True
    scale = d**-0.5
    out = sparse_decode_attention(q, k, v, idx, valid, scale)
    assert out.shape == (b, hq, d) and out.dtype == q.dtype
    grp = hq // h
    for bi in range(b):
        for hi in range(h):
            slots = idx[bi, hi][valid[bi, hi]]
            exp = _ref_attend(q[bi, hi * grp : (hi + 1) * grp], k[bi, hi, slots], v[bi, hi, slots], scale)
            torch.testing.assert_close(out[bi, hi * grp : (hi + 1) * grp].double(), exp, atol=1e-5, rtol=1e-5)
    # junk in the slots that only invalid entries point to changes nothing
    used = torch.zeros(b, h, s, dtype=torch.bool)
    used.scatter_(2, torch.where(valid, idx, idx[..., :1]), True)
    k2 = torch.where(used[..., None], k, torch.full_like(k, 1e4))
    v2 = torch.where(used[..., None], v, torch.full_like(v, -1e4))
    torch.testing.assert_close(sparse_decode_attention(q, k2, v2, idx, valid, scale), out, atol=0, rtol=0)
    # and the order of the slots does not matter
    perm = torch.randperm(n, generator=g)
    out_p = sparse_decode_attention(q, k, v, idx[..., perm], valid[..., perm], scale)
    torch.testing.assert_close(out_p, out, atol=1e-6, rtol=1e-6)


def test_dense_attention_causal_and_padding():
    g = torch.Generator().manual_seed(0)
    b, hq, h, t, d = 2, 4, 2, 9, 8
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, h, t, d, generator=g)
    v = torch.randn(b, h, t, d, generator=g)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[1, :3] = False  # 3 left-padding tokens in sequence 1
    q_pos = torch.arange(t).expand(b, t)
    out = dense_attention(q, k, v, q_pos, key_mask, d**-0.5, chunk=4)  # several chunks
    assert out.shape == (b, t, hq, d)
    assert torch.isfinite(out).all()
    for bi in range(b):
        for i in range(t):
            if not key_mask[bi, i]:
                continue
            keys = [j for j in range(i + 1) if key_mask[bi, j]]
            for head in range(hq):
                exp = _ref_attend(q[bi, head, i][None], k[bi, head // 2, keys], v[bi, head // 2, keys], d**-0.5)
                torch.testing.assert_close(out[bi, i, head].double(), exp[0], atol=1e-5, rtol=1e-5)
    # a padding query row attends to its own slot only
    torch.testing.assert_close(out[1, 0, 0], v[1, 0, 0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("t", [9, 5])
def test_left_padded_batch_takes_the_fused_path_with_the_masked_result(t, monkeypatch):
    """A left-padded batch (queries at the last T positions) runs fused causal attention per sequence and
    gives what the general masked path gives, padding rows included (each attends to its own slot)."""
    import kvdex.kernels.attention as A

    g = torch.Generator().manual_seed(1)
    b, hq, h, L, d = 3, 4, 2, 9, 8
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, h, L, d, generator=g)
    v = torch.randn(b, h, L, d, generator=g)
    key_mask = torch.ones(b, L, dtype=torch.bool)
    key_mask[1, :3] = False
    key_mask[2, :7] = False  # more padding than keys before the first query when t = 5
    q_pos = (L - t + torch.arange(t)).expand(b, t)
    assert A._left_pads(q_pos, key_mask, t, L) == [0, 3, 7]
    fused = dense_attention(q, k, v, q_pos, key_mask, d**-0.5)
    monkeypatch.setattr(A, "_left_pads", lambda *a: None)  # force the general masked path
    masked = dense_attention(q, k, v, q_pos, key_mask, d**-0.5, chunk=2)
    torch.testing.assert_close(fused, masked, atol=1e-5, rtol=1e-5)


def test_left_pads_rejects_other_masks():
    import kvdex.kernels.attention as A

    L, t = 6, 6
    q_pos = torch.arange(t).expand(2, t)
    inner = torch.ones(2, L, dtype=torch.bool)
    inner[0, 2] = False  # a hole, not left padding
    assert A._left_pads(q_pos, inner, t, L) is None
    shifted = q_pos.clone()
    shifted[1] -= 1  # queries not at the last T positions
    assert A._left_pads(shifted, torch.ones(2, L, dtype=torch.bool), t, L) is None
    assert A._left_pads(q_pos, None, t, L) is None
