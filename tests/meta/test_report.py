"""The compatibility report counts pytest's own reports right (every collected test, not only the scaler
checks it has a column for), and its headline says so whenever anything is unexpected."""
import json
from types import SimpleNamespace

import torch

from fsdp_amp_suite import report
from fsdp_amp_suite.harness.failures import death
from fsdp_amp_suite.child_run import ROOT
from fsdp_amp_suite.records import Cell, Report


def rep(nodeid, outcome, scaler="ours", family="single rank", when="call", reason=None, **props):
    r = SimpleNamespace(nodeid=nodeid, fspath=nodeid, when=when, passed=outcome == "passed", failed=outcome == "failed",
                        skipped=outcome in ("skipped", "xfailed"),
                        user_properties=[("scaler", scaler), ("family", family), *props.items()])
    if outcome == "xfailed":
        r.wasxfail = reason
    return r


def test_each_test_id_counts_once_with_its_worst_outcome():
    recs = report.records([rep("a", "passed", when="setup"), rep("a", "passed"),
                           rep("b", "skipped", when="setup"),
                           rep("c", "passed"), rep("c", "failed", when="teardown"),  # an error in teardown
                           rep("d", "xfailed", scaler="torch_amp", reason="bug X", bug="bug-x")])
    assert sorted((r.outcome, r.scaler) for r in recs) == [
        ("failed", "ours"), ("passed", "ours"), ("skipped", "ours"), ("xfailed", "torch_amp")]
    title, header, rows = report.tables(recs)[0]
    assert header == ["scaler", "single rank"] and rows == [["ours", "1/1/0/1"], ["torch_amp", "0/0/1/0"]]
    assert report.known_bugs(recs) == [("bug-x", "bug X", 1, ["torch_amp"])]  # named by its KNOWN_BUGS id
    assert "- 1 x [torch_amp] bug-x: bug X" in report.render(recs, markdown=False)


def test_unexpected_outcomes_lead_the_report_whatever_the_exit_status():
    strict_xpass = rep("e", "failed")  # pytest reports a strict xfail that passed as failed
    assert report.render(report.records([rep("a", "passed"), strict_xpass]), markdown=False).startswith(
        "UNEXPECTED OUTCOMES: 1 failed")
    assert report.render(report.records([rep("a", "passed")]), markdown=True).startswith("**All as expected")
    # nothing failed, yet pytest exits non-zero (interrupted, internal error, nothing collected)
    assert report.headline(report.records([rep("a", "passed")]), exitstatus=2).startswith(
        "UNEXPECTED OUTCOMES: pytest exits 2 (interrupted)")
    assert report.headline([], exitstatus=5).startswith("UNEXPECTED OUTCOMES: pytest exits 5")


def test_matrix_rows_are_implementation_mesh_and_scaler():
    recs = report.records([rep("m1", "passed", family=Cell("fp16", "offload").as_data(), impl="fsdp2"),
                           rep("m2", "xfailed", scaler="torch_amp", family=Cell("fp32", "nooffload").as_data(),
                               impl="fsdp1", reason="r"),
                           rep("m3", "passed", family=Cell("fp16", "nooffload").as_data(), impl="fsdp2"),
                           rep("m4", "failed", family=Cell("fp16", "nooffload").as_data(), impl="fsdp2", mesh="tp"),
                           rep("m5", "passed", family=Cell("fp32", "nooffload").as_data(), impl="fsdp2", mesh="hsdp")])
    title, header, rows = report.tables(recs)[0]
    assert title == "FSDP-vs-DDP matrix"
    assert header == ["implementation", "mesh", "scaler", "fp32 nooffload", "fp16 nooffload", "fp16 offload"]
    # a record without a mesh (a report from before the axis) is a 1d cell; 1d rows first, then each mesh
    assert rows == [["fsdp1", "1d", "torch_amp", "0/0/1/0", "", ""], ["fsdp2", "1d", "ours", "", "1/0/0/0", "1/0/0/0"],
                    ["fsdp2", "hsdp", "ours", "1/0/0/0", "", ""], ["fsdp2", "tp", "ours", "", "0/1/0/0", ""]]


