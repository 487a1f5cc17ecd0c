"""Every standalone repro (fsdp_amp_suite/repro/standalone/<id>.py, docs/upstream/README.md) run as a maintainer runs
it:
`python FILE` on this torch, with nothing of this repository on its path (forked with torch imported,
fsdp_amp_suite/upstream/forked.py; `python -m fsdp_amp_suite.upstream.reports --record` starts each run fresh). Where an
entry it
shows is in force, the run is a strict xfail that only the file's own "bug is there" (exit 1 after its two lines)
satisfies; where none is, it must exit 0. So a file that stops reproducing fails the suite, as a strict xfail
that passes does. Each file runs plain, in each real-training mode of its entries (Reach.run), and with its
proposed fix, which must exit 0 wherever the file runs. fsdp_amp_suite/expectations.py decides which (policy item 5).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_amp_suite.expectations import BugShown
from fsdp_amp_suite.known_bugs import standalone_files
from fsdp_amp_suite.upstream.runs import PLAIN, modes, run_file, verdict

pytestmark = pytest.mark.repro


def _params():
    return [pytest.param(stem, mode, id=stem if mode == PLAIN else f"{stem}-{mode}")
            for stem, shown in standalone_files().items() for mode in modes(shown)]


RECORD_DIR = "FSDP_AMP_STANDALONE_RECORD"  # env: a directory to write each run's record into (the reports' runs)


@pytest.mark.parametrize("standalone, mode", _params())
def test_standalone_repro_shows_no_bug(standalone, mode):
    proc = run_file(standalone, mode)
    if os.environ.get(RECORD_DIR):
        from fsdp_amp_suite.upstream.reports import record

        record(standalone, mode, proc, Path(os.environ[RECORD_DIR]))
    if verdict(proc):
        raise BugShown(proc.stdout.strip())
