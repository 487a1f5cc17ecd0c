"""CPU-seconds per test, its process tree included, as the JUnit property cpu_s: where a run's CPU goes.

    python -m pytest -p benchmarks.cputime ... --junitxml=J.xml     then: python -m benchmarks.junit J.xml

A worker-second is not a CPU-second. A worker that waits (on another worker's child run behind a file lock, on a
hang's timeout, on its pool's other ranks) counts seconds but burns no CPU; a rank pool or a child run burns CPU in
processes whose time the worker's clock does not show. On a 2-core runner only the CPU-seconds say what a change
saves. cpu_s is what the worker's process tree spent from the test's setup to its teardown: the worker, its live
descendants (rank pools, child runs) and what they have reaped, read from Linux's /proc (the harness is
Linux-only). Each such test also gets `worker` (its xdist worker) and `started` (epoch seconds at its setup), from
which benchmarks/junit.py draws each worker's timeline. ci/cpu.sh loads it for both jobs, ci/gpu.sh for the gate.
"""
import collections
import os
import time

import pytest

TICKS = os.sysconf("SC_CLK_TCK")
START = pytest.StashKey[float]()
STARTED = pytest.StashKey[float]()


def _stat(pid: str) -> tuple[int, int]:
    """(parent pid, clock ticks of user and system time, its own and its reaped children's)."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()  # from field 3 (state) on: the name may hold spaces
    return int(fields[1]), sum(int(t) for t in fields[11:15])  # ppid; utime, stime, cutime, cstime


def tree_cpu(root: int | None = None) -> float:
    """CPU-seconds spent by root (default: this process), its live descendants, and every child they reaped."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stats[int(name)] = _stat(name)
            except (OSError, ValueError, IndexError):
                pass  # it ended between the listing and the read
    children = collections.defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    total, todo = 0, [os.getpid() if root is None else root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo += children[pid]
    return total / TICKS


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if not item.get_closest_marker("skip"):  # a skip (most of a CPU run's checks) runs nothing to measure
        item.stash[START] = tree_cpu()
        item.stash[STARTED] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # before the teardown report is made: JUnit XML writes the teardown report's user_properties
    if call.when == "teardown" and START in item.stash:
        item.user_properties.append(("cpu_s", round(tree_cpu() - item.stash[START], 2)))
        # when and where it ran: benchmarks/junit.py's per-worker timeline (start-up, idle, the tail)
        item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
        item.user_properties.append(("started", round(item.stash[STARTED], 2)))
    yield
