"""The package's import graph has no cycle, and the kernels import no policy, store or adapter.

Every ``import`` / ``from ... import`` statement of every ``kvdex/**/*.py`` counts, at any depth
(function-level imports too): ``A -> B`` when module A names module B (``from kvdex.kernels import
topk`` names ``kvdex.kernels.topk``; ``from kvdex.kernels import triton_kernel`` names the package
``kvdex.kernels``). A package's ``__init__`` is the module named by the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvdex"
# kvdex.kernels sits under the policies, the stores and the transformers adapter
KERNEL_FORBIDDEN = ("kvdex.policies", "kvdex.storage", "kvdex.integration", "kvdex.engine", "kvdex.hf")


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
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
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
    assert "kvdex.kernels.attention" in g["kvdex.integration.layer"]
    assert "kvdex.policies.base" in g["kvdex.policies.quest"]
    assert "kvdex.kernels.pariskv" in g["kvdex.kernels.pariskv_triton"]  # from kvdex.kernels import pariskv
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
