"""The package's shape: imports run one way, and no function outgrows a screen or two.

* No module of ``src/stem_indexer`` imports, at the top or inside a function,
  a module that imports it back, directly or through others: each thing has
  one home, and a module that needs another's part imports that part's home.
* No function is longer than ``MAX_FUNCTION_LINES`` lines (docstring
  included).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "stem_indexer"
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its code).
    ``from . import x`` names the submodule x, not the package."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                    if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names
                        if f"{target}.{a.name}" in modules]
                found.update(subs or [target])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs (a, b) where a imports b and b reaches a again."""
    def reach(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(graph[node])
        return seen

    return sorted((a, b) for a in graph for b in graph[a] if a in reach(b))


def test_no_import_circles():
    graph = import_graph()
    assert "stem_indexer.operator.ops.torch_blas" in graph["stem_indexer.operator.ops.native"]
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [("a", "b"), ("b", "c"), ("c", "a")]


def test_no_function_is_longer_than_the_limit():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {lines}")
    assert not long, "\n".join(long)
