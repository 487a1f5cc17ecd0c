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
from parameterized import parameterized  # noqa: E402

from tests.repro import common  # noqa: E402
from tests.repro.common import SCALERS, ReproCase, known, main, needs_cuda  # noqa: E402

pytestmark = pytest.mark.repro
HITS = {**known("fairscale-rank-without-grads", {"fairscale_sharded"}),
        # torch.amp.GradScaler has no cross-rank agreement; on the rank without grads it raises the same assert
        **known("torch-amp-not-shard-aware", {"torch_amp"})}


def rank_without_grads(scaler):  # params and grads on CUDA
    return common.rank_without_grads(scaler, "cuda")


@needs_cuda
class TestFairscaleRankWithoutGrads(ReproCase):
    HITS = HITS

    @parameterized.expand(SCALERS)
    def test_rank_without_grads_takes_part(self, scaler):
        self.check(scaler, rank_without_grads)


if __name__ == "__main__":
    main(rank_without_grads, HITS, "A rank without grads (2 gloo ranks, one GPU, grads on CUDA)")
