"""fairscale ShardedGradScaler: a rank that holds no grads this step raises "No inf checks were
recorded for this optimizer" in step(), while the ranks that have grads wait for it in the found_inf
all_reduce (a crash on one rank, a hang on the others).

Under FSDP a rank can hold no grad this step (an unused branch, a frozen submodule, a shard that is
empty on that rank). fairscale 0.4.13's unscale_ records no found_inf when the optimizer has no
grads, so it skips the all_reduce and then trips its own assert; torch fixed the same defect in its
ShardedGradScaler (pytorch#99174), fairscale never did.

Setup: 2 gloo ranks sharing one GPU, params and grads on CUDA; rank 0 runs a clean scaled backward,
rank 1 only scales a detached loss (no grads); both call step() and update(). Rank 0 must step,
rank 1 must take part without stepping, and both keep scale 256. A hang is bounded by a 20 s
timeout. Needs one GPU.

    python tests/repro/test_fairscale_rank_without_grads.py
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
HITS = {**known("records no found_inf on a rank without grads", {"fairscale_sharded"}),
        # torch.amp.GradScaler has no cross-rank agreement; on the rank without grads it raises the same assert
        **known("it relies on DDP's all-reduced grads", {"torch_amp"})}
EXPECTED = "rank 0 steps, rank 1 (no grads) takes part without stepping; both keep scale 256.0"


def _rank1_without_grads(scaler):
    rank = dist.get_rank()
    pb = Problem("cuda", seed_offset=rank)
    s = build_scaler(scaler, pb, init_scale=256.0)
    opt = sgd(pb.params)
    before = pb.snapshot()
    if rank == 0:
        pb.backward(s)
    else:  # this rank's params got no grads this step, but it still steps with the others
        s.scale(pb.loss().detach())
    s.step(opt)
    s.update()
    return dict(stepped=not equal_lists(pb.snapshot(), before), scale=s.get_scale())


def rank_without_grads(scaler):
    try:
        out = run_on_ranks(_rank1_without_grads, scaler, world_size=2, device="cuda-shared", timeout=20)
    except RankHung:
        return Outcome(True, "the ranks hung (no answer within 20 s)", EXPECTED)
    except RankRaised as exc:  # the harness report: a header line, then each failing rank's traceback
        header, error = str(exc).splitlines()[0], str(exc).split("----- rank ")[1].strip().splitlines()[-1]
        return Outcome(True, f"{header}: {error}", EXPECTED)
    stepped, scales = [o["stepped"] for o in out], [o["scale"] for o in out]
    return Outcome(stepped != [True, False] or scales != [256.0, 256.0],
                   f"stepped per rank {stepped}, scale per rank {scales}", EXPECTED)


@needs_cuda
class TestFairscaleRankWithoutGrads(ReproCase):
    HITS = HITS

    @parameterized.expand(SCALERS)
    def test_rank_without_grads_takes_part(self, scaler):
        self.check(scaler, rank_without_grads)


if __name__ == "__main__":
    main(rank_without_grads, HITS, "A rank without grads (2 gloo ranks, one GPU, grads on CUDA)")
