"""Count the device work of one CUDA-graph-sized decode step, per layer, model side vs kvdex side (CPU).

A graph-replayed step of quest at 128k tokens on the H200 issues ~2500 kernels (~80 per layer); each
costs ~2 us even inside a graph. This script counts, on a CPU, what one replayable decode step issues:
every aten op (a TorchDispatchMode) and every Triton launch, attributed to

* the layer it runs in (decoder-layer forward hooks; ``top`` = embedding, final norm, lm_head),
* the side: ``model`` (transformers: norms, projections, RoPE, MLP, residuals) or ``kvdex`` (the
  cache's ``update`` and ``attention`` entry points), and within kvdex the phase: ``append``
  (store append), ``update`` (the rest of Cache.update), ``select`` (policy.select), ``attend``
  (slot list / gather / attention kernel) and ``count`` (the attended-token counter).

Metadata-only ops (views, reshapes, expand, ...: no kernel on a GPU) are listed apart (``views``).

``--gpu-path`` (default on) counts what the GPU runs: triton's interpreter runs the kernels on CPU
tensors and every ``is_cuda`` gate of the step is opened, so the seams take their CUDA branches
(Quest's fused scores, the Triton top-k, the paged / dense decode kernels). Aten ops the interpreter
issues to move data in and out of a kernel are not counted; each launch counts as one kernel.
Offloaded stores cannot take their UVA path on a CPU (no pinned memory): their gather is counted as
the index_select path, which the lead's GPU profile (scripts/gpu_step_profile.py) measures for real.

    PYTHONPATH=$PWD python3 scripts/count_step_ops.py [--storage device,offload] [--no-gpu-path] [--ops]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

# before triton is imported anywhere: the kernels run through the interpreter on CPU tensors
if "--no-gpu-path" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# no kernel on a GPU: views and metadata
VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "slice",
    "select", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "lift_fresh",
    "_reshape_alias", "unfold", "diagonal", "view_as_real", "view_as_complex", "chunk", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "_local_scalar_dense", "result_type", "set_",
}  # fmt: skip


HOST = "_count_step_ops_host"


def _interp_shim():
    """triton 3.6's interpreter calls int() on 1-element arrays in loop bounds (as tests/test_triton_kernels.py)."""
    from triton.runtime import interpreter as itp

    orig = itp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    itp._patch_lang_tensor = patched


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = ["top", "model"]  # [layer, phase]
        self.mute = 0
        self.ops: collections.Counter = collections.Counter()  # (layer, phase, kind, name) -> n

    def add(self, name, kind="op"):
        self.ops[(self.where[0], self.where[1], kind, name)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.mute:
            return out
        name = func.overloadpacket.__name__
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = bool(ins) and all(getattr(t, HOST, False) for t in ins)
        if host:  # host bookkeeping (lengths_host and what is derived from it): no kernel on a GPU
            for o in torch.utils._pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    setattr(o, HOST, True)
        self.add(name, "host" if host else "view" if name in VIEW_OPS else "op")
        return out

    @contextlib.contextmanager
    def phase(self, phase, layer=None):
        old = list(self.where)
        self.where = [old[0] if layer is None else layer, phase]
        try:
            yield
        finally:
            self.where = old


def _wrap(obj, attr, ctx_fn):
    fn = getattr(obj, attr)

    def wrapped(*a, **kw):
        with ctx_fn():
            return fn(*a, **kw)

    setattr(obj, attr, wrapped)


def build(storage: str, context: int, layers: int, budget: int, dtype=torch.float16):
    import kvdex
    from kvdex.bench import runner, shapes

    cfg = shapes.make_config("llama3-8b")  # Llama-3.1-8B's structure, narrow (a CPU runs it)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size = 256, 512, layers, 512
    cfg._attn_implementation = "sdpa"
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    cache = kvdex.Cache(model, "quest", budget, dense_layers=2, offload=storage == "offload")
    ids = runner._prompt(1, context, cfg.vocab_size, 0, "cpu")
    with torch.no_grad():
        nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
    for lay in cache.layers:
        lay.store.static = True  # CUDA-graph sizing (kvdex.integration.graph)
    return model, cache, nxt


@contextlib.contextmanager
def gpu_gates(counter: Counter):
    """Open the is_cuda gates of the step's seams; count each Triton launch as one kernel."""
    from triton.runtime.interpreter import InterpretedFunction

    from kvdex.kernels import triton_attention as ta

    orig_run, orig_cuda, orig_sms = InterpretedFunction.run, torch.Tensor.is_cuda, ta._num_sms

    def run(self, *a, **kw):
        counter.add(getattr(self.fn, "__name__", "triton"), "triton")
        counter.mute += 1
        try:
            return orig_run(self, *a, **kw)
        finally:
            counter.mute -= 1

    InterpretedFunction.run = run
    torch.Tensor.is_cuda = property(lambda self: True)
    ta._num_sms = lambda index: 132  # the H200's SM count (choose_splits)
    orig_choose = ta.choose_splits
    ta.choose_splits = lambda bh, n, block_n, device: orig_choose(bh, n, block_n, torch.device("cuda", 0))
    try:
        yield
    finally:
        InterpretedFunction.run, torch.Tensor.is_cuda, ta._num_sms = orig_run, orig_cuda, orig_sms
        ta.choose_splits = orig_choose


def count_step(storage: str, context: int, layers: int, budget: int, gpu_path: bool, dtype=torch.float16) -> Counter:
    from kvdex.bench import runner
    from kvdex.integration.graph import GraphDecoder

    model, cache, nxt = build(storage, context, layers, budget, dtype)
    dec = GraphDecoder(model, cache)  # for its decisions only: which steps a graph would replay
    # as GraphDecoder's capture: the attended-token counter is one buffer, added to in place
    cache._attended = torch.zeros((), dtype=torch.long) if cache._attended is None else cache._attended.clone()
    cache._attended_inplace = True
    with torch.no_grad():
        while dec._needs_eager() or dec._key() is None:
            nxt, _ = runner._step(model, cache, nxt)
    c = Counter()
    for i, lay in enumerate(model.model.layers):
        lay.register_forward_pre_hook(lambda m, a, i=i: c.where.__setitem__(slice(None), [i, "model"]))
        lay.register_forward_hook(lambda m, a, o: c.where.__setitem__(slice(None), ["top", "model"]))
    p = cache.policy
    _wrap(p, "select", lambda: c.phase("select"))
    for lay in cache.layers:
        _wrap(lay, "update", lambda: c.phase("update"))
        _wrap(lay, "attention", lambda: c.phase("attend"))
        _wrap(lay.store, "append", lambda: c.phase("append"))
    _wrap(cache, "_count_attended", lambda: c.phase("count"))
    for lay in cache.layers:
        setattr(lay.store.lengths_host, HOST, True)
    with torch.no_grad(), contextlib.ExitStack() as st:
        if gpu_path:
            st.enter_context(gpu_gates(c))
        st.enter_context(c)
        runner._step(model, cache, nxt)
    return c


KVDEX_PHASES = ("update", "append", "select", "attend", "count")


def report(name: str, c: Counter, dense_layers: int, show_ops: bool) -> dict:
    per = collections.defaultdict(collections.Counter)  # layer -> (phase, kind) -> n
    names = collections.defaultdict(collections.Counter)  # (layer, phase) -> op name -> n
    for (layer, phase, kind, op), n in c.ops.items():
        per[layer][(phase, kind)] += n
        if kind in ("op", "triton"):
            names[(layer, phase)][f"{op}{'*' if kind == 'triton' else ''}"] += n
    rows = {}
    for lk, pick in (("dense", lambda i: i < dense_layers), ("sparse", lambda i: i >= dense_layers)):
        ls = [i for i in per if i != "top" and pick(i)]
        if not ls:
            continue
        i = max(ls)  # the last layer of its kind (every layer of a kind issues the same work)
        kern = {ph: per[i][(ph, "op")] + per[i][(ph, "triton")] for ph in ("model", *KVDEX_PHASES)}
        side = lambda kind, i=i: sum(n for (ph, k), n in per[i].items() if k == kind)  # noqa: E731
        rows[lk] = dict(kern, kvdex=sum(kern[p] for p in KVDEX_PHASES), views=side("view"), host=side("host"))
        rows[lk]["ops"] = {ph: dict(names[(i, ph)]) for ph in ("model", *KVDEX_PHASES) if names[(i, ph)]}
    top = per["top"][("model", "op")]
    print(f"\n== {name}: kernels per layer (aten ops that launch device work + Triton launches*)")
    cols = ("model", "kvdex", *KVDEX_PHASES, "views", "host")
    print(f"{'layer':<8}" + "".join(f"{p:>8}" for p in cols))
    for lk, r in rows.items():
        print(f"{lk:<8}" + "".join(f"{r[p]:>8}" for p in cols))
    print(f"top (embedding, final norm, lm_head): {top};  views: no kernel; host: ops on lengths_host (CPU)")
    if show_ops:
        for lk, r in rows.items():
            for ph, ops in r["ops"].items():
                listed = ", ".join(f"{k} x{v}" for k, v in sorted(ops.items(), key=lambda x: -x[1]))
                print(f"  {lk:<6} {ph:<7} {listed}")
    return dict(rows, top=top)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storage", default="device,offload")
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (2 dense + the rest sparse)")
    ap.add_argument("--no-gpu-path", action="store_true", help="count the CPU (PyTorch twin) path instead")
    ap.add_argument("--ops", action="store_true", help="list the ops of each phase")
    ap.add_argument(
        "--dtype",
        default="float16",
        help="float16 (default: the casts of a bf16 model; numpy, which runs the interpreter, has no bf16) or float32",
    )
    a = ap.parse_args(argv)
    gpu = not a.no_gpu_path
    if gpu:
        _interp_shim()
    out = {}
    for storage in a.storage.split(","):
        c = count_step(storage, a.context, a.layers, a.budget, gpu, getattr(torch, a.dtype))
        out[storage] = report(f"quest/{storage} ({'GPU' if gpu else 'CPU'} path)", c, 2, a.ops)
    return out


if __name__ == "__main__":
    main()
