"""A tiny random Llama and a byte-level tokenizer, built without downloads (CPU smoke tests)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvdex.hf.loading import enable


def byte_tokenizer():
    """A byte-level tokenizer (one token per byte, 256 + eos/pad) as a PreTrainedTokenizerFast."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.padding_side = "left"
    return fast


def tiny_llama(vocab_size: int = 260, layers: int = 4, seed: int = 0, qk_scale: float = 8.0):
    """A random Llama (4 layers, 4 query / 2 kv heads, head_dim 16), kvdex-enabled, eval mode.

    ``qk_scale`` enlarges the q/k projections so attention is peaked rather than uniform, which
    makes recall differences between policies visible.
    """
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=16384,
        eos_token_id=vocab_size - 4,
        pad_token_id=vocab_size - 3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    return enable(model)
