"""Shared fixtures: tiny randomly initialised decoder-only models (fp32, no downloads) and helpers.

Every model is built twice from the same config and state dict: one is switched to kvdex's
attention, the other keeps transformers' own ``sdpa`` attention and is the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvdex
from kvdex import cache_kwargs

if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
    # the kernel tests under Triton's interpreter (the subprocess below): triton 3.6's interpreter turns
    # scalars into 1-element arrays and calls int() on them in loop bounds, which numpy >= 2.? rejects; read
    # the element instead (test-only compatibility shim, applied once for every kernel test module)
    from triton.runtime import interpreter as _itp

    _orig_patch = _itp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _itp._patch_lang_tensor = _patch_lang_tensor

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist (``-n``): the workers share the cores; torch's intra-op threads would otherwise each take
    # them all, and OpenMP threads spinning on an oversubscribed core slow every worker many times over
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

VOCAB = 128
PAGE = 16
SINK = 16
WINDOW = 32

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    # Large weights: peaked attention (selection matters) and well separated logits (no argmax ties).
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# family -> (config class, model class, config overrides)
FAMILIES = {
    "llama_gqa": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_mha": (LlamaConfig, LlamaForCausalLM, {"num_key_value_heads": 4}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": False, "head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}
FAMILY_NAMES = list(FAMILIES)
SPARSE_POLICIES = ["oracle", "streaming", "quest"]
ALL_POLICIES = ["full", *SPARSE_POLICIES]


def script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_config(family: str, **overrides):
    cfg_cls, _, fam = FAMILIES[family]
    return cfg_cls(**{**_COMMON, **fam, **overrides})


def build_pair(family: str, seed: int = 0, **overrides):
    """(kvdex-enabled model, sdpa reference) with identical weights, both in eval mode, fp32."""
    _, model_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(make_config(family, **overrides)).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # qkv biases are zero-initialised: make them matter
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # RMSNorm / q-k norm weights start at 1: make them matter too
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    ref = model_cls(make_config(family, attn_implementation="sdpa", **overrides)).eval()
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    kvdex.enable(model)
    assert model.config._attn_implementation == "kvdex"
    assert ref.config._attn_implementation == "sdpa"
    return model, ref


@functools.cache
def _cached_pair(family: str):
    return build_pair(family)


@pytest.fixture(params=FAMILY_NAMES)
def family(request):
    return request.param


@pytest.fixture
def pair(family):
    """Session-shared (model, reference) of the parametrised family. Do not mutate them."""
    return _cached_pair(family)


@pytest.fixture
def llama():
    return _cached_pair("llama_gqa")


def shared_pair(family: str):
    return _cached_pair(family)


def prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (1, n), generator=g)


def left_padded(lengths, seed: int = 0):
    """A left-padded batch of random prompts: (input_ids [B, W], attention_mask [B, W], prompts)."""
    prompts = [prompt(n, seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask, prompts


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The position ids generate() uses for a left-padded mask."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def teacher_forced(model, cache, steps: int = 40) -> torch.Tensor:
    """Logits [steps, V] of a 300-token prompt (seed 2) prefilled into ``cache``, then ``steps`` random tokens
    (seed 1) fed one at a time."""
    ids = prompt(300, seed=2)
    toks = torch.randint(2, model.config.vocab_size, (1, steps), generator=torch.Generator().manual_seed(1))
    out = []
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
        for i in range(steps):
            out.append(model(toks[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1])
    return torch.cat(out)


def tiny_graph_check(spec: str, steps: int = 40) -> dict:
    """``kvdex.bench.runner.check_graph`` of ``spec`` GPU-resident on the tiny bench shape (CUDA, float32, budget
    80, a 150-token context, one dense layer): its result (``ok``, ``counts``)."""
    from kvdex.bench import runner, shapes

    model = shapes.build_model("tiny", torch.float32, "cuda")
    cfg = runner.BenchConfig(shape="tiny", dtype="float32", device="cuda", budget=80, check_context=150,
                             dense_layers=1, storages=("device",))  # fmt: skip
    return runner.check_graph(model, cfg, [f"{spec}/device+graph"], steps=steps)[0]


def assert_refresh_graphs_match_eager(spec: str) -> None:
    """``pool_every``: refresh steps and the steps between are two graph variants; :func:`tiny_graph_check`'s 40
    captured steps give eager's logits, with at least two captures and 20 replays."""
    res = tiny_graph_check(spec)
    assert res["ok"], res
    c = res["counts"]
    assert c["replays"] >= 20 and c["captures"] >= 2, c


