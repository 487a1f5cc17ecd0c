"""The suite on several torch versions, then one table: known bug x torch version (ci/versions.py).

    nox                                   # every version, then the table (versions-out/table.md)
    nox -s "tests(torch='2.13.0')"        # one version; extra pytest args after --
    nox -s table                          # the table from the JSON reports in versions-out/

Each version gets its own venv (uv) with torch==V and the other pins of requirements.txt, and runs
`pytest -n 2 -m "not slow"`, writing versions-out/torch-V.json (--report-json) and torch-V.md.
Where torch comes from (default: PyPI, i.e. the CUDA build on Linux):
    FSDP_AMP_TORCH_INDEX=https://download.pytorch.org/whl/cpu   # an index for torch alone (CI: CPU wheels)
    FSDP_AMP_TORCH_FIND_LINKS=DIR                               # a directory of local torch wheels, tried first
uv's own settings (UV_FIND_LINKS, UV_INDEX_URL, ...) apply too.
"""
from __future__ import annotations

import os
import pathlib
import sys

import nox
from packaging.requirements import Requirement

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

ROOT = pathlib.Path(__file__).parent
OUT = ROOT / "versions-out"
# The oldest torch the suite supports (pyproject.toml: torch>=2.4; FSDP2 on a CPU-only machine needs 2.7, measured:
# FSDP2_CPU_TORCH in tests/matrix/implementations.py), the pin of requirements.txt, and the newest release checked here.
TORCH_VERSIONS = ["2.4.1", "2.13.0", "2.14.1"]
EXTRA = ["packaging"]  # not pinned in requirements.txt


def _pins() -> list[str]:
    """requirements.txt without its torch line."""
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line and Requirement(line).name != "torch"]


def _torch_sources() -> list[str]:
    args = []
    if os.environ.get("FSDP_AMP_TORCH_FIND_LINKS"):
        args += ["--find-links", os.environ["FSDP_AMP_TORCH_FIND_LINKS"]]
    if os.environ.get("FSDP_AMP_TORCH_INDEX"):
        args += ["--index-url", os.environ["FSDP_AMP_TORCH_INDEX"]]
    return args


@nox.session(python="3.11", tags=["versions"])
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    # torch first, alone, from its own source (the index's dependencies of torch come with it); then the
    # other pins from the default index, which keep the torch already installed
    session.install(*_torch_sources(), f"torch=={torch}")
    session.install(*_pins(), *EXTRA, f"torch=={torch}")
    session.run("python", "-c", "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)")
    OUT.mkdir(exist_ok=True)
    json_path, md_path = OUT / f"torch-{torch}.json", OUT / f"torch-{torch}.md"
    for stale in (json_path, md_path):  # a run that dies before writing must not leave the last run's
        stale.unlink(missing_ok=True)
    session.run("python", "-m", "pytest", "-n", "2", "-m", "not slow",
                f"--report-json={json_path}", f"--report={md_path}", *session.posargs)


@nox.session(python=False)
def table(session: nox.Session) -> None:
    """The table from every versions-out/torch-*.json there is (also as versions-out/table.md)."""
    # fails if a version of TORCH_VERSIONS has no report (args after -- replace this, e.g. `-- --expect ""`)
    args = session.posargs or ["--expect", ",".join(TORCH_VERSIONS)]
    session.run(sys.executable, str(ROOT / "ci" / "versions.py"), str(OUT), "--markdown", str(OUT / "table.md"),
                *args, external=True)
