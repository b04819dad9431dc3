"""``kvdex bench`` end to end on a tiny random-weight model (CPU): records, check, table, JSON, PNG,
and the full-budget check refusing to time a broken kernel. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from kvdex import cli
from kvdex.bench import report, runner, shapes
from kvdex.bench.cli import parse_sizes


def _cfg(**kw):
    base = dict(
        shape="tiny",
        dtype="float32",
        device="cpu",
        contexts=(96,),
        batches=(1, 2),
        policies=("quest",),
        storages=("device", "offload"),
        baselines=("hf/dynamic",),
        budget=64,
        steps=3,
        warmup=1,
        split_steps=2,
        check_context=80,
    )
    return runner.BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def result():
    return runner.run(_cfg(), log=lambda s: None)


def test_check_passes_and_every_method_is_measured(result):
    assert [c["method"] for c in result["check"]] == ["quest/device", "quest/offload"]
    for c in result["check"]:
        assert c["ok"] and c["same_token"] and c["rel"] < 1e-3 and c["budget"] > c["context"]
    rows = result["results"]
    assert [(r["method"], r["batch"]) for r in rows] == [
        (m, b) for b in (1, 2) for m in ("quest/device", "quest/offload", "hf/dynamic")
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["steps"] == 3 and r["ms_p90"] >= r["ms_median"] > 0 and r["tokens_per_s"] > 0
        assert r["prefill_s"] > 0


def test_transfer_and_split_are_consistent(result):
    by = {(r["method"], r["batch"]): r for r in result["results"]}
    for b in (1, 2):
        off, dev = by[("quest/offload", b)], by[("quest/device", b)]
        # budget 64 = sink 16 + window 32 + one 16-token page per kv head, fetched every step from host
        page_bytes = 2 * 16 * 16 * 4  # K and V, 16 tokens, head_dim 16, fp32
        sparse_layers = 3 - 2
        assert off["h2d_bytes_per_step"] == b * 2 * sparse_layers * page_bytes
        assert dev["h2d_bytes_per_step"] == 0 and off["kv_host_gb"] > 0 and dev["kv_host_gb"] == 0
        for r in (off, dev):
            sp = r["split"]
            total = sum(sp[f"{k}_ms"] for k in ("selection", "transfer", "attention", "rest"))
            assert total == pytest.approx(sp["step_ms_timed"], rel=1e-6) or sp["rest_ms"] == 0
            assert all(0 <= sp[f"{k}_frac"] <= 1 for k in ("selection", "transfer", "attention", "rest"))
            assert 0 <= sp["page_reuse"] <= 1
        assert dev["split"]["transfer_ms"] >= 0 and "split" not in by[("hf/dynamic", b)]


def test_report_table_json_png(result, tmp_path):
    text = report.table(result)
    assert "quest/offload" in text and "hf/dynamic" in text and len(text.splitlines()) == 2 + 6
    report.write_json(result, tmp_path / "bench.json")
    back = json.loads((tmp_path / "bench.json").read_text())
    assert back["config"]["shape"] == "tiny" and back["versions"]["torch"] == torch.__version__
    pytest.importorskip("matplotlib")
    assert report.plot(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_check_refuses_to_time_a_wrong_kernel(monkeypatch):
    """Fault injection: a decode kernel that drops the last attended slot must fail the check,
    and nothing is timed."""
    import kvdex.engine.step as step_mod

    real = step_mod.sparse_decode_attention

    def broken(q, k, v, idx, valid, scale):
        valid = valid.clone()
        valid[..., -1] = False
        return real(q, k, v, idx, valid, scale)

    monkeypatch.setattr(step_mod, "sparse_decode_attention", broken)
    res = runner.run(_cfg(storages=("offload",), batches=(1,)), log=lambda s: None)
    assert not res["check"][0]["ok"]
    assert [r["method"] for r in res["results"]] == ["hf/dynamic"] and "full-budget check failed" in res["error"]


def test_cli_end_to_end_and_errors(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(
        [
            "bench",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--contexts",
            "64",
            "--batches",
            "1",
            "--storages",
            "device",
            "--baselines",
            "none",
            "--budget",
            "64",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--split-steps",
            "0",
            "--check-context",
            "64",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "full budget vs dense" in printed and "quest/device" in printed
    data = json.loads((out / "bench.json").read_text())
    assert [r["method"] for r in data["results"]] == ["quest/device"] and "split" not in data["results"][0]
    for bad in (
        ["--shape", "nope"],
        ["--storages", "disk"],
        ["--contexts", "12q"],
        ["--baselines", "hf/x"],
        ["--policies", "nope"],
    ):
        assert cli.main(["bench", "--device", "cpu", "--shape", "tiny", *bad]) == 2
        assert "kvdex: error:" in capsys.readouterr().err


def test_parse_sizes_and_shapes():
    assert parse_sizes("32k,128k,512k") == (32768, 131072, 524288)
    assert parse_sizes("1, 8") == (1, 8)
    with pytest.raises(ValueError):
        parse_sizes("0")
    cfg = shapes.make_config("llama3-8b", 600_000)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.max_position_embeddings == 600_000
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.make_config("gpt-17")


@pytest.mark.parametrize(
    "method,page_cache",
    [("quest/device", 0), ("streaming/device", 0), ("full/device", 0), ("quest/offload", 0), ("quest/offload", 3)],
)
def test_static_sizing_decodes_like_dynamic(method, page_cache):
    """What graph decoding relies on: with ``store.static`` (whole slot buffer for dense layers, whole
    Quest index) eager decoding gives the dynamic result, across page boundaries."""
    cfg = _cfg(budget=80, check_context=64, page_cache=page_cache)
    model = shapes.build_model("tiny", torch.float32, "cpu")
    ids = runner._prompt(2, 150, model.config.vocab_size, 0, "cpu")
    runs = []
    feed = None
    for static in (False, True):
        cache = runner.make_cache(model, method, cfg)
        nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
        if static:
            for layer in cache.layers:
                layer.store.static = True
        fed, out = [], []
        for i in range(40):
            tok = nxt if feed is None else feed[i]  # the static run is teacher-forced with the dynamic tokens
            fed.append(tok)
            nxt, lg = runner._step(model, cache, tok)
            out.append(lg)
        feed = fed
        runs.append(out)
    assert cache.layers[-1].store.lengths_host.tolist() == [190, 190]
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "method", ["quest/device", "streaming/device", "full/device", "quest/offload", "oracle/device"]
)
def test_graph_decoding_matches_eager_on_gpu(method):
    model = shapes.build_model("tiny", torch.float32, "cuda")
    res = runner.check_graph(model, _cfg(device="cuda", budget=80, check_context=150), [f"{method}+graph"], steps=40)
    assert res[0]["ok"], res
    c = res[0]["counts"]
    assert c["replays"] > 20 and c["eager"] >= 2 and c["captures"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_with_page_cache_matches_eager_on_gpu():
    model = shapes.build_model("tiny", torch.float32, "cuda")
    cfg = _cfg(device="cuda", budget=80, check_context=150, page_cache=4)
    res = runner.check_graph(model, cfg, ["quest/offload+graph"], steps=40)
    assert res[0]["ok"], res
    assert res[0]["counts"]["replays"] > 20


def test_graph_methods_and_cpu_refusal(capsys):
    cfg = _cfg(storages=("device", "offload"), baselines=())
    assert runner.BenchConfig(**{**vars(cfg), "graph": True}).methods() == [
        "quest/device", "quest/offload", "quest/device+graph", "quest/offload+graph"
    ]  # fmt: skip
    assert runner.BenchConfig(**{**vars(cfg), "graph": "only"}).methods() == [
        "quest/device+graph",
        "quest/offload+graph",
    ]
    args = ["bench", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--contexts", "64", "--batches", "1"]
    assert cli.main([*args, "--graph-only", "--baselines", "none", "--check-context", "64"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_offloaded_run_that_would_exhaust_host_memory_is_skipped(monkeypatch):
    monkeypatch.setattr(runner, "_host_available", lambda: 1000)  # bytes
    model = shapes.build_model("tiny", torch.float32, "cpu")
    rec = runner.measure(model, "quest/offload", 96, 1, _cfg())
    assert rec["status"] == "skipped" and "pinned host memory" in rec["error"]
    assert runner.measure(model, "quest/device", 96, 1, _cfg(split_steps=0))["status"] == "ok"


def test_page_cache_and_chunked_prefill_in_the_bench():
    """Offloaded with a device page cache and a chunked prefill: the check passes, hits + misses are
    every selected page of every timed step, and H2D bytes are exactly the misses' pages."""
    cfg = _cfg(storages=("offload",), batches=(1, 2), baselines=(), page_cache=3, prefill_chunk=40, budget=96)
    res = runner.run(cfg, log=lambda s: None)
    assert all(c["ok"] for c in res["check"])
    page_bytes = 2 * 16 * 16 * 4  # K and V, 16 tokens, head_dim 16, fp32
    pages = (96 - 16 - 32) // 16  # Quest's pages per kv head at this budget
    for r in res["results"]:
        assert r["status"] == "ok" and r["prefill_chunk"] == 40 and r["page_cache"] == 3
        selected = r["steps"] * r["batch"] * 2 * 1 * pages  # steps x batch x kv heads x sparse layers x pages
        assert r["page_cache_hits"] + r["page_cache_misses"] == selected
        assert 0 <= r["page_cache_hit_rate"] <= 1
        assert r["h2d_bytes_per_step"] == r["page_cache_misses"] * page_bytes / r["steps"]
    assert "pc hit" in report.table(res)


