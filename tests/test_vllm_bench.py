"""``kvdex vllm bench`` without vLLM or a GPU: the dummy-weight model folder, the ``vllm serve`` / ``vllm bench serve``
command lines, the reading of vLLM's saved result, the ratios and table, resuming a run, the checks of the
arguments, and the server process's start and stop (a stand-in HTTP server)."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvdex import cli, models
from kvdex.bench.shapes import SHAPES
from kvdex.vllm import bench, bench_plan
from kvdex.vllm.bench_plan import (
    DEFAULT_ROW,
    bench_command,
    load,
    pending,
    read_result,
    serve_command,
    table,
    with_ratios,
    write_model_dir,
)

TOKENIZER = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": [{"id": 49151}]}


def args(*extra: str):
    return cli.build_parser().parse_args(["vllm", "bench", *extra])


def settings(*extra: str) -> dict:
    return bench_plan.settings_of(args(*extra))


@pytest.fixture
def no_models(tmp_path, monkeypatch):
    """No fetched model anywhere kvdex looks (KVDEX_MODELS and the home cache both empty)."""
    monkeypatch.setenv(models.ENV, str(tmp_path / "models"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "models"


@pytest.fixture
def smollm2(no_models):
    """A stand-in of the fetched SmolLM2's converted folder: its tokenizer files and completion stamp."""
    m = models.KNOWN["smollm2"]
    folder = no_models / m.subdir / models.CONVERTED
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "config.json").write_text("{}")  # SmolLM2's own: not copied
    (folder / "generation_config.json").write_text("{}")  # not copied either
    (folder / models.CONVERTED_FROM).write_text(m.sha256 + "\n")
    assert models.converted("smollm2") == folder
    return folder


# ---- the model folder ------------------------------------------------------------------------------------------


