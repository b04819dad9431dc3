"""torch.compile of the model's decoder layers for graph decoding (:class:`CompiledLayers`).

**torch.compile of the model's own work** (``compile=True``, opt-in; docs/bench/compile.md). Inside a
CUDA graph each kernel still costs ~2 us, and transformers' eager decoder layer issues ~40 small
elementwise kernels (RMSNorm's cast / pow / mean / rsqrt / mul, RoPE's slices / neg / cat, SiLU * up,
residual adds). The decoder (:class:`~kvdex.hf.graph.GraphDecoder`) compiles each
decoder layer with inductor (``dynamic=False``, no inductor cudagraphs: kvdex captures its own graph
around the whole step) so that these fuse. kvdex's entry points stay eager Python: ``kvdex.Cache.update``
and the ``"kvdex"`` attention function are ``torch.compiler.disable``d, so each layer compiles to the
work before the cache update and the work after the attention (two graph breaks per layer). The compiled
layers are swapped into the model's layer list only while the decoder runs a step (prefill and the
user's own calls run the model as it was), one compilation per layer and shape (dynamo specialises on
the module's ``layer_idx``), on the first decode step; later steps, eager ones included, reuse them (no
recompiles).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from kvdex.hf.cache import Cache

# torch.compile modes that keep inductor's own CUDA graphs off (kvdex captures the whole step itself).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def _compile_mode(compile) -> str | None:
    """``compile`` argument -> inductor mode (None: off)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    raise ValueError(
        f"compile must be a bool or one of {', '.join(COMPILE_MODES)} (modes with inductor cudagraphs such as "
        f"'reduce-overhead' would nest graphs inside kvdex's own capture), got {compile!r}"
    )


def decoder_layers(model) -> list[tuple[torch.nn.ModuleList, int, torch.nn.Module]]:
    """(layer list, index, decoder layer) of every layer holding a kvdex-served attention module: the
    direct parent of the attention module, an element of a ``ModuleList``. ValueError where a model is
    built otherwise."""
    from kvdex.hf.loading import attention_modules

    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for idx, attn in sorted(attention_modules(model).items()):
        parent, _, _ = names[id(attn)].rpartition(".")
        holder, _, key = parent.rpartition(".")
        box = model.get_submodule(holder) if holder else model
        if not isinstance(box, torch.nn.ModuleList) or not key.isdigit():
            raise ValueError(f"layer {idx}: the attention module's parent {parent!r} is not in a ModuleList")
        out.append((box, int(key), box[int(key)]))
    if not out:
        raise ValueError("no attention modules found to compile")
    return out


class CompiledLayers:
    """Each decoder layer of ``model`` compiled with ``torch.compile(layer, dynamic=False, mode=mode)``,
    swapped into the model's layer list only inside :meth:`active` (the model object is restored after
    every call). Dynamo specialises on each layer's ``layer_idx`` (an int attribute handed to the cache
    update), so every layer is its own compiled entry: the recompile limit is raised to cover them while
    active. ``graphs``: the graphs dynamo compiled while active (``torch._dynamo`` counters)."""

    def __init__(self, model, mode: str = "default"):
        self.mode = mode
        self.slots = [
            (box, i, layer, torch.compile(layer, dynamic=False, mode=mode)) for box, i, layer in decoder_layers(model)
        ]
        n = len(self.slots)
        cfg = torch._dynamo.config
        self._patch = {}
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                self._patch[name] = max(getattr(cfg, name), 8 * n + 8)  # a few batch sizes / dtypes
                break
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):  # newer / older torch
            if hasattr(cfg, name):
                self._patch[name] = max(getattr(cfg, name), 16 * n + 64)
                break
        self.graphs = 0
        self.compile_s = 0.0  # wall time of the calls in which dynamo compiled something

    @staticmethod
    def _graph_count() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @contextmanager
    def active(self):
        g0, t0 = self._graph_count(), time.perf_counter()
        for box, i, _, comp in self.slots:
            box[i] = comp
        cfg = torch._dynamo.config  # set / restored by hand: config.patch() costs ~1.5 ms per step
        saved = {k: getattr(cfg, k) for k, v in self._patch.items() if getattr(cfg, k) < v}
        try:
            for k in saved:
                setattr(cfg, k, self._patch[k])
            yield
        finally:
            for k, v in saved.items():
                setattr(cfg, k, v)
            for box, i, layer, _ in self.slots:
                box[i] = layer
            new = self._graph_count() - g0
            if new:
                self.graphs += new
                self.compile_s += time.perf_counter() - t0


@contextmanager
def marked_entry_points(prefix: str):
    """kvdex's eager entry points from the model (``Cache.update_eager`` and the ``"kvdex"`` attention
    function's eager body) wrapped in ``torch.profiler.record_function`` markers ``prefix + "update"`` /
    ``prefix + "attention"`` (still ``torch.compiler.disable``d), restored afterwards: a profile tells kvdex's
    work from the model's. Under ``torch.compile`` kvdex's decode work runs in the custom ops
    ``kvdex::append`` / ``kvdex::attend`` (:mod:`kvdex.hf.compiled_ops`), whose profiler events carry those
    names; the code dynamo traced is not touched (no recompilation)."""
    from kvdex.hf import attention as attn_mod

    upd = Cache.__dict__["update_eager"]
    fn = attn_mod._eager_attention

    @torch.compiler.disable
    def update(self, *a, **kw):
        with torch.profiler.record_function(prefix + "update"):
            return upd(self, *a, **kw)

    @torch.compiler.disable
    def attention(*a, **kw):
        with torch.profiler.record_function(prefix + "attention"):
            return fn(*a, **kw)

    Cache.update_eager = update
    attn_mod._eager_attention = attention
    try:
        yield
    finally:
        Cache.update_eager = upd
        attn_mod._eager_attention = fn
