"""fairscale ShardedGradScaler, scale on CPU: state_dict() raises after any backoff.

With its scale on CPU (the loss moved to the params' device under CPU offload, as in fairscale issue
#421), update() goes through fairscale's _amp_update_scale_cpu_, which on a backoff sets
`self._growth_tracker = 0`, a Python int where a tensor was. state_dict() then calls
self._growth_tracker.item() and raises AttributeError: 'int' object has no attribute 'item', so no
checkpoint can be saved after the first overflow (the tracker stays an int from then on). Needs one
GPU (fairscale's scaler disables itself without CUDA); params and grads on CPU, the loss computed on
the GPU and moved to CPU, world size 1 (NCCL).

    python -m fsdp_amp_suite.repro fairscale_state_dict_after_backoff
"""
import math

import torch

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler


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


@case("Scale on CPU, one overflow, then state_dict() (needs a GPU)", bugs=["fairscale-state-dict-after-backoff"],
      needs="cuda")
def test_state_dict_after_a_backoff(scaler):
    out = run_on_ranks(_state_after_backoff, scaler, world_size=1, device="cuda")[0]
    return Outcome(out != dict(scale=128.0, tracker=0),
                   f"state_dict() after the backoff: scale {out['scale']}, _growth_tracker {out['tracker']}",
                   "state_dict() returns scale 128.0, _growth_tracker 0")
