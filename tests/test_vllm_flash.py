"""vLLM's FlashAttention as kvdex's prompt-chunk attention, on a GPU (``-m gpu``; skipped without vLLM or CUDA):
:func:`kvdex.vllm.kernels.flash_prefill` on a random paged cache equals the PyTorch reference
(:func:`kvdex.vllm.paged.prefill_attention_reference`) for chunks at the start, the middle and the end of a prompt,
blocks scattered and in any order, query heads grouped over kv heads; :func:`kvdex.vllm.kernels.flash_decode` (a
dense layer's decode step on the blocks in place) equals :func:`kvdex.vllm.paged.decode_attention_reference`, also
replayed from a CUDA graph after the length changed; and vLLM's cache-write kernel
(:func:`kvdex.vllm.kernels.vllm_cache_write`) writes what kvdex's PyTorch write (:func:`kvdex.vllm.paged.write_kv`)
writes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("seq_len,n", [(40, 40), (700, 128), (1000, 1), (1537, 513)])
def test_flash_prefill_is_the_reference(seq_len, n):
    from kvdex.vllm.kernels import flash_prefill
    from kvdex.vllm.paged import prefill_attention_reference

    prefill = flash_prefill()
    if prefill is None:
        pytest.skip("this vLLM has no FlashAttention varlen kernel here")
    g = torch.Generator(device="cuda").manual_seed(seq_len)
    blocks_total, bs, h, hq, d = 160, 16, 2, 8, 64
    k_cache = torch.randn(blocks_total, bs, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(blocks_total, bs, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    need = -(-seq_len // bs)
    blocks = torch.randperm(blocks_total, device="cuda", generator=g)[: need + 3].int()  # a row wider than needed
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    got = prefill(q, blocks, seq_len, k_cache, v_cache, d**-0.5)
    want = prefill_attention_reference(q, blocks, seq_len, k_cache, v_cache, d**-0.5)
    assert got.shape == want.shape == (n, hq, d)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_vllms_cache_write_is_kvdex_write():
    from kvdex.vllm.kernels import vllm_cache_write
    from kvdex.vllm.paged import PAD_SLOT_ID, write_kv

    write = vllm_cache_write("cuda")
    if write is None:
        pytest.skip("this vLLM has no reshape_and_cache_flash kernel with kvdex's contract here")
    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc = (torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:40]
    slots[::7] = PAD_SLOT_ID
    want_k, want_v = kc.clone(), vc.clone()
    write_kv(want_k, want_v, slots, k, v)
    write(kc, vc, slots, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("kernel", ["flash", "triton"])
@pytest.mark.parametrize("length", [1, 37, 1000])
def test_flash_decode_is_the_reference_and_captures(length, kernel):
    """vLLM's FlashAttention decode and kvdex's Triton decode over the block table (what a layer that attends
    every token runs where vLLM's kernel is refused) on vLLM's layout, eager and in a CUDA graph."""
    from kvdex.kernels.triton_attention import block_table_decode_attention
    from kvdex.vllm.kernels import Probe, flash_decode
    from kvdex.vllm.paged import decode_attention_reference

    decode = flash_decode("cuda", Probe(32, 8, 128, 16)) if kernel == "flash" else block_table_decode_attention
    if decode is None:
        pytest.skip("this vLLM has no FlashAttention varlen kernel with kvdex's contract here")
    g = torch.Generator(device="cuda").manual_seed(length)
    kc, vc = (torch.randn(128, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    blocks = torch.randperm(128, device="cuda", generator=g)[:80]  # a row of 1280 tokens, blocks in any order
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = torch.tensor([length], device="cuda")
    want = decode_attention_reference(q, blocks, lengths, 1280, kc, vc, 128**-0.5)
    torch.testing.assert_close(decode(q, blocks, lengths, 1280, kc, vc, 128**-0.5).float(), want.float(),
                               atol=2e-2, rtol=2e-2)  # fmt: skip
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode(q, blocks, lengths, 1280, kc, vc, 128**-0.5)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = decode(q, blocks, lengths, 1280, kc, vc, 128**-0.5)
    lengths.fill_(length + 200)  # the replay reads the new length from the device
    graph.replay()
    want = decode_attention_reference(q, blocks, lengths, 1280, kc, vc, 128**-0.5)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_flash_batch_is_the_reference():
    """A step of four requests (two decode tokens, a prompt chunk in the middle of its prompt, a whole prompt) in
    one call of vLLM's FlashAttention (:func:`kvdex.vllm.kernels.flash_batch`, a policy that attends every token)
    equals the reference, one request at a time."""
    from kvdex.vllm.kernels import Probe, flash_batch
    from kvdex.vllm.paged import DenseBatch, batch_attention_reference

    attend = flash_batch("cuda", Probe(32, 8, 128, 16))
    if attend is None:
        pytest.skip("this vLLM has no FlashAttention varlen kernel here")
    g = torch.Generator(device="cuda").manual_seed(2)
    bs, h, hq, d = 16, 8, 32, 128
    kc, vc = (torch.randn(400, bs, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    lens, queries = [1000, 37, 700, 90], [1, 1, 128, 90]
    rows = torch.randperm(400, device="cuda", generator=g)[: 4 * 70].view(4, 70).int()
    qsl = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    batch = DenseBatch(qsl, torch.tensor(lens, dtype=torch.int32, device="cuda"), rows, max(queries), max(lens))
    q = torch.randn(sum(queries), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    got, want = torch.zeros_like(q), torch.zeros_like(q)
    attend(q, batch, kc, vc, d**-0.5, got)
    batch_attention_reference(q, batch, kc, vc, d**-0.5, want)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
