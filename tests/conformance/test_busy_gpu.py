"""Busy-GPU stress (the async-copy race, KNOWN_BUGS async-copy-race-busy-gpu, docs/bugs.md): CPU grads,
CUDA scale, a GPU still busy when step() runs.

Upstream scalers copy inv_scale / found_inf between CUDA and CPU with non_blocking=True and use the
CPU copy before it lands. With an idle GPU the copy wins the race and nothing shows; with queued
work (a metric, the next batch's preprocessing) it loses every time. So each trial queues ~20
milliseconds of matmuls between backward and step. In a real loop this bites only when GPU work is
queued between backward and unscale_/step (measured on an H200, torch 2.11, FSDP1 CPU offload, fp16:
with one 4096x4096 matmul queued before scaler.step, torch.amp.GradScaler skipped 3 of 20 clean steps).

These tests share the GPU with the other xdist workers' tasks: other contexts' kernels can only
delay this stream further, so the race is lost as surely (a correct scaler waits for its copies
either way). Taking the GPU alone would make every other worker's GPU work wait for each of them.
"""
import math

import pytest
import torch.distributed as dist

from fsdp_amp_suite.conformance.problem import (Problem, build_scaler, equal_lists, device_mode, keep_gpu_busy,
                                      placement_params, sgd)
from fsdp_amp_suite.harness import run_on_ranks

pytestmark = [pytest.mark.conformance, pytest.mark.gpu, pytest.mark.report_column("busy GPU")]
# A scaler that reads its copies early loses the race in nearly every trial with this much queued work (docs/bugs.md:
# 19 or 20 of 20), so five trials all miss it with odds below 1e-6; each trial waits out its queued matmuls on a GPU
# the other workers share, which is most of this file's time.
TRIALS = 5


def _busy_trials(spec, placement, bad, trials):
    rank = dist.get_rank()
    out = []
    for t in range(trials):
        pb = Problem(placement, seed_offset=rank, numel=4096)
        # a new scale every trial: a stale pinned CPU copy left by the previous trial is always wrong
        init_scale = 2.0 ** (4 + t % 8)
        s = build_scaler(spec, pb, init_scale=init_scale)
        opt = sgd(pb.params)
        before = pb.snapshot()
        pb.backward(s, inject={0: math.inf} if bad and rank == 0 else None)
        keep_gpu_busy()
        s.step(opt)
        s.update()
        out.append(dict(stepped=not equal_lists(pb.snapshot(), before), scale=s.get_scale(),
                        init_scale=init_scale,
                        grads_exact=equal_lists(pb.grads(), [c.cpu() for c in pb.targets])))
    return out


@pytest.mark.parametrize("world_size", [1, 2], ids=["1rank", "2ranks_one_gpu"])
@pytest.mark.parametrize("bad", [False, True], ids=["clean", "inf"])
@pytest.mark.parametrize("placement", placement_params(["offload", "mixed", "cuda"]))
def test_busy_gpu_cpu_grads_are_unscaled_and_checked(scaler, placement, bad, world_size):
    out = run_on_ranks(_busy_trials, scaler, placement, bad, TRIALS, world_size=world_size,
                       device=device_mode(placement, world_size), timeout=120)
    for rank, trials in enumerate(out):
        for t, trial in enumerate(trials):
            where = f"rank {rank}, trial {t}"
            if bad:
                assert not trial["stepped"], f"{where}: the inf was missed and the step applied"
                assert trial["scale"] == trial["init_scale"] / 2, f"{where}: scale {trial['scale']} did not back off"
            else:
                assert trial["grads_exact"], f"{where}: CPU grads were not unscaled exactly (zeroed?)"
                assert trial["stepped"] and trial["scale"] == trial["init_scale"], f"{where}: a clean step was skipped"
