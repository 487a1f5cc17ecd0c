"""Parametrize the matrix over its cells (axes.py), for the built-in or --fsdp implementations. Which cells
this machine cannot run is decided with every other expectation (tests/expectations.py)."""
from tests.matrix import axes, implementations


def _impls(config):
    return config.getoption("--fsdp") or list(implementations.BUILTINS)


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        generated = axes.cells(_impls(metafunc.config)) + axes.natural_cells(_impls(metafunc.config))
        metafunc.parametrize("cell", generated, ids=[c.id for c in generated])
