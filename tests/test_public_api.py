import importlib

import pytest

MODULES = ["spark_ckpt", "spark_ckpt.batch", "spark_ckpt.execution", "spark_ckpt.eventlog"]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_and_importable(name):
    module = importlib.import_module(name)
    assert list(module.__all__) == sorted(module.__all__)
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol}"


def test_library_installs_no_log_handlers():
    import logging

    import spark_ckpt  # noqa: F401

    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith("spark_ckpt") and isinstance(logger, logging.Logger):
            assert not logger.handlers, name


def _undocumented() -> list[str]:
    """Every name of ``spark_ckpt.__all__``, and every public method and property of its
    classes (the package's own, not Python's or PySpark's), that has no docstring."""
    import inspect

    import spark_ckpt

    missing = []
    for name in spark_ckpt.__all__:
        obj = getattr(spark_ckpt, name)
        doc = inspect.getdoc(obj)
        if not doc or (inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(")):
            missing.append(name)  # a dataclass's generated doc is only its signature
        if not inspect.isclass(obj):
            continue
        for attr in dir(obj):
            owner = next((k for k in obj.__mro__ if attr in vars(k)), None)
            if attr.startswith("_") or owner is None \
                    or not owner.__module__.startswith("spark_ckpt"):
                continue
            raw = vars(owner)[attr]
            if isinstance(raw, staticmethod | classmethod):
                raw = raw.__func__
            if isinstance(raw, property):
                member = raw
            elif inspect.isfunction(raw):
                member = getattr(obj, attr)
            else:
                continue  # a class attribute
            if not inspect.getdoc(member):
                missing.append(f"{name}.{attr}")
    return missing


def test_every_public_name_and_method_has_a_docstring():
    assert _undocumented() == []


@pytest.mark.parametrize("name", ["raw_state", "read_state", "rewrite_state"])
def test_the_state_processors_old_names_still_work_and_warn(name):
    import spark_ckpt
    import spark_ckpt.state

    with pytest.warns(DeprecationWarning, match=rf"spark_ckpt\.state\.{name} is deprecated"):
        old = getattr(spark_ckpt.state, name)
    assert old is getattr(spark_ckpt, name)


def test_the_delta_readers_old_module_still_works_and_warns():
    import importlib
    import sys

    from spark_ckpt.storage.delta_reader import read_delta

    sys.modules.pop("spark_ckpt.delta_reader", None)
    with pytest.warns(DeprecationWarning, match=r"spark_ckpt\.delta_reader is deprecated"):
        old = importlib.import_module("spark_ckpt.delta_reader")
    assert old.read_delta is read_delta


def test_a_python_worker_that_runs_a_stateful_task_does_not_import_the_driver_side():
    """``spark_ckpt`` imports its names on first use: a new Python worker that runs a stateful
    task imports ``spark_ckpt.state.process_task`` and not the streaming template, the batch
    runner or the tools (1.35 s of a new worker's first task before, on this machine)."""
    import subprocess
    import sys

    from helpers import ROOT

    probe = ("import sys, spark_ckpt, spark_ckpt.state.process_task; print(spark_ckpt.__file__); "
             "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('spark_ckpt.')}))")
    where, loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                   check=True, cwd=ROOT).stdout.splitlines()
    assert where.startswith(str(ROOT)), where  # this checkout's package, not another copy
    for driver_side in ("streaming", "batch", "ops", "eventlog", "sinks", "sources"):
        assert f"'{driver_side}'" not in loaded, loaded
    assert "'state'" in loaded
    import spark_ckpt  # and every public name still resolves, from the package itself

    assert all(getattr(spark_ckpt, name) is not None for name in spark_ckpt.__all__)
    assert set(spark_ckpt._MODULE_OF) == set(spark_ckpt.__all__)  # the two lists agree
