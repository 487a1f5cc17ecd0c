"""The versions this run is on, and version specifiers for the facts that hold only on some of them.

Every known bug (fsdp_amp_suite/known_bugs.py KNOWN_BUGS) and every version-dependent skip names the torch (and
fairscale) versions it holds for as a PEP 440 specifier (`packaging.specifiers.SpecifierSet`): a bug
fixed in torch N is `torch="<N"`, so on N its checks are expected to pass. Local version labels
(`2.11.0+cu130`) and pre-releases are compared by their release: `2.11.0+cu130` is in `==2.11.*`.
"""
from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from typing import Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import Version


# The torch releases the suite is checked on, oldest first (the floor, the pin, the newest): pyproject.toml's one list.
with open(pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as _f:
    CHECKED_TORCH = tuple(tomllib.load(_f)["tool"]["fsdp-amp-suite"]["checked-torch"])

# DTensor and its placements are public (torch.distributed.tensor) from torch 2.5; 2.4 keeps them private in
# torch.distributed._tensor (seen on 2.4.1: ImportError). The checks that build DTensors on a mesh skip below it.
DTENSOR_TORCH = "<2.5"
DTENSOR_REASON = (f"DTensor meshes need torch >= 2.5: on torch{DTENSOR_TORCH} torch.distributed.tensor has no DTensor "
                  "(2.4 keeps it private in torch.distributed._tensor)")


@functools.lru_cache(maxsize=None)
def installed(package: str) -> Version | None:
    """The installed version of a distribution (release only: no local label), or None."""
    try:
        return Version(Version(metadata.version(package)).base_version)
    except metadata.PackageNotFoundError:
        return None


def holds(torch: str | SpecifierSet = "", fairscale: str | SpecifierSet = "", on: Mapping | None = None) -> bool:
    """Do torch and fairscale satisfy these specifiers (an empty one: any version)? `on`: the versions to ask
    about, {package: Version or None}, as `here()` gives them; default the installed ones."""
    for package, spec in (("torch", torch), ("fairscale", fairscale)):
        spec = SpecifierSet(str(spec))
        if not str(spec):
            continue
        version = installed(package) if on is None else on.get(package)
        if version is None or not spec.contains(version, prereleases=True):
            return False
    return True


def here() -> dict:
    """The installed versions that known bugs and skips are decided on: {package: Version or None}."""
    return {package: installed(package) for package in ("torch", "fairscale")}


def describe() -> dict:
    """What this run is on, for the report's header (plain data)."""
    import platform

    import torch

    cuda = torch.version.cuda if torch.cuda.is_available() else None
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"python": platform.python_version(), "torch": torch.__version__,
            "fairscale": str(installed("fairscale")) if installed("fairscale") else None,
            "cuda": cuda, "gpus": gpus}


@functools.cache
def import_problem(package: str) -> str | None:
    """Why an installed package does not import, in one line (None: it imports): the import error and the versions
    involved. The framework checks (tests/conformance/test_frameworks.py) skip with that line, as they do where
    the framework is missing: a runner's broken environment is not a verdict on the scaler, and pytest -rs prints
    one line for all of them. Asked once per process, in a child process (accelerate and Lightning keep
    process-wide state)."""
    proc = subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    error = ([line for line in proc.stderr.splitlines() if line.strip()] or [f"exit code {proc.returncode}"])[-1]
    named = re.findall(r"""(?:No module named|from|module) '([\w.]+)'""", error)
    involved = dict.fromkeys([package, "torch", *(m.split(".")[0] for m in named)])
    return (f"{package} is installed but does not import ({error.strip()}); versions: "
            + ", ".join(f"{name} {_version(name)}" for name in involved)
            + ": fix the environment (pip install -r requirements-integrations.txt) or uninstall it")


def _version(module: str) -> str:
    dists = metadata.packages_distributions().get(module, [module])
    try:
        return metadata.version(dists[0])
    except metadata.PackageNotFoundError:
        return "(not installed)"
