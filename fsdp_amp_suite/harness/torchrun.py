"""torchrun mode: with RANK and WORLD_SIZE set, this process is a rank and runs the body right here.

Every launcher rank runs the same pytest session in the same order, so each test's body runs once per rank.
The outcomes are exchanged with all_gather_object, and every rank must reach it: run_task reports whatever
the body did (a pytest.skip on one rank too), so no rank leaves the others waiting in the gather. A hang is
bounded by the process group's timeout, not by the harness.
"""
from __future__ import annotations

import itertools
import os

from fsdp_amp_suite.harness.task import Task, run_task, set_rank_device, values

_task_ids = itertools.count()


def torchrun_world_size() -> int | None:
    """The world size torchrun launched, or None when this process was not launched by torchrun."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def run_under_torchrun(payload: bytes, device: str, backend: str, seed: int) -> list:
    """Every launcher rank's result of pickle.loads(payload) = (fn, args, kwargs), in rank order (task.values)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if device != "cpu":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    if device == "cpu":
        set_rank_device(torch.device("cpu"))
    else:
        set_rank_device(torch.device("cuda", torch.cuda.current_device()))
    mine = run_task(Task(next(_task_ids), payload, seed), dist.get_rank())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return values(every)
