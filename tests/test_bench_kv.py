"""``kvdex bench --kv random``: caches filled with random keys/values (no prefill) on a tiny random-weight
model (CPU). The fill goes through the ingest of a prefill (``kvdex.Cache.adopt_prefill``), is seeded,
keeps one layer alive at a time, and decodes like ``full`` when the budget covers the context."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from kvdex import cli
from kvdex.bench import report, runner, shapes
from kvdex.bench.decoding import decode_step, fill_random, make_cache, make_prompt

POLICIES = ("full", "quest", "chess", "pariskv", "prkv", "snapkv", "icecache", "icecache:search=summary:build=device")
CTX = 150


def _cfg(**kw):
    base = dict(
        shape="tiny",
        dtype="float32",
        device="cpu",
        contexts=(CTX,),
        batches=(2,),
        policies=POLICIES,
        storages=("device", "offload"),
        baselines=("hf/dynamic",),
        budget=64,
        dense_layers=1,
        steps=3,
        warmup=1,
        split_steps=0,
        check_context=80,
        kv="random",
    )
    return runner.BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model():
    return shapes.build_model("tiny", torch.float32, "cpu")


def test_random_kv_runs_every_policy_on_both_storages():
    cfg = _cfg(check=False)
    res = runner.run(cfg, log=lambda s: None)
    rows = res["results"]
    assert [r["method"] for r in rows] == [*cfg.methods()]
    assert len(rows) == 2 * len(POLICIES) + 1
    for r in rows:
        assert r["status"] == "ok", r
        assert r["kv"] == "random" and r["fill_s"] >= 0 and "prefill_s" not in r
        assert r["steps"] == 3 and r["tokens_per_s"] > 0
        if r["method"].startswith("icecache:search=summary:build=device"):  # the pages are built by the fill
            assert r["policy_stats"]["builds"] > 0 and r["policy_stats"]["semantic_store_per_dense_kv"] > 1
        if r["method"].endswith("/offload"):
            assert r["kv_host_gb"] > 0 and r["h2d_bytes_per_step"] > 0
        elif r["method"] != "hf/dynamic":
            assert r["kv_host_gb"] == 0 and r["h2d_bytes_per_step"] == 0
    assert res["config"]["kv"] == "random"
    text = report.table(res)
    assert "--kv random" in text and "decode figures only" in text
    quest = next(ln for ln in text.splitlines() if ln.startswith("quest/device"))
    assert quest.split()[8] == "-"  # no prefill time for a filled cache


@pytest.mark.parametrize("storage", ["device", "offload"])
def test_fill_is_a_prefill_of_the_context(model, storage):
    """After the fill the cache holds ``context`` tokens per row in every layer, the offloaded store
    holds them on the host, and decoding goes on at position ``context``."""
    cfg = _cfg()
    cache = make_cache(model, f"quest/{storage}", cfg)
    fill_random(model, cache, CTX, 2, seed=5)
    assert cache.step == 0 and cache.get_seq_length() == CTX
    for lay in cache.layers:
        assert lay.seen == CTX and lay.store.lengths_host.tolist() == [CTX, CTX]
        assert lay.pads.tolist() == [0, 0]
    s = cache.stats()
    assert s["context_tokens"] == [CTX, CTX]
    assert (s["kv_bytes_host"] > 0) == (storage == "offload")
    assert set(cache.policy.kmin) == set(cache.policy.info.sparse_layers)  # Quest indexed every sparse layer
    nxt = make_prompt(2, 1, model.config.vocab_size, 0, "cpu")
    decode_step(model, cache, nxt)
    assert cache.step == 1 and cache.get_seq_length() == CTX + 1
    assert cache.layers[-1].store.lengths_host.tolist() == [CTX + 1, CTX + 1]


def _greedy_after_fill(model, method, cfg, budget, new=12):
    cache = make_cache(model, method, cfg, budget=budget)
    fill_random(model, cache, CTX, 2, seed=3)
    nxt = make_prompt(2, 1, model.config.vocab_size, 4, "cpu")
    toks, logits = [], []
    for _ in range(new):
        nxt, lg = decode_step(model, cache, nxt)
        toks.append(nxt)
        logits.append(lg)
    return torch.cat(toks, 1), torch.stack(logits)


def test_full_budget_decodes_like_full_after_the_same_fill(model):
    """Every policy, on both storages, at a budget covering the context decodes the greedy tokens of
    ``full`` after the same random fill; so does transformers' DynamicCache filled through ``update``."""
    cfg = _cfg()
    # retrieval budget: whole pages covering the context and the new tokens (PRKV leaves the rest of a
    # static region's last page unattended when the retrieval budget is not a multiple of the page size)
    budget = cfg.sink + cfg.window + cfg.page_size * -(-(CTX + 64) // cfg.page_size)
    ref_toks, ref_logits = _greedy_after_fill(model, "full/device", cfg, budget)
    for method in ["hf/dynamic", *(f"{p}/{s}" for p in (*POLICIES, "h2o") for s in ("device", "offload"))]:
        toks, logits = _greedy_after_fill(model, method, cfg, budget)
        assert torch.equal(toks, ref_toks), method
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4, msg=method)


