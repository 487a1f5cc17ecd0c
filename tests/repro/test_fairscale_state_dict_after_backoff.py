"""fairscale ShardedGradScaler, scale on CPU: state_dict() raises after any backoff.

With its scale on CPU (the loss moved to the params' device under CPU offload, as in fairscale issue
#421), update() goes through fairscale's _amp_update_scale_cpu_, which on a backoff sets
`self._growth_tracker = 0`, a Python int where a tensor was. state_dict() then calls
self._growth_tracker.item() and raises AttributeError: 'int' object has no attribute 'item', so no
checkpoint can be saved after the first overflow (the tracker stays an int from then on). Needs one
GPU (fairscale's scaler disables itself without CUDA); params and grads on CPU, the loss computed on
the GPU and moved to CPU, world size 1 (NCCL).

    python tests/repro/test_fairscale_state_dict_after_backoff.py
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.harness import run_on_ranks  # noqa: E402
from tests.repro.common import Outcome, check, main, needs_cuda  # noqa: E402
from tests.scalers import make_scaler  # noqa: E402

pytestmark = pytest.mark.repro


def _state_after_backoff(scaler):
    gpu = torch.device("cuda", torch.cuda.current_device())
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))  # a CPU param (and grad), as under cpu_offload
    c = torch.tensor([0.25, 0.5, -1.0], device=gpu)
    opt = torch.optim.SGD([w], lr=0.5)
    s = make_scaler(scaler, device="cuda", init_scale=256.0)
    s.scale((w.to(gpu) * c).sum().to("cpu")).backward()  # loss.to(model_device): the scale lives on CPU
    w.grad[0] = math.inf  # an overflow
    s.step(opt)
    s.update()  # skipped step, backoff: 256.0 -> 128.0
    state = s.state_dict()  # a checkpoint after the backoff
    return dict(scale=float(state["scale"]), tracker=int(state["_growth_tracker"]))


def state_dict_after_backoff(scaler):
    out = run_on_ranks(_state_after_backoff, scaler, world_size=1, device="cuda")[0]
    return Outcome(out != dict(scale=128.0, tracker=0),
                   f"state_dict() after the backoff: scale {out['scale']}, _growth_tracker {out['tracker']}",
                   "state_dict() returns scale 128.0, _growth_tracker 0")


@needs_cuda
@pytest.mark.repro_of("fairscale-state-dict-after-backoff")
def test_state_dict_after_a_backoff(scaler):
    check(scaler, state_dict_after_backoff)


if __name__ == "__main__":
    main(state_dict_after_backoff, test_state_dict_after_a_backoff,
         "Scale on CPU, one overflow, then state_dict() (needs a GPU)")
