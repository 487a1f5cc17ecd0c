"""One run of a standalone repro (fsdp_amp_suite/repro/standalone/<id>.py) as a maintainer runs it, and what it
showed: the file's modes (and its report's minimal repro, fsdp_amp_suite/repro/minimal/<id>.py), `python FILE
[--MODE]` from an empty directory with nothing of this repository on its path (forked with torch imported,
forked.py), and its verdict. test_standalone.py runs every file against KNOWN_BUGS; reports.py records the runs for
the upstream reports; benchmarks/standalone.py times them.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from fsdp_amp_suite.expectations import WITH_FIX
from fsdp_amp_suite.known_bugs import STANDALONE_DIR
from fsdp_amp_suite.upstream import forked
from fsdp_amp_suite.paths import ROOT
PLAIN = "plain"
# the report's inline repro: fsdp_amp_suite/repro/minimal/<id>.py, the bug in at most MINIMAL_LINES lines that a
# maintainer pastes and runs as is; the same contract as the standalone file's plain run (its two lines, exit 1)
MINIMAL = "minimal"
MINIMAL_DIR = "fsdp_amp_suite/repro/minimal"
MINIMAL_LINES = 30
SKIP_STATUS = 77  # the file's own "this machine cannot run me": a wrong guess of its needs fails the check
TIMEOUT_S = 240  # a file bounds its own hangs (gloo timeouts of 10-20 s); this bounds a file that does not


def modes(shown) -> list[str]:
    """A file's runs: plain; each real-training flag of its entries; --with-fix, unless its bug is torch's
    design (nothing to fix) or fixed upstream (the fix is upstream's)."""
    own = shown[0]
    real = sorted({bug.reach.run.lstrip("-") for bug in shown if bug.reach and bug.reach.run})
    fix = [] if own.by_design or own.torch else [WITH_FIX]
    minimal = [MINIMAL] if minimal_path(own.standalone_file).exists() else []
    return [PLAIN, *minimal, *real, *fix]


def path_of(stem: str, mode: str = PLAIN) -> Path:
    return minimal_path(stem) if mode == MINIMAL else ROOT / STANDALONE_DIR / f"{stem}.py"


def minimal_path(stem: str) -> Path:
    return ROOT / MINIMAL_DIR / f"{stem}.py"


def run_file(stem: str, mode: str, python: str | None = None) -> subprocess.CompletedProcess:
    """`python FILE [--MODE]` from an empty directory, this repository off PYTHONPATH: only what the
    environment installs (torch, fairscale) can be imported from the file, as where a maintainer pastes it.
    python=None runs this interpreter forked, torch imported (fsdp_amp_suite/upstream/forked.py); an interpreter's path
    starts it fresh."""
    path = path_of(stem, mode)
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p).resolve() == ROOT or ROOT in Path(p).resolve().parents)]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    args = [] if mode in (PLAIN, MINIMAL) else [f"--{mode}"]
    with tempfile.TemporaryDirectory() as cwd:
        if python is None:
            return forked.run(str(path), args, env, cwd, TIMEOUT_S)
        return subprocess.run([python, str(path), *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)


def verdict(proc: subprocess.CompletedProcess) -> bool:
    """Did the bug show (True) or not (False)? AssertionError for anything else: a skip the expectation did not
    allow, a traceback, a status without the two lines."""
    out = proc.stdout.strip().splitlines()
    said = "\n".join(out[-6:])
    if proc.returncode == SKIP_STATUS:
        raise AssertionError(f"the file skipped itself where its KNOWN_BUGS `needs` say it runs: {said}")
    if proc.returncode not in (0, 1):
        raise AssertionError(f"exit status {proc.returncode}, neither 0 (fixed) nor 1 (the bug):\n{said}\n"
                             f"{proc.stderr[-3000:]}")
    observed = [line for line in out if line.startswith("observed: ")]
    expected = [line for line in out if line.startswith("expected: ")]
    if not observed or len(observed) != len(expected):
        raise AssertionError(f"exit status {proc.returncode} without its observed/expected lines:\n{said}\n"
                             f"{proc.stderr[-3000:]}")
    return proc.returncode == 1
