"""``kvdex.load`` and ``kvdex.enable``: get a transformers model ready for kvdex caches; and models of a given
shape with random weights (:func:`model_config`, :func:`random_model`: ``kvdex bench`` needs no download)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.masking_utils import AttentionMaskInterface

from kvdex.hf import step_backend
from kvdex.hf.attention import ATTN_NAME, kvdex_attention, padding_mask
from kvdex.hf.distributed import tensor_parallel
from kvdex.hf.model_parts import attention_modules, text_config  # noqa: F401  (kvdex.hf.loading's names)


def _check_supported(model) -> None:
    cfg = text_config(model)
    types = getattr(cfg, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in types)
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) is not False:
        sliding = True
    if sliding:
        raise ValueError(
            f"{type(model).__name__} uses sliding-window attention layers (sliding_window={window}, "
            f"layer_types={sorted(set(types)) or None}); kvdex supports full-attention layers only. "
            "If the model's context never exceeds the window, set config.sliding_window = None "
            "(and config.layer_types = None) before calling kvdex.enable"
        )
    if not attention_modules(model):
        raise ValueError(
            f"{type(model).__name__}: no attention modules with q/k/v/o projections and a layer_idx were found; "
            "kvdex supports decoder-only Llama / Qwen2 / Qwen3 / Mistral style models"
        )


def check_model(model) -> None:
    """``TypeError`` unless ``model`` is a transformers model (a tokenizer or a name is a common slip)."""
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        return
    what = type(model).__name__
    hint = ""
    if hasattr(model, "encode") and hasattr(model, "decode"):
        hint = " (a tokenizer: pass the model, e.g. `model, tok = kvdex.load(...)`, then kvdex.Cache(model, ...))"
    elif isinstance(model, (str, os.PathLike)):
        hint = f" (a name or path: load it first with `model, tok = kvdex.load({str(model)!r})`)"
    raise TypeError(f"expected a transformers model (a torch.nn.Module with a config), got {what}{hint}")


def enable(model):
    """Register kvdex's attention (transformers' public AttentionInterface) and switch ``model`` to it.

    Idempotent. Without a kvdex cache the model attends densely, exactly as before. Where the model is on a
    CUDA device and its ``generation_config`` names no ``compile_config``, it gets kvdex's
    (:mod:`kvdex.hf.step_backend`): ``model.generate`` with a kvdex cache replays each decode step as one CUDA
    graph. Elsewhere (a CPU model) it sets none: transformers compiles on CUDA only and warns, at every
    ``generate``, about a ``compile_config`` it cannot use. ``kvdex.Cache(model, ...)`` calls this again, so a
    model moved to CUDA after :func:`enable` gets kvdex's config when its first cache is made (and a model moved
    off CUDA loses kvdex's, never one the user set).
    """
    check_model(model)
    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, kvdex_attention)
        AttentionMaskInterface.register(ATTN_NAME, padding_mask)
    _check_supported(model)
    tensor_parallel(model)  # ValueError when the heads do not divide over the tensor-parallel ranks
    _set_compile_config(model)
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_NAME)
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = ATTN_NAME
    return model


def _set_compile_config(model) -> None:
    """kvdex's ``compile_config`` (:func:`kvdex.hf.step_backend.compile_config`) on a CUDA model that has none;
    on any other device kvdex's is removed (transformers would warn at every ``generate`` that it cannot
    compile there), a ``compile_config`` the user set is kept."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return
    current = getattr(gen, "compile_config", None)
    ours = current is not None and isinstance(getattr(current, "backend", None), step_backend.Backend)
    if _device_type(model) == "cuda":
        if current is None:
            gen.compile_config = step_backend.compile_config()
    elif ours:
        gen.compile_config = None


def _device_type(model) -> str:
    try:
        return torch.device(model.device).type
    except (AttributeError, TypeError, RuntimeError):  # no parameters, or an unusual module
        param = next(model.parameters(), None)
        return "cpu" if param is None else param.device.type


#: seconds the hub may take to answer whether a Hugging Face id exists, before kvdex.load calls it unreachable
HUB_TIMEOUT_S = 10.0


