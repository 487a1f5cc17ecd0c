"""The suite on several torch versions, then one table: known bug x torch version
(python -m fsdp_amp_suite.version_table).

    nox                                   # every version of TORCH_VERSIONS, then the table (versions-out/table.md)
    nox -s "tests(torch='2.13.0')"        # one of them; extra pytest args after --
    nox -s torch-version -- 2.12.0        # any version; extra pytest args after the version
    nox -s table                          # the table from the JSON reports in versions-out/

Each version gets its own venv (uv) with torch==V and requirements-suite.txt (the suite without torch), and runs
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
import tomllib

import nox
from packaging.version import InvalidVersion, Version

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests", "table"]  # plain `nox`: the versions below, then the table (torch-version needs one)

ROOT = pathlib.Path(__file__).parent
OUT = ROOT / "versions-out"
# The torch releases the suite is checked on: pyproject.toml's [tool.fsdp-amp-suite] checked-torch, the one list.
with open(ROOT / "pyproject.toml", "rb") as _f:
    TORCH_VERSIONS = tomllib.load(_f)["tool"]["fsdp-amp-suite"]["checked-torch"]
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
    _suite_on(session, torch, session.posargs)


@nox.session(name="torch-version", python="3.11")
def torch_version(session: nox.Session) -> None:
    """The suite on any torch: nox -s torch-version -- VERSION [pytest args]."""
    if not session.posargs:
        session.error("usage: nox -s torch-version -- VERSION [pytest args], e.g. -- 2.12.0")
    torch, *args = session.posargs
    try:
        Version(torch)
    except InvalidVersion:
        session.error(f"{torch!r} is not a version (give the torch release first, e.g. -- 2.12.0 -k fsdp2)")
    _suite_on(session, torch, args)


def _suite_on(session: nox.Session, torch: str, args) -> None:
    # torch first, alone, from its own source (the index's dependencies of torch come with it); then the
    # suite's other requirements from the default index, which keep the torch already installed
    session.install(*_torch_sources(), f"torch=={torch}")
    session.install("-r", str(ROOT / "requirements-suite.txt"), f"torch=={torch}")
    session.run("python", "-c", "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)")
    OUT.mkdir(exist_ok=True)
    json_path, md_path = OUT / f"torch-{torch}.json", OUT / f"torch-{torch}.md"
    for stale in (json_path, md_path):  # a run that dies before writing must not leave the last run's
        stale.unlink(missing_ok=True)
    session.run("python", "-m", "pytest", "-n", "2", "-m", "not slow",
                f"--report-json={json_path}", f"--report={md_path}", *args)


@nox.session(python=False)
def table(session: nox.Session) -> None:
    """The table from every versions-out/torch-*.json there is (also as versions-out/table.md)."""
    # fails if a version of TORCH_VERSIONS has no report (args after -- replace this, e.g. `-- --expect ""`)
    args = session.posargs or ["--expect", ",".join(TORCH_VERSIONS)]
    session.chdir(ROOT)
    session.run(sys.executable, "-m", "fsdp_amp_suite.version_table", str(OUT), "--markdown", str(OUT / "table.md"),
                *args, external=True)
