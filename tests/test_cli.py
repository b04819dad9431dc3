"""The ``kvdex`` command line, the demo's decoding paths and the passkey task, on a tiny random Llama.

The model and its word-level tokenizer are built here and saved with ``save_pretrained`` (no
downloads), so ``kvdex generate --model DIR`` runs exactly as a user's would.
"""

from __future__ import annotations

import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import kvdex
from kvdex import cli, demo
from kvdex import models as kvdex_models
from kvdex.eval import passkey

CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]


def _words() -> list[str]:
    text = " ".join([passkey.TASK, passkey.FILLER, passkey.NEEDLE, passkey.QUESTION, "hello world once upon a time"])
    return sorted(set(re.findall(r"[A-Za-z]+|[^\w\s]", text)) | set("0123456789"))


def make_tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIALS + _words())}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[4:],
    )
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A saved 3-layer GQA Llama (random weights) with a chat-templated word-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer(chat=True)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


LONG_PROMPT = " ".join([passkey.FILLER] * 12)  # ~280 tokens: sink, a middle of several pages, window


# ---- kvdex policies / errors ---------------------------------------------------------------------


def test_policies_lists_registered_names(capsys):
    from kvdex.hf.graph import graph_policies

    assert cli.main(["policies"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split(None, 2) for line in lines[1:]]
    assert [r[0] for r in rows] == kvdex.policies()
    assert {"full", "oracle", "quest", "streaming"} <= {r[0] for r in rows}
    capturable = set(graph_policies())
    for name, graph, what in rows:  # capture support comes from the policy classes, not a table
        assert graph == ("yes" if name in capturable else "no"), name
        assert len(what) > 10, name
    papers = {r[0]: r[2] for r in rows}
    assert "[Quest (Tang et al., 2024)]" in papers["quest"] and "[IceCache" in papers["icecache"]
    assert dict((r[0], r[1]) for r in rows)["icecache"] == "yes" and "[" not in papers["full"]


def test_policy_options_on_the_command_line_are_typed():
    options = cli._policy_options(["reuse=false", "threads=2", "group_merge=nsa"])
    p = kvdex.make_policy("icecache", **options)
    assert (p.reuse, p.threads, p.group_merge) == (False, 2, "nsa")
    assert kvdex.make_policy("icecache", **cli._policy_options(["reuse=no"])).reuse is False


def test_bad_option_value_exits_2_before_loading(capsys):
    rc = cli.main(["generate", "--model", "/no/such/dir", "--policy", "icecache", "-o", "reuse=maybe", "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "reuse='maybe': expected true/false" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--prompt", ""], ["--prompt", "  \n"]], ids=["empty", "blank"])
