"""The compatibility report counts pytest's own reports right, and says so when anything is unexpected."""
from types import SimpleNamespace

import pytest

from tests import report

pytestmark = pytest.mark.harness


def rep(nodeid, outcome, scaler="ours", family="single rank", when="call", reason=None, **props):
    r = SimpleNamespace(nodeid=nodeid, when=when, passed=outcome == "passed", failed=outcome == "failed",
                        skipped=outcome in ("skipped", "xfailed"),
                        user_properties=[("scaler", scaler), ("family", family), *props.items()])
    if outcome == "xfailed":
        r.wasxfail = reason
    return r


def test_each_test_id_counts_once_with_its_worst_outcome():
    recs = report.records([rep("a", "passed", when="setup"), rep("a", "passed"),
                           rep("b", "skipped", when="setup"),
                           rep("c", "passed"), rep("c", "failed", when="teardown"),  # an error in teardown
                           rep("d", "xfailed", scaler="torch_amp", reason="bug X")])
    assert sorted((r["outcome"], r["scaler"]) for r in recs) == [
        ("failed", "ours"), ("passed", "ours"), ("skipped", "ours"), ("xfailed", "torch_amp")]
    title, header, rows = report.tables(recs)[0]
    assert header == ["scaler", "single rank"] and rows == [["ours", "1/1/0/1"], ["torch_amp", "0/0/1/0"]]
    assert report.known_bugs(recs) == [("bug X", 1, ["torch_amp"])]


def test_unexpected_outcomes_lead_the_report():
    strict_xpass = rep("e", "failed")  # pytest reports a strict xfail that passed as failed
    assert report.render(report.records([rep("a", "passed"), strict_xpass]), markdown=False).startswith(
        "UNEXPECTED OUTCOMES: 1 failed")
    assert report.render(report.records([rep("a", "passed")]), markdown=True).startswith("**All as expected")


def test_matrix_rows_are_implementation_and_scaler():
    recs = report.records([rep("m1", "passed", family="fp16 offload", impl="fsdp2"),
                           rep("m2", "xfailed", scaler="torch_amp", family="fp32 nooffload", impl="fsdp1", reason="r")])
    title, header, rows = report.tables(recs)[0]
    assert title == "FSDP-vs-DDP matrix" and header == ["implementation", "scaler", "fp32 nooffload", "fp16 offload"]
    assert rows == [["fsdp1", "torch_amp", "0/0/1/0", ""], ["fsdp2", "ours", "", "1/0/0/0"]]