def test_model_folder_has_the_shape_and_smollm2s_tokenizer(smollm2, tmp_path):
    dest = write_model_dir("llama3-8b", tmp_path / "model", 131456)
    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["dtype"] == "bfloat16" and config["max_position_embeddings"] >= 131456
    for key, value in SHAPES["llama3-8b"][1].items():
        if key != "rope_theta":  # transformers 5 files it under rope_parameters
            assert config[key] == value, key
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert theta == SHAPES["llama3-8b"][1]["rope_theta"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (dest / name).read_bytes() == (smollm2 / name).read_bytes()
    assert not (dest / "generation_config.json").exists()
    assert sorted(p.name for p in dest.iterdir()) == ["chat_template.jinja", "config.json", "tokenizer.json",
                                                      "tokenizer_config.json"]  # fmt: skip
    assert write_model_dir("qwen2.5-7b", tmp_path / "q", 9000).joinpath("config.json").read_text().count("Qwen2")


def test_model_folder_without_smollm2_says_how_to_fetch_it(no_models, tmp_path):
    with pytest.raises(ValueError, match="kvdex models fetch smollm2"):
        write_model_dir("llama3-8b", tmp_path / "model", 40000)
    assert not (tmp_path / "model").exists()


def test_model_folder_keeps_its_tokenizer_without_smollm2(smollm2, tmp_path, monkeypatch):
    dest = write_model_dir("llama3-8b", tmp_path / "model", 40000)
    monkeypatch.setenv(models.ENV, str(tmp_path / "elsewhere"))  # a machine where SmolLM2 is not fetched
    assert models.converted("smollm2") is None
    write_model_dir("llama3-8b", dest, 140000)
    assert json.loads((dest / "config.json").read_text())["max_position_embeddings"] >= 140000
    assert (dest / "tokenizer.json").read_bytes() == (smollm2 / "tokenizer.json").read_bytes()


def test_a_shape_whose_vocabulary_is_smaller_than_the_tokenizers_is_refused(smollm2, tmp_path):
    with pytest.raises(ValueError, match="larger vocabulary"):
        write_model_dir("tiny", tmp_path / "model", 4096)


# ---- command lines ---------------------------------------------------------------------------------------------


def _flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, name
    return cmd[cmd.index(name) + 1]


def test_serve_command_of_the_default_backend(tmp_path):
    s = settings("--contexts", "32k,128k")
    cmd = serve_command(tmp_path, None, s)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    assert _flag(cmd, "--load-format") == "dummy"
    assert _flag(cmd, "--max-model-len") == str(131072 + 128 + bench_plan.MARGIN)
    assert _flag(cmd, "--gpu-memory-utilization") == "0.8" and _flag(cmd, "--block-size") == "16"
    assert "--no-enable-prefix-caching" in cmd
    assert "--attention-backend" not in cmd and "--additional-config" not in cmd and "--enforce-eager" not in cmd


def test_serve_command_of_a_kvdex_row(tmp_path):
    s = settings("--enforce-eager", "--gpu-memory-utilization", "0.6", "--serve-args=--max-num-seqs 16",
                 "--policies", "quest,chess:interval=16")  # fmt: skip
    cmd = serve_command(tmp_path, "chess:interval=16", s)
    assert _flag(cmd, "--attention-backend") == "CUSTOM"
    assert json.loads(_flag(cmd, "--additional-config")) == {"kvdex": {"policy": "chess:interval=16", "budget": 2048}}
    assert "--enforce-eager" in cmd and _flag(cmd, "--gpu-memory-utilization") == "0.6"
    assert cmd[-2:] == ["--max-num-seqs", "16"]
    config = json.loads(_flag(serve_command(tmp_path, "quest", settings("--budget", "4096")), "--additional-config"))
    assert config == {"kvdex": {"policy": "quest", "budget": 4096}}
    graphs = json.loads(_flag(serve_command(tmp_path, "quest", settings("--decode-graphs")), "--additional-config"))
    assert graphs == {"kvdex": {"policy": "quest", "budget": 2048, "decode_graphs": True}}
    more = settings("--settings", '{"prefill_attention": "flash", "window": 64}')
    config = json.loads(_flag(serve_command(tmp_path, "prkv", more), "--additional-config"))
    assert config == {"kvdex": {"policy": "prkv", "budget": 2048, "prefill_attention": "flash", "window": 64}}
    assert "--additional-config" not in serve_command(tmp_path, None, more)  # vLLM's row: no kvdex settings


def test_bench_command(tmp_path):
    s = settings("--prompts-per-concurrency", "3", "--request-rate", "4")
    cmd = bench_command(tmp_path / "model", 32768, 8, s, tmp_path / "results" / "quest_32k_c8.json")
    assert cmd[:6] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend"]
    expect = {"--backend": "vllm", "--dataset-name": "random", "--random-input-len": "32768",
              "--random-output-len": "128", "--num-prompts": "24", "--max-concurrency": "8", "--request-rate": "4",
              "--result-dir": str(tmp_path / "results"), "--result-filename": "quest_32k_c8.json",
              "--model": bench_plan.SERVED, "--tokenizer": str(tmp_path / "model"), "--port": "8000"}  # fmt: skip
    for name, value in expect.items():
        assert _flag(cmd, name) == value, name
    assert "--ignore-eos" in cmd and "--save-result" in cmd
    assert _flag(bench_command(tmp_path, 1024, 4, settings("--prompts-per-concurrency", "1"), tmp_path / "r.json"),
                 "--num-prompts") == "4"  # fmt: skip


# ---- vLLM's result, ratios, table ------------------------------------------------------------------------------


def fake_result(tok_s: float, tpot: float, ttft: float, **more) -> dict:
    """A ``vllm bench serve --save-result`` JSON (its key names, fewer keys)."""
    return {"date": "20260101-000000", "backend": "vllm", "model_id": "kvdex-bench", "num_prompts": 2,
            "request_rate": "inf", "max_concurrency": 1, "duration": 3.5, "completed": 2, "failed": 0,
            "total_input_tokens": 65536, "total_output_tokens": 256, "request_throughput": 0.57,
            "output_throughput": tok_s, "total_token_throughput": 18800.0, "mean_ttft_ms": ttft * 1.1,
            "median_ttft_ms": ttft, "std_ttft_ms": 1.0, "p99_ttft_ms": ttft * 1.3, "mean_tpot_ms": tpot * 1.05,
            "median_tpot_ms": tpot, "p99_tpot_ms": tpot * 1.2, "mean_itl_ms": tpot,
            "median_itl_ms": tpot} | more  # fmt: skip


def test_read_result(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(fake_result(73.0, 13.5, 1900.0)))
    got = read_result(path)
    assert got["metrics"] == {"output_throughput": 73.0, "median_tpot_ms": 13.5, "mean_tpot_ms": 13.5 * 1.05,
                              "median_ttft_ms": 1900.0}  # fmt: skip
    assert got["raw"]["total_output_tokens"] == 256 and got["raw"]["p99_tpot_ms"] == pytest.approx(16.2)
    path.write_text(json.dumps({k: v for k, v in fake_result(1, 1, 1).items() if k != "median_tpot_ms"}))
    with pytest.raises(ValueError, match="median_tpot_ms"):
        read_result(path)


def test_read_result_keeps_the_slowest_tokens_and_drops_the_texts(tmp_path):
    """``--save-detailed``'s per-request inter-token latencies (seconds) give the row's slowest output tokens (index
    in the request's output, the first token 0; the slowest gap over the requests), slowest first; the generated
    texts are not kept."""
    from kvdex.vllm.bench_plan import slow_steps

    itls = [[0.01, 0.5, 0.01, 0.01, 0.2], [0.01, 0.01, 0.9, 0.01, 0.3]]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(fake_result(73.0, 13.5, 1900.0, itls=itls, generated_texts=["a b", "c d"])))
    got = read_result(path)
    assert got["slow_steps"] == [[3, 900.0], [2, 500.0], [5, 300.0], [1, 10.0], [4, 10.0]]
    assert "generated_texts" not in got["raw"] and got["raw"]["itls"] == itls
    assert slow_steps(None) == [] and slow_steps(itls, top=1) == [[3, 900.0]]


