"""The known bug x torch version table (python -m fsdp_amp_suite.version_table) on the --report-json files the
report really writes: tiny child pytest runs (-p fsdp_amp_suite.options -p fsdp_amp_suite.report),
one per "torch version".

One install runs one torch, so each child's conftest stands in for what differs between versions: the torch
version the report names, its known-bug table (which bugs are in force), and the known bugs its checks xfail
as (marked as the suite's conftest.py marks them). Everything else, every record and the --xfails-file
entries that matched nothing, is what fsdp_amp_suite/report.py wrote and fsdp_amp_suite/records.py reads back.
"""
import dataclasses
import json
import subprocess
import sys

import pytest

from fsdp_amp_suite import version_table as table
from fsdp_amp_suite.child_run import ROOT, clean_env
from fsdp_amp_suite.records import Report, Unmatched
from fsdp_amp_suite.version_table import BugCell, Status

# slow: child pytest runs, CPU work: ci/cpu.sh runs them, the GPU gate leaves them out
pytestmark = [pytest.mark.harness, pytest.mark.slow]

CONFTEST = '''
import os
from types import SimpleNamespace

import pytest

from fsdp_amp_suite import report, versions, xfails

SESSION = os.environ["TABLE_SESSION"]  # old (torch<2.6), new, xpass (new, and the open bug's check passes)
IN_FORCE = {"old-bug", "cuda-bug", "open-bug"} if SESSION == "old" else {"cuda-bug", "open-bug"}
BUGS = [dict(id="old-bug", reason="fixed in 2.6", torch="<2.6", fairscale=""),
        dict(id="cuda-bug", reason="needs CUDA", torch="", fairscale=""),
        dict(id="open-bug", reason="still there", torch="", fairscale="")]
report.KNOWN_BUGS = [SimpleNamespace(**b, in_force=b["id"] in IN_FORCE) for b in BUGS]
versions.describe = lambda: dict(python="3.11.7", torch=os.environ["TABLE_TORCH"], fairscale="0.4.13", cuda=None,
                                 gpus=[])
BUG_OF = {"test_old": "old-bug", "test_cuda": "cuda-bug", "test_open": "open-bug", "test_open2": "open-bug"}


def pytest_configure(config):
    path = config.getoption("--xfails-file")
    config.stash[xfails.ENTRIES] = xfails.read(path) if path else []


def pytest_collection_modifyitems(items):
    for item in items:
        bug = BUG_OF.get(item.originalname)
        if bug:
            item.user_properties.append(("bug_any_version", bug))
        if bug in IN_FORCE:
            item.add_marker(pytest.mark.xfail(strict=True, reason=bug))
            item.user_properties.append(("bug", bug))
'''

CHECKS = '''
import os

import pytest

SESSION = os.environ["TABLE_SESSION"]


@pytest.mark.parametrize("scaler", ["a", "b"])
def test_old(scaler):
    assert SESSION != "old", "the old bug"


@pytest.mark.parametrize("scaler", ["x"])
def test_cuda(scaler):
    pytest.skip("needs CUDA")


def test_open():
    assert SESSION == "xpass", "the open bug (the xpass session: a strict xfail that passes)"


def test_open2():
    assert False, "the open bug"


def test_same():
    pass


@pytest.mark.parametrize("cell", range(3))
def test_fsdp2(cell):
    if SESSION == "old":
        pytest.skip("no FSDP2 on this torch")


if SESSION == "xpass":
    def test_new():
        pass
'''

