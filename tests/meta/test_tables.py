"""Every table that names tests names at least one collected test: a renamed test or param can never
silently drop a known bug's xfail, a mutant's expectation or a report column.

Checked against what the main job collects (the suite's testpaths with the built-in scalers and FSDP
implementations, before -m/-k deselect anything), collected by pytest itself in this process: KNOWN_BUGS (tests/known_bugs.py; an entry matches a check by its test names and
param conditions, on a CPU or a CUDA machine, whatever the scaler and versions), the mutants'
EXPECTED tests (tests/planted) and the report's COLUMNS (tests/report.py; each the REPORT_COLUMN of a module).
"""
import os

import pytest

from tests import report
from tests.child_run import ROOT
from tests.planted import EXPECTED
from tests.known_bugs import KNOWN_BUGS


def unmatched(collected) -> list[str]:
    """The table entries that match no collected (test function, params, report column)."""
    names = {name for name, _, _ in collected}
    columns = {column for _, _, column in collected}
    out = [f"KNOWN_BUGS {bug.id!r}: no collected test is {sorted(bug.tests) if bug.tests else 'a scaler check'} "
           f"with params its conditions accept" for bug in KNOWN_BUGS
           if not any("scaler" in params and bug.matches(name, params, cuda)
                      for name, params, _ in collected for cuda in (False, True))]
    out += [f"mutants EXPECTED {mutant!r}: no collected test is named {test!r}"
            for mutant, tests in EXPECTED.items() for test in tests if test not in names]
    out += [f"report COLUMNS {column!r}: no collected test counts in it (its module's REPORT_COLUMN, or tests/repro)"
            for column in report.COLUMNS if column not in columns]
    return out


def test_every_table_entry_names_a_collected_test(request, pytester, monkeypatch):
    for key in [k for k in os.environ if k.startswith("PYTEST_XDIST") or k == "PYTEST_ADDOPTS"]:
        monkeypatch.delenv(key)  # a session of its own, not a worker's
    testpaths = [os.path.join(ROOT, p) for p in request.config.getini("testpaths")]
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider", "-p", "no:xdist", "-c", os.path.join(ROOT, "pytest.ini"),
                                        "--rootdir", ROOT, *testpaths)
    collected = [(item.originalname, getattr(getattr(item, "callspec", None), "params", {}), report.column(item))
                 for item in items]
    assert len(collected) > 1000, f"collected only {len(collected)} checks from {testpaths}"
    stale = unmatched(collected)
    assert not stale, "table entries that match no collected test:\n" + "\n".join(stale)


def test_a_stale_entry_is_named():
    collected = [("test_renamed", {"scaler": "ours"}, "single rank")]
    stale = unmatched(collected)
    assert any("KNOWN_BUGS 'torch-amp-refuses-fp16-grads'" in line for line in stale), stale
    assert any("'no_agreement': no collected test is named 'test_ranks_keep_scale_in_lockstep'" in line for line in stale)
    assert any("COLUMNS 'across ranks'" in line for line in stale) and len(stale) > 20


def test_a_reworded_reason_keeps_its_repro_and_an_unknown_id_fails_loudly():
    """Repro cases name their bug by its id (@pytest.mark.repro_of), never by words of its reason: rewording
    keeps them working, and an id that names no entry is an error naming it (a usage error at collection)."""
    from tests import known_bugs

    bug = known_bugs.bug_by_id("fairscale-state-dict-after-backoff")
    reworded = type(bug)(**{**bug.__dict__, "reason": "entirely new words"})
    table = [reworded if b is bug else b for b in known_bugs.KNOWN_BUGS]  # a table of its own: the real one is untouched
    assert known_bugs.repro_bug("fairscale_sharded", [bug.id], any_version=True, bugs=table).reason == "entirely new words"
    assert known_bugs.repro_bug("ours", [bug.id], any_version=True, bugs=table) is None  # names fairscale's scaler only
    with pytest.raises(ValueError, match="repro_of\\('no-such-bug'\\): no KNOWN_BUGS entry has that id"):
        known_bugs.repro_bug("ours", ["no-such-bug"])