def test_empty_prompt_exits_2(tiny_model_dir, capsys, args):
    rc = cli.main(["generate", "--model", str(tiny_model_dir), *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kvdex: error: --prompt is empty") and "Traceback" not in err


def test_empty_prompt_file_and_missing_model_dir_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert cli.main(["generate", "--prompt-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tmp_path / "absent"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"model directory not found: {tmp_path / 'absent'}" in err and "Repo id" not in err


def _help_texts(parser):
    """(prog, text) of every description and epilog of ``parser`` and its subcommands (where examples are)."""
    import argparse

    yield parser.prog, parser.description or ""
    yield parser.prog, parser.epilog or ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _help_texts(sub)


def help_examples() -> list[str]:
    """Every ``kvdex ...`` command line in the ``--help`` texts (continued lines joined)."""
    found = []
    for _, text in _help_texts(cli.build_parser()):
        text = re.sub(r"\\\n\s*", " ", text)
        for line in text.splitlines():
            m = re.search(r"(?:^|example[^:]*:)\s*(kvdex \S.*)$", line.strip())
            if m:
                found.append(m.group(1).strip())
    return found


def test_help_examples_parse_and_their_policies_exist():
    import shlex

    examples = help_examples()
    assert len(examples) >= 4, examples
    assert any(e.startswith("kvdex generate") for e in examples)
    assert any(e.startswith("kvdex models fetch") for e in examples)
    for example in examples:
        args = cli.build_parser().parse_args(shlex.split(example, comments=True)[1:])  # SystemExit(2) on a bad example
        listed = getattr(args, "policies", None) or []
        listed = listed.split(",") if isinstance(listed, str) else listed  # bench takes the text
        for spec in [getattr(args, "policy", None), *listed]:
            if isinstance(spec, str):
                kvdex.make_policy(spec, **cli._policy_options(getattr(args, "option", [])))
        if getattr(args, "budgets", None):
            for b in args.budgets:
                kvdex.CacheConfig(budget=b)


def test_unknown_policy_exits_2_with_the_list(tiny_model_dir, capsys):
    rc = cli.main(["generate", "--model", str(tiny_model_dir), "--policy", "nope", "--prompt", "hello"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("kvdex: error: unknown policy 'nope'")
    assert ", ".join(kvdex.policies()) in err
    assert "Traceback" not in err


def test_budget_below_sink_plus_window_exits_2(tiny_model_dir, capsys):
    rc = cli.main([*"generate --policy quest --budget 32 --prompt hello --model".split(), str(tiny_model_dir)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("kvdex: error: budget (32) is smaller than sink + window")


def test_unknown_policy_option_and_missing_prompt_file_exit_2(tiny_model_dir, tmp_path, capsys):
    rc = cli.main([*"generate --policy quest -o bogus=1 --prompt hello --model".split(), str(tiny_model_dir)])
    assert rc == 2 and "has no option(s) bogus" in capsys.readouterr().err
    rc = cli.main(["generate", "--model", str(tiny_model_dir), "--prompt-file", str(tmp_path / "missing.txt")])
    assert rc == 2 and "no such file" in capsys.readouterr().err


def test_demo_rejects_unknown_policy_before_loading(capsys):
    assert cli.main(["demo", "--policies", "full,nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    # a spec with options is a policy name (it reaches the option check), and a bad option fails as early
    assert cli.main(["demo", "--policies", "full,prkv:rerank=0:bogus=1"]) == 2
    assert "has no option(s) bogus" in capsys.readouterr().err


def test_prompt_is_required():
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--policy", "quest"])
    assert e.value.code == 2


# ---- kvdex generate ------------------------------------------------------------------------------


def _stats(out: str) -> dict[str, str]:
    """The ``key  value`` lines after the continuation."""
    return dict(line.split(None, 1) for line in out.split("\n\n", 1)[1].strip().splitlines())


@pytest.mark.parametrize("extra", ["", "--offload", "--chat --dense-layers 1"], ids=["device", "offload", "chat"])
def test_generate_prints_continuation_and_stats(tiny_model_dir, capsys, extra):
    args = f"generate --policy quest --budget 64 --max-new-tokens 5 {extra}".split()
    rc = cli.main([*args, "--model", str(tiny_model_dir), "--prompt", LONG_PROMPT])
    out = capsys.readouterr().out
    assert rc == 0
    stats = _stats(out)
    assert stats["policy"] == "quest"
    assert stats["budget"] == "64"
    assert stats["decode_steps"] == "4"  # 5 new tokens: the first comes from the prefill
    assert float(stats["attended_tokens_per_step"]) <= 64
    assert stats["offload"] == str("--offload" in extra)
    assert stats["kv_bytes_device"].endswith("MiB)")


def test_generate_sampling_is_seeded(tiny_model_dir, capsys):
    args = "generate --policy oracle --budget 64 --max-new-tokens 6 --sample --temperature 1.5 --seed 3".split()
    args += ["--model", str(tiny_model_dir), "--prompt", LONG_PROMPT]
    outs = []
    for _ in range(2):
        assert cli.main(args) == 0
        outs.append(capsys.readouterr().out.split("\n\n", 1)[0])
    assert outs[0] == outs[1]


def test_eval_subcommand_is_optional(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "kvdex.eval.cli", None)  # as if the harness were not installed
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert "eval" not in sub.choices
    assert {"policies", "generate", "demo"} <= set(sub.choices)


# ---- the demo ------------------------------------------------------------------------------------


def test_demo_prints_a_row_per_policy(tiny_model_dir, capsys):
    args = "demo --length 300 --budget 64 --max-new-tokens 4 --policies full,oracle,streaming,quest".split()
    rc = cli.main([*args, "--model", str(tiny_model_dir)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "torch " in out and "transformers " in out and "budget 64" in out
    table = out[out.index("policy ") :].splitlines()
    assert [line.split()[0] for line in table[2:6]] == ["full", "oracle", "streaming", "quest"]
    assert "ms/token" not in out and "not measured on a CPU" in out  # CPU timings are not the product's speed
    assert table[2].split()[3] == "(100%)" and table[4].split()[3] != "(100%)"  # full: whole context; streaming


def test_demo_shows_time_legend_and_true_kv_bytes(tiny_model_dir, capsys):
    """Each row's wall time, a progress bar per policy (stderr), and a legend under the table: the columns, the
    device KV's formula (the bytes of the context's keys and values, every row's with offload off), and why
    each row that misses the key misses (streaming by design)."""
    args = "demo --length 300 --budget 64 --max-new-tokens 4 --policies full,streaming,quest".split()
    assert cli.main([*args, "--model", str(tiny_model_dir)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    table = out[out.index("policy ") :].splitlines()
    assert table[0].split()[:7] == ["policy", "correct", "attended/step/head", "device", "KV", "host", "KV"]
    assert "time" in table[0] and all(re.search(r"\d+\.\d s", line) for line in table[2:5])
    for name in ("full", "streaming", "quest"):
        assert re.search(rf"{name}\s*:?\s.*\|", captured.err), captured.err  # its tqdm bar
    legend = out[out.index("columns:") :]
    for column in ("correct", "attended/step/head", "device KV", "host KV", "time", "completion"):
        assert f"\n  {column} " in legend
    formula = re.search(
        r"(\d+) layers x (\d+) kv heads x (\d+) tokens x (\d+) x 2 \(k, v\) x (\d+) bytes = ([\d.]+ MiB)", legend
    )
    layers, heads, tokens, dim, item = (int(x) for x in formula.groups()[:5])
    prompt_tokens = int(re.search(r"prompt: +(\d+) tokens", out).group(1))
    assert (layers, heads, dim, item) == (3, 2, 16, 4) and tokens == prompt_tokens + 4 - 1
    assert formula.group(6) == f"{layers * heads * tokens * dim * 2 * item / 2**20:.2f} MiB"
    full = table[2].split()
    assert full[0] == "full" and " ".join(full[4:6]) == formula.group(6)  # the device KV cell
    assert "expected to miss the key" in legend and re.search(r"\n  streaming .*drops the middle", legend)
    assert all(re.search(rf"\n  {c[0]} +\S", legend) for c in map(str.split, table[2:5]) if c[1] == "NO")  # why


def test_demo_defaults_depend_on_the_device():
    parser = cli.build_parser()
    args = parser.parse_args(["demo"])
    assert args.policies is None and args.length is None and args.max_new_tokens is None  # resolved in main
    assert "oracle" not in demo.CPU_POLICIES and {"full", "streaming", "quest", "prkv"} <= set(demo.CPU_POLICIES)
    assert set(demo.CPU_POLICIES) <= set(demo.CUDA_POLICIES) and demo.CPU_LENGTH < demo.CUDA_LENGTH
    assert demo.CPU_NEW_TOKENS >= 6  # the key's five digits and one more


def test_fork_and_fresh_caches_decode_the_same(tiny_model_dir):
    model, tok = kvdex.load(tiny_model_dir)
    text, answer = passkey.make_passkey_prompt(tok, 400, 0.5, seed=1)
    ids = torch.tensor([passkey.encode(tok, text)])
    sizes = dict(page_size=16, sink=16, window=32, offload=False, dense_layers=1)
    args = dict(policies=["full", "oracle", "streaming", "quest"], budget=64, max_new_tokens=6, **sizes)
    forked, _ = demo.run(model, tok, ids, answer, fork=True, **args)
    fresh, _ = demo.run(model, tok, ids, answer, fork=False, **args)
    for a, b in zip(forked, fresh, strict=True):
        assert a.tokens == b.tokens, a.policy
        assert a.stats["attended_tokens_per_step"] == pytest.approx(b.stats["attended_tokens_per_step"])
    assert forked[0].stats["attended_tokens_per_step"] > 64  # full attends the whole context


# ---- models --------------------------------------------------------------------------------------


def test_resolve_model(tiny_model_dir, tmp_path):
    assert kvdex_models.resolve_model(str(tiny_model_dir), None) == (str(tiny_model_dir), None)
    assert kvdex_models.resolve_model("org/name", "m.gguf") == ("org/name", "m.gguf")
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"")
    assert kvdex_models.resolve_model(str(gguf), None) == (str(tmp_path), "m.Q4.gguf")
    with pytest.raises(ValueError, match="not a file in"):
        kvdex_models.resolve_model(str(tmp_path), "other.gguf")
    with pytest.raises(ValueError, match="GGUF file not found"):
        kvdex_models.resolve_model(str(tmp_path / "absent.gguf"), None)
    with pytest.raises(ValueError, match="pass --model as well"):
        kvdex_models.resolve_model(None, "m.gguf")
    with pytest.raises(ValueError, match="model directory not found"):
        kvdex_models.resolve_model(str(tmp_path / "absent"), None)


def test_default_model_falls_back_to_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(kvdex_models, "DEFAULT_PACKAGE", "kvdex_no_such_package")
    monkeypatch.setenv("KVDEX_MODELS", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError, match=r"run `kvdex models fetch smollm2`"):
        kvdex_models.default_model()
    f = tmp_path / kvdex_models.FETCH_SUBDIR / kvdex_models.DEFAULT_GGUF
    f.parent.mkdir()
    f.write_bytes(b"")
    assert kvdex_models.default_model() == f
    assert kvdex_models.resolve_model("smollm2") == (str(f.parent), f.name)


# ---- passkey -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
@pytest.mark.parametrize("n_tokens", [120, 500, 2000])
def test_passkey_prompt_hits_the_target_length(chat, n_tokens):
    tok = make_tokenizer(chat)
    text, answer = passkey.make_passkey_prompt(tok, n_tokens, 0.3, seed=7)
    n = len(passkey.encode(tok, text))
    assert n_tokens - 6 <= n <= n_tokens  # within one filler sentence (<= 5 tokens + the needle's split)
    assert re.fullmatch(r"\d{5}", answer) and text.count(answer) == 2
    assert text.endswith(("<|assistant|>" if chat else passkey.QUESTION + " ") + passkey.ANSWER_PREFIX + " ")


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 0.95, 1.0])
def test_passkey_needle_sits_at_the_requested_depth(depth):
    tok = make_tokenizer(chat=False)
    text, answer = passkey.make_passkey_prompt(tok, 1000, depth, seed=0)
    needle = passkey.NEEDLE.format(key=answer)
    before, after = text.split(needle)
    n_before = sum(before.count(s) for s in passkey._SENTENCES)
    n_after = sum(after.count(s) for s in passkey._SENTENCES)
    assert n_before + n_after > 150
    assert abs(n_before / (n_before + n_after) - depth) <= 1 / (n_before + n_after)


def test_passkey_keys_and_errors():
    tok = make_tokenizer(chat=False)
    assert passkey.make_passkey_prompt(tok, 300, 0.5, seed=3) == passkey.make_passkey_prompt(tok, 300, 0.5, seed=3)
    assert len({passkey.make_key(s) for s in range(20)}) > 15
    with pytest.raises(ValueError, match="depth"):
        passkey.make_passkey_prompt(tok, 300, 1.5, seed=0)
    with pytest.raises(ValueError, match="shorter than a passkey prompt"):
        passkey.make_passkey_prompt(tok, 20, 0.5, seed=0)


def test_passkey_score():
    assert passkey.score("12345", " 12345.")
    assert passkey.score("12345", "The pass key is 12345. Remember it.")
    assert not passkey.score("12345", "The pass key is 123456.")
    assert not passkey.score("12345", "1234")
    assert not passkey.score("12345", "a magical number")
    assert not passkey.score("12345", "")
