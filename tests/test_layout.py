"""The package's shape: imports run one way, and no function outgrows a screen or two.

* Imports run down the layers (``docs/ARCHITECTURE.md``): integrations
  (the engines) -> surfaces -> pipeline -> operator. A module imports, at the
  top or inside a function, only modules of its own layer or a lower one.
  ``stem_indexer`` itself (the public names) and ``stem_indexer.testing`` (the
  public test framework, which the ``stem-indexer`` command runs) sit with the
  surfaces: they import the pipeline and the operator, and no pipeline or
  operator module imports them.
* Every import of the package's own modules names one that exists (a
  relative import left at a module's old path fails only when its function
  runs: here it fails at once).
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


# Each package's layer, lowest first. ``stem_indexer`` itself (its
# ``__init__``, the public names) is a surface; a module directly beside it
# is in no layer.
LAYERS = {
    "stem_indexer.operator": 0,
    "stem_indexer.pipeline": 1,
    "stem_indexer.surfaces": 2,
    "stem_indexer.testing": 2,
    "stem_indexer.integrations": 3,
}
LAYER_NAMES = ("operator", "pipeline", "surfaces", "engines")


def _modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in (src / "stem_indexer").rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its code).
    ``from . import x`` names the submodule x, not the package."""
    modules = _modules(src)
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


def unresolved_imports(src: Path = SRC) -> list[str]:
    """Each import, anywhere in a module, of a module of the package that does not exist."""
    modules = _modules(src)
    missing = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                    if node.level else []
                targets = [".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            missing += [f"{path.relative_to(src)}:{node.lineno} imports {t}" for t in targets
                        if t.split(".")[0] == "stem_indexer" and t not in modules]
    return missing


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


def layer(module: str) -> int:
    """The layer of ``module``: that of the package in LAYERS that holds it."""
    if module == "stem_indexer":
        return LAYERS["stem_indexer.surfaces"]
    for package, number in LAYERS.items():
        if module == package or module.startswith(package + "."):
            return number
    raise KeyError(f"{module} is in no layer: move it into one of {sorted(LAYERS)}")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module of a higher layer than the importer's."""
    return sorted(f"{a} ({LAYER_NAMES[layer(a)]}) imports {b} ({LAYER_NAMES[layer(b)]})"
                  for a in graph for b in graph[a] if layer(b) > layer(a))


def test_imports_run_down_the_layers():
    graph = import_graph()
    assert "stem_indexer.operator.api" in graph["stem_indexer.pipeline.plan"]
    assert "stem_indexer.pipeline.paged" in graph["stem_indexer.integrations.vllm.rows"]
    assert {LAYER_NAMES[layer(name)] for name in graph} == set(LAYER_NAMES)
    assert upward_imports(graph) == []


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "stem_indexer" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_layer_check_finds_an_upward_import(tmp_path):
    """A kernel module that imports the pipeline inside a function is caught."""
    files = {
        "__init__.py": "from .surfaces import api\n",
        "operator/__init__.py": "",
        "operator/kernel.py": "def run():\n    from ..pipeline import plan\n    return plan\n",
        "pipeline/__init__.py": "",
        "pipeline/plan.py": "from ..operator import kernel\n",
        "surfaces/__init__.py": "",
        "surfaces/api.py": "from ..pipeline.plan import kernel\n",
    }
    assert upward_imports(import_graph(_write_package(tmp_path, files))) == [
        "stem_indexer.operator.kernel (operator) imports stem_indexer.pipeline.plan (pipeline)"]


def test_every_import_of_the_package_names_a_module_that_exists():
    assert unresolved_imports() == []


def test_the_import_check_finds_an_import_of_an_old_path(tmp_path):
    """A function's import of a module at the path it had before a move is caught."""
    root = _write_package(tmp_path, {
        "__init__.py": "",
        "operator/__init__.py": "",
        "operator/ops/__init__.py": "",
        "operator/ops/native.py": "",
        "pipeline/__init__.py": "from ..operator.ops import native\n",
        "pipeline/cache.py": "def write():\n    from .ops import native\n    return native\n",
    })
    assert unresolved_imports(root) == [
        "stem_indexer/pipeline/cache.py:2 imports stem_indexer.pipeline.ops"]


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
