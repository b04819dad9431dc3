"""kvdex's vLLM backend classes (``kvdex/vllm/backend.py``) without vLLM: the module is imported against a stub of
vLLM's attention interfaces, then driven as vLLM's model runner drives it -- the metadata builder once per step,
the implementation once per layer with vLLM's tensor shapes (flat tokens, a 2-D output buffer, the backend's KV
cache layout) -- and its outputs compared with dense causal attention at a budget covering the context. Also:
vLLM's profiling call (no metadata), the settings' and the layer's refusals."""

from __future__ import annotations

import enum
import importlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from vllm_sim import HQ, LAYERS, PS, SCALE, D, H


@pytest.fixture
def backend(monkeypatch):
    """kvdex.vllm.backend imported against stub vLLM modules (removed again afterwards)."""

    class AttentionCGSupport(enum.Enum):
        NEVER = 0
        ALWAYS = 3

    class AttentionMetadataBuilder:
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.kv_cache_spec = kv_cache_spec

    stub = types.ModuleType("vllm.v1.attention.backend")
    stub.__dict__.update(
        AttentionBackend=type("AttentionBackend", (), {}),
        AttentionImpl=type("AttentionImpl", (), {}),
        AttentionMetadataBuilder=AttentionMetadataBuilder,
        AttentionCGSupport=AttentionCGSupport,
    )
    for name in ("vllm", "vllm.v1", "vllm.v1.attention"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backend", stub)
    sys.modules.pop("kvdex.vllm.backend", None)
    try:
        yield importlib.import_module("kvdex.vllm.backend")
    finally:
        sys.modules.pop("kvdex.vllm.backend", None)


def vllm_config(kvdex: dict, pp: int = 1) -> SimpleNamespace:
    model = SimpleNamespace(
        get_num_attention_heads=lambda pc: HQ, get_num_kv_heads=lambda pc: H, get_head_size=lambda: D,
        hf_text_config=SimpleNamespace(num_hidden_layers=LAYERS), get_num_layers=lambda pc: LAYERS,
    )  # fmt: skip
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
                           additional_config={"kvdex": kvdex})  # fmt: skip


SPEC = SimpleNamespace(block_size=PS, num_kv_heads=H, head_size=D)
SIZES = {"budget": 1024, "page_size": PS, "sink": 16, "window": 32, "dense_layers": 1}


