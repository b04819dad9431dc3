"""kvdex as a vLLM attention backend: ``KvdexBackend`` (registered as vLLM's ``CUSTOM`` backend by
:func:`kvdex.vllm.plugin.register`), its metadata builder and its attention implementation.

This module imports vLLM (at import time: vLLM imports it by the path the plugin registers); everything it runs
is in torch-only modules: the settings (:mod:`kvdex.vllm.config`), the layout (:mod:`kvdex.vllm.paged`), the
request states (:mod:`kvdex.vllm.requests`) and the per-layer forward (:mod:`kvdex.vllm.forward`).

* :class:`KvdexMetadataBuilder` runs once per engine step: it maps the batch's rows to the requests' kvdex states
  (:meth:`RequestTable.plan <kvdex.vllm.requests.RequestTable.plan>`) and hands them to every layer in
  :class:`KvdexMetadata`. Its CUDA-graph support is ``NEVER``: vLLM runs kvdex's attention eagerly, between the
  pieces of its piecewise CUDA graphs (the rest of the model stays captured);
* :class:`KvdexImpl` runs one layer: the step's keys and values are written into the layer's cache at the slot
  mapping, then each request prefills densely or decodes over its policy's selection;
* the KV cache layout is :func:`kvdex.vllm.paged.kv_cache_shape`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdex.vllm.config import settings_from
from kvdex.vllm.forward import CacheWrite, PrefillAttention, forward_layer
from kvdex.vllm.paged import (
    PAD_SLOT_ID,
    PagedDecode,
    check_block_size,
    decode_attention_reference,
    kv_cache_shape,
    split_kv,
    write_kv,
)
from kvdex.vllm.requests import RequestState, RequestTable, Row, geometry_of

# vLLM's attention interfaces: vllm.v1.attention.backend in recent vLLM, earlier spread over these modules
_INTERFACES = ("vllm.v1.attention.backend", "vllm.attention.backends.abstract", "vllm.v1.attention.backends.utils")


def _interface(name: str) -> Any:
    """vLLM's class ``name`` from the first module of :data:`_INTERFACES` that has it."""
    for module in _INTERFACES:
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(found, name):
            return getattr(found, name)
    raise ImportError(f"vLLM has no {name} in {', '.join(_INTERFACES)}: kvdex's vLLM backend needs vllm>=0.26")


AttentionBackend: Any = _interface("AttentionBackend")
AttentionImpl: Any = _interface("AttentionImpl")
AttentionMetadataBuilder: Any = _interface("AttentionMetadataBuilder")
AttentionCGSupport: Any = _interface("AttentionCGSupport")

NAME = "CUSTOM"  # the registry member the plugin registers (vllm serve --attention-backend CUSTOM)
NULL_BLOCK = 0  # vLLM's block pool keeps block 0 as its null block: no request's row starts with it


@dataclass
class KvdexMetadata:
    """One step's metadata, shared by every layer of the KV-cache group: the requests' rows (each with its kvdex
    state) and vLLM's per-token slot mapping, plus the fields vLLM's own metadata carries."""

    rows: list[Row]
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    max_query_len: int = 0
    max_seq_len: int = 0
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    causal: Any = True  # bool, or a per-request tensor in recent vLLM (kvdex attends causally)
    prefill: PrefillAttention | None = None  # prompt chunks' attention (None: kvdex's PyTorch path)
    write: CacheWrite | None = None  # the step's cache write (None: kvdex's PyTorch path)
    extra: dict[str, Any] = field(default_factory=dict)


def _fa_version(fa_utils: Any) -> Callable[[int], dict[str, int]]:
    """``head_size -> {"fa_version": v}`` (or ``{}`` where vLLM leaves it to the kernel), looked up once per head
    size: the keyword vLLM's FlashAttention calls take."""
    versions: dict[int, int | None] = {}

    def version(d: int) -> dict[str, int]:
        if d not in versions:
            versions[d] = fa_utils.get_flash_attn_version(head_size=d)
        v = versions[d]
        return {} if v is None else {"fa_version": v}

    return version


def flash_prefill() -> PrefillAttention | None:
    """vLLM's FlashAttention (its varlen kernel, straight on the paged cache through the block table) as the
    attention of prompt chunks, with the contract of :func:`~kvdex.vllm.paged.prefill_attention_reference`; None
    where this vLLM or platform has no such kernel."""
    try:
        from vllm.v1.attention.backends import fa_utils
    except ImportError:
        return None
    if not fa_utils.is_flash_attn_varlen_func_available():
        return None
    version = _fa_version(fa_utils)

    def prefill(q: torch.Tensor, blocks: torch.Tensor, seq_len: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scale: float) -> torch.Tensor:  # fmt: skip
        n = q.shape[0]
        out = torch.empty_like(q)
        fa_utils.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, max_seqlen_q=n, max_seqlen_k=seq_len, softmax_scale=scale,
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=q.device),
            seqused_k=torch.tensor([seq_len], dtype=torch.int32, device=q.device),
            causal=True, block_table=blocks[None].to(device=q.device, dtype=torch.int32), **version(q.shape[-1]),
        )  # fmt: skip
        return out

    return prefill


