"""PRKV's system side on the GPU: contiguous (HND) indexing and batched transfer vs the naive ways.

PRKV §4.2 / §5.3 (Figure 7 right): keeping host KV pages in HND layout ("contiguous memory
indexing", CI) cuts TPOT 1.5x; gathering the selected pages into one pinned buffer and crossing
PCIe once ("batched KV transfer", BT) cuts it up to 7.7x, against page-by-page copies. kvdex's
``HostPages`` is HND + batched; this script swaps in the naive alternatives and measures both a
fetch micro-benchmark and end-to-end decode TPOT with ``offload=True``:

    hnd-batched   HND pages, one index_select into pinned staging, one copy   (PRKV; kvdex, UVA off)
    hnd-uva       kvdex's default on CUDA with triton: a kernel reads the pages from pinned memory
    hnd-perpage   HND pages, one host->device copy per (sequence, kv head, page)          (no BT)
    nhd-batched   NHD pages ([P, 2, ps, H, D] per sequence): strided gather, one copy     (no CI)
    nhd-perpage   NHD pages, one strided copy per (sequence, kv head, page)          (neither)

Correctness first: every variant must give the same greedy tokens and bit-identical logits (the
same pages are fetched, only how they travel changes). Timing: median of per-step wall times after
a warm-up, device synchronised; the first decode step (PRKV's prefill static selection and page
restructuring, "2R") is reported apart.

    python scripts/gpu_prkv.py                                    # random Llama-3.1-8B shape, 32k
    python scripts/gpu_prkv.py --model /tmp/m/qwen.gguf --context 16384
    python scripts/gpu_prkv.py --micro-only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import kvdex
import kvdex.storage.offload as offload_mod
from kvdex.storage.host import HostPages

DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---- the naive host page stores -------------------------------------------------------------------


class HNDBatched(HostPages):
    """kvdex's HostPages with the UVA kernel off: HND + index_select into staging + one copy."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._uva = None


class HNDPerPage(HNDBatched):
    """HND pages, but every selected page crosses PCIe in its own copy (no batched transfer)."""

    def fetch_pages(self, pages):
        b, h, p = pages.shape
        out = torch.empty(b, h, p, 2, self.page_size, self.head_dim, dtype=self.dtype, device=self.device)
        ids = pages.cpu().tolist()
        for bi in range(b):
            for hi in range(h):
                for i, pid in enumerate(ids[bi][hi]):
                    out[bi, hi, i].copy_(self.data[bi, hi, pid], non_blocking=True)
        self.stats.h2d_bytes += out.numel() * out.element_size()
        self.stats.h2d_calls += b * h * p
        return out


