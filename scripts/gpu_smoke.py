"""GPU smoke check of kvdex's CUDA paths (pinned host pages, async copies, bf16) on a random model.

Correctness first, in fp32 (full budget == transformers' SDPA, token for token and logits within
1e-3; offload == GPU-resident at a small budget). In bf16, greedy decoding of a random model flips
near-tied tokens on rounding-order differences alone, so exactness is checked in fp32. Then a
rough bf16 timing table of eager decoding (ms per token, KV bytes on device and host, bytes moved per
step) next to transformers' DynamicCache. For careful timings use ``kvdex bench``.

    python scripts/gpu_smoke.py [--context 8192] [--layers 8] [--budget 512]

Exits with status 1 if a correctness check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvdex


def build(layers: int, device: str, dtype):
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=131072,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    # Random weights give flat logits; scale the output head so greedy choices are not near-ties.
    model.lm_head.weight.data *= 8
    ref = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("sdpa")
    return kvdex.enable(model), ref


def greedy(model, ids, cache, n):
    out = model.generate(
        ids,
        **kvdex.cache_kwargs(cache),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1).float()


def ms_per_token(model, ids, make_cache, steps=32, warm=8):
    cache = make_cache()
    with torch.no_grad():
        out = model(ids, **kvdex.cache_kwargs(cache), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(warm + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = model(tok, **kvdex.cache_kwargs(cache), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            end.record()
            torch.cuda.synchronize()
            if i >= warm:
                times.append(start.elapsed_time(end))
    return statistics.median(times), cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", type=int, default=512)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} transformers {transformers.__version__}")
    model, ref = build(args.layers, dev, torch.float32)
    ids = torch.randint(0, 32000, (1, args.context), device=dev)
    n = 24

    t0 = time.perf_counter()
    ref_tok, ref_logits = greedy(ref, ids, DynamicCache(), n)
    checks = []
    for pol in ["full", "quest", "oracle", "streaming"]:
        for off in (False, True):
            cache = kvdex.Cache(model, pol, budget=args.context + 64, offload=off)
            tok, logits = greedy(model, ids, cache, n)
            err = (logits - ref_logits).abs().max().item()
            ok = bool((tok == ref_tok).all()) and err < 1e-3
            checks.append((f"{pol} full-budget offload={off}", ok, f"max|dlogit|={err:.3g}"))
    for pol in ["quest", "oracle", "streaming"]:
        a, _ = greedy(model, ids, kvdex.Cache(model, pol, budget=args.budget, offload=False), n)
        b, _ = greedy(model, ids, kvdex.Cache(model, pol, budget=args.budget, offload=True), n)
        checks.append((f"{pol} budget={args.budget}: offload == resident", bool((a == b).all()), ""))
    print(f"\ncorrectness, fp32 ({time.perf_counter() - t0:.1f}s)")
    for name, ok, note in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}  {note}")
    failed = [name for name, ok, _ in checks if not ok]
    del model, ref
    torch.cuda.empty_cache()
    model, ref = build(args.layers, dev, dtype)

    rows = []
    ms, _ = ms_per_token(ref, ids, DynamicCache)
    rows.append(("transformers sdpa DynamicCache", ms, None))
    for pol, off in [("full", False), ("quest", False), ("quest", True), ("full", True)]:
        ms, cache = ms_per_token(model, ids, lambda p=pol, o=off: kvdex.Cache(model, p, budget=args.budget, offload=o))
        rows.append((f"kvdex {pol} offload={off}", ms, cache.stats()))
    print(
        f"\nms/token, batch 1, context {args.context}, {args.layers} layers (hidden 2048, 16/4 heads, bf16), "
        f"budget {args.budget}, median of 32 after 8 warm-up, eager"
    )
    print(f"  {'method':36s} {'ms/token':>9s} {'dev KV MB':>10s} {'host KV MB':>10s} {'H2D MB/step':>12s}")
    for name, ms, st in rows:
        if st is None:
            print(f"  {name:36s} {ms:9.2f}")
        else:
            steps = max(st["decode_steps"], 1)
            print(
                f"  {name:36s} {ms:9.2f} {st['kv_bytes_device'] / 2**20:10.1f} {st['kv_bytes_host'] / 2**20:10.1f} "
                f"{st['bytes_host_to_device'] / 2**20 / steps:12.2f}"
            )
    if failed:
        print(f"\n{len(failed)} correctness check(s) failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
