"""Kernel counts of one decode step, with and without ``torch.compile`` (``GraphDecoder(compile=True)``).

A CUDA graph removes the CPU's launch cost but each replayed kernel still costs ~2 us on the GPU, so
the number of kernels per step matters. :func:`step_kernels` runs one (eager, not replayed) decoder
step under ``torch.profiler`` and counts what would be device kernels, split into the model's own
work and kvdex's (the cache update and the attention function, marked while counting):

* CUDA: the profiler's device kernel events (each launched kernel; a step replayed from a CUDA
  graph launches the same ones);
* CPU (no device kernels to see): a proxy. Every top-level ATen op that computes something (views,
  reshapes, allocations and other metadata ops are left out: they launch nothing on a GPU) plus
  every inductor-generated kernel (``cpp_fused_*``; named in the trace with
  ``torch._inductor.config.cpp.enable_kernel_profile``). Ops called from inside another op count
  once, through their caller; ``to`` / ``contiguous`` that return their input (no copy) not at all.
"""

from __future__ import annotations

import collections

import torch

from kvdex.hf.compiled_layers import marked_entry_points

# ATen ops that launch no kernel on a GPU (views, metadata, allocation without fill).
NO_KERNEL = {
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::_unsafe_view",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::expand",
    "aten::expand_as",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::slice",
    "aten::select",
    "aten::narrow",
    "aten::split",
    "aten::unbind",
    "aten::chunk",
    "aten::unflatten",
    "aten::flatten",
    "aten::as_strided",
    "aten::alias",
    "aten::detach",
    "aten::lift_fresh",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::result_type",
    "aten::dim",
    "aten::size",
    "aten::stride",
    "aten::is_nonzero",
    "aten::item",
    "aten::_local_scalar_dense",
}
MARK = "kvdex::"  # record_function names of the kvdex entry points while counting


def _kernel_name(e) -> bool:
    return "cpp_fused" in e.name or "cpp_kernel" in e.name


def _owner(e) -> str:
    """'kvdex' when the event runs under a kvdex marker, else 'model'."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(MARK):
            return "kvdex"
        p = p.cpu_parent
    return "model"


def _top_level(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::") or _kernel_name(p):
            return False
        p = p.cpu_parent
    return True


def step_kernels(decoder, ids: torch.Tensor) -> dict:
    """Kernels of one decode step of ``decoder`` (a :class:`kvdex.GraphDecoder`) on ``ids`` [B, 1]; the
    step runs eagerly (a replay has no per-op trace) and advances the cache by one token, like any
    step. Returns ``{"model": n, "kvdex": n, "total": n, "device": "cuda"|"cpu", "by_name": {...}}``
    (``by_name``: the model's own kernels by op / kernel name)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = decoder.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    saved = decoder.reason
    decoder._prepare()
    decoder.reason = decoder.reason or "counting kernels"  # run this step eagerly
    try:
        with marked_entry_points(MARK), profile(activities=acts) as prof:
            decoder.step(ids)
            if cuda:
                torch.cuda.synchronize(decoder.device)
    finally:
        decoder.reason = saved
    counts = collections.Counter()
    names = collections.Counter()
    if cuda:
        # device kernels, attributed through the CPU op that launched them (correlation)
        for e in prof.events():
            for k in e.kernels:
                own = _owner(e)
                counts[own] += 1
                if own == "model":
                    names[k.name[:80]] += 1
        # every device-side event (kernels, memcpy, memset: each a node of a captured graph); those the
        # profiler could not tie to a launching CPU op are "unattributed"
        every = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        counts["unattributed"] = max(every - counts["model"] - counts["kvdex"], 0)
    else:
        for e in prof.events():
            if not (_kernel_name(e) or (e.name.startswith("aten::") and e.name not in NO_KERNEL)):
                continue
            if not _top_level(e):
                continue
            if e.name in ("aten::to", "aten::contiguous") and not e.cpu_children:
                continue  # already of that dtype / layout: returns its input, no copy
            own = _owner(e)
            counts[own] += 1
            if own == "model":
                names[e.name] += 1
    return dict(
        device="cuda" if cuda else "cpu",
        model=counts["model"],
        kvdex=counts["kvdex"],
        unattributed=counts["unattributed"],
        total=counts["model"] + counts["kvdex"] + counts["unattributed"],
        by_name=dict(names.most_common()),
    )