def test_chunked_prefill_bench_prefill_matches_one_forward():
    model = shapes.build_model("tiny", torch.float32, "cpu")
    ids = runner._prompt(2, 150, model.config.vocab_size, 0, "cpu")
    cfg = _cfg()
    for method in ("quest/offload", "hf/dynamic"):  # the helper works with transformers' caches too
        a = runner._prefill(model, runner.make_cache(model, method, cfg), ids)
        b = runner._prefill(model, runner.make_cache(model, method, cfg), ids, chunk=32)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_prompt_from_text_ids():
    text = torch.arange(10, 60)
    ids = runner._prompt(3, 120, 1000, 0, "cpu", text)
    assert ids.shape == (3, 120)
    for row in ids:  # consecutive windows of the (repeated) text
        d = torch.diff(row)
        assert bool(((d == 1) | (d == -49)).all())


def test_cli_new_flag_errors(capsys):
    base = ["bench", "--device", "cpu", "--shape", "tiny"]
    for bad in (["--page-cache", "-1"], ["--prefill-chunk", "-2"], ["--text", "x.txt"], ["--model", "nope.gguf"]):
        assert cli.main([*base, *bad]) == 2
        assert "kvdex: error:" in capsys.readouterr().err


def test_bench_real_model_with_text(tmp_path):
    """``--model`` (a GGUF through kvdex.load) with ``--text`` prompts: the run checks and measures. (The suite's
    load of SmolLM2 from its GGUF file itself, ``gguf_file=``: the known name loads the converted folder.)
    The file is found as ``kvdex models`` finds it (``$KVDEX_MODELS``, else ``~/.cache/kvdex/models``)."""
    from kvdex import models

    path = models.find("smollm2")
    if path is None:
        pytest.skip(f"SmolLM2 GGUF not downloaded (kvdex models fetch smollm2; looked in {models.models_dir()})")
    path = str(path)
    pytest.importorskip("gguf")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    cfg = _cfg(
        shape="smol", model=path, text=str(text), contexts=(200,), batches=(1,), storages=("offload",),
        baselines=(), page_cache=8, steps=2, split_steps=0, check_context=96, budget=80,
    )  # fmt: skip
    res = runner.run(cfg, log=lambda s: None)
    assert all(c["ok"] for c in res["check"]), res["check"]
    r = res["results"][0]
    assert r["status"] == "ok" and r["page_cache_hit_rate"] is not None


