"""The checkout's own rules: the suite's configuration is in use, and tests/meta runs only when named.

The checks themselves come from the plugin (fsdp_amp_suite/plugin.py, which pytest.ini turns on).
"""
import pathlib

from fsdp_amp_suite import options

pytest_plugins = ["pytester"]  # the suite's own tests run child pytests

ROOT = pathlib.Path(__file__).parent  # as pytest found it (a submodule's path reads as the consumer wrote it)
META = (ROOT / "tests" / "meta").resolve()


def pytest_configure(config):
    options.check_configuration(config, str(ROOT / "pytest.ini"))


def pytest_ignore_collect(collection_path, config):
    """The suite's own tests (tests/meta) run only when a path on the command line names them: the main job
    and a consumer's `pytest path/to/suite -m ...` collect the verdict on torch and the scaler, nothing else."""
    if collection_path.resolve() == META and not any(_names_meta(arg, config) for arg in config.args):
        return True
    return None


def _names_meta(arg: str, config) -> bool:
    path = (config.invocation_params.dir / arg.split("::", 1)[0]).resolve()
    return path == META or META in path.parents
