"""fairscale FSDP (not a scaler bug): FullyShardedDataParallel(mixed_precision=True,
flatten_parameters=False) without CPU offload, at world size 1, leaves fp16 grads on the fp32
params, so a foreach SGD step raises "Tensors of the same index must be on the same device and the
same dtype" (and torch.amp.GradScaler already refuses them: "Attempting to unscale FP16 gradients.").

Every scaler hits it, because the optimizer, not the scaler, rejects the grads (KNOWN_BUGS
fairscale-fsdp-mixed-precision-grads). fairscale 0.4.13 on one H200: the same configuration trains with
cpu_offload=True or with flatten_parameters=True. Found by the FSDP-vs-DDP matrix and a sweep of 24
fairscale FSDP configurations at world size 1.

Setup: one rank (NCCL), a 2-layer MLP on CUDA wrapped as above (compute_dtype fp16), SGD with
momentum (foreach on CUDA), one clean scaled step. The grads must be fp32 like their params and the
step must apply. Needs one GPU.

    python -m fsdp_amp_suite.repro fairscale_fsdp_mixed_precision_grads
"""
import torch

from fsdp_amp_suite.harness import rank_device, run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler


def _fsdp_step(scaler):
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    device = rank_device()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(device)
    model = FullyShardedDataParallel(module, mixed_precision=True, compute_dtype=torch.float16,
                                     flatten_parameters=False, cpu_offload=False, move_grads_to_cpu=False,
                                     compute_device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    s = make_scaler(scaler, device="cuda", init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    s.scale(model(torch.randn(4, 8, device=device)).float().pow(2).mean()).backward()
    dtypes = sorted({(str(p.dtype), str(p.grad.dtype)) for p in model.parameters() if p.grad is not None})
    try:
        s.step(opt)
        s.update()
        error = None
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    stepped = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return dict(dtypes=dtypes, error=error, stepped=stepped)


# a bug of the FSDP implementation: every scaler hits it, ours included
@case("fairscale FSDP(mixed_precision=True, flatten_parameters=False), world size 1",
      bugs=["fairscale-fsdp-mixed-precision-grads"], needs="cuda")
def test_mixed_precision_unflattened_params_step(scaler):
    out = run_on_ranks(_fsdp_step, scaler, world_size=1, device="cuda", timeout=120)[0]
    mismatched = [f"{g} grads on {p} params" for p, g in out["dtypes"] if g != p]
    step = f"step() raised {out['error']}" if out["error"] else f"stepped {out['stepped']}"
    return Outcome(bool(mismatched) or out["error"] is not None or not out["stepped"],
                   f"after backward: {', '.join(mismatched) or 'grad dtypes match the params'}; {step}",
                   "fp32 grads on the fp32 params, and the step applies")