def greedy(model, ids, mask=None, cache=None, new=56, **kw):
    """Greedy generate returning (sequences, logits [steps, B, V])."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        **cache_kwargs(cache),
        max_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits)


def window_start(n: int, sink: int = SINK, page: int = PAGE, window: int = WINDOW) -> int:
    """First window position for a context of n tokens, from the layout rules in plain integers."""
    if n <= sink:
        return sink
    grid_pages = -(-(n - sink) // page)
    middle = max(0, grid_pages - window // page)
    return sink + middle * page


@functools.cache
def span_pages(keys: torch.Tensor, ps: int, cap: int, rows=None):
    """IceCache's device semantic pages (``kvdex.index.summary.SemanticPages``, min/max, fp32, CPU) of keys
    [B, H, n, D] with one page per ``ps`` consecutive positions (an empty table spills every page that joins);
    ``rows(j)``: [B] bool, the sequences page j joins (default: all). ``bound`` set to the pages held."""
    from kvdex.index.summary import SemanticPages

    B, H, n, D = keys.shape
    pages = SemanticPages(B, H, D, ps, cap, "minmax", torch.float32, "cpu")
    for j in range(n // ps):
        ok = torch.ones(B, dtype=torch.bool) if rows is None else rows(j)
        pages.insert(keys[:, :, j * ps : (j + 1) * ps], torch.arange(j * ps, (j + 1) * ps)[None].expand(B, -1), ok)
    pages.bound = int(pages.npages.max())
    return pages


def reference_greedy(family: str, n: int, seed: int, new: int):
    """Greedy tokens and logits of the sdpa reference for prompt(n, seed) (computed once)."""
    _, ref = _cached_pair(family)
    return greedy(ref, prompt(n, seed), new=new)


@pytest.fixture(scope="session")
def smollm2_cpu():
    """SmolLM2-135M-Instruct (``kvdex models fetch smollm2``) as ``kvdex scorecard --smoke`` loads it: CPU,
    float32, through ``kvdex.eval.models.load``: the folder ``kvdex models fetch`` converted it into, where
    there is one (a second), else the GGUF file (tens of seconds); loaded once for the session. Returns
    (model, tokenizer); do not mutate them."""
    from kvdex import models
    from kvdex.eval import models as eval_models

    if models.find("smollm2") is None:
        pytest.skip("SmolLM2 is not installed (kvdex models fetch smollm2)")
    return eval_models.load("smollm2", device="cpu", dtype="float32")


# pytest-xdist with ``--dist loadfile`` (README's test command): a file runs whole on one worker (its module-scoped
# fixtures are built once), files are handed out in collection order (pytest_configure turns off xdist's own
# reordering by test count, which would put the many-parametrised kernel modules first), so the longest start
# first and the workers end together (measured on the 2-core CI machine); the rest keep their order, except the
# modules of INTERPRETER_SUITES (below), last: their ``test_interpreter_suite`` waits for the background run,
# which by then has ended, instead of holding a worker idle while it runs.
LONG_FILES_FIRST = [
    "test_graph_joins.py",
    "test_graph.py",
    "test_user_path.py",
    "test_compile.py",
    "test_real_model.py",
    "test_equivalence.py",
    "test_lmeval.py",
    "test_scorecard.py",
    "test_contract.py",
    "test_bench.py",
    "test_icecache_batched.py",
    "test_icecache_summary.py",
    "test_icecache.py",
    "test_multigpu.py",
    "test_pariskv_graph.py",
]


def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", None) is None:
        return  # one process: collection order
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    last = len(rank) + 1
    # stable: each file keeps its order
    items.sort(key=lambda item: last if item.path.name in INTERPRETER_SUITES else rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", None):
        # xdist (--dist loadfile) sorts files by their number of tests unless told not to: keep the order
        # pytest_collection_modifyitems gives (the controller schedules from the workers' collection order)
        config.option.loadscopereorder = False


# ---- kernel tests under Triton's interpreter (CPU) ------------------------------------------------------
# What the kernel test modules share: where their kernels run (compiled on CUDA, else under the interpreter in
# the subprocess below, or nowhere) and the mark that skips a kernel test where neither is available.
CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA else "cpu"
run_kernels = pytest.mark.skipif(not (CUDA or INTERP), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

# triton reads TRITON_INTERPRET when it is first imported, long before these modules in a test session, so
# their kernel tests run again in a fresh interpreter with the variable set: one subprocess for every such
# module of the session (one start-up of torch, transformers and pytest), and each module's
# ``test_interpreter_suite`` checks its own tests there. The subprocess starts when collection ends and
# runs (one thread) beside the rest of the session; the first check waits for it. Under pytest-xdist
# (``-n``) the controller starts it, once, when the first worker has collected, and the checks, on whichever
# worker runs them, read its results from the folder the controller handed every worker. Module -> the -k
# selection of its kernel tests (None: the whole module).
INTERPRETER_SUITES = {
    "test_entropy_kernel.py": None,
    "test_obs_kernel.py": "triton_",
    "test_page_cache.py": "triton",
    "test_pariskv.py": "triton_",
    "test_step_kernels.py": None,
    "test_topk.py": None,
    "test_triton_kernels.py": None,
}
SUITE_TIMEOUT_S = 900
# this process's part: "tmp" (the folder, where this process owns it), "proc" (where it started the run)
_SUITE_RUN: dict = {}


def _suite_folder(config) -> Path:
    """The folder of this session's interpreter run: the controller's (handed to xdist workers), else our own."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        return Path(worker["kvdex_interpreter_suites"])
    if "tmp" not in _SUITE_RUN:
        _SUITE_RUN["tmp"] = tempfile.TemporaryDirectory(prefix="kvdex-interpreter-")
    return Path(_SUITE_RUN["tmp"].name)


