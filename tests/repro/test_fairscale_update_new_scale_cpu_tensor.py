"""fairscale ShardedGradScaler.update(new_scale=<tensor>) asserts a torch.cuda.FloatTensor, so a CPU
tensor is refused even when the scaler's own scale lives on CPU.

fairscale 0.4.13 supports a scale on CPU (its scale is created on the device of the first scaled
loss: CPU when the loss is moved to the CPU-offloaded params, as fairscale's FSDP tests do with
`loss.to(model_device)`, fairscale#421), but update() still checks
`isinstance(new_scale, torch.cuda.FloatTensor)`: AssertionError "new_scale should be a float or a
1-element torch.cuda.FloatTensor with requires_grad=False." torch's GradScaler and
ShardedGradScaler accept a 1-element tensor on the scale's device.

Setup: one rank, params, grads, loss and scale on CPU; one clean scaled step at scale 256, then
update(new_scale=torch.tensor(32.0)) on CPU. The scale must become 32. Needs a GPU machine only
because fairscale's scaler disables itself where CUDA is missing (then update() does nothing).

    python tests/repro/test_fairscale_update_new_scale_cpu_tensor.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conformance.problem import Problem, build_scaler, sgd  # noqa: E402
from tests.harness import run_on_ranks  # noqa: E402
from tests.repro.common import Outcome, check, main, needs_cuda  # noqa: E402

pytestmark = pytest.mark.repro


def _update_with_cpu_tensor(scaler):
    pb = Problem("cpu")  # everything on CPU: the scale lives on CPU
    s = build_scaler(scaler, pb, init_scale=256.0)
    opt = sgd(pb.params)
    pb.backward(s)
    s.step(opt)
    s.update(new_scale=torch.tensor(32.0))  # a CPU tensor, like the scale it replaces
    return s.get_scale()


def new_scale_cpu_tensor(scaler):
    if not torch.cuda.is_available():  # the ranks run on CPU here, so run_on_ranks would not skip
        pytest.skip("needs CUDA: without it fairscale's ShardedGradScaler disables itself and update() is a no-op")
    scale = run_on_ranks(_update_with_cpu_tensor, scaler, world_size=1, device="cpu", timeout=60)[0]
    return Outcome(scale != 32.0, f"update(new_scale=torch.tensor(32.0)) on CPU: scale is now {scale}",
                   "sets the scale to 32.0")


@needs_cuda
@pytest.mark.repro_of("fairscale-update-new-scale-cpu-tensor")
def test_update_with_a_cpu_tensor_new_scale(scaler):
    check(scaler, new_scale_cpu_tensor)


if __name__ == "__main__":
    main(new_scale_cpu_tensor, test_update_with_a_cpu_tensor_new_scale,
         "update(new_scale=<CPU tensor>) with the scale on CPU (1 rank)")
