"""The observation window's attention mass (SnapKV, PRKV's static refresh): the Triton kernels
(:mod:`kvdex.kernels.obs_triton`) against their PyTorch twin, and scores over relocated keys (PRKV) equal to
the same scores over the keys put back in position order.

The kernel tests run compiled on CUDA, and on a CPU machine under Triton's interpreter in a subprocess
(``test_interpreter_suite``, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, DEV, INTERP, run_kernels

from kvdex.kernels.reference import attention_mass_reference
from kvdex.policies.observation import middle_scores
from kvdex.storage.layout import Grid


@pytest.mark.skipif(CUDA or INTERP, reason="runs the kernels itself")
def test_interpreter_suite(interpreter_suite):
    """This file's kernel tests under TRITON_INTERPRET=1 in a fresh interpreter (tests/conftest.py)."""
    pytest.importorskip("triton")
    interpreter_suite(__file__)


def _window(b, hq, h, w, L, d, dtype, seed=0, permuted=False):
    """Random queries at the last w positions of ragged sequences (a few rows invalid), keys of L slots and,
    ``permuted``: a random position per slot (a permutation of each row's own slots, as PRKV's relocation)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, w, d, generator=gen).to(dtype)
    k = torch.randn(b, h, L, d, generator=gen).to(dtype)
    lengths = torch.tensor([L - 3 * i for i in range(b)])
    pos = lengths[:, None] - w + torch.arange(w)[None, :]  # the last w positions (each sees the keys before it)
    valid = (pos >= 0) & (torch.rand(b, w, generator=gen) > 0.2)
    valid[:, -1] = True
    key_pos = None
    if permuted:
        key_pos = torch.arange(L).repeat(b, h, 1)
        for i in range(b):
            for j in range(h):
                n = int(lengths[i])
                key_pos[i, j, :n] = torch.randperm(n, generator=gen)
    return q, pos.clamp(min=0), valid, k, lengths, key_pos


CASES = [  # b, hq, h, w, L, d
    (1, 4, 2, 16, 100, 32),
    (2, 8, 2, 70, 300, 64),  # two chunks of query rows, L not a multiple of the key tile
    (2, 4, 4, 5, 130, 16),  # G = 1, a short window
    (1, 2, 1, 8, 150, 256),  # head dim above 128: tiles of 64 keys
]


@run_kernels
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []))
def test_triton_mass_matches_twin(case, permuted, dtype):
    from kvdex.kernels import obs_triton

    b, hq, h, w, L, d = case
    q, pos, valid, k, lengths, key_pos = _window(b, hq, h, w, L, d, dtype, permuted=permuted)
    args = [x.to(DEV) if x is not None else None for x in (q, pos, valid, k, lengths)]
    kp = None if key_pos is None else key_pos.to(DEV)
    got = obs_triton.attention_mass(*args, 0.125, kp)
    want = attention_mass_reference(*args, 0.125, kp)
    assert got.shape == (b, hq, L) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the mass of a query row sums to 1 over what it sees: the window's valid rows in all
    torch.testing.assert_close(got.sum(-1), valid.sum(-1).to(got)[:, None].expand(b, hq).to(DEV), rtol=1e-4, atol=1e-4)
    assert (got[..., int(lengths.max()) :] == 0).all() and (got >= 0).all()


@run_kernels
def test_triton_mass_rejects_bad_shapes():
    from kvdex.kernels import obs_triton

    q, pos, valid, k, lengths, _ = _window(1, 4, 2, 8, 40, 16, torch.float32)
    with pytest.raises(ValueError, match="key_pos must be"):
        obs_triton.attention_mass(q.to(DEV), pos.to(DEV), valid.to(DEV), k.to(DEV), lengths.to(DEV), 1.0,
                                  torch.zeros(1, 2, 39, dtype=torch.long, device=DEV))  # fmt: skip
    with pytest.raises(ValueError, match="expected q"):
        obs_triton.attention_mass(q.to(DEV), pos[:, :4].to(DEV), valid.to(DEV), k.to(DEV), lengths.to(DEV), 1.0)


@pytest.mark.parametrize("per_query_head", [False, True])
def test_scores_of_relocated_keys_equal_scores_in_position_order(per_query_head):
    """middle_scores over a store whose middle slots hold permuted keys (``origin``: slot -> position - sink) ==
    middle_scores over the same keys put back in position order (what PRKV computed before it scored in place)."""
    grid = Grid(sink=4, page_size=8, window_pages=2)
    b, hq, h, w, L, d = 2, 8, 2, 12, 120, 32
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(b, h, L, d, generator=gen)
    lengths = torch.tensor([L, L - 9])
    q = torch.randn(b, hq, w, d, generator=gen)
    pos = lengths[:, None] - w + torch.arange(w)[None, :]
    valid = torch.ones(b, w, dtype=torch.bool)
    m = int(grid.num_middle_pages(lengths).max()) * grid.page_size
    own = grid.num_middle_pages(lengths) * grid.page_size
    origin = torch.arange(m).repeat(b, h, 1)
    for i in range(b):
        for j in range(h):
            origin[i, j, : own[i]] = torch.randperm(int(own[i]), generator=gen)
    kslots = k.clone()  # slot sink + j holds the key of position sink + origin[j]
    kslots[:, :, grid.sink : grid.sink + m] = k[:, :, grid.sink : grid.sink + m].gather(
        2, origin[..., None].expand(-1, -1, -1, d)
    )
    want = middle_scores(q, pos, valid, k, lengths, grid, 0.2, per_query_head=per_query_head)
    got = middle_scores(q, pos, valid, kslots, lengths, grid, 0.2, per_query_head=per_query_head, origin=origin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.isinf(got).any()  # the second sequence's slots past its middle
