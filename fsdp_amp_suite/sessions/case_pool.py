"""Run by test_harness_sessions.py in a child pytest (not collected by default): uses the rank pool."""
import os
import time

import torch.distributed as dist

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.harness import session


def _pid_and_rank():
    time.sleep(float(os.environ.get("CASE_SLEEP_S", "0")))
    burn = time.process_time() + float(os.environ.get("CASE_BURN_S", "0"))
    while time.process_time() < burn:  # CPU that only the rank's own process spends
        pass
    return os.getpid(), dist.get_rank()


def _report(tag):
    out = run_on_ranks(_pid_and_rank, world_size=2)
    assert [rank for _, rank in out] == [0, 1]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(os.environ["CASE_OUT_DIR"], f"{tag}.txt"), "w") as f:
        f.write(f"{worker} {os.getpid()} {' '.join(str(pid) for pid, _ in out)}\n")
    assert len(session().pools) == 1


def test_a():
    _report("a")


def test_b():
    _report("b")


def test_c():
    _report("c")


def test_d():
    _report("d")
