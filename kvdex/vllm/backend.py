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
  mapping, then each request prefills densely or decodes over its policy's selection (a policy that attends
  every token, ``full``: the whole batch in one attention call, no per-request state, ``forward_dense``);
* the KV cache layout is :func:`kvdex.vllm.paged.kv_cache_shape`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdex.vllm.config import settings_from
from kvdex.vllm.forward import CacheWrite, PrefillAttention, forward_dense, forward_layer
from kvdex.vllm.kernels import Probe, flash_batch, flash_decode, flash_prefill, vllm_cache_write
from kvdex.vllm.paged import BatchAttention, DenseBatch, check_block_size, kv_cache_shape, split_kv, write_kv
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
    dense: DenseBatch | None = None  # a policy that attends every token: the whole batch, no rows (forward_dense)
    attend: BatchAttention | None = None  # the dense batch's attention (None: kvdex's PyTorch path)
    extra: dict[str, Any] = field(default_factory=dict)


def cache_dtype(vllm_config: Any, kv_cache_spec: Any) -> torch.dtype:
    """The KV cache's dtype: the KV-cache spec's, else the model's (bf16 where neither says)."""
    model = getattr(vllm_config, "model_config", None)
    for d in (getattr(kv_cache_spec, "dtype", None), getattr(model, "dtype", None)):
        if isinstance(d, torch.dtype):
            return d
    return torch.bfloat16


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
        probe = Probe(geometry.q_heads, geometry.kv_heads, geometry.head_dim, geometry.block_size,
                      cache_dtype(vllm_config, kv_cache_spec))  # fmt: skip
        self.write = vllm_cache_write(device, probe) if cuda else None
        # a policy that attends every token (full) needs no per-request state: the whole batch in one call, with
        # vLLM's FlashAttention on CUDA (where it is refused there, the requests run one by one, as other policies)
        everything = not settings.make_policy().uses_budget
        self.attend = flash_batch(device, probe) if cuda and everything else None
        self.dense = everything and (self.attend is not None or not cuda)
        decode = flash_decode(device, probe) if cuda and not self.dense else None
        self.table = RequestTable(
            lambda caches: RequestState(settings, geometry, caches=caches, decode=decode),
            geometry.block_size, settings.max_idle_steps,
        )  # fmt: skip

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> KvdexMetadata:
        cm = common_attn_metadata
        n = int(cm.num_reqs)
        if self.dense:
            return self._dense(cm, n)
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

    def _dense(self, cm: Any, n: int) -> KvdexMetadata:
        """A dense policy's step: vLLM's own batch tensors (on the device, as its FlashAttention takes them)."""
        qsl = cm.query_start_loc if cm.query_start_loc is not None else cm.query_start_loc_cpu
        qsl, lens, table = (x.to(device=self.device, dtype=torch.int32)
                            for x in (qsl[: n + 1], cm.seq_lens[:n], cm.block_table_tensor[:n]))  # fmt: skip
        batch = DenseBatch(qsl, lens, table, int(cm.max_query_len), int(cm.max_seq_len))
        return KvdexMetadata(
            rows=[], num_actual_tokens=int(cm.num_actual_tokens), slot_mapping=cm.slot_mapping,
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, query_start_loc=qsl,
            seq_lens=cm.seq_lens, block_table=cm.block_table_tensor, write=self.write, dense=batch, attend=self.attend,
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
        dense = None if attn_metadata is None else attn_metadata.dense
        if attn_metadata is None or not (attn_metadata.rows or dense):  # vLLM's profiling and dummy runs
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        out = output.view(-1, self.num_heads, self.head_size)
        q = query.view(-1, self.num_heads, self.head_size)[:n]
        k = key.view(-1, self.num_kv_heads, self.head_size)[:n]
        v = value.view(-1, self.num_kv_heads, self.head_size)[:n]
        k_cache, v_cache = split_kv(kv_cache)
        slots = attn_metadata.slot_mapping[:n]
        if dense is not None:
            forward_dense(dense, q, k, v, k_cache, v_cache, slots, self.scale, out[:n], attend=attn_metadata.attend,
                          write=attn_metadata.write)  # fmt: skip
            return output
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
