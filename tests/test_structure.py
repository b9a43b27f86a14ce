"""The package's structure, counting every import a module makes (at the top, inside functions,
and for type checking only): no import circle between modules, none between packages, every
package importing only what ALLOWED (the table docs/architecture.md draws) lets it, and no module
name used twice with two meanings. So the tree reads along the data flow: sources -> template and
operators -> runtime -> tasks and state -> sinks, coordinators beside them, the batch capability
beside streaming, the tools on top."""

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


# The packages, each with the packages it may import. "spark_ckpt" is the foundation: the
# top-level modules (errors, options, clock, formats, names, session, ...). The public façades
# (spark_ckpt/__init__.py, spark_ckpt/shell.py, and the deprecated alias spark_ckpt/delta_reader.py)
# may import anything and nothing imports them.
FOUNDATION = "spark_ckpt"
FACADES = {"spark_ckpt", "spark_ckpt.shell", "spark_ckpt.delta_reader"}  # the last: an alias
ALLOWED: dict[str, set[str]] = {
    "spark_ckpt": set(),
    "spark_ckpt.sparkapi": {"spark_ckpt"},
    "spark_ckpt.storage": {"spark_ckpt", "spark_ckpt.sparkapi"},
    "spark_ckpt.execution": {"spark_ckpt", "spark_ckpt.storage"},
    "spark_ckpt.eventlog": {"spark_ckpt", "spark_ckpt.storage", "spark_ckpt.execution"},
    "spark_ckpt.checkpoint": {"spark_ckpt", "spark_ckpt.storage"},
    "spark_ckpt.state": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage"},
    "spark_ckpt.sources": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage"},
    "spark_ckpt.sinks": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage",
                         "spark_ckpt.execution", "spark_ckpt.checkpoint"},
    "spark_ckpt.streaming.template": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage",
                                      "spark_ckpt.sources", "spark_ckpt.sinks",
                                      "spark_ckpt.state", "spark_ckpt.checkpoint"},
    "spark_ckpt.streaming.runtime": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage",
                                     "spark_ckpt.sources", "spark_ckpt.sinks",
                                     "spark_ckpt.state", "spark_ckpt.checkpoint",
                                     "spark_ckpt.streaming.template"},
    "spark_ckpt.streaming": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage",
                             "spark_ckpt.sources", "spark_ckpt.sinks", "spark_ckpt.state",
                             "spark_ckpt.checkpoint", "spark_ckpt.streaming.template",
                             "spark_ckpt.streaming.runtime"},
    "spark_ckpt.batch": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage",
                         "spark_ckpt.execution", "spark_ckpt.eventlog", "spark_ckpt.sources",
                         "spark_ckpt.sinks"},
    "spark_ckpt.ops": {"spark_ckpt", "spark_ckpt.sparkapi", "spark_ckpt.storage",
                       "spark_ckpt.execution", "spark_ckpt.eventlog", "spark_ckpt.checkpoint",
                       "spark_ckpt.state", "spark_ckpt.sources", "spark_ckpt.sinks",
                       "spark_ckpt.streaming.template", "spark_ckpt.streaming.runtime",
                       "spark_ckpt.streaming", "spark_ckpt.batch"},
}
# Module names that appear in two packages with one meaning.
SAME_MEANING = {"shell.py": "the notebook façade (spark_ckpt.shell) and its functions (ops)",
                "delta_reader.py": "a deprecated alias of storage/delta_reader.py",
                "kafka.py": "Kafka: its source (sources/) and its sink (sinks/), the rooms "
                            "docs/architecture.md names for them"}


def package_of(module: str, root: Path) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package)."""
    parts = module.split(".")
    if Path(root.parent, *parts).is_dir():
        return module
    return ".".join(parts[:-1])


def package_edges(root: Path) -> dict[str, dict[str, set[str]]]:
    """package -> package it imports -> the module imports that make the edge."""
    edges: dict[str, dict[str, set[str]]] = {}
    for module, deps in package_graph(root).items():
        if module in FACADES:
            continue
        for dep in deps:
            a, b = package_of(module, root), package_of(dep, root)
            if a != b:
                edges.setdefault(a, {}).setdefault(b, set()).add(f"{module} -> {dep}")
    return edges


def test_every_package_is_in_the_table_and_the_table_has_no_circle():
    packages = {package_of(m, PACKAGE) for m in package_graph(PACKAGE)}
    assert packages == set(ALLOWED), "packages not in ALLOWED (add them, and to " \
        f"docs/architecture.md): {sorted(packages - set(ALLOWED))}; " \
        f"in ALLOWED but gone: {sorted(set(ALLOWED) - packages)}"
    assert circles({a: set(b) for a, b in ALLOWED.items()}) == []


def test_packages_import_only_what_the_table_allows():
    wrong = {f"{a} -> {b}": sorted(why) for a, deps in package_edges(PACKAGE).items()
             for b, why in deps.items() if b not in ALLOWED[a]}
    assert wrong == {}, "imports the table does not allow:\n" + "\n".join(
        f"{edge}: {', '.join(why)}" for edge, why in sorted(wrong.items()))
    assert not any(FACADES & deps for m, deps in package_graph(PACKAGE).items()
                   if m not in FACADES), "nothing inside the package imports its façades"


def test_no_package_circle():
    edges = package_edges(PACKAGE)
    found = circles({a: set(b) for a, b in edges.items()})
    assert found == [], f"package circles: {found}"


def test_no_module_name_has_two_meanings():
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    twice = {name: paths for name, paths in seen.items()
             if len(paths) > 1 and name not in SAME_MEANING}
    assert twice == {}, f"module names used twice: {twice}"
    packages = {p.name for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()}
    assert not {n.removesuffix(".py") for n in seen} & packages, "a module named as a package"


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


def test_the_architecture_page_draws_the_table():
    """docs/architecture.md's table of packages says exactly what ALLOWED lets each import."""
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    page = page[page.index("| package | holds | may import |"):]
    page = page[:page.index("\n\n")]
    drawn: dict[str, set[str]] = {}
    row_re = r"^\| (foundation \(`spark_ckpt/\*\.py`\)|`([a-z/]+)/`) \| .* \| (.*) \|$"
    for row in re.finditer(row_re, page, re.M):
        name = FOUNDATION if row.group(2) is None else \
            "spark_ckpt." + row.group(2).replace("/", ".")
        deps = row.group(3)
        drawn[name] = set() if deps == "nothing of the package" else {
            FOUNDATION if d == "foundation" else "spark_ckpt." + d.replace("/", ".")
            for d in deps.split(", ")}
    assert drawn == ALLOWED
