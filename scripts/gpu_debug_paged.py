"""Debug: resident quest decoding with the paged kernel vs with attend + slot kernel (bf16, tiny model)."""

import copy
import sys

import torch

sys.path.insert(0, "tests")
from conftest import build_pair, greedy, left_padded  # noqa: E402

import kvdex  # noqa: E402
import kvdex.integration.cache as cm  # noqa: E402

model, _ = build_pair("llama_gqa")
model = copy.deepcopy(model.cuda()).to(torch.bfloat16)
ids, mask, _ = left_padded([150, 97, 40], seed=2)
ids, mask = ids.cuda(), mask.cuda()
real = cm.paged_decode_attention
runs = {}
for name in ("paged", "slot", "offload"):
    cm.paged_decode_attention = real if name == "paged" else (lambda *a, **k: None)
    cache = kvdex.Cache(model, "quest", 96, offload=name == "offload", dense_layers=1)
    sel_log = []
    orig = cache.policy.select

    def rec(layer, q, store, scale, orig=orig, sel_log=sel_log):
        s = orig(layer, q, store, scale)
        sel_log.append(s.pages.clone())
        return s

    cache.policy.select = rec
    runs[name] = (greedy(model, ids, mask, cache, new=60), sel_log)
cm.paged_decode_attention = real
for a in ("slot", "offload"):
    (ta, la), sa = runs[a]
    (tp, lp), sp = runs["paged"]
    d = (la.float() - lp.float()).abs().amax(dim=(1, 2))
    first = int((d > 0).nonzero()[0]) if bool((d > 0).any()) else None
    same_sel = all(torch.equal(x, y) for x, y in zip(sa, sp, strict=False))
    print(
        f"paged vs {a}: tokens equal {torch.equal(ta, tp)}, max |dlogit| {float(d.max()):.3g}, "
        f"first differing step {first}, selections equal {same_sel} ({len(sa)} vs {len(sp)})"
    )
(ts, ls), _ = runs["slot"]
(to, lo), _ = runs["offload"]
print(f"slot vs offload: max |dlogit| {float((ls.float() - lo.float()).abs().max()):.3g}")