def row(name: str, ctx: int, conc: int, tok_s: float, tpot: float, ttft: float, gpu: str = "H100", **more) -> dict:
    metrics = {"output_throughput": tok_s, "median_tpot_ms": tpot, "mean_tpot_ms": tpot, "median_ttft_ms": ttft}
    return {"label": name, "policy": None if name == DEFAULT_ROW else name, "context": ctx, "concurrency": conc,
            "gpu": gpu, "num_prompts": 2 * conc, "status": "ok", "metrics": metrics, "wall_s": 10.0} | more  # fmt: skip


def test_ratios_are_to_the_default_row_of_the_same_context_concurrency_and_gpu():
    rows = [
        row(DEFAULT_ROW, 32768, 1, 100.0, 10.0, 1000.0),
        row("quest", 32768, 1, 50.0, 20.0, 1500.0),
        row(DEFAULT_ROW, 32768, 8, 400.0, 20.0, 4000.0),
        row("quest", 32768, 8, 800.0, 10.0, 4000.0),
        row("prkv", 131072, 1, 30.0, 30.0, 9000.0),  # no default row at 128k
        row("prkv", 32768, 1, 80.0, 12.0, 1000.0, gpu="H200"),  # nor on this GPU
    ]
    got = with_ratios(rows)
    assert got[1]["vs_default"] == {"output_throughput": 0.5, "median_tpot_ms": 2.0, "mean_tpot_ms": 2.0,
                                    "median_ttft_ms": 1.5}  # fmt: skip
    assert got[3]["vs_default"]["output_throughput"] == 2.0 and got[3]["vs_default"]["median_tpot_ms"] == 0.5
    assert "vs_default" not in got[0] and "vs_default" not in got[4] and "vs_default" not in got[5]
    text = table(rows).splitlines()
    assert text[0].split()[:2] == ["backend", "context"]
    assert len(text) == 7
    line = next(t for t in text if t.startswith("kvdex quest") and " 8 " in t)
    assert line.split()[-3:] == ["2.00", "0.50", "1.00"] and "800.0" in line
    assert line.split()[-5:-3] == ["-", "-"]  # no whole result: no inter-token latencies
    with_itl = row("quest", 32768, 8, 800.0, 10.0, 4000.0, raw=fake_result(800.0, 10.0, 4000.0, p99_itl_ms=250.0))
    line = next(t for t in table([rows[2], with_itl]).splitlines() if t.startswith("kvdex quest"))
    assert line.split()[-5:-3] == ["10.0", "250.0"]
    errored = row("chess", 32768, 1, 0, 0, 0) | {"status": "error", "metrics": None}
    assert next(t for t in table([*rows[:2], errored]).splitlines() if "chess" in t).split()[5] == "error"


