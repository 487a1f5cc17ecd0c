"""torch ShardedGradScaler issues one found_inf all_reduce per device that holds grads: a rank with
grads on CPU and on CUDA makes two collectives, a rank without grads makes one, and the group hangs.

ShardedGradScaler.unscale_ all-reduces each entry of found_inf_per_device separately. Since
pytorch#99174 a rank without grads records one found_inf (on the scale's device), so it takes part
in one all_reduce; a rank whose optimizer holds grads on two devices (here some params offloaded to
CPU, the rest on the GPU) waits for a second all_reduce that no peer ever issues. Any difference in
the set of grad devices between ranks does the same.

Setup: 2 gloo ranks sharing one GPU, the scale on CUDA; rank 0 has params (hence grads) on CPU and
on CUDA and runs a clean scaled backward; rank 1 only scales a detached loss (no grads); both call
step() and update(). Rank 0 must step, rank 1 must take part without stepping, both keep scale 256.
The hang is bounded by a 20 s timeout. Needs one GPU.

    python tests/repro/test_torch_sharded_collective_per_device.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from parameterized import parameterized  # noqa: E402

from tests.conformance.problem import Problem, build_scaler, equal_lists, sgd  # noqa: E402
from tests.harness import RankHung, RankRaised, run_on_ranks  # noqa: E402
from tests.repro.common import SCALERS, Outcome, ReproCase, known, main, needs_cuda  # noqa: E402

pytestmark = pytest.mark.repro
HITS = {**known("issues one all_reduce per device holding grads", {"torch_sharded"}),
        # not this bug, but deterministic here: fairscale records no found_inf on the rank without grads
        # (test_fairscale_rank_without_grads.py), and torch.amp.GradScaler has no cross-rank agreement
        **known("records no found_inf on a rank without grads", {"fairscale_sharded"}),
        **known("it relies on DDP's all-reduced grads", {"torch_amp"})}
EXPECTED = "rank 0 steps, rank 1 (no grads) takes part without stepping; both keep scale 256.0"


def _rank1_without_grads(scaler):
    rank = dist.get_rank()
    pb = Problem("mixed", seed_offset=rank)  # params 0 and 2 on CPU, param 1 on CUDA; the scale on CUDA
    s = build_scaler(scaler, pb, init_scale=256.0)
    opt = sgd(pb.params)
    before = pb.snapshot()
    if rank == 0:
        pb.backward(s)  # grads on CPU and on CUDA
    else:  # this rank's params got no grads this step, but it still steps with the others
        s.scale(pb.loss().detach())
    s.step(opt)
    s.update()
    return dict(stepped=not equal_lists(pb.snapshot(), before), scale=s.get_scale())


def rank_without_grads(scaler):
    try:
        out = run_on_ranks(_rank1_without_grads, scaler, world_size=2, device="cuda-shared", timeout=20)
    except RankHung as exc:
        return Outcome(True, str(exc).splitlines()[0], EXPECTED)
    except RankRaised as exc:  # the harness report: a header line, then each failing rank's traceback
        header, error = str(exc).splitlines()[0], str(exc).split("----- rank ")[1].strip().splitlines()[-1]
        return Outcome(True, f"{header}: {error}", EXPECTED)
    stepped, scales = [o["stepped"] for o in out], [o["scale"] for o in out]
    return Outcome(stepped != [True, False] or scales != [256.0, 256.0],
                   f"stepped per rank {stepped}, scale per rank {scales}", EXPECTED)


@needs_cuda
class TestTorchShardedCollectivePerDevice(ReproCase):
    HITS = HITS

    @parameterized.expand(SCALERS)
    def test_rank_with_grads_on_two_devices_and_rank_without_grads(self, scaler):
        self.check(scaler, rank_without_grads)


if __name__ == "__main__":
    main(rank_without_grads, HITS,
         "Grads on CPU and CUDA on rank 0, none on rank 1 (2 gloo ranks, one GPU, scale on CUDA)")
