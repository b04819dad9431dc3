"""CUDA-graph decoding of a transformers model with a kvdex cache: :class:`GraphDecoder` (the loop of
:func:`kvdex.generate`) captures and replays whole model steps, and does the CPU bookkeeping after a replay.

What a step must satisfy to be captured, the policy protocol (``graph_unsupported`` / ``graph_key`` /
``graph_replayed``), page joins and the step plan shared with the other graph users are described in
:mod:`kvdex.engine.graphs`; the model's decoder layers through ``torch.compile`` (``compile=True``) in
:mod:`kvdex.hf.compiled_layers`.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from kvdex.engine.graphs import (
    HostCounts,
    StepPlan,
    as_current,
    capture_step,
    capture_unsupported,
    free_deferred,
    free_with,
)
from kvdex.hf.cache import Cache
from kvdex.hf.compat import cache_kwargs
from kvdex.hf.compiled_layers import CompiledLayers, _compile_mode


def graph_policies() -> list[str]:
    """Registered policies whose decode step can be captured (with a suitable store)."""
    from kvdex.policies.registry import policy_classes

    return sorted(n for n, cls in policy_classes().items() if cls.capturable)


class GraphDecoder:
    """Decode a prefilled :class:`kvdex.Cache` one token at a time, replaying CUDA graphs.

    ``step(ids [B, 1]) -> logits [B, vocab]``. Where the cache cannot be captured (no CUDA device, a
    policy or store without graph support, ``timing=True``, an observer) every step runs eagerly
    and :attr:`reason` says why (warned once). ``counts``: eager steps, captures, replays.

    ``compile=True`` (or an inductor mode from :data:`~kvdex.hf.compiled_layers.COMPILE_MODES`): every step,
    eager or captured, runs the model's decoder layers compiled by ``torch.compile`` (:class:`CompiledLayers`);
    also on CPU and with ``enabled=False``. :attr:`compiled` holds them (``.graphs``, ``.compile_s``);
    :attr:`compile_reason` says why compilation is off where it was asked for (warned once).
    """

    def __init__(
        self,
        model,
        cache: Cache,
        batch: int | None = None,
        *,
        enabled: bool = True,
        warn: bool = True,
        compile: bool | str = False,
    ):
        if not isinstance(cache, Cache):
            raise ValueError("graph decoding needs a kvdex.Cache")
        self.cache = cache
        self.plan = StepPlan(cache)  # the step's decisions (page joins, graph key, eager warm-up steps)
        self.model = model
        self.device = next(model.parameters()).device
        self.batch = batch
        self.enabled, self.warn = enabled, warn
        self.reason: str | None = None
        self._checked = False
        self.graphs: dict = {}  # key -> (CUDA graph, its logits, its HostCounts delta)
        free_with(self, self.graphs)  # never destroyed inside a capture
        self.key = None
        self.logits = None
        self.ids = self.pos = self._neg_pads = None
        self.counts = {"eager": 0, "captures": 0, "replays": 0}
        self.compile_mode = _compile_mode(compile)
        self.compiled: CompiledLayers | None = None
        self.compile_reason: str | None = None
        self._compile_proven = False
        if self.compile_mode is not None:
            why = None
            if not torch._dynamo.is_dynamo_supported():
                why = "torch.compile is not supported on this Python / platform"
            else:
                try:
                    self.compiled = CompiledLayers(model, self.compile_mode)
                except ValueError as e:
                    why = str(e)
            if why is not None:
                self._compile_off(why)

    @property
    def graph(self):
        """The CUDA graph of the last replayed key (None: none). Setting None drops every graph and its pool."""
        entry = self.graphs.get(self.key)
        return None if entry is None else entry[0]

    @graph.setter
    def graph(self, value) -> None:
        if value is not None:
            raise ValueError("GraphDecoder.graph can only be reset (set to None)")
        self.graphs.clear()
        self.key = None

    def _compile_off(self, why: str) -> None:
        self.compiled, self.compile_reason = None, why
        if self.warn:
            warnings.warn(f"kvdex: torch.compile is off, running the model uncompiled: {why}", stacklevel=4)

    def _run(self, **kw):
        """The model's forward for one decode step, through the compiled layers when compiling. If the
        very first compiled call fails before any layer's cache was updated (no compiler, an inductor
        error), compilation is switched off with a warning and the step runs uncompiled; a failure after
        the cache changed cannot be undone and is raised."""
        if self.compiled is None:
            return self.model(**kw)
        if self._compile_proven:
            with self.compiled.active():
                return self.model(**kw)
        seen = [lay.seen for lay in self.cache.layers]
        try:
            with self.compiled.active():
                out = self.model(**kw)
        except Exception as e:
            if [lay.seen for lay in self.cache.layers] != seen:
                raise
            root = getattr(e, "inner_exception", None) or e
            while root.__cause__ is not None:
                root = root.__cause__
            line = next((x for x in str(root).splitlines() if x.strip()), "")
            self._compile_off(f"compiling failed ({type(e).__name__}): {type(root).__name__}: {line[:200]}")
            return self.model(**kw)
        self._compile_proven = True
        return out

    # ---- decisions --------------------------------------------------------------------------------
    def _unsupported(self) -> str | None:
        if self.device.type != "cuda":
            return "it needs a CUDA device"
        return capture_unsupported(self.cache)

    def _prepare(self) -> None:
        if self._checked:
            return
        stores = self.plan.stores()
        if any(st is None for st in stores):
            raise ValueError("prefill the cache before decoding with GraphDecoder")
        self._checked = True
        self.reason = self._unsupported() if self.enabled else "disabled (cuda_graph=False)"
        b = stores[0].batch
        if self.batch is not None and self.batch != b:
            raise ValueError(f"batch {self.batch} does not match the cache's batch {b}")
        self.batch = b
        dev = stores[0].device
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=dev)
        pads = self.cache.layers[0].pads
        pads = torch.zeros(b, dtype=torch.long) if pads is None else pads.to(torch.long).cpu()
        self._neg_pads = (-pads).to(dev)[:, None]
        if self.reason is not None:
            if self.warn and self.enabled:
                warnings.warn(f"kvdex: CUDA-graph decoding is off, decoding eagerly: {self.reason}", stacklevel=4)
            return
        self.plan.arm()

    # ---- one step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode one token for ids [B, 1] (device); returns the last-position logits [B, vocab]."""
        self._prepare()
        free_deferred()  # graphs of caches / decoders collected during a capture
        c = self.cache
        try:
            # page joins: Policy.joined runs in the plan (join_host), before every step (a replay runs no Python)
            c.joins_external = self.plan.joins
            c.decoder_active = True  # the cache's own per-layer step graphs stay out of this step
            with as_current(self.device):
                return self._step(ids)
        finally:  # the cache used without the decoder decides page joins itself again
            c.join_step, c.joins_external, c.decoder_active = None, False, False

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.cache
        decision = None if self.reason is not None else self.plan.decide(self.graphs)
        key, mode = (None, "eager") if decision is None else (decision.key, decision.mode)
        torch.add(self._neg_pads, c.layers[0].seen, out=self.pos)  # position of the new token, per row
        if mode == "eager":
            self.counts["eager"] += 1
            out = self._run(input_ids=ids, **cache_kwargs(c), use_cache=True, logits_to_keep=1, position_ids=self.pos)
            return out.logits[:, -1]
        self.ids.copy_(ids)
        if mode == "capture":
            self._capture(key)
            self.key = key
            self.graphs[key][0].replay()  # the capture ran this step's CPU side; this does its device work
            self.counts["replays"] += 1
            c.policy.on_step(c.step, self.logits)  # held back during the capture
            return self.logits
        graph, self.logits, delta = self.graphs[key]
        self.key = key
        self.plan.replayed(self.plan.replay_joins(decision), delta)
        graph.replay()
        self.counts["replays"] += 1
        c.policy.graph_replayed()
        c.policy.on_step(c.step, self.logits)
        return self.logits

    def _capture(self, key) -> None:
        c = self.cache
        for k in [k for k in self.graphs if self.plan.base(k) != self.plan.base(key)]:
            del self.graphs[k]  # captured over buffers that were re-allocated since: never replayed again
        # attended tokens: a persistent device counter that the replays accumulate into (in place), made at
        # the first capture only: the graphs kept (both page-join variants of a key) add into it by address
        c.counters.count_in_place(self.device)
        before = HostCounts.of(c)
        # compiled layers: compiled (and their kernels loaded) by the eager warm-up step before this;
        # a private pool per graph, errors reported for the whole process (capture_error_mode="global")
        with _on_step_held(c), capture_step(self.device, self.ids, error_mode="global", cuda=True) as g:
            out = self._run(
                input_ids=self.ids, **cache_kwargs(c), use_cache=True, logits_to_keep=1, position_ids=self.pos
            )
            self.logits = out.logits[:, -1]
        self.graphs[key] = (g, self.logits, before.since(c))
        self.counts["captures"] += 1


@contextmanager
def _on_step_held(cache):
    """The cache's logits hook skips ``policy.on_step`` inside (it fires during a capture, before any logits
    exist; the decoder calls it after the first replay)."""
    cache.on_step_held = True
    try:
        yield
    finally:
        cache.on_step_held = False