def test_table_ratio_to_full_matches_storage_and_decode_path():
    from kvdex.bench.report import table

    def row(method, tps):
        return dict(
            method=method,
            context=4096,
            batch=1,
            status="ok",
            tokens_per_s=tps,
            ms_median=1.0,
            ms_p90=1.0,
            ms_mean=1.0,
            prefill_s=0.1,
            h2d_bytes_per_step=0,
        )

    res = {
        "results": [
            row("full/device+graph", 100.0),
            row("full/device", 50.0),
            row("quest/device+graph", 150.0),
            row("quest/device", 40.0),
            row("hf/dynamic", 30.0),
        ]
    }
    lines = {ln.split()[0]: ln.split() for ln in table(res).splitlines()[2:]}
    assert lines["quest/device+graph"][4] == "1.50"  # against full/device+graph, not full/device
    assert lines["quest/device"][4] == "0.80"
    assert lines["full/device"][4] == "1.00"
    assert lines["hf/dynamic"][4] == "-"


def test_warm_up_runs_until_a_page_of_steps_captures_nothing():
    """Graph methods warm up past ``--warmup`` until ``quiet`` steps in a row captured no graph (a step's
    variants, e.g. a page join or a select_every reuse step, are captured on their first occurrence), at
    most ``most`` steps more; other methods run exactly ``--warmup`` steps."""
    from kvdex.bench.timing import warm_up

    def stepper(captures_at):
        counts, n = {"captures": 0}, [0]

        def step(x):
            counts["captures"] += n[0] in captures_at
            n[0] += 1
            return x + 1, None

        return step, counts

    step, counts = stepper({3, 5, 30})
    assert warm_up(step, 0, 4, counts, quiet=8, most=32) == (14, 14)  # step 5 captured: 6..13 are quiet
    step, counts = stepper(set(range(0, 1000, 3)))
    assert warm_up(step, 0, 4, counts, quiet=8, most=32) == (36, 36)  # never quiet: at most 32 more
    step, _ = stepper(set())
    assert warm_up(step, 0, 4) == (4, 4)  # no graph decoder: --warmup steps


