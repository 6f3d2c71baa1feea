"""The packages' modules import each other without cycles.

The graph is read from the source with ``ast``, without importing anything. Its nodes are the
modules of ``abftgemm`` and ``attention`` (subpackages included); an edge ``m -> n`` is any import
statement in ``m`` that names ``n``: ``import n``, ``from n import x``, and ``from p import n``
where ``n`` is the submodule ``p.n``, and ``importlib.import_module("n")`` with a literal name.
Imports inside functions count like those at module level: a deferred import hides a cycle from
the interpreter at import time, not from a reader, and the two modules still depend on each
other. Imports under ``if TYPE_CHECKING:`` do not count (they
never run). A package's ``__init__`` is an edge target only when it is named itself (``import
abftgemm``, ``from abftgemm import matmul``), not because one of its submodules is imported.

The graph must be acyclic.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("abftgemm", "attention")


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of :data:`PACKAGES`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif _dynamic_import(node):  # importlib.import_module("m"): as ``import m``
            found.append(ast.Import(names=[ast.alias(name=node.args[0].value)]))
        stack.extend(ast.iter_child_nodes(node))
    return found


def _dynamic_import(node: ast.AST) -> bool:
    """``importlib.import_module("m")`` or ``import_module("m")`` with a literal name."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func, name = node.func, node.args[0]
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return called == "import_module" and isinstance(name, ast.Constant) \
        and isinstance(name.value, str)


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of :data:`PACKAGES` it imports (see the module docstring)."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for module, path in files.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _absolute(module, path, node)
                subs = [f"{source}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in files]
                if len(targets) < len(subs):  # names that are not submodules come from source
                    targets.append(source)
            graph[module] |= {t for t in targets if t in files and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[m0, m1, ..., m0]``, or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph[node]):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state:
                cycle = visit(succ)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` that hold a cycle (two or more modules;
    no module imports itself here), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_graph_covers_both_packages():
    graph = import_graph()
    assert {"abftgemm", "abftgemm.plan", "attention", "attention.functional"} <= graph.keys()
    assert "abftgemm.backend" in graph["abftgemm.plan"]  # ``from abftgemm.backend import ...``
    assert "attention.softmax" in graph["attention.functional"]  # ``from attention import softmax``
    # ``importlib.import_module("attention.experiments.plots")`` inside a function
    assert "attention.experiments.plots" in graph["attention.experiments.cli"]


@pytest.mark.parametrize("source, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": set(), "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
])
def test_find_cycle(source, expected):
    assert find_cycle(source) == expected


def test_strongly_connected():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b"], ["c", "d"]]


def test_no_import_cycles():
    graph = import_graph()
    cycles = [" -> ".join(find_cycle({m: graph[m] & c for m in c}))
              for c in strongly_connected(graph)]
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_abftgemm_imports_nothing_from_attention():
    graph = import_graph()
    wrong = {m: sorted(t for t in ts if t.split(".")[0] == "attention")
             for m, ts in graph.items() if m.split(".")[0] == "abftgemm"}
    assert not any(wrong.values()), wrong


def test_attention_imports_no_private_abftgemm_module():
    """attention builds on abftgemm's public and internal (non-underscore) modules only."""
    graph = import_graph()
    wrong = {m: sorted(t for t in ts if t.split(".")[0] == "abftgemm"
                       and any(part.startswith("_") for part in t.split(".")[1:]))
             for m, ts in graph.items() if m.split(".")[0] == "attention"}
    assert not any(wrong.values()), wrong
