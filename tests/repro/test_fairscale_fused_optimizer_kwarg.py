"""fairscale ShardedGradScaler.step crashes on a fused optimizer: it passes grad_scaler=self to any
optimizer with _step_supports_amp_scaling (AdamW(fused=True) on CUDA), whose step() does not take
it: TypeError: Adam.step() got an unexpected keyword argument 'grad_scaler'.

fairscale 0.4.13 copied an old GradScaler.step contract (custom optimizers received the scaler as a
keyword). torch's fused optimizers now take grad_scale / found_inf attributes set by GradScaler
instead, and their step() accepts only a closure.

Setup: one rank, three fp32 params on CUDA with exactly known grads, AdamW(fused=True), one clean
scaled step. The step must apply. Needs one GPU.

    python -m fsdp_amp_suite.repro fairscale_fused_optimizer_kwarg
"""
import torch

from fsdp_amp_suite.conformance.problem import Problem, build_scaler, equal_lists
from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case


def _fused_step(scaler):
    pb = Problem("cuda")
    s = build_scaler(scaler, pb, init_scale=256.0)
    opt = torch.optim.AdamW(pb.params, lr=0.01, fused=True)  # _step_supports_amp_scaling = True
    before = pb.snapshot()
    pb.backward(s)
    s.step(opt)
    s.update()
    return not equal_lists(pb.snapshot(), before)


@case("A clean step with AdamW(fused=True) on CUDA (1 rank)", bugs=["fairscale-fused-optimizer-kwarg"],
      needs="cuda")
def test_clean_step_with_fused_adamw(scaler):
    stepped = run_on_ranks(_fused_step, scaler, world_size=1, device="cuda", timeout=60)[0]
    return Outcome(not stepped, f"a clean step with AdamW(fused=True): stepped {stepped}",
                   "steps the fused AdamW")