class NHDBatched(HNDBatched):
    """Pages stored NHD, [B, P, 2, ps, H, D]: ``data`` is an HND-shaped *view* of it, so every read of
    one head's page is strided over the other heads (what HND avoids). Batched: one gather into
    pinned staging, one copy."""

    def _alloc(self, pages):
        shape = (self.batch, pages, 2, self.page_size, self.kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, pin_memory=self.pin).permute(0, 4, 1, 2, 3, 5)

    def _rows(self, b, h, page, kv, off):
        """Row ids into the NHD tensor viewed as [B * P * 2 * ps * H, D] (broadcasting index grids)."""
        return (((b * self.capacity + page) * 2 + kv) * self.page_size + off) * self.kv_heads + h

    def fetch_pages(self, pages):
        b, h, p = pages.shape
        ps, d = self.page_size, self.head_dim
        bi = torch.arange(b)[:, None, None, None, None]
        hi = torch.arange(h)[None, :, None, None, None]
        kv = torch.arange(2)[:, None]
        rows = self._rows(bi, hi, pages.cpu()[..., None, None], kv, torch.arange(ps))  # [B, H, P, 2, ps]
        nhd = self.data.permute(0, 2, 3, 4, 1, 5)  # the contiguous [B, P, 2, ps, H, D] storage
        stage = self._stage((b, h, p, 2, ps, d))
        torch.index_select(nhd.reshape(-1, d), 0, rows.reshape(-1), out=stage.view(-1, d))  # 1 row per head
        out = stage.to(self.device, non_blocking=True)
        self._count(stage)
        return out

    def fetch_rows(self, positions, sink):
        b, h, t = positions.shape
        rel = positions.cpu() - sink
        bi = torch.arange(b)[:, None, None, None]
        hi = torch.arange(h)[None, :, None, None]
        kv = torch.arange(2)[None, None, None, :]
        page, off = (rel // self.page_size)[..., None], (rel % self.page_size)[..., None]
        rows = self._rows(bi, hi, page, kv, off)  # [B, H, T, 2]
        nhd = self.data.permute(0, 2, 3, 4, 1, 5)
        stage = self._stage((b, h, t, 2, self.head_dim))
        torch.index_select(nhd.reshape(-1, self.head_dim), 0, rows.reshape(-1), out=stage.view(-1, self.head_dim))
        out = stage.to(self.device, non_blocking=True)
        self._count(stage)
        return out


class NHDPerPage(NHDBatched, HNDPerPage):
    """NHD pages, one (strided) copy per page."""

    fetch_pages = HNDPerPage.fetch_pages


VARIANTS = {
    "hnd-batched": HNDBatched,
    "hnd-uva": HostPages,
    "hnd-perpage": HNDPerPage,
    "nhd-batched": NHDBatched,
    "nhd-perpage": NHDPerPage,
}


# ---- micro-benchmark: one layer's fetch ------------------------------------------------------------


def micro(args, dtype) -> list[dict]:
    dev = torch.device(DEVICE)
    rows = []
    h, d, ps = args.kv_heads, args.head_dim, args.page_size
    cap = args.context // ps
    g = torch.Generator().manual_seed(0)
    src = torch.randn(1, h, cap, 2, ps, d, generator=g).to(dtype)
    for pages in (8, 32, 128):
        sel = torch.stack([torch.randperm(cap, generator=g)[:pages] for _ in range(h)])[None]  # [1, H, P]
        want = None
        for name, cls in VARIANTS.items():
            store = cls(1, h, ps, d, dtype, dev, kvdex.storage.TransferStats())
            store.reserve(cap)
            store.data[:, :, :cap] = src
            got = store.fetch_pages(sel.to(dev))
            _sync()
            want = got if want is None else want
            if not torch.equal(got, want):
                raise AssertionError(f"{name}: fetched pages differ from hnd-batched")
            times = []
            for i in range(args.repeats + 5):
                _sync()
                t0 = time.perf_counter()
                store.fetch_pages(sel.to(dev))
                _sync()
                if i >= 5:
                    times.append((time.perf_counter() - t0) * 1e3)
            rows.append({"pages_per_head": pages, "variant": name, "ms": statistics.median(times)})
            print(f"fetch {pages:4d} pages x {h} heads  {name:12s} {statistics.median(times):8.3f} ms", flush=True)
    return rows


# ---- end to end: decode TPOT with offload=True -----------------------------------------------------


def build_model(args, dtype):
    if args.model != "random":
        model, _ = kvdex.load(args.model, dtype=dtype, device=DEVICE)
        return model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.q_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(131072, args.context * 2),
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly (an fp32 8B model would need 32 GB first)
    try:
        with torch.device(DEVICE):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    model.lm_head.weight.data *= 8  # well separated logits: greedy tokens are not near-ties
    return kvdex.enable(model)


@torch.inference_mode()
def decode(model, ids, args, policy_opts, offload=True):
    """Prefill, then ``steps`` single-token decode steps; returns (tokens, logits, step times ms)."""
    cache = kvdex.Cache(
        model, args.policy, args.budget, page_size=args.page_size, sink=args.sink, window=args.window,
        offload=offload, **policy_opts,
    )  # fmt: skip
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens, logits, times = [], [], []
    moved = None
    for i in range(args.steps):
        if i == 1 + args.warmup:  # transfers of the timed steps only
            moved = (cache.transfer.h2d_calls, cache.transfer.h2d_bytes)
        _sync()
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
        lg = out.logits[:, -1].float()
        tok = lg.argmax(-1, keepdim=True)
        tokens.append(int(tok))
        logits.append(lg.cpu())
    n = max(1, args.steps - 1 - args.warmup)
    calls = (cache.transfer.h2d_calls - moved[0]) / n
    mb = (cache.transfer.h2d_bytes - moved[1]) / n / 2**20
    del cache
    return tokens, torch.stack(logits), times, (calls, mb)


def tpot(args, dtype) -> list[dict]:
    model = build_model(args, dtype)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab - 100, (1, args.context), generator=g).to(DEVICE)
    opts = {"static_ratio": args.static_ratio, "refresh": args.refresh} if args.policy == "prkv" else {}
    rows, ref = [], None
    original = offload_mod.HostPages
    runs = [(name, True) for name in VARIANTS] + [("gpu-resident", False)]
    try:
        for name, off in runs:
            offload_mod.HostPages = VARIANTS.get(name, original)
            tokens, logits, times, (calls, mb) = decode(model, ids, args, opts, offload=off)
            if ref is None:
                ref = (tokens, logits)
            same = tokens == ref[0] and torch.equal(logits, ref[1])
            if off and not same:
                raise AssertionError(f"{name}: decode differs from hnd-batched (tokens or logits)")
            steady = times[1 + args.warmup :]
            row = {
                "variant": name,
                "tpot_ms": statistics.median(steady),
                "first_step_ms": times[0],
                "same_as_hnd_batched": same,
                "h2d_calls_per_step": calls,
                "h2d_mb_per_step": mb,
            }
            rows.append(row)
            print(
                f"{name:12s} TPOT {row['tpot_ms']:8.2f} ms  first step {row['first_step_ms']:8.1f} ms  "
                f"h2d calls/step {row['h2d_calls_per_step']:8.0f}  MB/step {row['h2d_mb_per_step']:7.1f}  "
                f"identical={same}",
                flush=True,
            )
    finally:
        offload_mod.HostPages = original
    base = {r["variant"]: r["tpot_ms"] for r in rows}
    print(f"\nCI (layout)  nhd-batched / hnd-batched = {base['nhd-batched'] / base['hnd-batched']:.2f}x   (paper 1.5x)")
    bt = base["hnd-perpage"] / base["hnd-batched"]
    print(f"BT (batched) hnd-perpage / hnd-batched = {bt:.2f}x   (paper up to 7.7x)")
    print(f"both         nhd-perpage / hnd-batched = {base['nhd-perpage'] / base['hnd-batched']:.2f}x")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random", help="'random' (Llama-3.1-8B shape) or a path/.gguf")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--policy", default="prkv")
    p.add_argument("--budget", type=int, default=1024)  # the paper's k
    p.add_argument("--static-ratio", type=float, default=0.25)
    p.add_argument("--refresh", type=int, default=128)
    p.add_argument("--page-size", type=int, default=32)  # the paper's page size and local window
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sink", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--micro-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="check the script on the CPU with a tiny model (no timings)")
    p.add_argument("--json", default="gpu_prkv.json")
    args = p.parse_args()
    global DEVICE
    dtype = torch.bfloat16
    if args.dry_run:  # tiny shapes on the CPU: exercises every variant and the equality checks
        DEVICE, dtype = "cpu", torch.float32
        args.layers, args.hidden, args.intermediate, args.q_heads, args.kv_heads = 3, 256, 512, 4, 2
        args.head_dim, args.context, args.steps, args.warmup, args.repeats = 64, 1024, 8, 1, 2
        args.budget, args.page_size, args.window, args.sink = 256, 16, 32, 16
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    env = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
    }
    print(env, flush=True)
    result = {"env": env, "micro": micro(args, dtype)}
    if not args.micro_only:
        result["tpot"] = tpot(args, dtype)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
