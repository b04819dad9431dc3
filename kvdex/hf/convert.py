"""A GGUF model in transformers' own format: what ``kvdex models fetch`` writes beside the GGUF file it installs
(:func:`kvdex.models.convert`), so that known names load in about a second."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def convert_gguf(gguf: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Write the model of GGUF file ``gguf`` into ``folder`` as transformers' own format (config, generation
    config, float32 safetensors weights, tokenizer files), as ``kvdex models fetch`` does: loading the folder
    takes about a second where the GGUF file takes tens of seconds (transformers reads it three times,
    dequantizes it and builds the tokenizer from its vocabulary). The weights are the GGUF file's, dequantized
    to float32 exactly as loading the file gives them; they and the tokenizer are read back and compared."""
    gguf = Path(gguf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    save_converted(model, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), folder)


def save_converted(model, tok, folder: str | os.PathLike) -> None:
    """``model`` (plain transformers, not :func:`enable`-d) and ``tok`` into ``folder``; ``RuntimeError`` unless
    the weights and the tokenizer read back from it are the same."""
    from safetensors.torch import load_file, save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the GGUF loader's: the folder holds plain float32 weights
        del config.quantization_config
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
