"""kvdex's ``torch.compile`` backend: a plain ``model.generate(..., cache=kvdex.Cache(...))`` replays its
whole decode step as one CUDA graph, as ``kvdex.generate`` does.

transformers compiles the decode step of a compileable cache with its ``generation_config.compile_config``
(``torch.compile(model.__call__, **compile_config)``, a public option). :func:`kvdex.enable` sets it to
:func:`compile_config` where the model has none: :class:`Backend` as the ``torch.compile`` backend.

* A graph that holds kvdex's ops (:mod:`kvdex.hf.compiled_ops`: the decode step of a prefilled kvdex
  cache) is compiled by inductor without CUDA graphs, and each call goes through :class:`WholeStep`, the
  cache's step plan (:class:`~kvdex.engine.graphs.plan.StepPlan`, as
  :class:`~kvdex.hf.graph.GraphDecoder`'s): page joins and the step's graph key decided on the
  host, then an eager step (a new key, a boundary), a capture of the whole compiled step with kvdex's ops
  running inside it, or a replay followed by the host side of the replayed work. One launch per step
  instead of inductor's CUDA graphs split around kvdex's ops (one partition per layer) and a Python call
  into kvdex per layer.
* Any other graph (another cache, the output head behind kvdex's logits hook) is compiled as transformers'
  default would (``mode="reduce-overhead"``: inductor with CUDA graphs).

Where a step cannot be captured (no CUDA device, ``step_graphs=False``, a policy or store without graph
support, ``timing=True``), the call runs the compiled graph as it is and the cache's per-layer step graphs
(:mod:`kvdex.engine.graphs.layer_graphs`) decide, warning once why they are off.
"""

from __future__ import annotations

import torch

from kvdex.engine.graphs import (
    HostCounts,
    StepPlan,
    as_current,
    capture_step,
    free_deferred,
    free_with,
    replay_unsupported,
)
from kvdex.hf import compiled_ops

_APPEND = torch.ops.kvdex.append.default


def compile_config():
    """transformers' ``CompileConfig`` with kvdex's :class:`Backend` (what :func:`kvdex.enable` sets)."""
    from transformers import CompileConfig

    return CompileConfig(backend=Backend(), mode=None)


class Backend:
    """A ``torch.compile`` backend (see the module). ``inner``: the compiler of each graph, ``"inductor"``
    (the default) or ``"eager"`` (the graph as traced: tests run it under the CPU stand-in for CUDA graphs)."""

    def __init__(self, inner: str = "inductor") -> None:
        if inner not in ("inductor", "eager"):
            raise ValueError(f"inner must be 'inductor' or 'eager', got {inner!r}")
        self.inner = inner

    def __eq__(self, other) -> bool:  # transformers compiles again when its compile_config changes
        return isinstance(other, Backend) and other.inner == self.inner

    def __hash__(self) -> int:
        return hash((Backend, self.inner))

    def __repr__(self) -> str:
        return f"kvdex.hf.step_backend.Backend(inner={self.inner!r})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **_kw):
        nodes = list(gm.graph.nodes)
        appends = [n for n in nodes if n.op == "call_function" and n.target is _APPEND]
        places = [n for n in nodes if n.op == "placeholder"]
        handle = appends[0].args[2] if appends else None
        if handle is None or handle not in places:
            return self._compile(gm, example_inputs, cudagraphs=True)
        mutated = [i for i, n in enumerate(places) if any(_in_place(u, n) for u in n.users)]
        layers = frozenset(n.args[3] for n in appends)
        return _Step(self._compile(gm, example_inputs, cudagraphs=False), places.index(handle), mutated, layers)

    def _compile(self, gm, example_inputs, cudagraphs: bool):
        if self.inner == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": cudagraphs})


