"""Decode steps of a kvdex cache replayed from a CUDA graph (``kvdex bench --graph``).

Eager decoding of a 32-layer model launches thousands of small kernels per token from Python;
the GPU waits on the CPU. A CUDA graph records one step's kernels once and replays them with one
launch. A kvdex step is replayable when nothing in it depends on values the CPU must look at:

* between page boundaries nothing joins the middle region, so ``policy.index`` (Python over
  data-dependent shapes) does not run and every shape is fixed. A step in which a new page starts
  (the oldest window page joins the middle, once every ``page_size`` tokens) runs eagerly;
* stores and policies are switched to *static* sizing (``store.static = True``): the dense layers
  read the whole slot buffer (rows past each length are masked by the kernel using the device
  lengths), and Quest scores its whole index capacity (pages past the middle are masked). No
  length is baked into the captured step;
* positions are fed from a device buffer (``position_ids``);
* offloaded stores are replayable only with the UVA gather (page ids never leave the device).

A captured graph stays valid while the buffers it read keep their identity and size (slot
buffers, policy index tensors): the key of a graph is those tensors' ids and shapes, plus the
number of middle pages for policies whose selection slices by it (e.g. ``oracle``). A changed key
captures again. After a replay, the CPU-side bookkeeping of the step the graph stands for is done
here (lengths, sequence length, step counter, ``policy.on_step``).

Capture runs the step's Python once (its CPU-side effects are those of the captured step), then
the first replay performs its device work.
"""

from __future__ import annotations

import torch

import kvdex
from kvdex.storage import OffloadStore

# Policies whose selection does not slice by the host-side number of middle pages when static.
STATIC_SAFE = {"quest", "streaming", "full"}


class GraphDecoder:
    def __init__(self, model, cache: kvdex.Cache, batch: int):
        if not isinstance(cache, kvdex.Cache):
            raise ValueError("graph decoding needs a kvdex.Cache")
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise ValueError("graph decoding needs a CUDA device")
        self.model, self.cache, self.batch = model, cache, batch
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.cpos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph = None
        self.key = None
        self._warm_key = None
        self.logits = None
        self.counts = {"eager": 0, "captures": 0, "replays": 0}

    # ---- decisions --------------------------------------------------------------------------------
    def _stores(self):
        return [lay.store for lay in self.cache.layers]

    def _check_ready(self) -> None:
        for st in self._stores():
            if st is None:
                raise ValueError("prefill the cache before graph decoding")
            if isinstance(st, OffloadStore) and st.host._uva is None:
                raise ValueError("graph decoding of an offloaded store needs the UVA gather (triton, KVDEX_UVA != 0)")
            st.static = True

    def _needs_eager(self) -> bool:
        st = self._stores()[0]
        g, L = st.grid, st.lengths_host
        if bool((g.num_middle_pages(L + 1) != g.num_middle_pages(L)).any()):
            return True  # a page joins the middle: store/policy index work with data-dependent shapes
        for s in self._stores():
            if not isinstance(s, OffloadStore) and int(s.lengths_host.max()) + 1 > s.k.shape[2]:
                return True  # the resident buffer grows
        return False

    def _key(self):
        key = []
        for s in self._stores():
            key.append((id(s.k), tuple(s.k.shape)))
        for name, val in sorted(vars(self.cache.policy).items()):
            vals = val.items() if isinstance(val, dict) else [(None, val)]
            for k, t in vals:
                if isinstance(t, torch.Tensor):
                    key.append((name, k, id(t), tuple(t.shape)))
        name = self.cache.policy.name
        offloaded = any(isinstance(s, OffloadStore) for s in self._stores())
        if name not in STATIC_SAFE or (name == "full" and offloaded):  # offloaded "full" fetches range(nmid)
            st = self._stores()[0]
            key.append(int(st.grid.num_middle_pages(st.lengths_host).max()))
        return tuple(key)

    # ---- one step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode one token for ids [B, 1] (device); returns the last-position logits [B, vocab]."""
        self._check_ready()
        c = self.cache
        key = None if self._needs_eager() else self._key()
        if key is None or (key != self.key and key != self._warm_key):
            # eager: a page boundary, or a new key run once eagerly first so that every kernel
            # variant is compiled and loaded before a capture (no module loads while capturing)
            self._warm_key = key
            self.counts["eager"] += 1
            out = self.model(input_ids=ids, past_key_values=c, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        self.ids.copy_(ids)
        self.cpos.fill_(c.layers[0].seen)
        if self.graph is None or key != self.key:
            self._capture()
            self.key = key
            self.graph.replay()  # the capture ran this step's CPU side; this does its device work
            self.counts["replays"] += 1
            return self.logits
        c.step += 1
        for lay in c.layers:
            lay.seen += 1
            lay.store.lengths_host += 1
        c.transfer.h2d_bytes += self._h2d[0]  # what the captured step's Python counted once
        c.transfer.h2d_calls += self._h2d[1]
        self.graph.replay()
        self.counts["replays"] += 1
        c.policy.on_step(c.step, self.logits)
        return self.logits

    def _capture(self) -> None:
        self.graph = None
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        t = self.cache.transfer
        before = (t.h2d_bytes, t.h2d_calls)
        with torch.cuda.graph(g):  # a private pool per graph (a shared one trips the allocator on re-capture)
            out = self.model(
                input_ids=self.ids,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                position_ids=self.cpos[None].expand(self.batch, 1),
            )
            self.logits = out.logits[:, -1]
        self.graph = g
        self._h2d = (t.h2d_bytes - before[0], t.h2d_calls - before[1])
        self.counts["captures"] += 1
