"""The suite as a pytest plugin: its options everywhere, its checks where the configuration turns them on.

pytest loads this module through the `pytest11` entry point of an installed suite (pyproject.toml), or from
pytest.ini's `-p fsdp_amp_suite.plugin` in a checkout that is not installed; under both, pytest registers it once.
Installed, it is part of every pytest run in that environment, so it adds the suite's options and nothing else,
unless the configuration in use sets `fsdp_amp_suite = true` (the suite's pytest.ini; options.ACTIVE). Then it
registers `checks` (the rank harness, the scaler parametrization, every check's expectation) and `report`.
"""
import pytest

from fsdp_amp_suite import options

PLUGINS = ("fsdp_amp_suite.report", "fsdp_amp_suite.checks")  # registered under these names, in this order


def pytest_addoption(parser):
    options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if not config.getini(options.ACTIVE):
        return
    options.hand_to_workers(config)
    import importlib

    for name in PLUGINS:  # a child run may have named the report with -p already
        if not config.pluginmanager.has_plugin(name):
            config.pluginmanager.register(importlib.import_module(name), name)
