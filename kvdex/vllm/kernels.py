"""vLLM's own kernels that kvdex's backend calls in place of its PyTorch forms, each checked once when the engine
starts, on a small cache of the engine's own shape (its heads, head size, block size and dtype):

* :func:`flash_prefill`: vLLM's FlashAttention for prompt chunks, straight on the paged cache
  (:func:`~kvdex.vllm.paged.prefill_attention_reference` is its PyTorch form);
* :func:`flash_decode`: vLLM's FlashAttention as the decode of a layer that attends every token, in place over the
  request's blocks (:func:`~kvdex.vllm.paged.decode_attention_reference`);
* :func:`flash_batch`: vLLM's FlashAttention over a whole step's batch, for a policy that attends every token
  (:func:`~kvdex.vllm.paged.batch_attention_reference`);
* :func:`vllm_cache_write`: vLLM's cache write, one launch (:func:`~kvdex.vllm.paged.write_kv`).

A kernel this vLLM lacks, or one that does not compute its PyTorch form on the check's cache, is not used, and the
reason is logged once (a warning): kvdex then runs its own path (a decode that attends every token: kvdex's Triton
decode over the block table on CUDA, :func:`~kvdex.kernels.triton_attention.block_table_decode_attention`).

vLLM is imported inside each function, so this module imports without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvdex.vllm.forward import CacheWrite, PrefillAttention
from kvdex.vllm.paged import (
    PAD_SLOT_ID,
    BatchAttention,
    DenseBatch,
    PagedDecode,
    batch_attention_reference,
    decode_attention_reference,
    write_kv,
)

log = logging.getLogger(__name__)
# what runs instead of a refused FlashAttention decode (kvdex.vllm.store.PagedStore.dense_decode)
_OWN_DECODE = "layers that attend every token run kvdex's own decode over the block table instead"
# what runs instead of a refused batched FlashAttention (kvdex.vllm.backend: a policy that attends every token)
_OWN_BATCH = "the policy's requests run one by one through kvdex's engine instead"


@dataclass(frozen=True)
class Probe:
    """The shape of the cache the kernels are checked on: this engine's query and kv heads per process, head size,
    block size and dtype (the defaults: a small stand-in)."""

    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


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


def _fa_utils() -> Any | None:
    """vLLM's FlashAttention helpers, or None (with the reason logged) where this vLLM or platform has none."""
    try:
        from vllm.v1.attention.backends import fa_utils
    except ImportError as e:
        log.warning("kvdex: vLLM's FlashAttention is not importable here (%s): kvdex's own kernels run instead", e)
        return None
    if not fa_utils.is_flash_attn_varlen_func_available():
        log.warning("kvdex: this vLLM has no FlashAttention varlen kernel on this platform: kvdex's kernels run")
        return None
    return fa_utils


def _probe_cache(p: Probe, device: torch.device | str, queries: int) -> tuple[torch.Tensor, ...]:
    """``(q [queries, Hq, D], k_cache, v_cache [8 blocks])``: random (seeded) tensors of ``p``'s shape on
    ``device``, the small cache a kernel is checked on."""
    g = torch.Generator(device="cpu").manual_seed(0)
    kc, vc = (torch.randn(8, p.block_size, p.kv_heads, p.head_dim, generator=g).to(device, p.dtype) for _ in "kv")
    return torch.randn(queries, p.q_heads, p.head_dim, generator=g).to(device, p.dtype), kc, vc


def _computes(kernel: str, probe: str, run: Callable[[], torch.Tensor], want: torch.Tensor, instead: str) -> bool:
    """Whether ``run()`` (vLLM's ``kernel`` on ``probe``, a small stand-in of this engine's shape) computes ``want``
    (its PyTorch form); where it fails or differs, a warning says so and what runs ``instead``."""
    try:
        got = run()
    except Exception as e:  # another signature in this vLLM, or a shape its build leaves out
        log.warning("kvdex: vLLM's %s failed on %s of this engine's shape (%s: %s); %s", kernel, probe,
                    type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "", instead)  # fmt: skip
        return False
    if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
        err = (got.float() - want.float()).abs().max().item()
        log.warning("kvdex: vLLM's %s differs from kvdex's reference by %.3g on %s of this engine's shape; %s",
                    kernel, err, probe, instead)  # fmt: skip
        return False
    return True


def flash_prefill() -> PrefillAttention | None:
    """vLLM's FlashAttention (its varlen kernel, straight on the paged cache through the block table) as the
    attention of prompt chunks, with the contract of :func:`~kvdex.vllm.paged.prefill_attention_reference`; None
    where this vLLM or platform has no such kernel."""
    fa_utils = _fa_utils()
    if fa_utils is None:
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


