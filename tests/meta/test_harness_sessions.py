"""Whole child sessions keep the harness's promises: no rank process outlives its pytest (ended, or
SIGKILLed), xdist workers run pools side by side, torchrun mode runs the bodies on the launcher's ranks
(and a pytest.skip on one of them is reported to all, not a hang), and run_on_ranks uses the harness the
session built from its options."""
import os
import resource
import signal
import subprocess
import sys
import time
import uuid

import pytest

from fsdp_amp_suite.child_run import ROOT
from fsdp_amp_suite.harness import session
from fsdp_amp_suite.sessions.children import SESSIONS, child_env, processes_with, wait_until_gone

pytestmark = pytest.mark.harness


def test_no_process_outlives_a_pytest_session(tmp_path):
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(SESSIONS, "case_pool.py")],
                          cwd=ROOT, env=child_env(token, tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rank_pids = {int(p) for f in tmp_path.iterdir() for p in f.read_text().split()[2:]}
    assert len(rank_pids) == 2, "all four tests should have shared one pool"
    assert wait_until_gone(token, 5) == []


_BURN_ON_RANKS = """
import resource
from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.sessions.case_pool import _pid_and_rank
run_on_ranks(_pid_and_rank, world_size=2)
own = resource.getrusage(resource.RUSAGE_SELF)
print(own.ru_utime + own.ru_stime)
"""


def test_what_the_ranks_spent_reaches_whoever_reaps_their_owner(tmp_path):
    """The ranks' fork server is reaped by the process that started it, not orphaned at its exit: the CPU of the
    ranks (which the server reaped) then reaches that process's parent (benchmarks.cputime counts child runs so)."""
    burn = 0.5  # CPU-seconds that each of the two ranks spends in its task
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", _BURN_ON_RANKS], cwd=ROOT, capture_output=True, text=True,
                          env=child_env(uuid.uuid4().hex, tmp_path, CASE_BURN_S=str(burn)), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    beyond_own = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime - float(proc.stdout.split()[-1])
    assert beyond_own >= 2 * burn, f"the child's reaped processes spent {beyond_own:.2f} CPU-s, its ranks {2 * burn}"


def test_no_process_outlives_a_killed_pytest(tmp_path):
    token = uuid.uuid4().hex
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              os.path.join(SESSIONS, "case_pool.py")],
                             cwd=ROOT, env=child_env(token, tmp_path, CASE_SLEEP_S="60"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(processes_with(token)) < 3 and time.monotonic() < deadline:  # pytest + 2 ranks
            time.sleep(0.2)
        assert len(processes_with(token)) >= 3, "the child session never started its ranks"
        time.sleep(1.0)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert wait_until_gone(token, 10) == []
    finally:
        if child.poll() is None:
            child.kill()


def test_two_xdist_workers_run_pools_at_once(tmp_path):
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "load", os.path.join(SESSIONS, "case_pool.py")],
                          cwd=ROOT, env=child_env(token, tmp_path, CASE_SLEEP_S="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [f.read_text().split() for f in tmp_path.iterdir()]
    workers = {row[0] for row in rows}
    assert workers == {"gw0", "gw1"}, rows
    pools = {tuple(row[2:]) for row in rows}
    assert len(pools) == 2, "each worker should have its own pool of two ranks"
    assert wait_until_gone(token, 5) == []


def test_torchrun_mode_runs_bodies_on_launcher_ranks(tmp_path):
    """case_torchrun.py's tests, each run once per launcher rank, a pytest.skip on one rank among them: with
    no outcome of it in the gather, the other rank would wait there (up to this test's timeout)."""
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-rs", os.path.join(SESSIONS, "case_torchrun.py")],
                          cwd=ROOT, env=child_env(token, tmp_path, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("2 passed, 2 skipped") == 2, out  # each launcher rank ran the session
    assert "needs world_size 3; torchrun launched 2 ranks" in out
    assert "every rank skips this" in out  # a pytest.skip on every rank skips the test


def test_run_on_ranks_uses_the_session_harness_built_from_the_options(request):
    from fsdp_amp_suite import checks

    harness, _ = request.config.stash[checks.HARNESS]
    assert session() is harness
    assert (harness.isolate, harness.timeout) == (request.config.getoption("--isolate-ranks"),
                                                  request.config.getoption("--rank-timeout"))
