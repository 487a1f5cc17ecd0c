"""Parametrize the matrix over its cells (axes.py), for the built-in or --fsdp implementations."""
import pytest
import torch

from tests.matrix import axes, implementations


def _impls(config):
    return config.getoption("--fsdp") or list(implementations.BUILTINS)


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        generated = axes.cells(_impls(metafunc.config))
        metafunc.parametrize("cell", generated, ids=[c.id for c in generated])


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        cell = getattr(getattr(item, "callspec", None), "params", {}).get("cell")
        reason = cell and axes.skip_reason(cell, n_gpus)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
