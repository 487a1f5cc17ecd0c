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

    python -m fsdp_amp_suite.repro fairscale_update_new_scale_cpu_tensor
"""
import torch

from fsdp_amp_suite.conformance.problem import Problem, build_scaler, sgd
from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case


def _update_with_cpu_tensor(scaler):
    pb = Problem("cpu")  # everything on CPU: the scale lives on CPU
    s = build_scaler(scaler, pb, init_scale=256.0)
    opt = sgd(pb.params)
    pb.backward(s)
    s.step(opt)
    s.update(new_scale=torch.tensor(32.0))  # a CPU tensor, like the scale it replaces
    return s.get_scale()


@case("update(new_scale=<CPU tensor>) with the scale on CPU (1 rank)", bugs=["fairscale-update-new-scale-cpu-tensor"],
      needs="cuda")  # without CUDA fairscale's ShardedGradScaler disables itself and update() is a no-op
def test_update_with_a_cpu_tensor_new_scale(scaler):
    scale = run_on_ranks(_update_with_cpu_tensor, scaler, world_size=1, device="cpu", timeout=60)[0]
    return Outcome(scale != 32.0, f"update(new_scale=torch.tensor(32.0)) on CPU: scale is now {scale}",
                   "sets the scale to 32.0")
