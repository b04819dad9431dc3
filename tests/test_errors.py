"""Every user mistake raises a clear error (or warns) with the fix in its message."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import build_pair, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.config import CacheConfig
from kvdex.policies import registry as policy_registry


def test_policies_lists_builtins():
    assert {"full", "oracle", "streaming", "quest"} <= set(kvdex.policies())
    assert kvdex.policies() == sorted(kvdex.policies())


def test_unknown_policy_lists_valid_ones(llama):
    model, _ = llama
    with pytest.raises(ValueError, match="unknown policy 'nope'") as err:
        kvdex.Cache(model, "nope")
    for name in kvdex.policies():
        assert name in str(err.value)
    with pytest.raises(ValueError, match="unknown policy"):
        kvdex.make_policy("Quest")


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            dict(budget=40, sink=16, window=32),
            r"budget \(40\) is smaller than sink \+ window \(16 \+ 32\).*budget >= 48",
        ),
        (dict(budget=8, page_size=16, sink=0, window=16), r"budget \(8\) is smaller than one page \(16 tokens\)"),
        (dict(page_size=12), r"page_size must be a power of two.*got 12.*page_size=16"),
        (dict(page_size=0), r"page_size must be a power of two"),
        (dict(window=40), r"window must be a positive multiple of page_size \(16\), got 40.*window=48"),
        (dict(window=0), r"window must be a positive multiple of page_size"),
        (dict(sink=-1), r"sink and dense_layers must be >= 0"),
    ],
)
def test_config_errors(llama, kwargs, pattern):
    model, _ = llama
    with pytest.raises(ValueError, match=pattern):
        CacheConfig(**kwargs)
    budget = kwargs.pop("budget", 256)
    with pytest.raises(ValueError, match=pattern):
        kvdex.Cache(model, "quest", budget, **kwargs)


def test_config_type_errors():
    with pytest.raises(TypeError, match="budget must be an int"):
        CacheConfig(budget=96.0)
    with pytest.raises(TypeError, match="page_size must be an int"):
        CacheConfig(page_size=True)


def test_valid_config_boundaries_accepted():
    c = CacheConfig(budget=48, sink=16, window=32)  # budget == sink + window
    assert c.retrieval_tokens == 0 and c.retrieval_pages == 0
    c = CacheConfig(budget=16, page_size=16, sink=0, window=16)  # budget == one page
    assert c.window_pages == 1
    assert CacheConfig(budget=100).retrieval_pages == (100 - 48) // 16


def test_unknown_policy_option_lists_options(llama, monkeypatch):
    model, _ = llama
    with pytest.raises(TypeError, match=r"policy 'quest' has no option\(s\) foo.*its options are: group"):
        kvdex.Cache(model, "quest", 96, foo=1)

    # a policy with options lists them
    monkeypatch.setattr(policy_registry, "_REGISTRY", dict(policy_registry._REGISTRY))

    @kvdex.register_policy
    @dataclasses.dataclass
    class WithOptions(kvdex.Policy):
        name = "test_with_options"
        alpha: float = 0.5
        beta: int = 2

        def select(self, q, view):
            return kvdex.Selection(everything=True)

    with pytest.raises(TypeError, match=re.escape("no option(s) bogus, gamma; its options are: alpha, beta")):
        kvdex.make_policy("test_with_options", gamma=1, bogus=2)
    p = kvdex.make_policy("test_with_options", beta=7)
    assert p.options() == {"alpha": 0.5, "beta": 7}


def test_sliding_window_model_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4096,
    )
    model = MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"sliding-window attention.*sliding_window=4096.*sliding_window = None"):
        kvdex.enable(model)
    with pytest.raises(ValueError, match="sliding-window"):
        kvdex.Cache(model, "quest", 96)


def test_qwen2_with_sliding_window_enabled_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
    )
    with pytest.raises(ValueError, match="sliding-window"):
        kvdex.enable(Qwen2ForCausalLM(cfg).eval())


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_right_padded_mask_refused(llama, offload):
    model, _ = llama
    ids = prompt(20, 0).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # right padding
    cache = kvdex.Cache(model, "quest", 96, offload=offload)
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=3, do_sample=False)


def test_cache_of_another_enabled_model_refused(llama):
    model, _ = llama
    other, _ = build_pair("llama_gqa", seed=5)
    cache = kvdex.Cache(model, "quest", 96)
    with pytest.raises(ValueError, match=r"made for another model.*create a new kvdex.Cache"):
        other.generate(prompt(20, 0), **cache_kwargs(cache), max_new_tokens=3, do_sample=False)


def test_cache_used_with_a_model_without_kvdex_attention_refused(llama):
    """The cache's model twin with transformers' sdpa attention: kvdex's attention never runs, so
    the cache never stores a token; it must refuse instead of decoding with an empty cache."""
    model, ref = llama
    cache = kvdex.Cache(model, "quest", 96)
    with pytest.raises(ValueError):
        ref.generate(prompt(60, 0), **cache_kwargs(cache), max_new_tokens=5, do_sample=False)


def test_prompt_longer_than_max_positions_warns():
    model, _ = build_pair("llama_gqa", max_position_embeddings=64)
    cache = kvdex.Cache(model, "quest", 96)
    with pytest.warns(UserWarning, match=r"\(70 tokens\) is longer than the model's max_position_embeddings \(64\)"):
        model.generate(prompt(70, 0), **cache_kwargs(cache), max_new_tokens=3, do_sample=False)


def test_no_warning_within_max_positions(recwarn):
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "quest", 96)
    model.generate(prompt(70, 0), **cache_kwargs(cache), max_new_tokens=3, do_sample=False)
    assert not [w for w in recwarn if "max_position_embeddings" in str(w.message)]


@pytest.mark.parametrize(
    "call,pattern",
    [
        (lambda c: c.reorder_cache(torch.tensor([0])), "beam search"),
        (lambda c: c.crop(3), "cropped"),
        (lambda c: c.batch_repeat_interleave(2), "num_return_sequences"),
        (lambda c: c.batch_select_indices(torch.tensor([0])), "selecting batch rows"),
    ],
)
def test_unsupported_cache_operations(llama, call, pattern):
    model, _ = llama
    with pytest.raises(NotImplementedError, match=pattern):
        call(kvdex.Cache(model, "quest", 96))


# ---- mistakes a new user makes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,want",
    [("no", False), ("False", False), ("false", False), ("0", False), (False, False), (0, False),
     ("yes", True), ("True", True), ("on", True), (True, True), (1, True)],
)  # fmt: skip
def test_boolean_option_given_as_text_means_what_it_says(llama, value, want):
    model, _ = llama
    cache = kvdex.Cache(model, "icecache", 96, reuse=value)
    assert cache.policy.reuse is want
    assert kvdex.make_policy(f"icecache:reuse={value}").reuse is want


@pytest.mark.parametrize(
    "spec,pattern",
    [("icecache:reuse=maybe", r"reuse='maybe': expected true/false"), ("icecache:reuse=2", r"reuse=2: expected"),
     ("icecache:threads=many", r"threads='many': expected int"), ("prkv:refresh=1.5", r"refresh=1.5: expected int"),
     ("chess:preset=3", r"preset=3: expected str")],
)  # fmt: skip
def test_option_of_the_wrong_type_refused(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        kvdex.make_policy(spec)


def test_options_given_as_text_are_typed():
    p = kvdex.make_policy("icecache", threads="2", norm_margin="1.5", reuse="off")
    assert (p.threads, p.norm_margin, p.reuse) == (2, 1.5, False)
    assert kvdex.make_policy("pariskv:candidate_ratio=none").candidate_ratio is None
    assert kvdex.make_policy("prkv:static_ratio=auto").static_ratio == "auto"
    assert kvdex.make_policy("prkv", static_ratio="0.5").static_ratio == 0.5
    assert kvdex.make_policy(kvdex.make_policy("icecache"), reuse="no").reuse is False  # a copy with options


def test_cache_holding_a_prompt_of_another_model_refused():
    """A filled cache passed to a model with other kv heads: a ValueError at the cache, not a shape error."""
    model, _ = shared_pair("llama_gqa")  # 2 kv heads
    other, _ = shared_pair("llama_mha")  # 4 kv heads
    cache = kvdex.Cache(model, "quest", 96)
    model.generate(prompt(100, 0), **cache_kwargs(cache), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"2 kv heads.*4 kv heads.*create a new kvdex.Cache"):
        other.generate(prompt(140, 1), **cache_kwargs(cache), max_new_tokens=2, do_sample=False)


def test_empty_prompt_refused(llama):
    model, _ = llama
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"prompt is empty \(0 tokens\)"):
        model.generate(empty, **cache_kwargs(kvdex.Cache(model, "quest", 96)), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt is empty"):
        model(input_ids=empty, **cache_kwargs(kvdex.Cache(model, "quest", 96)))


def test_tokenizer_passed_as_the_model_refused():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    with pytest.raises(TypeError, match=r"got \w+ \(a tokenizer: pass the model"):
        kvdex.Cache(tok, "quest", 96)
    with pytest.raises(TypeError, match=r"a tokenizer"):
        kvdex.enable(tok)
    with pytest.raises(TypeError, match=r"kvdex.load\('org/name'\)"):
        kvdex.Cache("org/name", "quest", 96)


@pytest.mark.parametrize("name", ["./no-such-model", "/no/such/model-dir", "~/no-such-model/"])
def test_missing_model_directory_named(name):
    with pytest.raises(ValueError, match=r"model directory not found: " + re.escape(name)) as err:
        kvdex.load(name)
    assert "Repo id" not in str(err.value)


def test_known_model_not_fetched_says_how(tmp_path, monkeypatch):
    from kvdex import models

    monkeypatch.setenv("KVDEX_MODELS", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "kvdex_no_such_package")
    monkeypatch.chdir(tmp_path)
    for name in ("smollm2", "qwen05b"):
        with pytest.raises(ValueError, match=rf"run `kvdex models fetch {name}`"):
            kvdex.load(name)


# ---- model names that name no model: at once, no download ---------------------------------------------


@pytest.fixture
def no_download(monkeypatch, tmp_path):
    """Any download or hub request fails the test; the working directory holds no model folders."""
    import huggingface_hub
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def refuse(*args, **kwargs):
        raise AssertionError(f"a download was attempted: {args[:2]}")

    for cls in (AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name", ["smollm", "SmolLM2-135M", "gpt2"])
def test_unknown_model_name_lists_the_known_ones(no_download, name):
    from kvdex import models

    for call in (lambda: kvdex.load(name), lambda: models.resolve_model(name)):
        with pytest.raises(ValueError, match=rf"unknown model '{re.escape(name)}'") as err:
            call()
        msg = str(err.value)
        assert "smollm2" in msg and "qwen05b" in msg and "`kvdex models fetch NAME`" in msg
        assert "Hugging Face id, org/name" in msg and "local model directory" in msg and ".gguf" in msg
    if name == "smollm":
        assert "did you mean 'smollm2'?" in msg


def test_hugging_face_id_offline_fails_fast(no_download, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"'kvdex-tests/no-such-model' is not in the Hugging Face cache and offline"):
        kvdex.load("kvdex-tests/no-such-model")


def test_hugging_face_id_unreachable_hub_fails_fast(no_download, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    asked = []

    def unreachable(self, repo_id, **kw):
        asked.append((repo_id, kw.get("timeout")))
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(ValueError, match=r"the hub cannot be reached \(ConnectionError: Name or service") as err:
        kvdex.load("kvdex-tests/no-such-model")
    assert "nothing was downloaded" in str(err.value) and "smollm2" in str(err.value)
    from kvdex.hf.loading import HUB_TIMEOUT_S

    assert asked == [("kvdex-tests/no-such-model", HUB_TIMEOUT_S)]  # one request, bounded


def test_hugging_face_id_in_the_cache_loads_offline_from_it(monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    from kvdex.hf.loading import hub_local_only

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name, **kw: f"/cache/{repo}/{name}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_local_only("org/name") is True
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: (_ for _ in ()).throw(OSError()))
    assert hub_local_only("org/name") is True  # unreachable hub: the cached copy, no retries
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: None)
    assert hub_local_only("org/name") is False  # the hub answered: transformers downloads as usual