# ---- the run: resuming, stopping -------------------------------------------------------------------------------


class FakeServer:
    started: list[list[str]] = []

    def __init__(self, cmd, port, log, deadline, timeout=0.0):
        self.cmd, self.log, self.startup_s = cmd, log, 1.0

    def __enter__(self):
        FakeServer.started.append(self.cmd)
        return self

    def __exit__(self, *exc):
        pass

    def alive(self):
        return True

    def attention_backend(self):
        return "CUSTOM" if "--attention-backend" in self.cmd else "FLASH_ATTN"

    def kvdex_messages(self):
        return ["kvdex: a message"] if "--attention-backend" in self.cmd else []


WARMUPS: list[tuple[str, int, int]] = []  # the warm-up requests fake_vllm served: (label, context, concurrency)
SHORT: dict[str, int] = {}  # output tokens a backend's stand-in leaves out of each row (a server that stopped)


@pytest.fixture
def fake_vllm(smollm2, monkeypatch):
    """``run`` with a stand-in server and a stand-in ``vllm bench serve`` that saves a result JSON; returns the
    list of (label, context, concurrency) each measured."""
    measured: list[tuple[str, int, int]] = []

    def fake_bench(cmd, log, timeout):
        served = FakeServer.started[-1]
        name = json.loads(_flag(served, "--additional-config"))["kvdex"]["policy"] if "--attention-backend" in served \
            else DEFAULT_ROW  # fmt: skip
        ctx, conc = int(_flag(cmd, "--random-input-len")), int(_flag(cmd, "--max-concurrency"))
        result = Path(_flag(cmd, "--result-dir")) / _flag(cmd, "--result-filename")
        (WARMUPS if result.name.startswith("warmup-") else measured).append((name, ctx, conc))
        speed = 100.0 if name == DEFAULT_ROW else 50.0
        tokens = int(_flag(cmd, "--num-prompts")) * int(_flag(cmd, "--random-output-len")) - SHORT.get(name, 0)
        result.write_text(json.dumps(fake_result(speed * conc, 1000 / speed, 100.0, total_output_tokens=tokens)))
        log.write_text("done\n")
        return 0

    FakeServer.started = []
    WARMUPS.clear()
    SHORT.clear()
    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "_bench", fake_bench)
    monkeypatch.setattr(bench, "gpu_name", lambda: "Fake GPU")
    monkeypatch.setattr(bench, "_check_installed", lambda todo: None)
    return measured


def test_a_rerun_skips_the_rows_already_measured(fake_vllm, tmp_path, capsys):
    out = tmp_path / "out"
    s = settings("--contexts", "1k", "--concurrency", "1,4", "--policies", "quest,prkv")
    first = row(DEFAULT_ROW, 1024, 1, 100.0, 10.0, 100.0, gpu="Fake GPU")
    out.mkdir()
    (out / "bench.json").write_text(json.dumps({"settings": s, "rows": [first]}))
    record = bench.run(s, out, out / "model")
    assert fake_vllm == [(DEFAULT_ROW, 1024, 4), ("quest", 1024, 1), ("quest", 1024, 4), ("prkv", 1024, 1),
                         ("prkv", 1024, 4)]  # fmt: skip
    assert len(FakeServer.started) == 3  # one server per backend, every row of it
    assert record["complete"] and record["gpu"] == "Fake GPU" and "vllm" in record["versions"]
    saved = json.loads((out / "bench.json").read_text())
    assert len(saved["rows"]) == 6 and all(r["status"] == "ok" for r in saved["rows"])
    quest4 = next(r for r in saved["rows"] if (r["label"], r["concurrency"]) == ("quest", 4))
    assert quest4["vs_default"]["output_throughput"] == 0.5 and quest4["raw"]["completed"] == 2
    assert quest4["attention_backend"] == "CUSTOM" and (out / quest4["result_file"]).is_file()
    assert quest4["kvdex_messages"] == ["kvdex: a message"]
    printed = capsys.readouterr().out
    assert printed.count("  kvdex: a message") == 2  # once per kvdex server (quest, prkv), before its rows
    assert "kvdex quest" in printed

    fake_vllm.clear()
    bench.run(settings("--contexts", "1k", "--concurrency", "1,4", "--policies", "quest,prkv"), out, out / "model")
    assert fake_vllm == []  # all there
    bench.run(settings("--contexts", "1k,2k", "--concurrency", "4", "--policies", "prkv"), out, out / "model")
    assert fake_vllm == [(DEFAULT_ROW, 2048, 4), ("prkv", 2048, 4)]  # the grid grew: only the new rows
    with pytest.raises(ValueError, match="other settings.*budget 2048 -> 1024"):
        bench.run(settings("--contexts", "1k", "--budget", "1024"), out, out / "model")
    with pytest.raises(ValueError, match="other settings.*decode_graphs False -> True"):
        bench.run(settings("--contexts", "1k", "--decode-graphs"), out, out / "model")
    with pytest.raises(ValueError, match="other settings.*kvdex_settings {} -> {'window': 64}"):
        bench.run(settings("--contexts", "1k", "--settings", '{"window": 64}'), out, out / "model")
    saved = json.loads((out / "bench.json").read_text())
    del saved["settings"]["decode_graphs"], saved["settings"]["kvdex_settings"]  # a record from before them
    (out / "bench.json").write_text(json.dumps(saved))
    bench.run(settings("--contexts", "1k", "--concurrency", "1,4", "--policies", "quest,prkv"), out, out / "model")


