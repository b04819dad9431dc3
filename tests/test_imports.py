"""The package's import graph has no cycle, the kernels import no policy, store or adapter, only the
adapter (kvdex/hf/) imports transformers or lm_eval, and no module probes a store or a policy instead of
asking the typed contract (``LayerStore`` / ``Policy``).

Every ``import`` / ``from ... import`` statement of every ``kvdex/**/*.py`` counts, at any depth
(function-level imports too): ``A -> B`` when module A names module B (``from kvdex.kernels import
topk`` names ``kvdex.kernels.topk``; ``from kvdex.kernels import triton_kernel`` names the package
``kvdex.kernels``). A package's ``__init__`` is the module named by the package.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvdex"
# kvdex.kernels sits under the policies, the stores and the transformers adapter
KERNEL_FORBIDDEN = ("kvdex.policies", "kvdex.storage", "kvdex.hf", "kvdex.engine")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The kvdex modules that the file ``path`` (module ``name``) imports, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return import_targets(ast.walk(tree), name, path.name == "__init__.py", known)


def import_targets(nodes, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The kvdex modules that the statements ``nodes`` of module ``name`` import."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from .. import y
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # "from P import m" names the module P.m where it is one, else P itself
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # import kvdex.a.b.c where c is a name: the deepest module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(path, name, known) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def describe(g: dict[str, set[str]], comp: list[str]) -> str:
    inside = set(comp)
    edges = [f"  {a} -> {b}" for a in comp for b in sorted(g[a] & inside)]
    return f"cycle of {len(comp)} modules:\n" + "\n".join(edges)


def test_graph_sees_imports():
    """The walker finds top-level, function-level, relative and 'from package import module' imports."""
    g = graph()
    assert "kvdex.kernels.attention" in g["kvdex.engine.step"]
    assert "kvdex.policies.base" in g["kvdex.policies.quest"]
    assert "kvdex.kernels.pariskv" in g["kvdex.kernels.pariskv_coarse_triton"]  # from kvdex.kernels import pariskv
    assert len(g) > 40


def test_cycle_detection_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    g = graph()
    found = cycles(g)
    if found:
        pytest.fail("import cycles in kvdex/:\n" + "\n".join(describe(g, c) for c in found))


def test_kernels_import_no_policy_store_or_adapter():
    g = graph()
    bad = [
        f"{a} -> {b}"
        for a in sorted(g)
        if a == "kvdex.kernels" or a.startswith("kvdex.kernels.")
        for b in sorted(g[a])
        if b.startswith(KERNEL_FORBIDDEN)
    ]
    assert not bad, "kvdex.kernels must not import policies, stores or the adapter:\n" + "\n".join(bad)


# ---- the engine runs without transformers ------------------------------------------------------------
ENGINE = "kvdex.engine"
FRAMEWORK = "transformers"


def load_time_imports(tree: ast.Module) -> list[ast.AST]:
    """The import statements that run when the module is imported: module and class level, inside
    if / try / with, not in functions and not under ``if TYPE_CHECKING``."""
    out: list[ast.AST] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
            todo += [h for h in getattr(node, "handlers", ())]  # try: except handlers hold statements
    return out


def framework_imports(sources: dict[str, str], start: str) -> list[str]:
    """The chains ``start -> ... -> transformers`` through kvdex modules (``sources``: module -> text) that
    importing the modules under ``start`` runs. Importing ``kvdex.a.b`` also runs ``kvdex.a``'s ``__init__``;
    the root package ``kvdex`` is left out (its ``__init__`` is the transformers adapter's public API)."""
    known = set(sources)
    packages = {m.rpartition(".")[0] for m in known}
    edges: dict[str, set[str]] = {}
    direct: set[str] = set()
    for name, text in sources.items():
        tree = ast.parse(text)
        nodes = load_time_imports(tree)
        for node in nodes:
            roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not getattr(node, "level", 0) and any(r.split(".")[0] == FRAMEWORK for r in roots):
                direct.add(name)
        targets = import_targets(nodes, name, name in packages, known)
        parents = {".".join(t.split(".")[:i]) for t in targets for i in range(2, t.count(".") + 1)}
        edges[name] = (targets | parents) & known
    chains, seen = [], set()
    todo = deque((m, [m]) for m in sorted(known) if m == start or m.startswith(start + "."))
    while todo:  # breadth first: the shortest chain to each module
        mod, chain = todo.popleft()
        if mod in seen:
            continue
        seen.add(mod)
        if mod in direct:
            chains.append(" -> ".join([*chain, FRAMEWORK]))
        todo += [(n, [*chain, n]) for n in sorted(edges[mod]) if n != "kvdex"]
    return chains


def test_framework_walker_finds_planted_imports():
    src = {
        "kvdex": "import transformers",
        "kvdex.engine": "from kvdex.engine import step",
        "kvdex.engine.step": "import torch\nfrom kvdex.storage.device import X\ndef f():\n    import transformers",
        "kvdex.storage": "from kvdex.storage.device import X",
        "kvdex.storage.device": "try:\n    from kvdex.hf import y\nexcept ImportError:\n    pass",
        "kvdex.hf": "from transformers.cache_utils import Cache",
    }
    assert framework_imports(src, ENGINE) == ["kvdex.engine.step -> kvdex.storage.device -> kvdex.hf -> transformers"]
    src["kvdex.storage.device"] = "X = 1"
    assert framework_imports(src, ENGINE) == []  # the root package and function-level imports do not count
    src["kvdex.storage"] = "import transformers.utils"  # a parent package's __init__ runs too
    assert framework_imports(src, ENGINE) == ["kvdex.engine.step -> kvdex.storage -> transformers"]


def test_engine_imports_no_transformers():
    """kvdex/engine/ runs without transformers: none of its modules, nor any kvdex module they import
    (transitively, at load time), imports transformers."""
    sources = {name: path.read_text() for name, path in modules().items()}
    assert any(m.startswith(ENGINE + ".") for m in sources)
    bad = framework_imports(sources, ENGINE)
    assert not bad, "kvdex.engine must not import transformers:\n" + "\n".join(bad)


# ---- the typed contract instead of probes -------------------------------------------------------------
# Outside kvdex/storage/ a store is asked (LayerStore: static, offloaded, positional_slots, graph_unsupported,
# graph_buffers, grows_on_append, reserve_prompt, window_slots, page_cache, places_pages), never tested for its class; a
# policy's optional behaviour is a method or ClassVar of Policy, never a hasattr.
PROBE_DIRS = (
    "kvdex/engine/",
    "kvdex/hf/",
    "kvdex/bench/",
    "kvdex/eval/",
)  # hasattr / getattr probes: the engine
# expressions that name a policy, a store, a cache layer or the cache (not transformers' model or config)
PROBED = re.compile(r"polic|store|layer|cache|\b(p|st|s|pol|lay)\b")
PROBE_ALLOWED: set[str] = set()  # files exempt from the probe check (none)


def _class_names(node: ast.AST) -> list[str]:
    elts = node.elts if isinstance(node, ast.Tuple) else [node]
    return [ast.unparse(e).rpartition(".")[2] for e in elts]


def probes(source: str, rel: str) -> list[str]:
    """Store / policy probes in the module text ``source`` at path ``rel`` (relative to the root)."""
    out = []
    engine = rel.startswith(PROBE_DIRS)
    in_storage = rel.startswith("kvdex/storage/")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and not in_storage:  # type(x) is / in (... Store ...)
            left = node.left
            if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "type":
                if any(n.endswith("Store") for c in node.comparators for n in _class_names(c)):
                    out.append(f"{rel}:{node.lineno}: a store's class compared: {ast.unparse(node)}")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or len(node.args) < 2:
            continue
        fn, obj, what = node.func.id, ast.unparse(node.args[0]), node.args[1]
        name = what.value if isinstance(what, ast.Constant) and isinstance(what.value, str) else None
        line = f"{rel}:{node.lineno}: {ast.unparse(node)}"
        if fn == "isinstance" and not in_storage and any(n.endswith("Store") for n in _class_names(what)):
            out.append(f"{line} (ask a LayerStore property instead of its class)")
        elif fn == "getattr" and name == "static":
            out.append(f"{line} (LayerStore.static is declared: read it)")
        elif fn in ("hasattr", "getattr") and obj not in ("self", "cls"):
            if engine and PROBED.search(obj) and (fn == "hasattr" or len(node.args) == 3):
                out.append(f"{line} (declare it on Policy / LayerStore and call it)")
            elif engine and PROBED.search(obj) and name is not None and name.startswith("_"):
                out.append(f"{line} (another object's private field)")
            elif fn == "hasattr" and re.search(r"store", obj):
                out.append(f"{line} (declare it on LayerStore and call it)")
    return out


def test_probe_finder_finds_planted_probes():
    src = (
        "isinstance(st, OffloadStore)\nisinstance(s, (kvdex.storage.DeviceStore, int))\ntype(st) is DeviceStore\n"
        "getattr(store, 'static', False)\nhasattr(p, 'graph_key')\ngetattr(c.policy, 'positions', None)\n"
        "getattr(layer, '_pads', None)\n"
    )
    assert len(probes(src, "kvdex/hf/x.py")) == 7
    assert len(probes("hasattr(store, '_slot')\nisinstance(x, DeviceStore)", "kvdex/policies/x.py")) == 2
    assert probes("isinstance(x, DeviceStore)\ngetattr(cfg, 'head_dim', None)", "kvdex/storage/x.py") == []
    assert probes("getattr(model.config, 'x', None)\nhasattr(self, 'y')", "kvdex/bench/x.py") == []


def test_no_store_or_policy_probes():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in PROBE_ALLOWED:
            found += probes(path.read_text(), rel)
    assert not found, "probes instead of the LayerStore / Policy contract:\n" + "\n".join(found)


# ---- transformers and lm-eval are imported in kvdex/hf/ only ------------------------------------------
ADAPTER = "kvdex/hf/"
ADAPTED = ("transformers", "lm_eval")  # the frameworks only the adapter package may import


def adapted_imports(source: str, rel: str) -> list[str]:
    """The ``import`` / ``from ... import`` statements of ``source`` (path ``rel``) that name transformers or
    lm_eval, at any depth (inside functions, classes, ``try`` and ``if`` too)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots = [node.module or ""]
        else:
            continue
        if any(r.split(".")[0] in ADAPTED for r in roots):
            out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_adapted_import_finder_finds_planted_imports():
    src = (
        "import torch, transformers\nfrom transformers.cache_utils import Cache\n"
        "def f():\n    try:\n        from lm_eval.api.registry import register_model\n    except ImportError:\n"
        "        pass\nclass C:\n    def g(self):\n        import lm_eval.models as m\n"
    )
    assert [line.split(":")[1] for line in adapted_imports(src, "kvdex/x.py")] == ["1", "2", "5", "10"]
    clean = "import transformers_stream\nfrom .transformers import x\nfrom kvdex.hf import transformers\n"
    assert adapted_imports(clean + "'''import transformers'''\n", "kvdex/x.py") == []


def test_only_the_adapter_imports_transformers():
    """kvdex/hf/ is the one package that imports transformers or lm_eval; everything else calls it."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(ADAPTER):
            found += adapted_imports(path.read_text(), rel)
    assert not found, "transformers / lm_eval imported outside kvdex/hf/ (move the code into kvdex.hf):\n" + "\n".join(
        found
    )


# ---- the engine owns the CUDA graphs -----------------------------------------------------------------
# A policy declares what is capturable (graph_key) and hands work to the engine's graph service
# (view.graphs, kvdex.engine.graphs); the transformers adapter captures decode steps through the engine's
# capture path (kvdex.engine.graphs.capture_step). No policy, index or adapter module captures a graph itself.
GRAPH_CAPTURE = re.compile(r"CUDAGraph|torch\.cuda\.graph|capture_begin")
NO_CAPTURE_DIRS = ("kvdex/policies", "kvdex/index", "kvdex/hf")


def test_no_policy_index_or_adapter_module_captures_graphs():
    assert GRAPH_CAPTURE.search("g = torch.cuda.CUDAGraph()") and GRAPH_CAPTURE.search("g.capture_begin()")
    files = [p for d in NO_CAPTURE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 10
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{i}: {line.strip()}"
        for path in files
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if GRAPH_CAPTURE.search(line)
    ]
    assert not found, "graph capture outside the engine (use view.graphs, kvdex.engine.graphs):\n" + "\n".join(found)