def flash_decode(device: torch.device | str) -> PagedDecode | None:
    """vLLM's FlashAttention (its varlen kernel on the paged cache) as the dense decode of a request's layer
    (:meth:`PagedStore.dense_decode <kvdex.vllm.store.PagedStore.dense_decode>`: every token read in place, none
    gathered), with the contract of :func:`~kvdex.vllm.paged.decode_attention_reference`: the length a device
    tensor and the bound a host int, so a decode graph captures it; None where this vLLM has no such kernel, or
    where it does not compute the reference on a small cache of ``device`` (checked once, here)."""
    try:
        from vllm.v1.attention.backends import fa_utils
    except ImportError:
        return None
    if not fa_utils.is_flash_attn_varlen_func_available():
        return None
    first = torch.tensor([0, 1], dtype=torch.int32, device=device)  # cu_seqlens_q of one query, made once
    version = _fa_version(fa_utils)

    def decode(q: torch.Tensor, blocks: torch.Tensor, lengths: torch.Tensor, capacity: int, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(q)
        fa_utils.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, max_seqlen_q=1, max_seqlen_k=capacity, softmax_scale=scale,
            cu_seqlens_q=first, seqused_k=lengths.to(torch.int32), causal=False,
            block_table=blocks[None].to(torch.int32), **version(q.shape[-1]),
        )  # fmt: skip
        return out

    g = torch.Generator(device="cpu").manual_seed(0)
    kc, vc = (torch.randn(8, 16, 2, 64, generator=g).to(device, torch.bfloat16) for _ in range(2))
    q = torch.randn(1, 8, 64, generator=g).to(device, torch.bfloat16)
    blocks, lengths = torch.tensor([5, 2, 7, 0], device=device), torch.tensor([37], device=device)
    want = decode_attention_reference(q, blocks, lengths, 64, kc, vc, 0.125)
    try:
        got = decode(q, blocks, lengths, 64, kc, vc, 0.125)
    except Exception:  # another signature in this vLLM: kvdex's gather and kernel
        return None
    return decode if torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2) else None


def vllm_cache_write(device: torch.device | str) -> CacheWrite | None:
    """vLLM's own cache-write kernel (``reshape_and_cache_flash``: keys and values in one launch, padding slots
    skipped, nothing read back to the host) as the step's cache write, with the contract of
    :func:`~kvdex.vllm.paged.write_kv`; None where this vLLM has none, or where it does not write what
    :func:`~kvdex.vllm.paged.write_kv` writes on a small cache of ``device`` (checked once, here)."""
    try:
        from vllm.v1.attention.backends import fa_utils

        op = fa_utils.reshape_and_cache_flash
    except (ImportError, AttributeError):
        return None
    one = torch.ones((), dtype=torch.float32, device=device)  # the fp8 scales, unused for a bf16 / fp16 cache

    def write(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:  # fmt: skip
        op(key, value, k_cache, v_cache, slots, "auto", one, one)

    g = torch.Generator(device="cpu").manual_seed(0)
    kc, vc = (torch.randn(4, 16, 2, 64, generator=g).to(device, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(3, 2, 64, generator=g).to(device, torch.bfloat16) for _ in range(2))
    slots = torch.tensor([5, PAD_SLOT_ID, 37], device=device)
    want_k, want_v = kc.clone(), vc.clone()
    write_kv(want_k, want_v, slots, k, v)
    try:
        write(kc, vc, slots, k, v)
    except Exception:  # another signature in this vLLM: kvdex's own write
        return None
    return write if torch.equal(kc, want_k) and torch.equal(vc, want_v) else None


class KvdexMetadataBuilder(AttentionMetadataBuilder):
    """Maps each step's batch to the requests' kvdex states (one :class:`RequestTable` per KV-cache group)."""

    _cudagraph_support = AttentionCGSupport.NEVER
    cudagraph_support = AttentionCGSupport.NEVER  # the attribute's name in earlier vLLM
    reorder_batch_threshold = None

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        try:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        except TypeError:  # an ABC whose __init__ takes other arguments
            pass
        self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (
            kv_cache_spec, layer_names, vllm_config, device,
        )  # fmt: skip
        self.settings = settings_from(getattr(vllm_config, "additional_config", None))
        pp = int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) or 1)
        if pp > 1:
            raise NotImplementedError("kvdex's vLLM backend runs every layer of a request in one process: "
                                      "pipeline parallelism is not supported (tensor parallelism is)")  # fmt: skip
        check_block_size(int(kv_cache_spec.block_size), self.settings.config.page_size)
        self.geometry = geometry_of(vllm_config, kv_cache_spec)
        settings, geometry = self.settings, self.geometry
        self.prefill = None
        if settings.prefill_attention == "flash":
            self.prefill = flash_prefill() if torch.device(device).type == "cuda" else None
            if self.prefill is None:
                raise ValueError("kvdex setting prefill_attention=flash needs vLLM's FlashAttention varlen kernel, "
                                 "which this vLLM or device does not have: use prefill_attention=torch")  # fmt: skip
        cuda = torch.device(device).type == "cuda"
        self.write = vllm_cache_write(device) if cuda else None
        decode = flash_decode(device) if cuda else None
        self.table = RequestTable(
            lambda caches: RequestState(settings, geometry, caches=caches, decode=decode),
            geometry.block_size, settings.max_idle_steps,
        )  # fmt: skip

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> KvdexMetadata:
        cm = common_attn_metadata
        n = int(cm.num_reqs)
        qsl = cm.query_start_loc_cpu[: n + 1]
        seq_lens = cm.seq_lens[:n].cpu()  # exact lengths (a host copy; the CPU mirror may be an upper bound)
        prefilling = getattr(cm, "is_prefilling", None)  # recent vLLM: requests with prompt tokens left
        prefilling = None if prefilling is None else prefilling[:n].cpu()
        rows = self.table.plan(qsl, seq_lens, cm.block_table_tensor[:n], prefilling, null_block=NULL_BLOCK)
        return KvdexMetadata(
            rows=rows, num_actual_tokens=int(cm.num_actual_tokens), slot_mapping=cm.slot_mapping,
            max_query_len=int(cm.max_query_len), max_seq_len=int(cm.max_seq_len), query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens, block_table=cm.block_table_tensor, causal=getattr(cm, "causal", True),
            prefill=self.prefill, write=self.write,
        )  # fmt: skip

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> KvdexMetadata:
        """A dummy run's metadata (vLLM's warm-up and capture runs): no request, so the layers do nothing (kvdex's
        attention is never captured: CUDA-graph support NEVER)."""
        cm = common_attn_metadata
        return KvdexMetadata(rows=[], num_actual_tokens=int(cm.num_actual_tokens), slot_mapping=cm.slot_mapping)


