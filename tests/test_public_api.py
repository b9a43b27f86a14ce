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