def _in_place(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether ``user`` writes into ``node`` (an in-place op or method on it, or a copy into it)."""
    if user.op not in ("call_function", "call_method") or not user.args or user.args[0] is not node:
        return False
    name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
    name = str(name).split(".")[0]
    return name.endswith("_") and not name.startswith("_")


class _Step:
    """The compiled decode step of kvdex's caches: finds the call's cache by its handle, lets its
    :class:`WholeStep` run the call. ``layers``: the layer indices whose appends the graph holds (fewer
    than the cache's layers where a graph break splits the step into several graphs)."""

    def __init__(self, inner, handle_at: int, mutated: list[int], layers: frozenset = frozenset()) -> None:
        self.inner, self.handle_at, self.mutated, self.layers = inner, handle_at, mutated, layers

    def __call__(self, *args):
        cache = compiled_ops.cache_of(args[self.handle_at])
        if cache is None:
            raise RuntimeError("kvdex: the kvdex.Cache of this compiled decode step was garbage-collected")
        return cache.whole_step.run(self, args)


SPLIT = "the compiled decode step is split into several graphs (a graph break); per-layer step graphs decide"


class WholeStep:
    """One :class:`kvdex.Cache`'s whole-step CUDA graphs under :class:`Backend` (``cache.whole_step``):
    ``counts`` (eager steps, captures, replays), ``reason`` (why its steps are not captured; None: they are)."""

    def __init__(self, cache) -> None:
        self.plan = StepPlan(cache, weak=True)  # no reference cycle (kvdex.engine.graphs.free_with)
        self.reason: str | None = None
        self._checked = False
        self.graphs: dict = {}  # key -> (graph, static inputs, outputs, HostCounts delta)
        free_with(self, self.graphs)
        self.counts = {"eager": 0, "captures": 0, "replays": 0}

    @property
    def cache(self):
        return self.plan.cache

    def _prepare(self) -> None:
        self._checked = True
        c = self.cache
        self.reason = replay_unsupported(c) if c.step_graphs.enabled else "disabled (step_graphs=False)"
        if self.reason is None:
            self.plan.arm()

    def run(self, step: _Step, args: tuple):
        if not self._checked:
            self._prepare()
        if self.reason is None and len(step.layers) != len(self.cache.layers):
            # a graph break split the step (a hook, accelerate's device_map, dynamo's fallback after too many
            # recompilations): the step plan, taken once per call, would run once per part
            self.reason = SPLIT
        if self.reason is not None:  # the cache's per-layer step graphs decide (and warn why they are off)
            return step.inner(*args)
        free_deferred()
        c = self.cache
        c.joins_external, c.decoder_active = self.plan.joins, True  # the per-layer step graphs stay out
        try:
            with as_current(c.layers[0].store.device):
                return self._step(step, args)
        finally:
            c.join_step, c.joins_external, c.decoder_active = None, False, False

    def _step(self, step: _Step, args: tuple):
        c = self.cache
        decision = self.plan.decide(self.graphs, _signature(args, step.handle_at))
        key, mode = decision.key, decision.mode
        if mode == "eager":
            self.counts["eager"] += 1
            return step.inner(*args)
        if mode == "capture":
            self._capture(key, step, args)
        else:
            graph, static, _, delta = self.graphs[key]
            for a, s in zip(args, static, strict=True):
                if isinstance(s, torch.Tensor) and s is not a and not isinstance(s, torch.nn.Parameter):
                    s.copy_(a)
            self.plan.replayed(self.plan.replay_joins(decision), delta)
            c.in_forward = True  # kvdex's logits hook (outside this graph) runs the policy's on_step
            graph.replay()
            self.counts["replays"] += 1
            c.policy.graph_replayed()
        graph, static, outs, _ = self.graphs[key]
        for i in step.mutated:
            args[i].copy_(static[i])
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]

    def _capture(self, key, step: _Step, args: tuple) -> None:
        c = self.cache
        for k in [k for k in self.graphs if self.plan.base(k) != self.plan.base(key)]:
            del self.graphs[k]  # over buffers re-allocated since: never replayed again
        dev = c.layers[0].store.device
        c.counters.count_in_place(dev)
        static = [a if i == step.handle_at else _static(a) for i, a in enumerate(args)]
        before = HostCounts.of(c)
        first = next((s for s in static if isinstance(s, torch.Tensor)), None)  # a CPU test's stand-in is made with it
        host = [lay.store.lengths_host for lay in c.layers]
        with capture_step(dev, first, host) as g:  # a private pool
            outs = step.inner(*static)
        self.graphs[key] = (g, static, list(outs), before.since(c))
        self.counts["captures"] += 1
        if dev.type == "cuda":  # the capture ran this step's host side; the replay does its device work
            g.replay()
            self.counts["replays"] += 1


def _static(a):
    """A capture's input: parameters and non-tensors as they are; other tensors copied (each replay copies
    the call's values into them)."""
    if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter):
        return a.clone()
    return a


def _signature(args: tuple, handle_at: int) -> tuple:
    """What a captured step depends on besides kvdex's own key: the shapes of the copied inputs, the
    identity of the parameters it reads in place, the values of integer inputs (the cache's handle aside)."""
    sig = []
    for i, a in enumerate(args):
        if i == handle_at:
            continue
        if isinstance(a, torch.nn.Parameter):
            sig.append(id(a))
        elif isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.dtype))
        else:
            sig.append(a)
    return tuple(sig)
