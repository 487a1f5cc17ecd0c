"""Every table that names tests names at least one collected test: a renamed test or param can never
silently drop a known bug's xfail, a mutant's expectation or a report column.

Checked against what the main job collects (the suite's testpaths with the built-in scalers and FSDP
implementations, before -m/-k deselect anything), collected by pytest itself in this process: KNOWN_BUGS
(fsdp_amp_suite/known_bugs.py; each Check of an entry, by its test names and param conditions, on a CPU or
a CUDA machine, whatever the scaler and versions), the mutants'
EXPECTED tests (fsdp_amp_suite/planted) and the report's COLUMNS (fsdp_amp_suite/report.py; each a module's
report_column mark).
"""
import itertools
import os

import pytest

from fsdp_amp_suite import report
from fsdp_amp_suite.child_run import ROOT
from fsdp_amp_suite.known_bugs import KNOWN_BUGS, Check, KnownBug
from fsdp_amp_suite.planted import EXPECTED
from fsdp_amp_suite.scalers import BUILTINS


def unmatched(collected) -> list[str]:
    """The table entries that match no collected (test function, params, report column)."""
    names = {name for name, _, _ in collected}
    columns = {column for _, _, column in collected}
    out = [f"KNOWN_BUGS {bug.id!r}: no collected scaler check is {check!r}"
           for bug in KNOWN_BUGS for check in bug.checks
           if not any("scaler" in params and check.matches(name, params, cuda)
                      for name, params, _ in collected for cuda in (False, True))]
    out += [f"mutants EXPECTED {mutant!r}: no collected test is named {test!r}"
            for mutant, tests in EXPECTED.items() for test in tests if test not in names]
    out += [f"report COLUMNS {column!r}: no collected test counts in it (its module's report_column mark, or "
            "tests/repro)"
            for column in report.COLUMNS if column not in columns]
    return out


def undeclared_overlaps(collected, bugs=KNOWN_BUGS) -> list[str]:
    """Pairs of entries that claim one collected check (for some built-in scaler, on a CPU or a CUDA machine,
    whatever the versions) without exactly one of them declaring that it wins (KnownBug.precedes)."""
    pairs = {}
    for name, params, _ in collected:
        if "scaler" not in params:
            continue
        for spec, cuda in itertools.product(BUILTINS, (False, True)):
            claiming = [b for b in bugs if b.hits(spec) and b.matches(name, params, cuda)]
            for a, b in itertools.combinations(claiming, 2):
                pairs.setdefault((a.id, b.id), (a, b, name))
    return [f"{a.id!r} and {b.id!r} both claim {name} ({'both' if a.wins_over(b) else 'neither'} declare to win)"
            for a, b, name in pairs.values() if a.wins_over(b) == b.wins_over(a)]


_COLLECTED = []  # this module's one collection, shared by its tests (a few seconds each time)


@pytest.fixture
def collected(request, pytester, monkeypatch):
    """(test function, params, report column) of every check the main job collects."""
    if not _COLLECTED:
        for key in [k for k in os.environ if k.startswith("PYTEST_XDIST") or k == "PYTEST_ADDOPTS"]:
            monkeypatch.delenv(key)  # a session of its own, not a worker's
        testpaths = [os.path.join(ROOT, p) for p in request.config.getini("testpaths")]
        items, _ = pytester.inline_genitems("-p", "no:cacheprovider", "-p", "no:xdist", "-c",
                                            os.path.join(ROOT, "pytest.ini"), "--rootdir", ROOT, *testpaths)
        _COLLECTED.extend((item.originalname, getattr(getattr(item, "callspec", None), "params", {}),
                           report.column(item)) for item in items)
    assert len(_COLLECTED) > 1000, f"collected only {len(_COLLECTED)} checks"
    return list(_COLLECTED)


def test_every_table_entry_names_a_collected_test(collected):
    stale = unmatched(collected)
    assert not stale, "table entries that match no collected test:\n" + "\n".join(stale)


def test_entries_claiming_one_check_declare_which_wins(collected):
    missing = undeclared_overlaps(collected)
    assert not missing, "KNOWN_BUGS entries that claim one check without a declared precedence:\n" + "\n".join(missing)


def test_an_undeclared_overlap_is_named():
    def entry(bug_id, precedes=()):
        return KnownBug(bug_id, frozenset({"torch_amp"}), (Check("test_x"),), "reason", "title",
                        precedes=frozenset(precedes))
    check = [("test_x", {"scaler": "torch_amp"}, "single rank")]
    assert undeclared_overlaps(check, [entry("a"), entry("b")]) == [
        "'a' and 'b' both claim test_x (neither declare to win)"]
    assert undeclared_overlaps(check, [entry("a", {"b"}), entry("b", {"a"})]) == [
        "'a' and 'b' both claim test_x (both declare to win)"]
    assert undeclared_overlaps(check, [entry("a"), entry("b", {"a"})]) == []


def test_a_stale_entry_is_named():
    collected = [("test_renamed", {"scaler": "ours"}, "single rank")]
    stale = unmatched(collected)
    assert any("KNOWN_BUGS 'torch-amp-refuses-fp16-grads'" in line for line in stale), stale
    assert any("'no_agreement': no collected test is named "
               "'test_ranks_keep_scale_in_lockstep'" in line for line in stale)
    assert any("COLUMNS 'across ranks'" in line for line in stale) and len(stale) > 20


def test_a_reworded_reason_keeps_its_repro_and_an_unknown_id_fails_loudly():
    """Repro cases name their bug by its id (@pytest.mark.repro_of), never by words of its reason: rewording
    keeps them working, and an id that names no entry is an error naming it (a usage error at collection)."""
    from fsdp_amp_suite import known_bugs

    bug = known_bugs.bug_by_id("fairscale-state-dict-after-backoff")
    reworded = type(bug)(**{**bug.__dict__, "reason": "entirely new words"})
    table = [reworded if b is bug else b for b in known_bugs.KNOWN_BUGS]  # a table of its own: the real one is
                                                                          # untouched
    assert (known_bugs.repro_bug("fairscale_sharded", [bug.id], any_version=True, bugs=table).reason
            == "entirely new words")
    assert known_bugs.repro_bug("ours", [bug.id], any_version=True, bugs=table) is None  # names fairscale's scaler only
    with pytest.raises(ValueError, match="repro_of\\('no-such-bug'\\): no KNOWN_BUGS entry has that id"):
        known_bugs.repro_bug("ours", ["no-such-bug"])
