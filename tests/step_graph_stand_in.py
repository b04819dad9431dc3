"""A CPU stand-in for the CUDA graphs of kvdex's per-layer decode step (``kvdex.engine.graphs``).

The capture records the aten ops of the captured region, except host-side ones (ops on the stores'
host lengths and what is computed from them: on CUDA those run on the CPU at capture time and are not
part of the graph); a replay runs the recorded ops again on the *same tensors* (a graph re-launches the
same kernels on the same addresses) and writes their results into the captured outputs. As a CUDA
capture would, it fails on a device value read on the host (``.item()``, ``bool(t)``); a replay fails
where a tensor the graph reads was freed or moved since the capture; a host value copied into a
persistent device buffer inside the capture is an error (the graph would replay the captured value).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


class StepGraphStandIn:
    instances: list = []

    def __init__(self, static_q: torch.Tensor):
        self.static = static_q
        self.ops: list = []
        self.inside: dict[int, torch.Tensor] = {}
        self.outside: dict[int, tuple] = {}
        self.host: set[int] = set()
        self._keep: list = []
        self.replays = 0
        self._mode = None
        StepGraphStandIn.instances.append(self)

    def capture_begin(self, host=(), **_):
        self.host = {id(t) for t in host}
        self._keep = list(host)
        stand_in = self

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return stand_in._op(func, args, kwargs or {})

        self._mode = Record()
        self._mode.__enter__()

    def capture_end(self):
        self._mode.__exit__(None, None, None)

    def _op(self, func, args, kwargs):
        if getattr(func, "namespace", None) == "kvdex":  # kvdex's own ops (a whole compiled step): their
            from kvdex.hf import compiled_ops  # Python runs now, its aten ops are recorded as CUDA would

            with self._mode:
                return getattr(compiled_ops, func._opname)._init_fn(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        tens = [x for x in flat if isinstance(x, torch.Tensor)]
        hosted = [x for x in tens if id(x) in self.host]
        if hosted:  # a host-side op: runs now, is not part of the graph
            for x in tens:
                if id(x) not in self.host and id(x) in self.outside:
                    raise AssertionError(f"{func}: a host value fed into a persistent device buffer during capture")
            out = func(*args, **kwargs)
            for o in tree_flatten(out)[0] + tens:
                if isinstance(o, torch.Tensor):
                    self.host.add(id(o))
                    self._keep.append(o)
            return out
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("operation not permitted when stream is capturing (a device value read on the host)")
        out = func(*args, **kwargs)
        slots = []
        for x in flat:
            if not isinstance(x, torch.Tensor) or id(x) in self.inside or x is self.static:
                slots.append(("value", x))
            elif func is torch.ops.aten.lift_fresh.default:
                slots.append(("value", x))
            else:
                if id(x) not in self.outside:
                    meta = (x.untyped_storage().data_ptr(), x.shape, x.stride(), x.storage_offset())
                    self.outside[id(x)] = (weakref.ref(x), *meta)
                slots.append(("outside", id(x)))
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                self.inside[id(o)] = o
        self.ops.append((func, slots, spec, out))
        return out

    def replay(self):
        for ref, ptr, size, stride, off in self.outside.values():
            x = ref()
            assert x is not None, "the captured graph reads a tensor freed since the capture (stale pointer)"
            assert (x.untyped_storage().data_ptr(), x.shape, x.stride(), x.storage_offset()) == (ptr, size, stride, off)
        for func, slots, spec, out in self.ops:
            flat = [self.outside[v][0]() if kind == "outside" else v for kind, v in slots]
            args, kwargs = tree_unflatten(flat, spec)
            res = func(*args, **kwargs)
            for o, r in zip(tree_flatten(out)[0], tree_flatten(res)[0], strict=True):
                if isinstance(o, torch.Tensor) and not (o.shape == r.shape and o.data_ptr() == r.data_ptr()):
                    o.copy_(r)
        self.replays += 1


def failing_captures(monkeypatch, after: int) -> list:
    """``capture_step`` of the step graphs raising before it begins, from its ``after``-th call on (as PyTorch's
    caching allocator does for a pool it refuses); returns the list of calls."""
    from kvdex.engine.graphs import layer_graphs

    real, calls = layer_graphs.capture_step, []

    def capture_step(*args, **kw):
        calls.append(1)
        if len(calls) > after:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (a stand-in)")
        return real(*args, **kw)

    monkeypatch.setattr(layer_graphs, "capture_step", capture_step)
    return calls
