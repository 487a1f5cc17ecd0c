"""The expectation policy as a table: for each kind of check (a scaler check, a matrix cell, a repro case, a
consumer's --xfails-file entry) on each kind of machine, `fsdp_amp_suite/expectations.py` `expectation` says pass,
strict xfail (naming its bug or entry) or skip (with its reason), and which known bug the version table
attributes the check to. The function is pure, so the table is the whole test: no pytest run, no ranks.
A table of bugs of its own keeps the rows independent of KNOWN_BUGS' wording; one row checks the real one.
"""
import dataclasses

import pytest
from packaging.version import Version

from fsdp_amp_suite.expectations import BugShown, Expectation, Machine, ReproOf, expectation
from fsdp_amp_suite.known_bugs import EVERY_SCALER, KNOWN_BUGS, Check, KnownBug
from fsdp_amp_suite.matrix import axes
from fsdp_amp_suite.xfails import Entry

TORCH = {"torch": Version("2.13.0"), "fairscale": Version("0.4.13")}
CPU = Machine(cuda=False, n_gpus=0, versions=TORCH)
GPU = Machine(cuda=True, n_gpus=1, versions=TORCH)
NEWER_TORCH = Machine(cuda=False, n_gpus=0, versions={**TORCH, "torch": Version("2.99.0")})
TORCH_2_4 = Machine(cuda=False, n_gpus=0, versions={**TORCH, "torch": Version("2.4.1")})


def _bug(bug_id, scalers, tests=("test_check",), beats_race=False, torch=""):
    return KnownBug(bug_id, scalers if scalers is EVERY_SCALER else frozenset(scalers),
                    (Check(tests),) if tests else (), f"reason of {bug_id}", f"title of {bug_id}", beats_race, torch,
                    "")


