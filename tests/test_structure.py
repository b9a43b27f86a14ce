"""The package's structure: no import circle anywhere in spark_ckpt, counting every import a
module makes (at the top, inside functions, and for type checking only), so each layer can be
read, tested and replaced on its own: streaming's template below its scheduler below the
StreamingContext façade; the batch job API over its runner over the vertex runner."""

from __future__ import annotations

import ast
from pathlib import Path

import spark_ckpt

PACKAGE = Path(spark_ckpt.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, modules: set[str]) -> set[str]:
    """The package's modules ``source`` imports: ``from a.b import c`` counts ``a.b.c`` when that
    is a module, else ``a.b``; a package's ``__init__`` counts only when imported for itself."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= submodules
            if len(submodules) < len(node.names) and node.module in modules:
                found.add(node.module)  # names defined in that module itself
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph(root: Path) -> dict[str, set[str]]:
    paths = list(root.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    graph = {}
    for p in paths:
        name = module_name(p, root)
        graph[name] = imports_of(p.read_text(), modules) - {name}
    return graph


def test_no_import_circle_in_the_package():
    graph = package_graph(PACKAGE)
    assert len(graph) > 60 and "spark_ckpt.streaming.context" in graph
    found = circles(graph)
    assert found == [], "import circles (each a group of modules importing each other):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_the_facades_sit_on_top():
    graph = package_graph(PACKAGE)
    assert "spark_ckpt.streaming.context" not in set().union(
        *(deps for name, deps in graph.items() if name.startswith("spark_ckpt.streaming.")
          and name != "spark_ckpt.streaming"))
    assert "spark_ckpt.batch.job" not in set().union(
        *(deps for name, deps in graph.items() if name.startswith("spark_ckpt.batch.")
          and name != "spark_ckpt.batch"))
    assert "spark_ckpt.batch.runner" not in graph["spark_ckpt.batch.vertex_runner"]


def test_the_check_finds_a_circle_through_a_type_checking_or_lazy_import(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from typing import TYPE_CHECKING\n"
                               "if TYPE_CHECKING:\n    from pkg.b import B\n")
    (root / "b.py").write_text("def f():\n    from pkg.a import A\n")
    (root / "c.py").write_text("from pkg import a\n")
    assert circles(package_graph(root)) == [["pkg.a", "pkg.b"]]
