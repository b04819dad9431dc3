"""Storage: offload then fetch is bit-exact, and DeviceStore / OffloadStore agree exactly.

The stores are driven directly with random K/V (ragged lengths, single- and multi-column
appends) and compared with the ground truth kept by the test, with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import window_start

from kvdex.selection import Selection
from kvdex.storage import DeviceStore, Grid, OffloadStore, TransferStats

B, H, D = 4, 2, 8


class Truth:
    """The K/V every sequence should hold, position by position."""

    def __init__(self, lengths, g, sink, page, window):
        self.g, self.sink, self.page, self.window = g, sink, page, window
        self.k = [torch.randn(H, n, D, generator=g) for n in lengths]
        self.v = [torch.randn(H, n, D, generator=g) for n in lengths]

    def left_aligned(self):
        width = max(1, max(x.shape[1] for x in self.k))
        k = torch.full((B, H, width, D), float("nan"))  # junk past each length must never be read
        v = torch.full((B, H, width, D), float("nan"))
        for b in range(B):
            n = self.k[b].shape[1]
            k[b, :, :n], v[b, :, :n] = self.k[b], self.v[b]
        return k, v, torch.tensor([x.shape[1] for x in self.k])

    def new_columns(self, t):
        k = torch.randn(B, H, t, D, generator=self.g)
        v = torch.randn(B, H, t, D, generator=self.g)
        for b in range(B):
            self.k[b] = torch.cat([self.k[b], k[b]], dim=1)
            self.v[b] = torch.cat([self.v[b], v[b]], dim=1)
        return k, v

    def lengths(self):
        return [x.shape[1] for x in self.k]


def make_stores(sink, page, window, work=48):
    grid = Grid(sink, page, window // page)
    dev = DeviceStore(grid, B, H, D, torch.float32, "cpu", TransferStats())
    off = OffloadStore(grid, B, H, D, torch.float32, "cpu", TransferStats(), work_tokens=work)
    return grid, dev, off


class UpdateLog:
    """Collects MiddleUpdates: every middle page must be reported exactly once, in order."""

    def __init__(self):
        self.pages = [dict() for _ in range(B)]

    def add(self, upd, where):
        assert upd.start.shape == upd.count.shape == (B,)
        ids = upd.page_ids()
        for b in range(B):
            for j in range(int(upd.count[b])):
                page = int(upd.start[b]) + j
                assert int(ids[b, j]) == page
                assert page not in self.pages[b], f"{where}: page {page} of seq {b} reported twice"
                assert page == len(self.pages[b]), f"{where}: page {page} of seq {b} reported out of order"
                vals = None if upd.values is None else upd.values[b, :, j].clone()
                self.pages[b][page] = (upd.keys[b, :, j].clone(), vals)
            assert bool((ids[b, int(upd.count[b]) :] == -1).all())

    def check(self, truth, where):
        for b in range(B):
            n = truth.lengths()[b]
            m = (window_start(n, truth.sink, truth.page, truth.window) - truth.sink) // truth.page
            assert sorted(self.pages[b]) == list(range(m)), f"{where}: seq {b} pages {sorted(self.pages[b])} != {m}"
            for pg, (k, v) in self.pages[b].items():
                s = truth.sink + pg * truth.page
                assert torch.equal(k, truth.k[b][:, s : s + truth.page]), f"{where}: keys of page {pg} seq {b}"
                if v is not None:
                    assert torch.equal(v, truth.v[b][:, s : s + truth.page]), f"{where}: values of page {pg}"


def check_dense(store, truth, where):
    k, v = store.dense()
    lens = truth.lengths()
    assert store.lengths_host.tolist() == lens
    assert store.lengths.tolist() == lens
    assert k.shape == (B, H, max(lens), D)
    for b, n in enumerate(lens):
        assert torch.equal(k[b, :, :n], truth.k[b]), f"{where}: dense keys of seq {b}"
        assert torch.equal(v[b, :, :n], truth.v[b]), f"{where}: dense values of seq {b}"


GEOMETRIES = [(16, 16, 32), (4, 8, 16), (0, 4, 8), (5, 4, 12)]


@pytest.mark.parametrize("sink,page,window", GEOMETRIES)
@pytest.mark.parametrize("lengths", [[1, 48, 49, 100], [3, 17, 64, 130]], ids=["edges", "ragged"])
def test_offload_dense_equals_device_dense_bit_exact(sink, page, window, lengths):
    g = torch.Generator().manual_seed(sum(lengths) + sink + page)
    truth = Truth(lengths, g, sink, page, window)
    _, dev, off = make_stores(sink, page, window)
    logs = {"device": UpdateLog(), "offload": UpdateLog()}
    k, v, lens = truth.left_aligned()
    for name, store in (("device", dev), ("offload", off)):
        logs[name].add(store.ingest(k, v, lens.clone()), f"{name} ingest")
    fixed_shape = off.k.shape
    steps = [1] * 40 + [3, 1, 5, 1, 1, 17, 1, 2] + [1] * 30  # ragged appends, several evictions at once
    for i, t in enumerate(steps):
        kc, vc = truth.new_columns(t)
        for name, store in (("device", dev), ("offload", off)):
            logs[name].add(store.append(kc, vc), f"{name} append {i}")
        if i % 7 == 0 or t > 1:
            check_dense(dev, truth, f"device after append {i}")
            check_dense(off, truth, f"offload after append {i}")
            kd, vd = dev.dense()
            ko, vo = off.dense()
            for b, n in enumerate(truth.lengths()):
                assert torch.equal(kd[b, :, :n], ko[b, :, :n]) and torch.equal(vd[b, :, :n], vo[b, :, :n])
    for name, log in logs.items():
        log.check(truth, name)
    # the offloaded device buffer does not grow with the context
    assert off.k.shape == fixed_shape == (B, H, sink + window + 48, D)
    assert off.host_bytes() > 0 and dev.host_bytes() == 0
    # middle_keys: slot j == position sink + j
    for store in (dev, off):
        mk = store.middle_keys()
        for b, n in enumerate(truth.lengths()):
            m = window_start(n, sink, page, window) - sink
            assert torch.equal(mk[b, :, :m], truth.k[b][:, sink : sink + m])


def _filled(sink=16, page=16, window=32, lengths=(40, 90, 130, 200), appends=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    truth = Truth(list(lengths), g, sink, page, window)
    grid, dev, off = make_stores(sink, page, window)
    k, v, lens = truth.left_aligned()
    dev.ingest(k, v, lens.clone())
    off.ingest(k, v, lens.clone())
    for _ in range(appends):
        kc, vc = truth.new_columns(1)
        dev.append(kc, vc)
        off.append(kc, vc)
    return grid, truth, dev, off, g


def test_dense_keys_are_dense_keys_and_the_offloaded_store_reads_no_values():
    """``dense_keys()`` (what scoring the whole context reads: PRKV's refresh, SnapKV, H2O, oracle) equals
    ``dense()``'s keys on both stores; offloaded, half the bytes of ``dense()`` cross from the host."""
    _, truth, dev, off, _ = _filled(seed=4)
    before = off.stats.h2d_bytes
    k = off.dense_keys().clone()
    keys_bytes = off.stats.h2d_bytes - before
    full_k, _ = off.dense()
    both_bytes = off.stats.h2d_bytes - before - keys_bytes
    assert keys_bytes > 0 and 2 * keys_bytes == both_bytes
    for b, n in enumerate(truth.lengths()):  # rows past a length are junk
        for got in (k, full_k, dev.dense_keys()):
            assert torch.equal(got[b, :, :n], dev.dense()[0][b, :, :n])


def test_fetch_pages_and_rows_are_exact():
    grid, truth, _, off, g = _filled()
    nmid = grid.num_middle_pages(off.lengths_host)
    assert nmid.tolist() == [(window_start(n) - 16) // 16 for n in truth.lengths()]
    pages = torch.stack(
        [torch.stack([torch.randint(0, max(1, int(m)), (6,), generator=g) for _ in range(H)]) for m in nmid]
    )
    pages = torch.where(nmid[:, None, None] > 0, pages, 0)
    before = off.stats.h2d_bytes
    blocks = off.host.fetch_pages(pages).clone()  # on a CPU the result is the staging buffer, reused by a fetch
    assert blocks.shape == (B, H, 6, 2, 16, D)
    assert off.stats.h2d_bytes - before == blocks.numel() * blocks.element_size()
    for b in range(B):
        if int(nmid[b]) == 0:
            continue
        for h in range(H):
            for j, pg in enumerate(pages[b, h].tolist()):
                s = 16 + pg * 16
                assert torch.equal(blocks[b, h, j, 0], truth.k[b][h, s : s + 16])
                assert torch.equal(blocks[b, h, j, 1], truth.v[b][h, s : s + 16])
    before = off.stats.h2d_bytes
    keys = off.page_keys(pages)  # the rerank's read: the keys alone, half the bytes of the pages
    assert keys.shape == (B, H, 6, 16, D) and torch.equal(keys, blocks[:, :, :, 0])
    assert off.stats.h2d_bytes - before == blocks.numel() * blocks.element_size() // 2
    ws = torch.tensor([window_start(n) for n in truth.lengths()])
    pos = torch.stack(
        [torch.stack([torch.randint(16, max(17, int(w)), (9,), generator=g) for _ in range(H)]) for w in ws]
    )
    pos = torch.where(ws[:, None, None] > 16, pos, 16)
    rows = off.host.fetch_rows(pos, 16)
    assert rows.shape == (B, H, 9, 2, D)
    for b in range(B):
        if int(ws[b]) == 16:
            continue
        for h in range(H):
            for j, p in enumerate(pos[b, h].tolist()):
                assert torch.equal(rows[b, h, j, 0], truth.k[b][h, p])
                assert torch.equal(rows[b, h, j, 1], truth.v[b][h, p])


def _gathered(aset, b, h):
    """(positions, k rows, v rows) of the valid slots of one (sequence, kv head), sorted by position."""
    valid = aset.valid[b, h]
    pos = aset.positions[b, h][valid]
    slots = aset.idx[b, h][valid]
    order = torch.argsort(pos, stable=True)
    return pos[order].tolist(), aset.k[b, h, slots[order]], aset.v[b, h, slots[order]]


def _selections(grid, lengths, g):
    nmid = grid.num_middle_pages(torch.tensor(lengths))
    p = 3
    pages = torch.full((B, H, p), -1, dtype=torch.long)
    tokens = torch.full((B, H, 7), -1, dtype=torch.long)
    for b, m in enumerate(nmid.tolist()):
        for h in range(H):
            if m:
                ch = torch.randperm(m, generator=g)[: min(p, m)]
                pages[b, h, : len(ch)] = ch
                ws = grid.sink + m * grid.page_size
                tk = grid.sink + torch.randperm(ws - grid.sink, generator=g)[:5]
                tokens[b, h, : len(tk)] = tk
    return {
        "pages": Selection(pages=pages),
        "tokens": Selection(tokens=tokens),
        "both": Selection(pages=pages, tokens=tokens),
        "everything": Selection(everything=True),
        "empty": Selection(pages=torch.full((B, H, 0), -1, dtype=torch.long)),
    }


def _few_swaps(m: int, g: torch.Generator) -> torch.Tensor:
    """A permutation of m slots that swaps two pairs (a few rows move: the sparse path)."""
    order = torch.arange(m)
    a = torch.randperm(m, generator=g)[:4]
    order[a[0]], order[a[1]], order[a[2]], order[a[3]] = a[1], a[0], a[3], a[2]
    return order


@pytest.mark.parametrize("moves", ["all", "few"])
def test_host_permute_moves_whole_token_rows_and_leaves_spare_pages(moves):
    """PRKV's relocation on the host (``HostPages.permute_tokens``): slot j of every (sequence, head) takes the key
    and value of token ``order[j]``, bit for bit; pages past the permuted ones (the buffer's spare room) stay.
    ``few``: a permutation that moves a few tokens (PRKV's ``relocate="swap"``), which moves those rows alone."""
    from kvdex.storage.host import HostPages

    g = torch.Generator().manual_seed(3)
    b, h, ps, m, spare = 2, 3, 4, 24, 2
    host = HostPages(b, h, ps, D, torch.bfloat16, "cpu", TransferStats())
    host.reserve(m // ps + spare)
    host.data.copy_(torch.randn(host.data.shape, generator=g).to(torch.bfloat16))
    before = host.data.clone()
    perm = (lambda: torch.randperm(m, generator=g)) if moves == "all" else (lambda: _few_swaps(m, g))
    order = torch.stack([torch.stack([perm() for _ in range(h)]) for _ in range(b)])
    host.permute_tokens(order)
    cap = host.capacity
    assert cap >= m // ps + spare
    for s in range(b):
        for k in range(h):
            for j, o in enumerate(order[s, k].tolist()):
                for kv in range(2):
                    got = host.data[s, k, j // ps, kv, j % ps]
                    assert torch.equal(got, before[s, k, o // ps, kv, o % ps]), (s, k, j, kv)
            assert torch.equal(host.data[s, k, m // ps :], before[s, k, m // ps :])


@pytest.mark.parametrize("kind", ["pages", "tokens", "both", "everything", "empty"])
def test_attend_set_identical_between_device_and_offload(kind):
    grid, truth, dev, off, g = _filled(seed=11)
    sel = _selections(grid, truth.lengths(), g)[kind]
    a_dev, a_off = dev.attend(sel), off.attend(sel)
    for b, n in enumerate(truth.lengths()):
        ws = window_start(n)
        for h in range(H):
            pos_d, kd, vd = _gathered(a_dev, b, h)
            pos_o, ko, vo = _gathered(a_off, b, h)
            assert pos_d == pos_o, f"seq {b} head {h}: positions differ"
            assert torch.equal(kd, ko) and torch.equal(vd, vo), f"seq {b} head {h}: gathered K/V differ"
            # and both are the truth, position by position
            idx = torch.tensor(pos_d, dtype=torch.long)
            assert torch.equal(kd, truth.k[b][h, idx]) and torch.equal(vd, truth.v[b][h, idx])
            # exactly sink + window + the selection
            expected = set(range(min(16, n))) | set(range(ws, n))
            if kind == "everything":
                expected |= set(range(16, ws))
            elif kind != "empty":
                sp = sel.token_positions(16, 16)[b, h]
                expected |= {int(x) for x in sp if x >= 0}
            assert set(pos_d) == expected
            if kind != "both":  # pages and tokens may overlap; otherwise no slot is attended twice
                assert len(pos_d) == len(set(pos_d))


def test_offload_work_buffer_grows_for_large_selection():
    grid, truth, dev, off, g = _filled(seed=4, lengths=(300, 260, 280, 290), appends=5)
    nmid = int(grid.num_middle_pages(off.lengths_host).min())
    pages = torch.arange(nmid).expand(B, H, nmid)  # more than work_tokens=48 tokens
    sel = Selection(pages=pages)
    a_dev, a_off = dev.attend(sel), off.attend(sel)
    for b in range(B):
        for h in range(H):
            pd, kd, vd = _gathered(a_dev, b, h)
            po, ko, vo = _gathered(a_off, b, h)
            assert pd == po and torch.equal(kd, ko) and torch.equal(vd, vo)


def test_selection_token_positions():
    sel = Selection(pages=torch.tensor([[[2, -1]]]), tokens=torch.tensor([[[21, -1, 17]]]))
    pos = sel.token_positions(sink=4, page_size=4)
    assert pos.tolist() == [[[12, 13, 14, 15, -1, -1, -1, -1, 21, -1, 17]]]
    assert sel.num_pages().tolist() == [[1]] and sel.num_tokens().tolist() == [[2]]
    with pytest.raises(ValueError, match="integer tensor"):
        Selection(pages=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="empty Selection"):
        Selection().token_positions(4, 4)


def test_grown_capacity_keeps_a_short_index_about_its_size():
    """A policy index re-allocates to :func:`kvdex.storage.grown_capacity`: a first allocation holds what it must,
    a small one doubles, a large one grows by the step or a quarter; filled one entry at a time it re-allocates
    a logarithmic number of times."""
    from kvdex.storage import grown_capacity

    assert grown_capacity(3, 0, 256) == 3
    assert grown_capacity(4, 3, 256) == 7
    assert grown_capacity(300, 0, 256) == 300
    assert grown_capacity(301, 300, 256) == 556
    assert grown_capacity(2001, 2000, 256) == 2500
    cap, grown = 0, 0
    for need in range(1, 100_001):
        if need > cap:
            cap, grown = grown_capacity(need, cap, 256), grown + 1
    assert grown < 40, grown