def test_the_json_records_are_the_records():
    """--report-json's data, through JSON and back, is the same Records (a matrix cell's family a Cell again),
    so it rebuilds the report's tables (a saved GPU run) and the version table reads what the report wrote."""
    recs = report.records([rep("c", "passed"), rep("x", "failed", when="setup"),
                           rep("m", "xfailed", family=Cell("fp16", "offload").as_data(), impl="fsdp1", reason="r",
                               bug="b", bug_any_version="b", xfails_file="f", test="test_m", function="f.py::test_m"),
                           rep("t", "passed", scaler=None, family="test_x.py")])
    back = Report.from_data(json.loads(json.dumps(report.as_data(recs, 0, {"torch": "2.4.1"}))))
    assert list(back.records) == recs and back.records[2].family == Cell("fp16", "offload")
    assert back.versions == {"torch": "2.4.1"} and back.exitstatus == 0 and back.known_bugs
    assert report.tables(back.records) == report.tables(recs)


NEW_FILE = """
import pytest

@pytest.mark.parametrize("scaler", ["ours"])
def test_a_new_scaler_check(scaler):
    pass

def test_a_new_plain_check():
    assert False, "planted"
"""


DECLARED = """
import pytest

pytestmark = pytest.mark.report_column("declared column")

@pytest.mark.parametrize("scaler", ["ours"])
def test_a_declared_check(scaler):
    pass
"""


def test_a_failure_in_a_file_without_a_family_makes_the_headline_unexpected(pytester, monkeypatch):
    """A new test file that marks no report_column: its tests are counted (the scaler check in a
    column of its own, named by its file, the plain one under the rest), and its failure leads the report;
    a file that declares one counts in that column."""
    pytester.makepyfile(test_zz_new=NEW_FILE, test_zz_declared=DECLARED)
    pytester.makeini("[pytest]\n")
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the child imports the report plugin from this checkout
    result = pytester.runpytest_subprocess("-p", "fsdp_amp_suite.options", "-p", "fsdp_amp_suite.report",
                                           "-p", "no:cacheprovider", "-p", "no:xdist",
                                           "--report", "r.md")
    result.assert_outcomes(passed=2, failed=1)
    text = (pytester.path / "r.md").read_text()
    assert text.startswith("**UNEXPECTED OUTCOMES: 1 failed"), text
    assert "| scaler | declared column | test_zz_new.py |" in text, text
    assert "| ours | 1/0/0/0 | 1/0/0/0 |" in text and "| test_zz_new.py | 0/1/0/0 |" in text, text


def test_xfails_file_entries_match_a_test_or_every_param_of_a_function(tmp_path):
    from fsdp_amp_suite import xfails

    path = tmp_path / "x.txt"
    path.write_text("# ours\n\ntests/a.py::test_f[p1]  # T-1\ntests/a.py::test_g\ntests/a.py::test_gone\n")
    entries = xfails.read(str(path))
    assert [(e.check, e.reason, e.line) for e in entries] == [
        ("tests/a.py::test_f[p1]", "T-1", 3), ("tests/a.py::test_g", f"listed in {path}", 4),
        ("tests/a.py::test_gone", f"listed in {path}", 5)]
    ran = ["tests/a.py::test_f[p1]", "tests/a.py::test_f[p2]", "tests/a.py::test_g[x]", "tests/a.py::test_gx[y]"]
    assert [xfails.find(entries, n) and xfails.find(entries, n).line for n in ran] == [3, None, 4, None]
    stale = xfails.unmatched(entries, ran)
    assert [e.check for e in stale] == ["tests/a.py::test_gone"]
    assert "line 5: tests/a.py::test_gone" in report.render([], markdown=False, stale=stale)


