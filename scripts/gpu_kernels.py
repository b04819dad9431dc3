"""GPU micro-benchmark of kvdex's Triton kernels against their PyTorch twins (correctness first).

Llama-3.1-8B attention shape (8 kv heads, 32 query heads, head_dim 128, bf16), one layer:
* sparse decode attention over 2048 selected slots of a 128k slot buffer, batch 1 and 8;
* dense decode attention over 32k / 128k tokens (the dense layers and ``full``), vs the SDPA path;
* gather of 128 selected 16-token pages per kv head from pinned host memory: UVA kernel vs the
  index_select + pinned staging + copy path (``KVDEX_UVA=0``);
* Quest page scores over 8k pages (128k tokens): fused kernel vs the PyTorch path.

    PYTHONPATH=$PWD python scripts/gpu_kernels.py
"""

from __future__ import annotations

import statistics
from functools import partial

import torch

from kvdex.kernels import attention as ref
from kvdex.kernels import quest_triton as qt
from kvdex.kernels import triton_attention as ta
from kvdex.kernels import uva
from kvdex.storage import TransferStats
from kvdex.storage.host import HostPages


def bench(fn, reps=50, warm=5):
    for _ in range(warm):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def row(name, ms_fast, ms_ref, err, nbytes=None):
    bw = f"{nbytes / ms_fast / 1e6:8.1f} GB/s" if nbytes else ""
    print(f"{name:<52} triton {ms_fast * 1e3:9.1f} us   twin {ms_ref * 1e3:9.1f} us   max|err| {err:.2e} {bw}")


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    h, g, d = 8, 4, 128
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for b in (1, 8):
        s, n = 131072 if b == 1 else 16384, 2048
        q = torch.randn(b, h * g, d, device=dev, dtype=dt)
        k = torch.randn(b, h, s, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        idx = torch.randint(0, s, (b, h, n), device=dev)
        valid = torch.rand(b, h, n, device=dev) < 0.97
        f = partial(ta.sparse_decode_attention, q, k, v, idx, valid, d**-0.5)
        r = partial(ref.sparse_decode_attention_reference, q, k, v, idx, valid, d**-0.5)
        err = float((f().float() - r().float()).abs().max())
        row(f"sparse decode b={b} N={n} (slots of {s})", bench(f), bench(r), err, 2 * b * h * n * d * 2)
    for b, s in ((1, 32768), (1, 131072), (8, 32768)):
        q = torch.randn(b, h * g, d, device=dev, dtype=dt)
        k = torch.randn(b, h, s, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        lens = torch.full((b,), s, device=dev)
        lens[0] = s - 5
        f = partial(ta.dense_decode_attention, q, k, v, lens, d**-0.5, max_len=s)
        pos = (lens - 1)[:, None]
        km = torch.arange(s, device=dev)[None, :] < lens[:, None]
        r = partial(ref.dense_attention, q[:, :, None], k, v, pos, km, d**-0.5)
        err = float((f().float() - r()[:, 0].float()).abs().max())
        row(f"dense decode b={b} L={s}", bench(f), bench(r), err, 2 * b * h * s * d * 2)
        del k, v
    for b in (1, 8):
        pages_total, sel = 8192 if b == 1 else 2048, 128
        hp = HostPages(b, h, 16, d, dt, dev, TransferStats())
        hp.reserve(pages_total)
        hp.data.copy_(torch.randn(hp.data.shape, dtype=dt, device=dev))
        pages = torch.randint(0, pages_total, (b, h, sel), device=dev)
        f = partial(hp.fetch_pages, pages)
        uva_fn = hp._uva
        got = f()
        hp._uva = None
        r = partial(hp.fetch_pages, pages)
        err = float((got.float() - r().float()).abs().max())
        ms_r = bench(r, reps=20)
        hp._uva = uva_fn
        row(f"host page gather b={b} {sel} pages x {h} heads (UVA vs staging)", bench(f, reps=20), ms_r, err,
            got.numel() * 2)  # fmt: skip
        pos = torch.randint(16, 16 + pages_total * 16, (b, h, 2048), device=dev)
        got = uva.gather_rows(hp.data, pos, 16)
        err = float((got.float() - uva.gather_rows_reference(hp.data, pos.cpu(), 16).to(dev).float()).abs().max())
        ms = bench(partial(uva.gather_rows, hp.data, pos, 16), reps=20)
        print(f"{'host row gather b=' + str(b) + ' 2048 rows x 8 heads (UVA)':<52} triton {ms * 1e3:9.1f} us"
              f"   max|err| {err:.2e} {got.numel() * 2 / ms / 1e6:8.1f} GB/s")  # fmt: skip
    for b in (1, 8):
        p = 8192 if b == 1 else 2048
        q = torch.randn(b, h * g, d, device=dev, dtype=dt)
        kmin = torch.randn(b, h, p, d, device=dev, dtype=dt)
        kmax = kmin + torch.rand_like(kmin)
        npg = torch.full((b,), p, device=dev)
        f = partial(qt.page_scores, q, kmin, kmax, npg)
        r = partial(qt.page_scores_reference, q, kmin, kmax, npg)
        err = float((f() - r()).abs().max())
        row(f"quest page scores b={b} P={p}", bench(f), bench(r), err, 2 * kmin.numel() * 2)


if __name__ == "__main__":
    main()