def test_skipped_rows_are_left_out_of_the_grid(fake_vllm, tmp_path):
    out = tmp_path / "out"
    s = settings("--contexts", "1k,2k", "--concurrency", "1,4", "--policies", "quest", "--skip", "2k:4, 1k:1")
    assert s["skip"] == [[2048, 4], [1024, 1]]
    bench.run(s, out, out / "model")
    assert fake_vllm == [(DEFAULT_ROW, 1024, 4), (DEFAULT_ROW, 2048, 1), ("quest", 1024, 4), ("quest", 2048, 1)]
    fake_vllm.clear()
    bench.run(settings("--contexts", "1k,2k", "--concurrency", "1,4", "--policies", "quest"), out, out / "model")
    assert fake_vllm == [(DEFAULT_ROW, 1024, 1), (DEFAULT_ROW, 2048, 4), ("quest", 1024, 1), ("quest", 2048, 4)]


def test_each_server_serves_one_warm_up_request_before_its_rows(fake_vllm, tmp_path, capsys):
    """The grid's longest prompt with --warmup-len output tokens (default: --output-len), outside every row;
    --warmup-len 0: none."""
    out = tmp_path / "out"
    bench.run(settings("--contexts", "1k,2k", "--concurrency", "1,4", "--policies", "quest"), out, out / "model")
    assert WARMUPS == [(DEFAULT_ROW, 2048, 1), ("quest", 2048, 1)] and len(fake_vllm) == 8
    assert (out / "logs" / "bench-warmup-quest.log").is_file() and "warm-up request" in capsys.readouterr().out
    saved = json.loads((out / "bench.json").read_text())
    assert saved["settings"]["warmup_len"] == saved["settings"]["output_len"] == 128 and len(saved["rows"]) == 8
    WARMUPS.clear()
    bench.run(settings("--contexts", "1k", "--concurrency", "1", "--policies", "quest", "--warmup-len", "0"),
              tmp_path / "none", tmp_path / "none" / "model")  # fmt: skip
    assert WARMUPS == []
    with pytest.raises(ValueError, match="other settings.*warmup_len 128 -> 0"):
        bench.run(settings("--contexts", "1k", "--warmup-len", "0"), out, out / "model")


def test_a_row_whose_requests_came_back_short_is_an_error(fake_vllm, tmp_path):
    """--ignore-eos: every request returns --output-len tokens; fewer (a server that stopped mid-row, its stream
    closed without an error) is recorded as an error, not as a fast row."""
    SHORT["quest"] = 100
    out = tmp_path / "out"
    record = bench.run(settings("--contexts", "1k", "--concurrency", "1", "--policies", "quest"), out, out / "model")
    bad = next(r for r in record["rows"] if r["label"] == "quest")
    assert bad["status"] == "error" and "156 of 256 output tokens" in bad["error"]
    assert next(r for r in record["rows"] if r["label"] == DEFAULT_ROW)["status"] == "ok" and not record["complete"]