TORCH_DIR = torch.__path__[0]
ABORT_IN_GLOO = f"""malloc(): unaligned fastbin chunk detected
Fatal Python error: Aborted

Thread 0x00007f3a (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait

Current thread 0x00007f3b (most recent call first):
  File "{TORCH_DIR}/distributed/_functional_collectives.py", line 203 in all_gather_tensor
  File "{ROOT}/fsdp_amp_suite/matrix/cell.py", line 240 in full_params
"""


def test_a_rank_death_is_read_from_its_faulthandler_stack():
    """The current thread's innermost frame, and whose code it is: torch's (not a scaler verdict) or anyone else's."""
    assert str(death(1, -6, ABORT_IN_GLOO)) == ("rank 1 SIGABRT in torch's code at "
                                                "torch/distributed/_functional_collectives.py:203 all_gather_tensor")
    ours = death(0, -11, ABORT_IN_GLOO.replace(f"{TORCH_DIR}/distributed/_functional_collectives.py",
                                               f"{ROOT}/scaler_impl/scaler.py"))
    assert (ours.owner, ours.frame) == ("other", f"{ROOT}/scaler_impl/scaler.py:203 all_gather_tensor")
    assert str(death(0, 7, "")) == "rank 0 exit code 7 (no Python stack printed)"
    # a native thread died (gloo's, as seen on one GPU): the next thread's frames are not its own
    native = ABORT_IN_GLOO.split("Current thread")[0] + (
        "Current thread 0x00007f3b (most recent call first):\n  <no Python frame>\n\n"
        'Thread 0x00007f3c (most recent call first):\n  File "/usr/lib/python3.12/threading.py", line 355 in wait\n')
    assert str(death(0, -11, native)) == "rank 0 SIGSEGV in a thread without Python frames (native code)"
    assert death(0, -11, native).owner == "native"


def test_a_rank_that_died_in_torch_is_told_apart_from_a_failed_check():
    theirs = [death(1, -6, ABORT_IN_GLOO).as_data()]
    recs = report.records([rep("a", "failed", deaths=theirs, rerun="python -m pytest a"), rep("b", "failed"),
                           rep("c", "failed", deaths=[death(0, -11, "").as_data()], rerun="python -m pytest c")])
    text = report.render(recs, markdown=False)
    assert text.startswith("UNEXPECTED OUTCOMES: 3 failed (failures, errors or strict xfails that passed, 1 of them "
                           "a rank that died in torch's, fairscale's or native code, not a scaler verdict")
    assert ("- a: rank 1 SIGABRT in torch's code at torch/distributed/_functional_collectives.py:203 all_gather_tensor "
            "(torch's, fairscale's or native code); rerun: python -m pytest a") in text
    assert "- c: rank 0 SIGSEGV (no Python stack printed) (a verdict on the scaler); rerun: python -m pytest c" in text
    assert "- b:" not in text  # a check that failed, no rank died
    back = Report.from_data(json.loads(json.dumps(report.as_data(recs, 1, {}))))
    assert back.records == tuple(recs)


def test_the_race_free_checks_are_counted_by_scaler_and_outcome():
    recs = report.records([rep("a", "passed", race_free=True), rep("b", "xfailed", race_free=True, reason="bug"),
                           rep("c", "passed", scaler="torch_amp", race_free=True), rep("d", "passed")])
    lines = report.render(recs, markdown=False).splitlines()
    at = lines.index("Race-free checks (copies made blocking: the async-copy race cannot decide them):")
    assert [line.split() for line in lines[at + 1:at + 5] if line.strip()][1:] == [
        ["ours", "1", "0", "1", "0"], ["torch_amp", "1", "0", "0", "0"]]
    assert Report.from_data(json.loads(json.dumps(report.as_data(recs, 0, {})))).records == tuple(recs)
    assert "Race-free" not in report.render(report.records([rep("d", "passed")]), markdown=False)
