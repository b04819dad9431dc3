"""CUDA only (run on the device machine): offloaded KV in pinned host memory gives the same
tokens as GPU-resident storage, in bf16 and fp32.

For the sparse policies the attended slots hold the same values in the same order in both
stores, so the decode kernel sees identical inputs: tokens must match exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_pair, greedy, left_padded

import kvdex

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEW = 60


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2"])
def cuda_pair(request):
    model, ref = build_pair(request.param)
    return model.cuda(), ref.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["quest", "oracle", "streaming"])
def test_pinned_offload_matches_resident(cuda_pair, policy, dtype, monkeypatch):
    # Storage invariant: the offloaded store hands the kernel the same K/V as the resident one.
    # Both must then run the same kernel: the resident store's fused paged kernel rounds
    # differently in bf16 (it is checked against the slot kernel in tests/test_triton_kernels.py).
    monkeypatch.setenv("KVDEX_PAGED", "0")
    model = copy.deepcopy(cuda_pair[0]).to(dtype)  # the shared fp32 pair stays untouched
    ids, mask, _ = left_padded([150, 97, 40], seed=2)
    ids, mask = ids.cuda(), mask.cuda()
    resident = kvdex.Cache(model, policy, 96, offload=False, dense_layers=1)
    t_res, l_res = greedy(model, ids, mask, resident, new=NEW)
    offloaded = kvdex.Cache(model, policy, 96, offload=True, dense_layers=1)
    t_off, l_off = greedy(model, ids, mask, offloaded, new=NEW)
    assert torch.equal(t_off, t_res)
    torch.testing.assert_close(l_off, l_res, atol=1e-3 if dtype == torch.bfloat16 else 1e-5, rtol=0)

    for layer in offloaded.layers[1:]:
        store = layer.store
        assert isinstance(store, kvdex.storage.OffloadStore)
        assert store.k.is_cuda and store.k.dtype == dtype
        assert store.host.pin and store.host.data.is_pinned() and not store.host.data.is_cuda
        assert store.host._staging is None or store.host._staging.is_pinned()
    for layer in resident.layers:
        assert layer.store.k.is_cuda and layer.store.host_bytes() == 0
    s = offloaded.stats()
    assert s["bytes_host_to_device"] > 0 and s["kv_bytes_host"] > 0
    assert s["kv_bytes_device"] < resident.stats()["kv_bytes_device"]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", ["full", "quest", "oracle", "streaming"])
def test_cuda_covering_budget_matches_sdpa_fp32(cuda_pair, policy, offload):
    model, ref = cuda_pair
    ids, mask, _ = left_padded([70, 45], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    t_ref, l_ref = greedy(ref, ids, mask, new=NEW)
    cache = kvdex.Cache(model, policy, 256, offload=offload, dense_layers=1)
    t_got, l_got = greedy(model, ids, mask, cache, new=NEW)
    assert torch.equal(t_got, t_ref)
    torch.testing.assert_close(l_got, l_ref, atol=1e-3, rtol=0)  # TF32 may be on for matmuls
