"""vLLM's paged layout as kvdex writes it (``kvdex.vllm.paged``), without vLLM: the cache write reads nothing back
to the host, whatever the padding."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