_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """The model's layer number in a vLLM layer name (``model.layers.12.self_attn.attn`` -> 12)."""
    found = _LAYER.findall(name)
    if not found:
        raise ValueError(f"no layer number in the attention layer name {name!r}")
    return int(found[-1])


class KvdexImpl(AttentionImpl):
    """One attention layer through kvdex (decoder self-attention; the other variants are refused)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.num_heads, self.head_size, self.scale = int(num_heads), int(head_size), float(scale)
        self.num_kv_heads = int(num_kv_heads or num_heads)
        self.kv_cache_dtype = kv_cache_dtype
        refused = {
            "ALiBi": alibi_slopes is not None,
            "a sliding window": sliding_window not in (None, -1, (-1, -1)),
            "logits soft-capping": bool(logits_soft_cap),
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": str(getattr(attn_type, "value", attn_type)) != "decoder",
            f"kv_cache_dtype={kv_cache_dtype}": not str(kv_cache_dtype).startswith(("auto", "float16", "bfloat16")),
        }
        bad = [what for what, on in refused.items() if on]
        if bad:
            raise NotImplementedError(f"kvdex's vLLM backend does not support {', '.join(bad)}")
        self._layers: dict[str, int] = {}

    def layer_of(self, layer: Any) -> int:
        name = str(getattr(layer, "layer_name", ""))
        if name not in self._layers:
            self._layers[name] = layer_index(name)
        return self._layers[name]

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvdex's vLLM backend does not fuse output quantization")
        if output is None:
            width = self.num_heads * self.head_size
            output = torch.zeros(query.shape[0], width, dtype=query.dtype, device=query.device)
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata.get(getattr(layer, "layer_name", ""))
        if attn_metadata is None or not attn_metadata.rows:  # vLLM's profiling and dummy runs: no request
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        out = output.view(-1, self.num_heads, self.head_size)
        q = query.view(-1, self.num_heads, self.head_size)[:n]
        k = key.view(-1, self.num_kv_heads, self.head_size)[:n]
        v = value.view(-1, self.num_kv_heads, self.head_size)[:n]
        k_cache, v_cache = split_kv(kv_cache)
        slots = attn_metadata.slot_mapping[:n]
        forward_layer(attn_metadata.rows, self.layer_of(layer), q, k, v, k_cache, v_cache, slots, self.scale, out[:n],
                      prefill=attn_metadata.prefill, write=attn_metadata.write)  # fmt: skip
        return output

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The cache write alone (for a vLLM that asks for it separately; ``forward`` writes too, the same rows)."""
        k_cache, v_cache = split_kv(kv_cache)
        n = slot_mapping.shape[0]
        shape = (-1, self.num_kv_heads, self.head_size)
        write_kv(k_cache, v_cache, slot_mapping, key.view(shape)[:n], value.view(shape)[:n])


class KvdexBackend(AttentionBackend):
    """kvdex's sparse decoding over vLLM's paged KV cache (``--attention-backend CUSTOM``)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[KvdexImpl]:
        return KvdexImpl

    @staticmethod
    def get_builder_cls() -> type[KvdexMetadataBuilder]:
        return KvdexMetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type[KvdexMetadata]:
        return KvdexMetadata

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return list(cls.supported_dtypes)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: kvdex's kernels take any

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True
