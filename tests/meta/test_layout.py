"""The library and the tests stay apart: tests/ holds test modules (and their packages' __init__.py) only, nothing
outside tests/ imports from `tests`, and no module imports a test module. A consumer's own `tests` package and
the suite's machinery then never meet (fsdp_amp_suite/plugin.py, pytest.ini's --import-mode=importlib)."""
import ast

import pytest

from fsdp_amp_suite.paths import ROOT, TESTS

pytestmark = pytest.mark.harness
SKIP_DIRS = {".git", ".ci-venv", ".venv", ".nox", "__pycache__", "build", "node_modules"}


def python_files():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if not SKIP_DIRS.intersection(parts) and not parts[0].startswith("."):
            yield path


def imported(path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file: `from a.b import c` gives a.b and a.b.c."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_tests_holds_only_test_modules():
    other = [p.relative_to(ROOT).as_posix() for p in TESTS.rglob("*.py")
             if "__pycache__" not in p.parts and not (p.name.startswith("test_") or p.name == "__init__.py")]
    assert not other, f"not test modules, in tests/: {other}; the library's modules belong in fsdp_amp_suite/"


def test_nothing_outside_tests_imports_from_tests_and_no_module_imports_a_test_module():
    bad = []
    for path in python_files():
        inside = TESTS in path.parents
        for line, module in imported(path):
            names = module.split(".")
            if (not inside and names[0] == "tests") or names[-1].startswith("test_"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert not bad, "imports of a test module, or of `tests` from outside it:\n" + "\n".join(bad)