def _start_interpreter_suites(folder: Path, collected) -> None:
    """Start the subprocess for the modules whose ``test_interpreter_suite`` was collected (``collected``:
    (file name, test name) pairs). It writes into ``folder``: names (its modules), output.txt, junit.xml, and
    done (its exit status) once it has ended."""
    import importlib.util
    import subprocess
    import sys
    import threading

    if "proc" in _SUITE_RUN or os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return  # started already, or the kernel tests run in this session itself
    if importlib.util.find_spec("triton") is None:
        return
    wanted = {file for file, test in collected if test == "test_interpreter_suite"}
    names = sorted(n for n in INTERPRETER_SUITES if n in wanted)
    if not names:
        return
    here = Path(__file__).parent
    select = " or ".join(n if INTERPRETER_SUITES[n] is None else f"({n} and {INTERPRETER_SUITES[n]})" for n in names)
    cmd = [sys.executable, "-m", "pytest", *(str(here / n) for n in names), "-q", "-p", "no:cacheprovider"]
    cmd += ["-m", "not gpu", "-k", select, f"--junitxml={folder / 'junit.xml'}"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    with open(folder / "output.txt", "w") as log:  # a file, not a pipe: nothing waits for a reader
        proc = subprocess.Popen(cmd, env=env, cwd=here.parent, stdout=log, stderr=subprocess.STDOUT)
    (folder / "names").write_text("\n".join(names))
    _SUITE_RUN["proc"] = proc

    def mark_done() -> None:
        rc = proc.wait()
        try:
            (folder / "done.tmp").write_text(str(rc))
            os.replace(folder / "done.tmp", folder / "done")  # readers see it whole or not at all
        except OSError:  # the session ended first and removed the folder
            pass

    threading.Thread(target=mark_done, daemon=True).start()


def pytest_collection_finish(session):
    if getattr(session.config, "workerinput", None) is None:  # not an xdist worker: the controller starts it
        _start_interpreter_suites(_suite_folder(session.config), [(i.path.name, i.name) for i in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, per worker: the folder of the session's interpreter run."""
    node.workerinput["kvdex_interpreter_suites"] = str(_suite_folder(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller (no items of its own): start the run from the first worker's collection."""
    collected = [(Path(i.split("::")[0]).name, i.split("::")[-1]) for i in ids]
    _start_interpreter_suites(_suite_folder(node.config), collected)


def pytest_sessionfinish(session, exitstatus):
    proc = _SUITE_RUN.get("proc")
    if proc is not None and proc.poll() is None:  # the session ended before a check waited for it
        proc.kill()
        proc.wait()
    if getattr(session.config, "workerinput", None) is None and "tmp" in _SUITE_RUN:
        _SUITE_RUN.pop("tmp").cleanup()


@pytest.fixture(scope="session")
def interpreter_suite(request):
    """``check(__file__)``: asserts that the module's kernel tests passed under ``TRITON_INTERPRET=1``
    (at least one, none failed), in the subprocess this session started after collection (one for
    the modules of ``INTERPRETER_SUITES`` whose ``test_interpreter_suite`` it collected)."""
    import time
    import xml.etree.ElementTree as ET

    folder = _suite_folder(request.config)
    outcomes: dict[str, dict] = {}

    def collect() -> None:
        deadline = time.monotonic() + SUITE_TIMEOUT_S
        while not (folder / "done").is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        proc = _SUITE_RUN.get("proc")
        if proc is not None and proc.poll() is None:  # started here and still running: end it
            proc.kill()
            proc.wait()
        out = folder / "output.txt"
        tail = out.read_text(errors="replace")[-6000:] if out.is_file() else ""
        if not (folder / "done").is_file():
            tail = f"[not finished after {SUITE_TIMEOUT_S} s]\n{tail}"
        for n in (folder / "names").read_text().split():
            outcomes[n] = {"passed": 0, "failed": [], "tail": tail}
        xml = folder / "junit.xml"
        cases = ET.parse(xml).getroot().iter("testcase") if xml.is_file() else []
        for case in cases:
            name = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
            if name not in outcomes:
                continue
            if case.find("failure") is not None or case.find("error") is not None:
                outcomes[name]["failed"].append(case.get("name"))
            elif case.find("skipped") is None:
                outcomes[name]["passed"] += 1

    def check(module_file: str) -> None:
        name = Path(module_file).name
        assert name in INTERPRETER_SUITES, f"{name} is not in conftest.INTERPRETER_SUITES"
        started = (folder / "names").is_file() and name in (folder / "names").read_text().split()
        assert started, "the interpreter suites did not start (see conftest)"
        if not outcomes:
            collect()
        got = outcomes[name]
        assert not got["failed"] and got["passed"] > 0, f"{name}: failed {got['failed']}\n{got['tail']}"

    return check
