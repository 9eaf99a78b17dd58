"""Layers with arrows one way: the engine (``emllm``) imports nothing of ``emllm_integrations`` (the adapters, the
command line, the bench) nor any framework, and no module of either package is part of an import cycle.

Two checks: the engine modules imported in a fresh interpreter (what really gets loaded), and the import graph
read from the sources with ``ast`` (every ``import``/``from ... import``, at module level and inside functions,
relative and absolute; those under ``if TYPE_CHECKING:`` never run and are left out), which also sees the imports a
function makes only when called."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import emllm
import emllm_integrations

ENGINE = "emllm"
FORBIDDEN_IN_ENGINE = ("emllm_integrations", "langchain_core", "langchain", "llama_index")
LAZY_IN_ENGINE = ("sentence_transformers",)
"""A model library the engine loads only when a scorer reads event text (emllm.embeddings), as it loads transformers
models: never at import time."""


def _modules(package) -> dict[str, pathlib.Path]:
    """Every module of a package, by dotted name (a subpackage by its own name, for its __init__.py)."""
    root = pathlib.Path(package.__file__).resolve().parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package.__name__, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__main__":
            continue  # run as a program, never imported
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = {**_modules(emllm), **_modules(emllm_integrations)}
ENGINE_MODULES = sorted(name for name in MODULES if name == ENGINE or name.startswith(ENGINE + "."))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement that can run: anywhere in the tree but under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        for child in node.orelse if isinstance(node, ast.If) and _is_type_checking(node.test) else (node,):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            yield from _imports(child)


def _known(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None: a module of another distribution)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _targets(module: str, path: pathlib.Path) -> set[str]:
    """The dotted names a module imports: ours resolved to the module that runs, others as written."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import name` imports the submodule pkg.name when there is one, else pkg itself
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        targets.update(_known(name) or name for name in names)
    return targets


GRAPH = {module: _targets(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected group of our modules (Tarjan's algorithm)."""
    edges = {m: sorted(t for t in targets if t in graph) for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in edges[node]:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_cycle_in(group, edges) for group in groups]


def _cycle_in(group: list[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, through the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in edges[node]:
                if target == start:
                    return paths[node] + [start]
                if target in members and target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    return group


def test_the_graph_sees_both_packages_and_their_imports():
    """The parser finds what it must, or the checks below would pass on nothing."""
    assert {"emllm.engine", "emllm.memory", "emllm_integrations.langchain", "emllm_integrations.cli",
            "emllm_integrations.bench", "emllm_integrations.bench.harness"} <= set(MODULES)
    assert "emllm.memory" in GRAPH["emllm.engine"]                       # relative, module level
    assert "emllm_integrations.bench.items" in GRAPH["emllm_integrations.bench.harness"]
    assert "emllm_integrations.rag" in GRAPH["emllm_integrations.bench.harness"]  # inside a function
    assert "emllm.config" in GRAPH["emllm_integrations.cli"]             # absolute
    assert "emllm_integrations.bench.tasks" in GRAPH["emllm_integrations.bench.items"]  # from . import tasks
    assert _cycles({"a": {"b"}, "b": {"c", "x"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"a"}, "b": set()}) == [["a", "a"]]


def test_the_engine_sources_import_nothing_of_the_integrations_or_a_framework():
    """Statically, so an import inside a function that a plain import would not run is caught too."""
    bad = {module: sorted(t for t in GRAPH[module] if t.split(".")[0] in FORBIDDEN_IN_ENGINE)
           for module in ENGINE_MODULES}
    assert not {m: t for m, t in bad.items() if t}, bad


def test_no_module_is_part_of_an_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_engine_modules_imported_load_nothing_of_the_integrations():
    """Every engine module imported in one fresh interpreter: what one module loads alone is a subset of what they
    load together (and importing any of them runs emllm/__init__.py, which imports most of the others), so one
    interpreter finds whatever a module-by-module run would, in one start-up instead of one per module."""
    code = (f"import sys, {', '.join(ENGINE_MODULES)}; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN_IN_ENGINE + LAZY_IN_ENGINE!r}); "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