def hub_local_only(repo_id: str, filename: str | None = None) -> bool:
    """Before ``from_pretrained`` downloads Hugging Face id ``repo_id``: True where it must load from the
    Hugging Face cache (offline mode, ``HF_HUB_OFFLINE``, or the hub unreachable: one quick ``model_info``
    request, no retries), False where the hub answered. ``ValueError`` at once where the model can come
    from neither (transformers would retry an unreachable hub for most of a minute), or the hub has no
    such repository."""
    import huggingface_hub as hub
    from huggingface_hub import errors

    from kvdex import models

    where = (
        f"; or pass a local model directory, a .gguf file or a name kvdex knows ({', '.join(models.KNOWN)}: "
        "`kvdex models fetch NAME` installs it)"
    )
    try:
        cached = isinstance(hub.try_to_load_from_cache(repo_id, filename or "config.json"), str)
    except errors.HFValidationError as e:
        raise ValueError(f"{repo_id!r} is not a valid Hugging Face id (org/name): {e}{where}") from None
    if hub.is_offline_mode():
        if cached:
            return True
        raise ValueError(
            f"{repo_id!r} is not in the Hugging Face cache and offline mode is on (HF_HUB_OFFLINE): nothing is "
            f"downloaded. Unset HF_HUB_OFFLINE on a machine that reaches huggingface.co to download it{where}"
        )
    try:
        hub.HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError:
        return False  # it exists; transformers says what access it needs
    except errors.RepositoryNotFoundError:
        raise ValueError(
            f"{repo_id!r}: no such model on the Hugging Face hub (a private one? `hf auth login`){where}"
        ) from None
    except errors.HfHubHTTPError:
        return False  # the hub answered: let transformers download and report
    except Exception as e:  # the network library's own connection / timeout errors
        if cached:
            return True
        raise ValueError(
            f"{repo_id!r} is not in the Hugging Face cache and the hub cannot be reached "
            f"({type(e).__name__}: {e}): nothing was downloaded{where}"
        ) from None
    return False


def load(
    model: str | os.PathLike,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device | None = None,
):
    """Load a causal LM and its tokenizer, ready for kvdex.

    ``model``: a Hugging Face id, a local directory, a ``.gguf`` file (loaded through transformers'
    own GGUF support, which needs the ``gguf`` package), or a name ``kvdex models list`` knows
    (``"smollm2"``, ``"qwen05b"``: installed by ``kvdex models fetch NAME``, which also converts them to
    transformers' format for fast loading: :func:`kvdex.models.convert`). Returns
    ``(model, tokenizer)``; the tokenizer pads on the left, which batched generation needs.
    """
    from kvdex import models

    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"kvdex.load expects a model name or path, got {type(model).__name__}")
    if str(model) in models.KNOWN and not Path(model).exists():
        if gguf_file is not None:
            raise ValueError(f"{model!r} names a GGUF file already; drop gguf_file")
        model, gguf_file = models.known_model(str(model))  # its converted folder, else its GGUF file
    path = Path(model).expanduser()
    if not path.exists() and models.looks_like_path(str(model)):
        raise ValueError(models.missing_dir_message(model))
    local_only = False
    if not path.exists() and path.suffix != ".gguf":
        if "/" not in str(model):  # a typo of a known name, a missing folder: no download attempted
            raise ValueError(models.unknown_model_message(str(model)))
        local_only = hub_local_only(str(model), gguf_file)
    if path.is_dir():
        model = str(path)
        if gguf_file is not None and not (path / gguf_file).is_file():
            raise ValueError(f"gguf_file {gguf_file!r} is not a file in {path}")
    if gguf_file is None and path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        gguf_file, model = path.name, str(path.parent)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    if local_only:
        kw["local_files_only"] = True
    tok = load_tokenizer(model, gguf_file, local_files_only=local_only)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **kw)
    lm = lm.to(device).eval()
    return enable(lm), tok


def load_tokenizer(path: str | os.PathLike, gguf_file: str | None = None, local_files_only: bool = False):
    """The tokenizer of the model in ``path`` (a hub id or a directory; ``gguf_file``: a GGUF file in it),
    padding on the left with the eos token where it has no pad token, as :func:`load` returns it."""
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    if local_files_only:
        kw["local_files_only"] = True
    tok = AutoTokenizer.from_pretrained(path, **kw)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def model_config(model_type: str, **fields):
    """The transformers config of architecture ``model_type`` (``"llama"``, ``"qwen2"``, ...) with ``fields``."""
    return AutoConfig.for_model(model_type, **fields)


def random_model(config, dtype: torch.dtype, device: str | torch.device | None = None, tp_plan: str | None = None):
    """A causal LM of ``config`` with random weights (seed torch first), in eval mode: created directly on
    ``device``; or, with ``tp_plan`` (``"auto"``, under ``torchrun``), sharded over the ranks by
    transformers' tensor parallelism (``DistributedConfig(tp_plan=...)``), each rank on its own device."""
    if tp_plan is None:
        with torch.device(device or "cpu"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    from transformers.distributed import DistributedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    with warnings.catch_warnings():  # every weight is "missing" (random init): transformers reports each
        warnings.simplefilter("ignore")
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            None, config=config, state_dict={}, dtype=dtype, distributed_config=DistributedConfig(tp_plan=tp_plan)
        )
    return model.eval()
