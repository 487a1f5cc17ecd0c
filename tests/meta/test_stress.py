"""benchmarks/stress.py counts what it says: every check once, then only the targets again, in order; rank deaths
by signal and by frame over the target runs."""
import subprocess
import sys

from benchmarks import stress
from fsdp_amp_suite.child_run import ROOT, clean_env


def test_the_targets_run_again_after_every_check_ran_once():
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                          "-p", "benchmarks.stress", "--stress-rounds=3", "tests/conformance/test_ranks.py",
                          "tests/conformance/test_fsdp2.py", "-k", "ours"],
                         cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    rounds = [int(i.rsplit("round", 1)[1].split("]")[0].split("-")[0]) for i in ids]
    assert rounds == sorted(rounds) and set(rounds) == {0, 1, 2}, ids  # round 0 first, then 1, then 2
    later = {i.split("::")[0] for i, r in zip(ids, rounds) if r > 0}
    assert later == {"tests/conformance/test_fsdp2.py"}, later  # only the targets again
    assert {i.split("::")[0] for i, r in zip(ids, rounds) if r == 0} == {"tests/conformance/test_ranks.py",
                                                                         "tests/conformance/test_fsdp2.py"}


def test_deaths_are_counted_by_signal_and_frame_over_the_target_runs():
    abort = {"rank": 1, "how": "SIGABRT", "frame": "torch/distributed/_functional_collectives.py:203 all_gather_tensor",
             "owner": "torch"}
    records = [{"nodeid": "a", "outcome": "failed", "deaths": [abort]},
               {"nodeid": "b", "outcome": "passed", "deaths": []},
               {"nodeid": "c", "outcome": "skipped"},
               {"nodeid": "d", "outcome": "failed", "deaths": [dict(abort, rank=0, how="SIGSEGV")]},
               {"nodeid": "e", "outcome": "failed"}]
    text = stress.summary(records, {"a", "b", "c", "d"}, 12.0, "-n 2", 3)
    assert "deaths by signal: SIGABRT 1, SIGSEGV 1" in text
    assert "  2 x torch/distributed/_functional_collectives.py:203 all_gather_tensor (torch's code)" in text
    assert "failed (a rank died): a" in text and "failed: e" in text
    assert text.splitlines()[-1] == "rank_deaths=2 target_runs=3 deaths_per_1000=666.67"
