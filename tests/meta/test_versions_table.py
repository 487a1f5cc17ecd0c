"""ci/versions.py (known bug x torch version, from --report-json files) on synthetic reports."""
import importlib.util
import json
import pathlib

import pytest

pytestmark = pytest.mark.harness

_spec = importlib.util.spec_from_file_location("ci_versions", pathlib.Path(__file__).parents[2] / "ci" / "versions.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)

BUGS = [dict(id="old-bug", reason="fixed in 2.6", torch="<2.6", fairscale=""),
        dict(id="cuda-bug", reason="needs CUDA", torch="", fairscale=""),
        dict(id="open-bug", reason="still there", torch="", fairscale="")]
FSDP2 = "tests/matrix/test_matrix.py::test_fsdp_matches_ddp"


def rec(nodeid, outcome, bug=None, any_bug=None):
    return dict(nodeid=nodeid, outcome=outcome, scaler="ours", impl=None, family="single rank", bug=bug,
                bug_any_version=any_bug)


def session(torch, records, exitstatus=0, in_force=("old-bug", "cuda-bug", "open-bug")):
    return dict(versions=dict(python="3.11.7", torch=torch, fairscale="0.4.13", cuda=None, gpus=[]),
                exitstatus=exitstatus, headline="All as expected: ...",
                known_bugs=[dict(b, in_force=b["id"] in in_force) for b in BUGS], records=records, unmatched=[])


def three_versions():
    """torch 2.4.1: old-bug hit, FSDP2 skipped; 2.13 and 2.10: old-bug fixed, FSDP2 runs. Out of order."""
    def common(old_outcome, fsdp2, old_bug):
        return ([rec("t.py::test_old[a]", old_outcome, old_bug, "old-bug"),
                 rec("t.py::test_old[b]", old_outcome, old_bug, "old-bug"),
                 rec("t.py::test_cuda[x]", "skipped", None, "cuda-bug"),
                 rec("t.py::test_open", "xfailed", "open-bug", "open-bug"),
                 rec("t.py::test_same", "passed")]
                + [rec(f"{FSDP2}[fsdp2-cell{i}-ours]", fsdp2) for i in range(100)])
    newer = ("cuda-bug", "open-bug")
    return [session("2.13.0+cpu", common("passed", "passed", None), in_force=newer),
            session("2.4.1+cu121", common("xfailed", "skipped", "old-bug")),
            session("2.10.0", common("passed", "passed", None), in_force=newer)]


def test_sessions_are_ordered_by_torch_version_not_by_string():
    assert [s["versions"]["torch"] for s in table.order(three_versions())] == ["2.4.1+cu121", "2.10.0", "2.13.0+cpu"]


def test_bug_cells_hit_fixed_na():
    header, rows = table.bug_table(table.order(three_versions()))
    assert header == ["known bug", "holds for", "torch 2.4.1+cu121", "torch 2.10.0", "torch 2.13.0+cpu", "reason"]
    assert rows == [["old-bug", "torch<2.6", "hit 2", "fixed 2", "fixed 2", "fixed in 2.6"],
                    ["cuda-bug", "any", "n/a", "n/a", "n/a", "needs CUDA"],
                    ["open-bug", "any", "hit 1", "hit 1", "hit 1", "still there"]]


def test_a_failed_check_of_a_bug_is_unexpected_and_a_problem():
    sessions = table.order(three_versions())
    sessions[2]["records"][3] = rec("t.py::test_open", "failed", "open-bug", "open-bug")  # an XPASS(strict)
    sessions[2]["exitstatus"] = 1
    assert table.bug_table(sessions)[1][2][-2] == "UNEXPECTED 1"
    assert table.problems(sessions) == ["torch 2.13.0+cpu: exit status 1", "open-bug on torch 2.13.0+cpu: UNEXPECTED 1"]
    sessions[2]["records"].append(rec("t.py::test_open2", "xfailed", "open-bug", "open-bug"))
    assert table.bug_table(sessions)[1][2][-2] == "UNEXPECTED 1 (hit 1)"


def test_in_force_bug_whose_checks_pass_is_not_called_fixed():
    s = session("2.4.1", [rec("t.py::test_old", "passed", None, "old-bug")])  # in force, yet passed
    assert table.bug_cell("old-bug", s) == "other 1"


def test_changed_checks_grouped_by_function_and_pattern():
    groups = table.changed(table.order(three_versions()))
    assert [(g["test"], g["pattern"], g["count"]) for g in groups] == [
        (FSDP2, ("skipped", "passed", "passed"), 100),
        ("t.py::test_old", ("xfailed", "passed", "passed"), 2)]
    assert groups[1]["bugs"] == {"old-bug"} and groups[0]["example"] == f"{FSDP2}[fsdp2-cell0-ours]"


def test_a_check_missing_from_a_version_counts_as_changed():
    a = session("2.4.1", [rec("t.py::test_new", "passed")])
    b = session("2.13.0", [])
    assert [g["pattern"] for g in table.changed([a, b])] == [("passed", "-")]


def test_missing_exit_status_and_missing_version_are_problems():
    sessions = table.order(three_versions())
    del sessions[1]["exitstatus"]
    assert table.problems(sessions, expect=["2.4.1", "2.10.0", "2.13.0", "2.14.1"]) == [
        "torch 2.10.0: exit status missing",
        "torch 2.14.1: no report (the session did not run, or died before writing it)"]


def test_main_reads_the_directory_prints_and_writes_markdown(tmp_path, capsys):
    for s in three_versions():
        (tmp_path / f"torch-{s['versions']['torch'].split('+')[0]}.json").write_text(json.dumps(s))
    md = tmp_path / "table.md"
    assert table.main([str(tmp_path), "--markdown", str(md), "--expect", "2.4.1,2.10.0,2.13.0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("All as expected across 3 torch version(s)")
    assert "100 x tests/matrix/test_matrix.py::test_fsdp_matches_ddp: skipped / passed / passed" in out
    assert "| old-bug | torch<2.6 | hit 2 | fixed 2 | fixed 2 | fixed in 2.6 |" in md.read_text()
    assert table.main([str(tmp_path), "--expect", "2.14.1"]) == 1