BUGS = [
    _bug("amp-bug", {"torch_amp"}, torch="<2.14"),            # fixed in 2.14
    _bug("fsdp-bug", EVERY_SCALER, tests=("test_fsdp_matches_ddp",)),
    _bug("deterministic-bug", {"torch_sharded"}, tests=("test_racy",), beats_race=True),
    _bug("racy-bug", {"torch_amp"}, tests=("test_racy",)),
    _bug("repro-bug", {"fairscale_sharded"}, tests=()),      # only a repro case names it
    dataclasses.replace(_bug("cuda-bug", {"torch_amp"}, tests=()), needs="cuda"),  # its standalone file needs CUDA
    dataclasses.replace(_bug("same-defect", {"torch_amp"}, tests=(), torch="<2.14"), standalone="repro-bug"),
]
ENTRY = Entry("tests/x.py::test_check", "JIRA-12", line=3)
UNRUNNABLE_CELL = next(c for c in axes.cells(["fsdp1"]) if c.world_size == 8)
RACE = ("timing-dependent", "async-copy race")  # words every race reason has
RACY_PARAMS = {"placement": "offload"}
# (row id, scaler, test, params, machine, repro_of, their_entry) -> Expectation
ROWS = [
    ("not-a-scaler-check", None, "test_x", {}, CPU, None, None, Expectation()),
    ("not-a-scaler-check-their-entry", None, "test_check", {}, CPU, None, ENTRY,
     Expectation(xfail="JIRA-12 (--xfails-file line 3)", xfails_file=ENTRY.check)),
    ("bug-in-force", "torch_amp", "test_check", {}, CPU, None, None,
     Expectation(xfail="reason of amp-bug", bug="amp-bug", bug_any_version="amp-bug")),
    ("bug-fixed-on-this-torch-passes-but-stays-known", "torch_amp", "test_check", {}, NEWER_TORCH, None, None,
     Expectation(bug_any_version="amp-bug")),
    ("a-plugged-scaler-gets-no-builtin-bug", "pkg.mod:factory", "test_check", {}, CPU, None, None, Expectation()),
    ("their-entry-where-no-builtin-bug", "pkg.mod:factory", "test_check", {}, CPU, None, ENTRY,
     Expectation(xfail="JIRA-12 (--xfails-file line 3)", xfails_file=ENTRY.check)),
    ("a-builtin-bug-comes-before-their-entry", "torch_amp", "test_check", {}, CPU, None, ENTRY,
     Expectation(xfail="reason of amp-bug", bug="amp-bug", bug_any_version="amp-bug")),
    ("an-fsdp-bug-hits-a-plugged-scaler", "pkg.mod:factory", "test_fsdp_matches_ddp", {}, CPU, None, None,
     Expectation(xfail="reason of fsdp-bug", bug="fsdp-bug", bug_any_version="fsdp-bug")),
    ("race-on-a-gpu-machine-runs-race-free-and-its-bug-is-an-xfail", "torch_amp", "test_racy", RACY_PARAMS, GPU, None,
     None, Expectation(xfail="reason of racy-bug", bug="racy-bug", bug_any_version="racy-bug", race_free=RACE)),
    ("race-on-a-gpu-machine-runs-race-free-and-must-pass-without-a-bug", "fairscale_sharded", "test_racy",
     RACY_PARAMS, GPU, None, None, Expectation(race_free=RACE)),
    ("no-race-without-cuda", "torch_amp", "test_racy", RACY_PARAMS, CPU, None, None,
     Expectation(xfail="reason of racy-bug", bug="racy-bug", bug_any_version="racy-bug")),
    ("a-bug-that-beats-the-race-is-an-xfail", "torch_sharded", "test_racy", RACY_PARAMS, GPU, None, None,
     Expectation(xfail="reason of deterministic-bug", bug="deterministic-bug", bug_any_version="deterministic-bug")),
    ("our-scaler-does-not-race", "ours", "test_racy", RACY_PARAMS, GPU, None, None, Expectation()),
    ("a-cell-this-machine-cannot-run-skips-whatever-its-bug", "pkg.mod:factory", "test_fsdp_matches_ddp",
     {"cell": UNRUNNABLE_CELL}, GPU, None, None, Expectation(skip=("world size 8 runs only on a host with 8 GPUs",))),
    ("repro-case-of-this-scaler", "fairscale_sharded", "test_repro", {}, CPU, ReproOf(("repro-bug",)), None,
     Expectation(xfail="reason of repro-bug", bug="repro-bug", bug_any_version="repro-bug")),
    ("repro-case-other-scaler-must-pass", "ours", "test_repro", {}, CPU, ReproOf(("repro-bug",)), None, Expectation()),
    ("repro-case-needs-cuda", "fairscale_sharded", "test_repro", {}, CPU, ReproOf(("repro-bug",), needs="cuda"),
     None, Expectation(skip=("needs CUDA",))),
    ("repro-case-needs-no-cuda", "ours", "test_repro", {}, GPU, ReproOf(("repro-bug",), needs="no-cuda"), None,
     Expectation(skip=("only on a machine without CUDA",))),
    ("repro-case-needs-dtensor-skips-below-torch-2-5", "ours", "test_repro", {}, TORCH_2_4,
     ReproOf(("repro-bug",), needs="dtensor"), None, Expectation(skip=("DTensor meshes need torch >= 2.5",))),
    ("repro-case-needs-dtensor-runs-on-torch-2-5-and-later", "fairscale_sharded", "test_repro", {}, CPU,
     ReproOf(("repro-bug",), needs="dtensor"), None,
     Expectation(xfail="reason of repro-bug", bug="repro-bug", bug_any_version="repro-bug")),
    ("repro-case-races-for-a-scaler-without-its-bug", "torch_sharded", "test_repro", {}, GPU,
     ReproOf(("repro-bug",), placement="offload"), None, Expectation(race_free=RACE)),
    ("standalone-bug-in-force-is-an-xfail-that-only-its-bug-satisfies", None, "test_standalone_repro_shows_no_bug",
     {"standalone": "repro-bug", "mode": "plain"}, CPU, None, None,
     Expectation(xfail="reason of repro-bug", bug="repro-bug", bug_any_version="repro-bug", raises=BugShown)),
    ("standalone-real-training-run-likewise", None, "test_standalone_repro_shows_no_bug",
     {"standalone": "amp-bug", "mode": "real-overflow"}, CPU, None, None,
     Expectation(xfail="reason of amp-bug", bug="amp-bug", bug_any_version="amp-bug", raises=BugShown)),
    ("standalone-with-fix-must-pass", None, "test_standalone_repro_shows_no_bug",
     {"standalone": "repro-bug", "mode": "with-fix"}, CPU, None, None, Expectation(bug_any_version="repro-bug")),
    ("standalone-bug-fixed-on-this-torch-must-pass", None, "test_standalone_repro_shows_no_bug",
     {"standalone": "amp-bug", "mode": "plain"}, NEWER_TORCH, None, None, Expectation(bug_any_version="amp-bug")),
    ("standalone-shared-file-xfails-while-any-of-its-entries-holds", None, "test_standalone_repro_shows_no_bug",
     {"standalone": "repro-bug", "mode": "plain"}, NEWER_TORCH, None, None,
     Expectation(xfail="reason of repro-bug", bug="repro-bug", bug_any_version="repro-bug", raises=BugShown)),
    ("standalone-needs-cuda", None, "test_standalone_repro_shows_no_bug",
     {"standalone": "cuda-bug", "mode": "plain"}, CPU, None, None, Expectation(skip=("needs CUDA",))),
    ("standalone-needing-cuda-runs-on-a-gpu-machine", None, "test_standalone_repro_shows_no_bug",
     {"standalone": "cuda-bug", "mode": "plain"}, GPU, None, None,
     Expectation(xfail="reason of cuda-bug", bug="cuda-bug", bug_any_version="cuda-bug", raises=BugShown)),
    ("repro-case-shows-its-bug-whatever-the-race", "fairscale_sharded", "test_repro", {}, GPU,
     ReproOf(("repro-bug",), placement="offload"), None,
     Expectation(xfail="reason of repro-bug", bug="repro-bug", bug_any_version="repro-bug")),
]