def test_rows_of_another_gpu_or_recorded_as_errors(fake_vllm, tmp_path):
    s = settings("--contexts", "1k", "--concurrency", "1", "--policies", "quest")
    other = row(DEFAULT_ROW, 1024, 1, 1, 1, 1, gpu="Other GPU")
    failed = row("quest", 1024, 1, 0, 0, 0, gpu="Fake GPU") | {"status": "error"}
    record = {"settings": s, "rows": [other, failed]}
    assert pending(record, s, "Fake GPU") == [(None, 1024, 1)]
    assert pending(record, s, "Fake GPU", retry=True) == [(None, 1024, 1), ("quest", 1024, 1)]
    (tmp_path / "bench.json").write_text(json.dumps(record))
    assert load(tmp_path, s)["rows"] == record["rows"]
    bench.run(s, tmp_path, tmp_path / "model", retry=True)
    assert fake_vllm == [(DEFAULT_ROW, 1024, 1), ("quest", 1024, 1)]


def test_the_time_limit_stops_between_rows(fake_vllm, tmp_path, monkeypatch, capsys):
    s = settings("--contexts", "1k", "--concurrency", "1,2", "--policies", "quest", "--warmup-len", "0")
    clock = iter(range(0, 10_000, 100))  # 100 s per look at the clock
    monkeypatch.setattr(bench, "_clock", lambda: float(next(clock)))
    record = bench.run(s, tmp_path, tmp_path / "model", max_minutes=5)
    assert 0 < len(fake_vllm) < 4 and not record["complete"]
    assert "INCOMPLETE" in capsys.readouterr().out


def test_a_row_cut_by_the_time_limit_is_not_recorded(fake_vllm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_bench", lambda cmd, log, timeout: None)  # timed out
    s = settings("--contexts", "1k", "--concurrency", "1", "--warmup-len", "0")
    record = bench.run(s, tmp_path, tmp_path / "m", max_minutes=5)
    assert record["rows"] == [] and not record["complete"]
    assert "not recorded" in capsys.readouterr().out
    s = settings("--contexts", "1k", "--concurrency", "1")
    record = bench.run(s, tmp_path / "w", tmp_path / "m", max_minutes=5)
    assert record["rows"] == [] and "during the warm-up of default" in capsys.readouterr().out


def test_dry_run_prints_the_commands(smollm2, tmp_path, capsys):
    bench.run(settings("--contexts", "1k", "--concurrency", "2", "--policies", "quest"), tmp_path, tmp_path / "m",
              dry_run=True)  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and "--attention-backend CUSTOM" in lines[3] and "bench serve" in lines[5]
    assert "--random-output-len 128 " in lines[4] and "--num-prompts 1 " in lines[4]  # the warm-up request
    assert not (tmp_path / "bench.json").exists()


# ---- arguments -------------------------------------------------------------------------------------------------


def test_defaults():
    s = settings()
    assert s["shape"] == "llama3-8b" and s["contexts"] == [32768, 131072] and s["concurrency"] == [1, 8]
    assert s["policies"] == ["quest", "prkv", "chess"] and s["budget"] == 2048 and s["output_len"] == 128
    assert s["prompts_per_concurrency"] == 2 and args().func is bench.main


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policies", "quest,nosuch"], "unknown policy 'nosuch'"),
        (["--policies", "quest:nosuch=1"], "quest"),
        (["--policies", "chess:trigger=uncertainty"], "trigger=interval"),
        (["--policies", "quest,quest"], "once"),
        (["--budget", "16"], "budget >= "),
        (["--contexts", "32q"], "--contexts '32q'.*32k,128k"),
        (["--contexts", "0"], "positive"),
        (["--concurrency", "one"], "--concurrency"),
        (["--skip", "128k"], "CONTEXT:CONCURRENCY"),
        (["--skip", "64k:1"], "not a row of the grid"),
        (["--skip", "128k:2"], "not a row of the grid"),
        (["--shape", "llama9"], "shapes: "),
        (["--request-rate", "fast"], "inf"),
        (["--gpu-memory-utilization", "1.5"], r"\(0, 1\]"),
        (["--output-len", "0"], ">= 1"),
        (["--settings", "prefill_attention=flash"], "JSON object"),
        (["--settings", "[1]"], "JSON object"),
        (["--settings", '{"budget": 512}'], "--budget"),
        (["--settings", '{"prefill_attention": "fast"}'], "prefill_attention"),
        (["--settings", '{"offload": true}'], "no offload"),
    ],
)
def test_bad_arguments_name_the_fix(extra, message):
    with pytest.raises(ValueError, match=message):
        settings(*extra)


