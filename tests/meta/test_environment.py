"""A runner's broken environment reads as one line, not as a rank traceback per check."""
import importlib.metadata

from fsdp_amp_suite.versions import import_problem


def test_an_installed_framework_that_does_not_import_is_one_line_naming_the_error_and_the_versions(tmp_path,
                                                                                                   monkeypatch):
    (tmp_path / "brokenframework").mkdir()
    (tmp_path / "brokenframework" / "__init__.py").write_text("from torch import no_such_name\n")
    info = tmp_path / "brokenframework-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenframework\nVersion: 1.2\n")
    (info / "top_level.txt").write_text("brokenframework\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # this process reads the versions
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the child that tries the import
    line = import_problem("brokenframework")
    torch = importlib.metadata.version("torch")
    assert line.startswith("brokenframework is installed but does not import (ImportError: cannot import name "
                           "'no_such_name' from 'torch'"), line
    assert line.endswith(f"versions: brokenframework 1.2, torch {torch}: fix the environment (pip install -r "
                         "requirements-integrations.txt) or uninstall it"), line
    assert "\n" not in line


def test_a_framework_that_imports_has_no_problem():
    assert import_problem("json") is None