@pytest.mark.parametrize("spec, test, params, machine, repro_of, their_entry, want",
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_the_policy(spec, test, params, machine, repro_of, their_entry, want):  # spec: `scaler` is the suite's
    got = expectation(spec, test, params, machine=machine, repro_of=repro_of, their_entry=their_entry, bugs=BUGS)
    if isinstance(want.skip, tuple):  # a skip reason is prose: the row names words it must contain
        assert got.skip and all(w in got.skip for w in want.skip), got
        assert (got.xfail, got.bug, got.xfails_file) == (None, None, None), f"a skip is only a skip: {got}"
        # a check that skips for a race never counts for its bug in the version table (nor "fixed" there)
        assert got.bug_any_version == want.bug_any_version, got
    elif isinstance(want.race_free, tuple):  # likewise the race a race-free run closes
        assert got.race_free and all(w in got.race_free for w in want.race_free), got
        assert dataclasses.replace(got, race_free=want.race_free) == want, got
    else:
        assert got == want


def test_a_repro_case_naming_no_known_bug_is_an_error():
    with pytest.raises(ValueError, match="repro_of\\('no-such-bug'\\): no KNOWN_BUGS entry has that id"):
        expectation("ours", "test_repro", {}, machine=CPU, repro_of=ReproOf(("no-such-bug",)), bugs=BUGS)


def test_a_standalone_file_no_entry_names_is_an_error():
    with pytest.raises(ValueError, match="standalone repro 'nowhere': no KNOWN_BUGS entry names that file"):
        expectation(None, "test_standalone_repro_shows_no_bug", {"standalone": "nowhere", "mode": "plain"},
                    machine=CPU, bugs=BUGS)


def test_the_real_table_on_a_real_check():
    """One row through KNOWN_BUGS itself: torch.amp.GradScaler refuses fp16 grads on every torch."""
    params = {"scaler": "torch_amp", "dtype": "float16", "placement": "cpu"}
    got = expectation("torch_amp", "test_clean_step_unscales_exactly_and_steps", params, machine=CPU)
    assert got.bug == "torch-amp-refuses-fp16-grads" and got.xfail and not got.skip
    assert KNOWN_BUGS  # the default table is the real one