@pytest.mark.parametrize("policy", ["quest", "full"])
def test_a_batch_through_the_backend_is_dense_attention(backend, policy):
    """Two requests (prompts of 70 and 40 tokens, then 20 decode steps each) through the builder and the
    implementation, each step's rows reversed; every output equals dense causal attention. ``full`` keeps no
    per-request state: each step is one batched attention over the blocks (forward_dense)."""
    kb = backend.KvdexBackend
    assert kb.get_name() == "CUSTOM" and kb.get_builder_cls() is backend.KvdexMetadataBuilder
    builder = kb.get_builder_cls()(SPEC, ["model.layers.0.self_attn.attn"], vllm_config({"policy": policy, **SIZES}),
                                   torch.device("cpu"))  # fmt: skip
    assert builder.dense == (policy == "full")
    impl = kb.get_impl_cls()(HQ, D, SCALE, H)
    caches = [torch.zeros(kb.get_kv_cache_shape(32, PS, H, D)) for _ in range(LAYERS)]
    layers = [SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn") for i in range(LAYERS)]
    g = torch.Generator().manual_seed(0)
    n_tok = {"a": 90, "b": 60}
    qkv = {r: [torch.randn(n, HQ + 2 * H, D, generator=g) for _ in range(LAYERS)] for r, n in n_tok.items()}
    blocks = {"a": [5, 9, 2, 7, 11, 3], "b": [4, 1, 8, 12]}  # no request is given block 0 (vLLM's null block)
    done = {"a": 0, "b": 0}
    steps = [{"a": 70, "b": 40}] + [{"a": 1, "b": 1}] * 20
    got = {r: torch.full((LAYERS, n, HQ, D), float("nan")) for r, n in n_tok.items()}
    for i, step in enumerate(steps):
        order = list(step) if i % 2 == 0 else list(step)[::-1]
        starts = [0]
        for r in order:
            starts.append(starts[-1] + step[r])
        seq = [done[r] + step[r] for r in order]
        table = torch.tensor([blocks[r] + [0] * (6 - len(blocks[r])) for r in order])
        slots = torch.cat([torch.tensor(blocks[r])[torch.arange(done[r], done[r] + step[r]) // PS] * PS
                           + torch.arange(done[r], done[r] + step[r]) % PS for r in order])  # fmt: skip
        cm = SimpleNamespace(
            num_reqs=len(order), query_start_loc_cpu=torch.tensor(starts), query_start_loc=None,
            seq_lens=torch.tensor(seq), block_table_tensor=table, slot_mapping=slots, num_actual_tokens=starts[-1],
            max_query_len=max(step.values()), max_seq_len=max(seq),
        )  # fmt: skip
        meta = builder.build(0, cm)
        for lay in range(LAYERS):
            x = torch.cat([qkv[r][lay][done[r] : done[r] + step[r]] for r in order])
            q, k, v = x[:, :HQ], x[:, HQ : HQ + H], x[:, HQ + H :]
            out = torch.full((starts[-1] + 3, HQ * D), float("nan"))  # padded past the real tokens, as vLLM pads
            pad = torch.zeros(3, HQ + 2 * H, D)
            qp, kp, vp = (torch.cat([t, pad[:, : t.shape[1]]]) for t in (q, k, v))
            impl.forward(layers[lay], qp.flatten(1), kp.flatten(1), vp.flatten(1), caches[lay], meta, output=out)
            for j, r in enumerate(order):
                got[r][lay, done[r] : done[r] + step[r]] = out[starts[j] : starts[j + 1]].view(-1, HQ, D)
        for r in order:
            done[r] += step[r]
    assert (len(builder.table), builder.table.made) == ((0, 0) if policy == "full" else (2, 2))
    for r, n in done.items():  # dense causal attention over each request's tokens
        for lay in range(LAYERS):
            x = qkv[r][lay][:n]
            k, v = (t.repeat_interleave(HQ // H, 1) for t in (x[:, HQ : HQ + H], x[:, HQ + H :]))
            s = torch.einsum("qhd,khd->hqk", x[:, :HQ], k) * SCALE
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
            assert torch.allclose(got[r][lay, :n], want, atol=2e-5), (r, lay)


def test_profiling_calls_and_refusals(backend):
    impl = backend.KvdexImpl(HQ, D, SCALE, H)
    out = torch.full((4, HQ * D), 7.0)
    cache = torch.zeros(backend.KvdexBackend.get_kv_cache_shape(4, PS, H, D))
    x = torch.zeros(4, HQ * D)
    assert impl.forward(SimpleNamespace(layer_name="model.layers.0.attn"), x, x, x, cache, None, output=out).eq(0).all()
    with pytest.raises(NotImplementedError, match="sliding window"):
        backend.KvdexImpl(HQ, D, SCALE, H, sliding_window=128)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype=fp8"):
        backend.KvdexImpl(HQ, D, SCALE, H, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="--block-size 16"):
        backend.KvdexMetadataBuilder(SimpleNamespace(block_size=32, num_kv_heads=H, head_size=D),
                                     [], vllm_config({"budget": 512}), torch.device("cpu"))  # fmt: skip
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        backend.KvdexMetadataBuilder(SPEC, [], vllm_config({}, pp=2), torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown policy"):
        backend.KvdexMetadataBuilder(SPEC, [], vllm_config({"policy": "nope"}), torch.device("cpu"))
    assert backend.layer_index("model.layers.12.self_attn.attn") == 12
