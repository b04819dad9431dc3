"""A GGUF model in transformers' own format: what ``kvdex models fetch`` writes beside the GGUF file it installs
(:func:`kvdex.models.convert`), so that known names load in about a second."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

#: The dtype of the converted weights. A quantized GGUF block dequantizes to ``d * q + m`` (float16 ``d``, ``m``)
#: computed in float32, which neither float16 nor bfloat16 holds exactly (SmolLM2's Q4_1 file: 41 % of the values
#: move in float16, 79 % in bfloat16); float16 rounds them 8x closer than bfloat16 (relative error <= 2**-11, at
#: most 0.002 in absolute value there) at half float32's size. :func:`save_converted` reports the rounding.
CONVERTED_DTYPE = torch.float16


def convert_gguf(gguf: str | os.PathLike, folder: str | os.PathLike, dtype: torch.dtype = CONVERTED_DTYPE) -> dict:
    """Write the model of GGUF file ``gguf`` into ``folder`` as transformers' own format (config, generation
    config, safetensors weights in ``dtype``, tokenizer files), as ``kvdex models fetch`` does: loading the folder
    takes about a second where the GGUF file takes tens of seconds (transformers reads it three times,
    dequantizes it and builds the tokenizer from its vocabulary). The weights are the GGUF file's, dequantized
    to float32 as loading the file gives them, then rounded to ``dtype`` (float16 by default: see
    :data:`CONVERTED_DTYPE`); they and the tokenizer are read back and compared. Returns :func:`save_converted`'s
    report of the rounding."""
    gguf = Path(gguf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return save_converted(model, tok, folder, dtype=dtype)


def cast_weights(model, dtype: torch.dtype) -> dict:
    """Cast ``model``'s floating-point parameters and buffers to ``dtype`` in place (tied weights stay tied),
    except a tensor whose values ``dtype`` cannot hold (out of its range): that one keeps its dtype. Returns
    ``{"dtype", "max_abs_error", "max_rel_error", "changed_values", "values", "kept": [names]}``: how far the
    rounding moved the values."""
    report = {"dtype": str(dtype).replace("torch.", ""), "max_abs_error": 0.0, "max_rel_error": 0.0}
    report.update(changed_values=0, values=0, kept=[])
    named = [*model.named_parameters(), *model.named_buffers()]  # each shared tensor once
    for name, t in named:
        if not t.is_floating_point() or t.dtype == dtype:
            continue
        cast = t.data.to(dtype)
        back = cast.to(t.dtype)
        if not torch.equal(torch.isfinite(back), torch.isfinite(t.data)):
            report["kept"].append(name)
            continue
        err = (back - t.data).abs()
        report["max_abs_error"] = max(report["max_abs_error"], float(err.max()) if err.numel() else 0.0)
        rel = err / t.data.abs().clamp(min=torch.finfo(dtype).tiny)
        report["max_rel_error"] = max(report["max_rel_error"], float(rel.max()) if rel.numel() else 0.0)
        report["changed_values"] += int((err > 0).sum())
        report["values"] += t.numel()
        t.data = cast
    return report


def save_converted(model, tok, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> dict | None:
    """``model`` (plain transformers, not :func:`enable`-d) and ``tok`` into ``folder``; ``RuntimeError`` unless
    the weights and the tokenizer read back from it are the same. ``dtype``: the weights are first cast to it in
    place (:func:`cast_weights`, whose report is returned); the config keeps the model's dtype, so that plain
    ``from_pretrained(folder)`` loads it in that dtype as before (``kvdex.load`` passes its own)."""
    from safetensors.torch import load_file, save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the GGUF loader's: the folder holds plain weights
        del config.quantization_config
    config.dtype = model.dtype  # the dtype it loads in by default, whatever the file holds
    report = None
    if dtype is not None:
        report = cast_weights(model, dtype)
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))  # tied weights stored once
    tok.save_pretrained(folder)
    state, saved = model.state_dict(), load_file(folder / "model.safetensors")
    if any(not torch.equal(state[k], v) for k, v in saved.items()) or not set(saved) <= set(state):
        raise RuntimeError(f"{folder}: the saved weights differ from the loaded model's")
    text = "The pass key is 17412. Remember it.\n<|im_start|>user\n你好 éé\t x"
    if AutoTokenizer.from_pretrained(folder).encode(text) != tok.encode(text):
        raise RuntimeError(f"{folder}: the saved tokenizer encodes differently from the loaded one")
    return report