def test_fill_is_deterministic_for_a_seed_and_the_same_for_every_method(model):
    cfg = _cfg()

    def layers(method, seed):
        cache = make_cache(model, method, cfg)
        fill_random(model, cache, CTX, 2, seed=seed)
        if method == "hf/dynamic":
            return [(lay.keys, lay.values) for lay in cache.layers]
        out = [lay.store.dense() for lay in cache.layers]
        assert all(lay.engine.obs_q.shape == (2, 4, 128, 16) for lay in cache.layers)  # the kept queries
        return [(k[:, :, :CTX], v[:, :, :CTX]) for k, v in out]

    a, b = layers("quest/device", 11), layers("snapkv/offload", 11)
    c, d = layers("hf/dynamic", 11), layers("quest/device", 12)
    for i in range(len(a)):
        for x, y, z in zip(a[i], b[i], c[i], strict=True):
            assert torch.equal(x, y) and torch.equal(x, z)
        assert not torch.equal(a[i][0], d[i][0])  # another seed, other numbers
        if i:
            assert not torch.equal(a[i][0], a[0][0])  # every layer its own
    assert abs(float(a[0][0].std()) - 1) < 0.05  # N(0, 1)


def test_one_layer_alive_at_a_time(model):
    """``Cache.adopt_prefill`` drops a layer's prompt before the next is made (at 512k a layer is 2 GiB)."""
    cfg = _cfg()
    cache = make_cache(model, "quest/offload", cfg)
    alive = []

    def make():
        gc.collect()
        assert not any(r() is not None for r in alive), "the previous layer's prompt is still alive"
        kvq = torch.randn(2, 2, CTX, 16), torch.randn(2, 2, CTX, 16), torch.randn(2, 4, 8, 16)
        alive.extend(weakref.ref(t) for t in kvq)
        return kvq

    def layers():
        for _ in cache.layers:
            yield make()

    cache.adopt_prefill(layers(), torch.full((2,), CTX))
    assert cache.get_seq_length() == CTX


def test_adopt_prefill_needs_a_new_cache(model):
    cfg = _cfg()
    cache = make_cache(model, "quest/device", cfg)
    fill_random(model, cache, CTX, 1, seed=0)
    with pytest.raises(ValueError, match="needs a new cache"):
        fill_random(model, cache, CTX, 1, seed=0)
    with pytest.raises(ValueError, match="layers gave 0 layers, the model has 3"):
        make_cache(model, "quest/device", cfg).adopt_prefill(iter(()), torch.full((1,), CTX))
    fork = cache.fork("snapkv", 96)  # a filled cache forks like a prefilled one
    assert fork.get_seq_length() == CTX and fork.step == 0


def test_bad_kv_value_and_conflicting_flags(capsys, tmp_path):
    with pytest.raises(ValueError, match="--kv 'rand'.*'prompt'.*'random'"):
        runner.BenchConfig(kv="rand")
    with pytest.raises(ValueError, match="drop --text and --prefill-chunk"):
        runner.BenchConfig(kv="random", prefill_chunk=1024)
    base = ["bench", "--device", "cpu", "--shape", "tiny", "--dtype", "float32"]
    assert cli.main([*base, "--kv", "rand"]) == 2
    err = capsys.readouterr().err
    assert "kvdex: error:" in err and "--kv 'rand'" in err
    assert cli.main([*base, "--kv", "random", "--prefill-chunk", "64"]) == 2
    assert "drop --text and --prefill-chunk" in capsys.readouterr().err
    out = tmp_path / "run"
    args = ["--contexts", "64", "--batches", "1", "--storages", "device", "--baselines", "none", "--budget", "64"]
    args += ["--steps", "2", "--warmup", "0", "--split-steps", "0", "--check-context", "64", "--out", str(out)]
    assert cli.main([*base, *args, "--kv", "random"]) == 0
    assert "random fill" in capsys.readouterr().out
    rec = json.loads((out / "bench.json").read_text())["results"][0]
    assert rec["kv"] == "random" and "fill_s" in rec and "prefill_s" not in rec
