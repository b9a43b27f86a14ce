"""The error tree: every ``raise`` in spark_ckpt raises a class of spark_ckpt/errors.py (but for
a short list of deliberate exceptions, each with its reason), and errors.py's docstring draws
the tree as it is."""

from __future__ import annotations

import ast
import builtins
import importlib
import warnings
import inspect
import re
import typing
from pathlib import Path
from types import ModuleType

import spark_ckpt
from spark_ckpt import errors

PACKAGE = Path(spark_ckpt.__file__).parent

#: (module, class name) -> why that raise stays outside the tree. "*": in any module.
ALLOWED = {
    ("*", "NotImplementedError"): "an abstract method: the subclass overrides it",
    ("spark_ckpt.state.processor", "KeyError"): "KeyRows[column]: the mapping protocol",
    ("spark_ckpt.sources.receivers", "ConnectionResetError"):
        "the server closed the socket: an OSError the receiver's reconnect loop catches",
    ("spark_ckpt.state", "AttributeError"): "a module's __getattr__ (PEP 562) for a name it lacks",
    ("spark_ckpt", "AttributeError"): "a module's __getattr__ (PEP 562) for a name it lacks",
    ("spark_ckpt.ops.cli", "ClickException"): "click's protocol for a message and exit code 1",
    ("spark_ckpt.ops.cli", "UsageError"): "click's protocol for a usage error (exit code 2)",
    ("spark_ckpt.faults", "OSError"): "an injected storage failure: the storage's own error",
    ("spark_ckpt.storage.faulty", "OSError"):
        "an injected storage failure: the storage's own error",
    ("spark_ckpt.storage", "OSError"): "an injected full disk (faultfs.enospc): ENOSPC",
    ("spark_ckpt.sparkapi.connect_plan", "_Unwritable"):
        "control flow of the Connect plan reader: caught in that module and turned into an "
        "expression kind the split refuses, naming why; it never leaves the module",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST) -> dict[str, str]:
    """Every name a module's imports bind, at the top or inside functions: name -> where."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


def resolve(dotted: str, module: ModuleType, imports: dict[str, str]) -> object | None:
    """What ``a.b.c`` names in ``module`` (its globals, its function-level imports, the
    built-ins); None for a local variable (an exception object held: a re-raise)."""
    root, *rest = dotted.split(".")
    if hasattr(module, root):
        obj = getattr(module, root)
    elif root in imports:
        where, _, attr = imports[root].partition(":")
        obj = importlib.import_module(where)
        if attr:
            obj = getattr(obj, attr)
    elif hasattr(builtins, root):
        obj = getattr(builtins, root)
    else:
        return None
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def raised_class(obj: object) -> type | None:
    """The class a raise of ``obj`` or ``obj(...)`` raises: a class, or a factory function's
    annotated return type."""
    if inspect.isclass(obj):
        return obj
    if callable(obj):
        returned = typing.get_type_hints(obj).get("return")
        return returned if inspect.isclass(returned) else None
    return None


def raises_outside_the_tree() -> tuple[list[str], int]:
    found, checked = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        tree = ast.parse(path.read_text())
        with warnings.catch_warnings():  # a deprecated alias warns when imported
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(name)
        imports = imported_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue  # a bare re-raise
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if not isinstance(target, ast.Name | ast.Attribute):
                found.append(f"{where}: raise of {ast.unparse(target)}")
                continue
            dotted = ast.unparse(target)
            if dotted.startswith("self."):
                continue  # an exception object held (stored by another thread): a re-raise
            obj = resolve(dotted, module, imports)
            if obj is None:
                continue  # a local variable: the exception caught or built above
            cls = raised_class(obj)
            checked += 1
            if cls is None:
                found.append(f"{where}: raise of {dotted}: not a class, nor a function "
                             "annotated to return one")
            elif cls.__module__ == errors.__name__ and issubclass(cls, errors.SparkCkptError):
                continue
            elif ("*", cls.__name__) not in ALLOWED and (name, cls.__name__) not in ALLOWED:
                found.append(f"{where}: raise {dotted} ({cls.__module__}.{cls.__name__})")
    return found, checked


def test_every_raise_in_the_package_raises_a_class_of_the_error_tree():
    found, checked = raises_outside_the_tree()
    assert checked > 300
    assert found == [], ("raises outside spark_ckpt/errors.py (raise the fitting class there, "
                         "or add a deliberate exception to ALLOWED with its reason):\n"
                         + "\n".join(found))


def tree_classes() -> list[type]:
    return [c for c in vars(errors).values() if inspect.isclass(c)
            and issubclass(c, errors.SparkCkptError) and c.__module__ == errors.__name__]


def test_the_docstring_draws_every_class_of_the_tree_under_its_parent():
    """Each line of the drawing is ``<indent>Name [Builtin]``: the parent is the nearest line
    above with less indent; the bracket names the built-in error it also derives from."""
    drawing = errors.__doc__.split("::", 1)[1]
    drawn: dict[str, tuple[str | None, str | None]] = {}
    stack: list[tuple[int, str]] = []
    for line in drawing.splitlines():
        match = re.fullmatch(r"([ │├└─]*)(\w+)(?: \[(\w+)\])?(?: \(.*\))?", line.rstrip())
        if not match or not line.strip():
            continue
        depth = len(match.group(1))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        drawn[match.group(2)] = (stack[-1][1] if stack else None, match.group(3))
        stack.append((depth, match.group(2)))
    actual = {}
    for cls in tree_classes():
        parents = [b for b in cls.__bases__ if issubclass(b, errors.SparkCkptError)]
        builtins = [b.__name__ for b in cls.__bases__ if b.__module__ == "builtins"
                    and b is not Exception]
        actual[cls.__name__] = (parents[0].__name__ if parents else None,
                                builtins[0] if builtins else None)
    assert drawn == actual


def test_every_class_of_the_tree_is_exported():
    assert sorted(errors.__all__) == sorted(c.__name__ for c in tree_classes())


def test_a_changed_key_raises_one_class_wherever_it_is_found():
    """The key of a stateful operator cannot change under a checkpoint: StateSchemaError at
    every place that finds it (a CheckpointError, so older ``except`` clauses still catch it)."""
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    raised = set()
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    "cannot change under a checkpoint" in ast.unparse(node.exc) and \
                    "key" in ast.unparse(node.exc).split("cannot change")[0][-80:]:
                raised.add((ast.unparse(node.exc.func), path.name))
    assert {cls for cls, _ in raised} == {"StateSchemaError"}, raised
    assert issubclass(errors.StateSchemaError, errors.CheckpointError)
