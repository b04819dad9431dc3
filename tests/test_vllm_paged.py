"""vLLM's paged layout as kvdex writes it (``kvdex.vllm.paged``), without vLLM: the cache write reads nothing back
to the host, whatever the padding, and any write keeping its contract (vLLM's kernel on a GPU) is a drop-in."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm_sim import run_scenario

from kvdex.vllm import settings_from
from kvdex.vllm.paged import PAD_SLOT_ID, kv_cache_shape, split_kv, write_slots

PS, H, D = 16, 2, 8
HOST_READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "item"}


class HostReads(TorchDispatchMode):
    """Counts the operations that bring a tensor's value to the host (a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "slots",
    [[3, PAD_SLOT_ID, 40, 127, 16], [PAD_SLOT_ID, 5, 6], [7, 8, PAD_SLOT_ID, PAD_SLOT_ID], [PAD_SLOT_ID] * 3, [9]],
)
def test_write_slots_skips_padding_and_reads_nothing_back(slots):
    kv = torch.randn(kv_cache_shape(8, PS, H, D))
    k_cache, _ = split_kv(kv)
    before = kv.clone()
    rows = torch.randn(len(slots), H, D)
    with HostReads() as mode:
        write_slots(k_cache, torch.tensor(slots), rows)
    assert mode.seen == []
    want = before.clone()
    flat = want[0].view(-1, H, D)
    for i, s in enumerate(slots):
        if s >= 0:
            flat[s] = rows[i]
    assert torch.equal(kv, want)  # every real row in place, nothing else touched (slot 0 included)


def test_write_slots_of_nothing():
    kv = torch.zeros(kv_cache_shape(2, PS, H, D))
    write_slots(split_kv(kv)[0], torch.zeros(0, dtype=torch.long), torch.zeros(0, H, D))
    assert kv.abs().sum() == 0


def _write_by_loop(k_cache, v_cache, slots, key, value):
    """The cache write's contract computed row by row."""
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            k_cache[s // k_cache.shape[1], s % k_cache.shape[1]] = key[i]
            v_cache[s // v_cache.shape[1], s % v_cache.shape[1]] = value[i]


def test_the_cache_write_is_a_drop_in():
    st = settings_from({"kvdex": {"policy": "quest", "budget": 96, "sink": 16, "window": 32, "dense_layers": 1}})
    want, _ = run_scenario(st)
    got, _ = run_scenario(st, write=_write_by_loop)
    assert all(torch.equal(got.out[key], o) for key, o in want.out.items())
    wrong, _ = run_scenario(st, write=lambda kc, vc, slots, k, v: _write_by_loop(kc, vc, slots, k, 2 * v))
    assert not all(torch.equal(wrong.out[key], o) for key, o in want.out.items())
