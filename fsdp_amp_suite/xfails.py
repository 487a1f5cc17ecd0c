"""A consumer's own known bugs: `--xfails-file PATH`, for a plugged --scaler or --fsdp.

The built-ins' known bugs live in KNOWN_BUGS (fsdp_amp_suite/known_bugs.py); a team that plugs its own scaler or
wrapper keeps its own in a file (the Array API test suite's --xfails-file), so its first run is green
until something outside the file breaks, and the day it fixes one the run says so:

    # comment lines and blank lines are ignored
    tests/conformance/test_ranks.py::test_ranks_keep_scale_in_lockstep[their_pkg.scalers-broken-cpu]  # JIRA-12
    tests/matrix/test_matrix.py::test_fsdp_matches_ddp          # every cell of that test (no [params])

One check id per line: a test id as pytest prints it (relative to this repo), or a test function's id
without [params] for all its params; after "#", the reason. Each matching check becomes a strict
xfail: it must fail (an error counts), and passing is a failure (XPASS(strict)). Entries that match no
test of the run are named in the report (a renamed test, a deselected one, a typo).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Entry:
    check: str   # a test id, or a test function's id without [params]
    reason: str
    line: int    # where it is in the file, for messages

    def matches(self, nodeid: str) -> bool:
        return nodeid == self.check or ("[" not in self.check and nodeid.startswith(self.check + "["))


def read(path: str) -> list[Entry]:
    """The entries of an xfails file; ValueError naming the file and line for what is not an entry."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--xfails-file {path!r}: cannot be read ({exc.strerror})") from None
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        check, _, reason = raw.partition("#")
        check = check.strip()
        if not check:
            continue
        if " " in check or "::" not in check:
            raise ValueError(f"--xfails-file {path!r} line {number}: {check!r} is not a test id "
                             f"(path::test_function[params], one per line, a reason after '#')")
        entries.append(Entry(check, reason.strip() or f"listed in {path}", number))
    return entries


ENTRIES = pytest.StashKey[list]()  # config.stash: the entries of --xfails-file ([] without it)


def find(entries: list[Entry], nodeid: str) -> Entry | None:
    return next((e for e in entries if e.matches(nodeid)), None)


def unmatched(entries: list[Entry], nodeids) -> list[Entry]:
    """The entries that match none of these test ids."""
    nodeids = list(nodeids)
    return [e for e in entries if not any(e.matches(n) for n in nodeids)]
