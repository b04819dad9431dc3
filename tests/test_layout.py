"""Page-grid arithmetic (kvdex.storage.Grid) and the left-padding parser."""

from __future__ import annotations

import pytest
import torch

from kvdex.storage import Grid, left_padding, strip_left_padding

SINK, PS, WP = 16, 16, 2  # window = 32


@pytest.mark.parametrize(
    "length,middle_pages",
    [
        (0, 0),
        (1, 0),
        (SINK - 1, 0),  # < sink
        (SINK, 0),  # exactly the sink
        (SINK + 1, 0),
        (SINK + 32 - 1, 0),
        (SINK + 32, 0),  # exactly sink + window: a full window, no middle yet
        (SINK + 32 + 1, 1),  # a new page starts: the oldest window page joins the middle
        (SINK + 48, 1),  # page boundary
        (SINK + 48 + 1, 2),
        (SINK + 64, 2),
        (SINK + 64 + 1, 3),
        (1000, (1000 - SINK + PS - 1) // PS - WP),
    ],
)
def test_grid_edges(length, middle_pages):
    grid = Grid(SINK, PS, WP)
    n = torch.tensor([length])
    assert grid.window == 32
    assert grid.num_middle_pages(n).tolist() == [middle_pages]
    assert grid.window_start(n).tolist() == [SINK + middle_pages * PS]
    assert grid.page_start(middle_pages) == SINK + middle_pages * PS


@pytest.mark.parametrize("sink,ps,wp", [(16, 16, 2), (0, 4, 1), (5, 8, 3), (1, 1, 4), (7, 2, 1)])
def test_grid_invariants_brute_force(sink, ps, wp):
    grid = Grid(sink, ps, wp)
    lengths = torch.arange(0, 400)
    mid = grid.num_middle_pages(lengths)
    ws = grid.window_start(lengths)
    window = ps * wp
    prev = 0
    for n in range(400):
        m, w = int(mid[n]), int(ws[n])
        assert w == sink + m * ps and (w - sink) % ps == 0
        # the per-length tensor result equals the one-element result (no cross-talk in a batch)
        assert grid.num_middle_pages(torch.tensor([n])).item() == m
        if n <= sink + window:
            assert m == 0, n
        else:
            # the window holds between window - ps + 1 and window tokens, and the middle is whole pages
            assert window - ps + 1 <= n - w <= window, (n, w)
        # the middle only grows, one page at a time, and only when a token starts a new grid page
        assert m - prev in (0, 1)
        if m > prev:
            assert (n - 1 - sink) % ps == 0, n
        prev = m


def test_left_padding_counts():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    assert left_padding(mask, 3, 4).tolist() == [0, 2, 1]
    assert left_padding(None, 2, 5).tolist() == [0, 0]
    # a longer mask (decode) is cut to the width
    assert left_padding(torch.tensor([[0, 1, 1, 1, 1]]), 1, 3).tolist() == [1]


@pytest.mark.parametrize(
    "mask",
    [[[1, 1, 0, 0]], [[1, 0, 1, 1]], [[0, 1, 0, 1]]],
    ids=["right", "hole", "mixed"],
)
def test_left_padding_refuses_other_padding(mask):
    with pytest.raises(ValueError, match="padding_side"):
        left_padding(torch.tensor(mask), 1, 4)


def test_left_padding_refuses_empty_row():
    with pytest.raises(ValueError, match="no tokens"):
        left_padding(torch.tensor([[1, 1], [0, 0]]), 2, 2)


def test_strip_left_padding():
    x = torch.arange(2 * 1 * 4 * 1, dtype=torch.float).view(2, 1, 4, 1) + 1
    out = strip_left_padding(x, torch.tensor([0, 3]))
    assert out[0, 0, :, 0].tolist() == [1, 2, 3, 4]
    assert out[1, 0, :1, 0].tolist() == [8]
    assert strip_left_padding(x, torch.tensor([0, 0])) is x