def flash_decode(device: torch.device | str, probe: Probe | None = None) -> PagedDecode | None:
    """vLLM's FlashAttention (its varlen kernel on the paged cache) as the dense decode of a request's layer
    (:meth:`PagedStore.dense_decode <kvdex.vllm.store.PagedStore.dense_decode>`: every token read in place, none
    gathered), with the contract of :func:`~kvdex.vllm.paged.decode_attention_reference`: the length a device
    tensor and the bound a host int, so a decode graph captures it. None, with the reason logged, where this vLLM
    has no such kernel, or where the kernel fails or does not compute the reference on a small cache of
    ``device`` shaped as ``probe`` says (checked once, here)."""
    fa_utils = _fa_utils()
    if fa_utils is None:
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

    p = probe or Probe()
    bs, scale = p.block_size, p.head_dim**-0.5
    q, kc, vc = _probe_cache(p, device, 1)
    blocks, lengths = torch.tensor([5, 2, 7, 1], device=device), torch.tensor([2 * bs + 5], device=device)
    want = decode_attention_reference(q, blocks, lengths, 4 * bs, kc, vc, scale)

    def run() -> torch.Tensor:
        return decode(q, blocks, lengths, 4 * bs, kc, vc, scale)

    return decode if _computes("FlashAttention decode", "a cache", run, want, _OWN_DECODE) else None


def flash_batch(device: torch.device | str, probe: Probe | None = None) -> BatchAttention | None:
    """vLLM's FlashAttention varlen kernel over a whole step's batch on the paged cache (prompt chunks and decode
    tokens alike, each request's queries causal over its tokens), with the contract of
    :func:`~kvdex.vllm.paged.batch_attention_reference`: what vLLM's own backend runs, for a policy that attends
    every token. None, with the reason logged, where this vLLM has no such kernel or where it does not compute the
    reference on a small two-request cache of ``device`` shaped as ``probe`` says (checked once, here)."""
    fa_utils = _fa_utils()
    if fa_utils is None:
        return None
    version = _fa_version(fa_utils)

    def attend(q: torch.Tensor, batch: DenseBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               out: torch.Tensor) -> None:  # fmt: skip
        fa_utils.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, max_seqlen_q=batch.max_query_len, max_seqlen_k=batch.max_seq_len,
            softmax_scale=scale, cu_seqlens_q=batch.query_start_loc, seqused_k=batch.seq_lens, causal=True,
            block_table=batch.block_table, **version(q.shape[-1]),
        )  # fmt: skip

    p = probe or Probe()
    bs, scale = p.block_size, p.head_dim**-0.5
    q, kc, vc = _probe_cache(p, device, 4)  # 1 decode token, a 3-token chunk
    qsl, lens, table = (torch.tensor(x, dtype=torch.int32, device=device)
                        for x in ([0, 1, 4], [2 * bs + 5, bs + 3], [[5, 2, 7], [1, 6, 0]]))  # fmt: skip
    batch = DenseBatch(qsl, lens, table, 3, 2 * bs + 5)
    want, got = torch.zeros_like(q), torch.zeros_like(q)
    batch_attention_reference(q, batch, kc, vc, scale, want)

    def run() -> torch.Tensor:
        attend(q, batch, kc, vc, scale, got)
        return got

    return attend if _computes("FlashAttention", "a batch", run, want, _OWN_BATCH) else None


def vllm_cache_write(device: torch.device | str, probe: Probe | None = None) -> CacheWrite | None:
    """vLLM's own cache-write kernel (``reshape_and_cache_flash``: keys and values in one launch, padding slots
    skipped, nothing read back to the host) as the step's cache write, with the contract of
    :func:`~kvdex.vllm.paged.write_kv`; None (the reason logged) where this vLLM has none, or where it does not
    write what :func:`~kvdex.vllm.paged.write_kv` writes on a small cache of ``device`` shaped as ``probe`` says
    (checked once, here)."""
    try:
        from vllm.v1.attention.backends import fa_utils

        op = fa_utils.reshape_and_cache_flash
    except (ImportError, AttributeError):
        log.warning("kvdex: this vLLM has no reshape_and_cache_flash: kvdex writes the step's keys and values")
        return None
    one = torch.ones((), dtype=torch.float32, device=device)  # the fp8 scales, unused for a bf16 / fp16 cache

    def write(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:  # fmt: skip
        op(key, value, k_cache, v_cache, slots, "auto", one, one)

    p = probe or Probe()
    g = torch.Generator(device="cpu").manual_seed(0)
    kc, vc = (torch.randn(4, p.block_size, p.kv_heads, p.head_dim, generator=g).to(device, p.dtype) for _ in "kv")
    k, v = (torch.randn(3, p.kv_heads, p.head_dim, generator=g).to(device, p.dtype) for _ in "kv")
    slots = torch.tensor([5, PAD_SLOT_ID, 2 * p.block_size + 5], device=device)
    want_k, want_v = kc.clone(), vc.clone()
    write_kv(want_k, want_v, slots, k, v)
    try:
        write(kc, vc, slots, k, v)
    except Exception as e:  # another signature in this vLLM: kvdex's own write
        log.warning("kvdex: vLLM's cache write failed on a cache of this engine's shape (%s); kvdex writes the "
                    "step's keys and values", type(e).__name__)  # fmt: skip
        return None
    if not (torch.equal(kc, want_k) and torch.equal(vc, want_v)):
        log.warning("kvdex: vLLM's cache write does not write what kvdex's does here; kvdex writes them")
        return None
    return write