@pytest.mark.parametrize("steps,want", [(3, 0), (8, 2)])
def test_periodic_rebuilds_among_the_timed_steps_are_counted(monkeypatch, steps, want):
    """PRKV rebuilds its static set every ``refresh`` steps, eagerly: the record says how many of its rebuilds
    the timed steps span (the ones the policy itself recorded after the warm-up), and the line warns when none."""
    made = []
    make = runner.make_cache
    monkeypatch.setattr(runner, "make_cache", lambda *a, **kw: made.append(make(*a, **kw)) or made[-1])
    lines = []  # budget 80: a static part of 16 tokens
    cfg = _cfg(policies=("prkv:static_ratio=0.5:refresh=4",), storages=("device",), batches=(1,), baselines=(),
               steps=steps, split_steps=0, budget=80)  # fmt: skip
    (rec,) = runner.run(cfg, log=lines.append)["results"]
    assert rec["rebuild_every"] == 4 and rec["rebuilds_timed"] == want
    layer = made[-1].policy.info.sparse_layers[0]
    done = made[-1].policy.schedule.refreshes.get(layer, [])
    assert made[-1].policy.n_static == 16 and sum(s >= rec["warmup_steps"] for s in done) == want
    line = next(s for s in lines if s.startswith("prkv"))
    assert f"rebuilds {want} (every 4 steps)" in line and (("NOT in the timing" in line) == (want == 0))
