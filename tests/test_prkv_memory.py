"""Prefill memory of ``prkv`` and ``arkvale``: what they keep beyond the KV stays a small share of it.

The prefill's peak of live tensor bytes is counted op by op (every storage an op returns, until it
is freed) for ``full`` and for the policy on the same prompt; the policy's extra peak must stay
under a fifth of the KV bytes. That holds the digests (fp32, a centre and a radius per page: 1/8 of
the KV bytes of a bf16 model with 16-token pages; here fp32, but the index's capacity rounds up to
256 pages, 4096 tokens) and the observation rows (64 per layer); it fails for anything that keeps a
layer-sized tensor per sparse layer -- as PRKV once did with the prompt's whole queries (twice the
KV bytes with 4 query heads per kv head, the Llama-3.1-8B ratio), which the last test reproduces.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import FAMILIES, make_config, prompt
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kvdex
from kvdex.policies import make_policy
from kvdex.policies.prkv import PRKVPolicy

# 16 query / 4 kv heads of dim 16 (the 4:1 group of Llama-3.1-8B), 4 layers, all sparse
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, head_dim=16, max_position_embeddings=4096)  # fmt: skip
N = 3072  # prompt tokens
LIMIT = 0.2  # extra peak / KV bytes (measured: 0.13 for prkv)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops returned while active and that are still alive."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = self.peak = 0

    def _drop(self, key: int) -> None:
        self.live -= self.alive.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.alive.items() if ref.expired()]:
            self._drop(key)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                if s.data_ptr() and s.data_ptr() not in self.alive:
                    self.alive[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
                    self.live += s.nbytes()
        self.peak = max(self.peak, self.live)
        return out


@pytest.fixture(scope="module")
def model():
    _, model_cls, fam = FAMILIES["llama_gqa"]
    torch.manual_seed(0)
    m = model_cls(make_config("llama_gqa", **SHAPE)).eval()
    kvdex.enable(m)
    return m


def prefill_peak(model, policy) -> tuple[int, int]:
    """(peak live bytes during the prefill of N tokens, KV bytes)."""
    gc.collect()
    cache = kvdex.Cache(model, policy, budget=256, dense_layers=0)
    meter = LiveBytes()
    with torch.no_grad(), meter:
        model(prompt(N, 0), **kvdex.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * N * 4  # fp32
    return meter.peak, kv


@pytest.fixture(scope="module")
def full_peak(model):
    return prefill_peak(model, "full")[0]


@pytest.mark.parametrize(
    "policy", ["prkv", "prkv:static_ratio=auto", "prkv:static_ratio=1.0", "arkvale", "snapkv", "h2o"]
)
def test_prefill_peak_is_near_full(model, full_peak, policy):
    peak, kv = prefill_peak(model, policy)
    assert peak - full_peak <= LIMIT * kv, f"{policy}: {(peak - full_peak) / kv:.2f}x the KV bytes over full's peak"


class _KeepsUpdate(PRKVPolicy):
    """PRKV keeping the whole prefill update until decoding (what it did before keeping the rows only)."""

    def index(self, layer, update) -> None:
        super().index(layer, update)
        if update.obs_queries is not None:
            self.schedule.pending[layer] = update


def test_the_meter_sees_kept_prompt_queries(model, full_peak):
    peak, kv = prefill_peak(model, make_policy(_KeepsUpdate()))
    assert peak - full_peak > 1.5 * kv  # 4 layers x [16 heads, N, 16] fp32 = 2x the KV bytes