def test_bad_arguments_exit_2_before_anything_runs(tmp_path, capsys):
    assert cli.main(["vllm", "bench", "--out", str(tmp_path / "o"), "--policies", "nosuch"]) == 2
    assert "unknown policy 'nosuch'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_module_imports_no_vllm():
    import ast

    for module in (bench, bench_plan):
        tree = ast.parse(Path(module.__file__).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(n == "vllm" or n.startswith("vllm.") for n in names), module.__name__


# ---- the server process ----------------------------------------------------------------------------------------

STAND_IN = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # as vLLM's engine core
    print("child", child.pid, flush=True)
    print("INFO Using AttentionBackendEnum.CUSTOM backend.", flush=True)

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()
            self.wfile.write(b'{"data": []}')

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_servers_kvdex_warnings_are_read_from_its_log_once_each(tmp_path):
    log = tmp_path / "serve.log"
    server = bench.Server(["vllm"], 8000, log, deadline=0.0)
    assert server.kvdex_messages() == []
    warn = "kvdex: vLLM's FlashAttention decode failed on a cache of this engine's shape (RuntimeError: no kernel)"
    log.write_text(f"(EngineCore pid=1) INFO started\n(EngineCore pid=1) {warn}\nINFO x\n{warn}\n")
    assert server.kvdex_messages() == [warn]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_server_waits_for_v1_models_then_stops_its_whole_group(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(STAND_IN)
    port = _free_port()
    log = tmp_path / "logs" / "serve.log"
    with bench.Server([sys.executable, str(script), str(port)], port, log, deadline=time.monotonic() + 60) as server:
        assert server.alive() and server.attention_backend() == "CUSTOM"
        pid = server.proc.pid
        child = int(log.read_text().split()[1])
        assert _running(pid) and _running(child)
        with pytest.raises(ValueError, match=f"port {port} is in use"):
            bench.Server([sys.executable, "-c", "pass"], port, tmp_path / "other.log", time.monotonic() + 5).__enter__()
    assert not _running(pid) and not _running(child)


def test_server_that_exits_is_an_error_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('ValueError: no CUSTOM backend'); sys.exit(3)"]
    with pytest.raises(bench.ServerError, match="exited with 3.*no CUSTOM backend"):
        with bench.Server(cmd, _free_port(), tmp_path / "s.log", deadline=time.monotonic() + 60):
            pass


def test_a_server_that_fails_records_its_rows_as_errors(fake_vllm, tmp_path, monkeypatch, capsys):
    class Failing(FakeServer):
        def __enter__(self):
            if "--attention-backend" in self.cmd:
                raise bench.ServerError("vllm serve exited with 1 before serving: no CUSTOM backend")
            return super().__enter__()

    monkeypatch.setattr(bench, "Server", Failing)
    s = settings("--contexts", "1k", "--concurrency", "1,2", "--policies", "quest")
    record = bench.run(s, tmp_path, tmp_path / "model")
    assert fake_vllm == [(DEFAULT_ROW, 1024, 1), (DEFAULT_ROW, 1024, 2)]  # the next backend still ran
    errors = [r for r in record["rows"] if r["status"] == "error"]
    assert [(r["label"], r["concurrency"]) for r in errors] == [("quest", 1), ("quest", 2)]
    assert "no CUSTOM backend" in errors[0]["error"] and not record["complete"]
    assert "--retry-errors" in capsys.readouterr().out
    fake_vllm.clear()
    bench.run(s, tmp_path, tmp_path / "model")
    assert fake_vllm == []  # not retried unless asked
