"""The README's "Use the scaler in your training" snippets run as written, from a pip install of this repository.

The scaler is installed (`pip install --no-deps --target`) from a copy of the repository's packaging files, and
each snippet runs in a fresh interpreter whose path has that install and not the repository: a snippet that
relies on the checkout, or a package the install forgot, fails. A snippet that needs a framework that is not
installed skips and says which (requirements-integrations.txt).
"""
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_amp_suite.child_run import ROOT, clean_env

REPO = Path(ROOT)
SECTION = "## Use the scaler in your training"


def snippets(readme: str) -> list[str]:
    """The python blocks of the section, in order."""
    body = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def needs(snippet: str) -> list[str]:
    """The top-level packages a snippet imports that are not torch or the scaler."""
    imported = re.findall(r"^(?:from|import) (\w+)", snippet, flags=re.M)
    return [m for m in dict.fromkeys(imported) if m not in ("torch", "scaler_impl")]


SNIPPETS = snippets((REPO / "README.md").read_text(encoding="utf-8"))


def test_the_section_has_a_loop_accelerate_and_lightning():
    assert [needs(s) for s in SNIPPETS] == [[], ["accelerate"], ["lightning"]], [needs(s) for s in SNIPPETS]


def test_a_section_without_snippets_is_named():
    assert snippets(f"{SECTION}\n\ntext only\n\n## Next\n```python\nx = 1\n```\n") == []


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The scaler, pip-installed from a copy of what the packaging reads: its path."""
    src, target = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("site")
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copytree(REPO / "scaler_impl", src / "scaler_impl", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True, timeout=120)
    return target


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=["loop", "accelerate", "lightning"][:len(SNIPPETS)])
def test_a_readme_snippet_runs_from_the_installed_scaler(installed, index, tmp_path):
    missing = [m for m in needs(SNIPPETS[index]) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (a test dependency): pip install -r requirements-integrations.txt")
    env = clean_env()
    env["PYTHONPATH"] = str(installed)
    run = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, f"README snippet {index} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
