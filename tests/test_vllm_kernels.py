"""The checks kvdex runs on vLLM's own kernels when an engine starts (``kvdex/vllm/kernels.py``), without vLLM: a
stub of vLLM's ``fa_utils`` whose FlashAttention computes kvdex's PyTorch reference is taken, on a cache of the
engine's shape; one that fails on that shape, or computes something else, is refused with the reason logged, and
kvdex's own path runs instead."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from kvdex.vllm import kernels
from kvdex.vllm.paged import decode_attention_reference, write_kv


def _reference_varlen(seen, bad_head_dim=None, skew=0.0):
    """A stand-in of vLLM's ``flash_attn_varlen_func`` for one decode query: kvdex's reference, recording shapes."""

    def varlen(q, k, v, out, max_seqlen_q, max_seqlen_k, softmax_scale, cu_seqlens_q, seqused_k, causal,
               block_table, fa_version=None):  # fmt: skip
        seen.append((tuple(q.shape), tuple(k.shape), q.dtype))
        if q.shape[-1] == bad_head_dim:
            raise RuntimeError(f"this build has no kernel for head dim {bad_head_dim}")
        want = decode_attention_reference(q, block_table[0].long(), seqused_k.long(), max_seqlen_k, k, v,
                                          softmax_scale)  # fmt: skip
        out.copy_(want + skew)

    return varlen


@pytest.fixture
def fa_utils(monkeypatch):
    stub = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    stub.is_flash_attn_varlen_func_available = lambda: True
    stub.get_flash_attn_version = lambda head_size=None: 3
    stub.reshape_and_cache_flash = lambda k, v, kc, vc, slots, dtype, ks, vs: write_kv(kc, vc, slots, k, v)
    pkg = types.ModuleType("vllm.v1.attention.backends")
    pkg.fa_utils = stub
    for name in ("vllm", "vllm.v1", "vllm.v1.attention"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends", pkg)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.fa_utils", stub)
    return stub


def test_flash_decode_is_checked_on_the_engines_shape_and_taken(fa_utils):
    seen = []
    fa_utils.flash_attn_varlen_func = _reference_varlen(seen)
    probe = kernels.Probe(q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32)
    decode = kernels.flash_decode("cpu", probe)
    assert decode is not None
    assert seen == [((1, 32, 128), (8, 16, 8, 128), torch.float32)]  # the engine's heads, head size, block, dtype


def test_flash_decode_that_fails_on_the_engines_shape_is_refused_with_the_reason(fa_utils, caplog):
    fa_utils.flash_attn_varlen_func = _reference_varlen([], bad_head_dim=128)
    with caplog.at_level(logging.WARNING, logger="kvdex.vllm.kernels"):
        assert kernels.flash_decode("cpu", kernels.Probe(head_dim=128, dtype=torch.float32)) is None
    assert "no kernel for head dim 128" in caplog.text and "kvdex's own decode over the block table" in caplog.text
    caplog.clear()
    assert kernels.flash_decode("cpu", kernels.Probe(head_dim=64, dtype=torch.float32)) is not None
    assert caplog.text == ""


def test_flash_decode_that_differs_from_the_reference_is_refused(fa_utils, caplog):
    fa_utils.flash_attn_varlen_func = _reference_varlen([], skew=0.5)
    with caplog.at_level(logging.WARNING, logger="kvdex.vllm.kernels"):
        assert kernels.flash_decode("cpu", kernels.Probe(dtype=torch.float32)) is None
    assert "differs from kvdex's reference by 0.5" in caplog.text


def test_cache_write_is_checked_on_the_engines_shape(fa_utils, caplog):
    assert kernels.vllm_cache_write("cpu", kernels.Probe(kv_heads=4, head_dim=32, dtype=torch.float32)) is not None
    fa_utils.reshape_and_cache_flash = lambda k, v, kc, vc, slots, dtype, ks, vs: write_kv(kc, vc, slots, v, k)
    with caplog.at_level(logging.WARNING, logger="kvdex.vllm.kernels"):
        assert kernels.vllm_cache_write("cpu", kernels.Probe(dtype=torch.float32)) is None
    assert "does not write what kvdex's does" in caplog.text


def test_without_vllm_nothing_is_taken(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm... raises ImportError
    with caplog.at_level(logging.WARNING, logger="kvdex.vllm.kernels"):
        assert kernels.flash_decode("cpu") is None and kernels.flash_prefill() is None
    assert "not importable" in caplog.text