FSDP2 = "test_checks.py::test_fsdp2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"green": a directory of three versions' reports, all as expected; "red": the xpass session's}."""
    child = tmp_path_factory.mktemp("child")
    (child / "pytest.ini").write_text("[pytest]\n")
    (child / "conftest.py").write_text(CONFTEST)
    (child / "test_checks.py").write_text(CHECKS)
    (child / "xfails.txt").write_text("# ours\ntest_checks.py::test_renamed  # T-1\n")
    dirs = {"green": tmp_path_factory.mktemp("green"), "red": tmp_path_factory.mktemp("red")}
    for where, session, torch, extra in [("green", "old", "2.4.1+cu121", ["--xfails-file", "xfails.txt"]),
                                         ("green", "new", "2.13.0+cpu", []), ("green", "new", "2.10.0", []),
                                         ("red", "xpass", "2.13.0+cpu", [])]:
        out = dirs[where] / f"torch-{torch.split('+')[0]}.json"
        env = dict(clean_env(), PYTHONPATH=ROOT, TABLE_SESSION=session, TABLE_TORCH=torch)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "fsdp_amp_suite.options",
                               "-p", "fsdp_amp_suite.report",
                               "-p", "no:cacheprovider", "-p", "no:xdist", f"--report-json={out}", *extra],
                              cwd=child, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == (1 if session == "xpass" else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
    return dirs


def test_sessions_are_ordered_by_torch_version_not_by_string(runs):
    assert [s.versions["torch"] for s in table.load(runs["green"])] == ["2.4.1+cu121", "2.10.0", "2.13.0+cpu"]


def test_bug_cells_hit_fixed_na(runs):
    header, rows = table.bug_table(table.load(runs["green"]))
    assert header == ["known bug", "holds for", "torch 2.4.1+cu121", "torch 2.10.0", "torch 2.13.0+cpu", "reason"]
    hit, fixed, na = BugCell(Status.HIT, 2), BugCell(Status.FIXED, 2), BugCell(Status.NA)
    assert rows == [["old-bug", "torch<2.6", hit, fixed, fixed, "fixed in 2.6"],
                    ["cuda-bug", "any", na, na, na, "needs CUDA"],
                    ["open-bug", "any", hit, hit, hit, "still there"]]
    assert [str(c) for c in (hit, fixed, na)] == ["hit 2", "fixed 2", "n/a"]


def test_a_failed_check_of_a_bug_is_unexpected_and_a_problem(runs):
    sessions = table.load(runs["green"])[:2] + table.load(runs["red"])  # 2.13.0: test_open passes, XPASS(strict)
    cell = table.bug_table(sessions)[1][2][-2]
    assert cell == BugCell(Status.UNEXPECTED, 1, hit=1) and str(cell) == "UNEXPECTED 1 (hit 1)"
    assert str(BugCell(Status.UNEXPECTED, 1)) == "UNEXPECTED 1"
    assert table.problems(sessions) == ["torch 2.13.0+cpu: exit status 1",
                                        "open-bug on torch 2.13.0+cpu: UNEXPECTED 1 (hit 1)"]


def test_in_force_bug_whose_checks_pass_is_not_called_fixed(runs):
    new = table.load(runs["green"])[1]  # old-bug's checks pass there; say the bug were in force all the same
    s = dataclasses.replace(new, known_bugs=tuple(dataclasses.replace(b, in_force=True) for b in new.known_bugs))
    assert table.bug_cell("old-bug", s) == BugCell(Status.OTHER, 2)


def test_changed_checks_grouped_by_function_and_pattern(runs):
    groups = table.changed(table.load(runs["green"]))
    assert [(g["test"], g["pattern"], g["count"]) for g in groups] == [
        (FSDP2, ("skipped", "passed", "passed"), 3),
        ("test_checks.py::test_old", ("xfailed", "passed", "passed"), 2)]
    assert groups[1]["bugs"] == {"old-bug"} and groups[0]["example"] == f"{FSDP2}[0]"


def test_a_check_missing_from_a_version_counts_as_changed(runs):
    sessions = table.load(runs["green"])[2:] + table.load(runs["red"])
    assert ("test_checks.py::test_new", ("-", "passed")) in [(g["test"], g["pattern"]) for g in table.changed(sessions)]


def test_missing_exit_status_and_missing_version_are_problems(runs):
    sessions = table.load(runs["green"])
    data = json.loads((runs["green"] / "torch-2.10.0.json").read_text())
    del data["exitstatus"]  # a report without it
    sessions[1] = Report.from_data(data)
    assert table.problems(sessions, expect=["2.4.1", "2.10.0", "2.13.0", "2.14.1"]) == [
        "torch 2.10.0: exit status missing",
        "torch 2.14.1: no report (the session did not run, or died before writing it)"]


def test_an_xfails_file_entry_that_matched_nothing_is_named(runs):
    old = table.load(runs["green"])[0]
    assert old.xfails_file_unmatched == (Unmatched(2, "test_checks.py::test_renamed"),)
    assert "  - --xfails-file line 2 matched no test: test_checks.py::test_renamed" in table.render([old])


def test_the_cli_reads_the_directory_prints_and_writes_markdown_without_pytest_or_torch(runs, tmp_path):
    """python -m fsdp_amp_suite.version_table as the table job runs it (nox -s table: an interpreter with nox and
    packaging
    alone)."""
    md = tmp_path / "table.md"
    no_pytest = ("import runpy, sys; sys.modules.update(pytest=None, torch=None); sys.argv = sys.argv[1:]; "
                 "runpy.run_module(sys.argv[0], run_name='__main__')")

    def cli(*args):
        return subprocess.run([sys.executable, "-c", no_pytest, "fsdp_amp_suite.version_table", *args], cwd=ROOT,
                              env=clean_env(), capture_output=True, text=True, timeout=120)

    proc = cli(str(runs["green"]), "--markdown", str(md), "--expect", "2.4.1,2.10.0,2.13.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("All as expected across 3 torch version(s)"), proc.stdout
    assert f"3 x {FSDP2}: skipped / passed / passed" in proc.stdout
    assert ("| known bug | holds for | torch 2.4.1+cu121 | torch 2.10.0 | torch 2.13.0+cpu | reason |\n"
            "|---|---|---|---|---|---|\n"
            "| old-bug | torch<2.6 | hit 2 | fixed 2 | fixed 2 | fixed in 2.6 |\n") in md.read_text()
    assert cli(str(runs["green"]), "--expect", "2.14.1").returncode == 1
