"""Named model shapes for ``kvdex bench``: transformers configs of real architectures, random weights.

Speed needs no trained weights: a model of the real shape with random weights does the same work
per token. Each shape copies the sizes of the public config of the named model (hidden size,
layers, heads, kv heads, head dim, MLP width, vocabulary). Rotary scaling variants (Llama 3.1's
``llama3`` rope) are left at plain RoPE with the model's theta: they change no tensor shape and
no kernel, only the frequencies. ``max_position_embeddings`` is raised to the longest context of a
run so the cache does not warn about positions past the trained length.
"""

from __future__ import annotations

from kvdex.hf.loading import model_config, random_model

# name -> (model_type, config fields)
SHAPES: dict[str, tuple[str, dict]] = {
    "llama3-8b": (  # Llama-3.1-8B
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "llama3-70b": (  # Llama-3.1-70B (80 layers; kvdex.bench.tp --layers runs fewer)
        "llama",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "llama3-1b": (  # Llama-3.2-1B
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-7b": (
        "qwen2",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    "tiny": (  # for tests: a few layers, GQA, runs on a CPU in seconds
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
}


def shape_names() -> list[str]:
    return sorted(SHAPES)


def make_config(name: str, max_positions: int = 0):
    """The transformers config of shape ``name`` (``ValueError`` for an unknown name)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(shape_names())}")
    model_type, fields = SHAPES[name]
    cfg = model_config(model_type, **fields)
    cfg.max_position_embeddings = max(getattr(cfg, "max_position_embeddings", 0) or 0, max_positions, 8192)
    cfg.bos_token_id = cfg.eos_token_id = None
    cfg.pad_token_id = 0
    return cfg


def build_model(name: str, dtype, device, max_positions: int = 0, seed: int = 0):
    """A random-weight model of shape ``name``, created directly on ``device`` in ``dtype``, eval mode."""
    import torch

    cfg = make_config(name, max_positions)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = random_model(cfg, dtype, device)
    model.generation_config.eos_token_id = None
    return model


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
