"""Where the suite's files are: one home for the checkout's paths, and the one way to load a check's file.

The library reads files of the checkout it came with (the README, docs/, the test modules of tests/): an
editable install or a source tree. `pip install .` installs the library without them; what needs them says so.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: fsdp_amp_suite/ sits at its top level
TESTS = ROOT / "tests"
REPRO_DIR = TESTS / "repro"


def load_file(path, name: str):
    """A check's file, loaded by its path under `name` and kept in sys.modules (pickle finds its functions there), as
    pytest's importlib mode loads it: the library and the ranks read the suite's test modules without importing a
    `tests` package, which may be a consumer's. The module already loaded from that file under that name is reused."""
    import sys

    path = Path(path)
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the suite's test modules ship with its checkout, not "
                                f"with `pip install .`: run from the checkout)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: a dataclass in it looks its module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
