"""bf16 grads on CUDA crash every scaler that unscales them with
torch._amp_foreach_non_finite_check_and_unscale_: the op has no CUDA kernel for bf16
(NotImplementedError: ... not implemented for 'BFloat16'), while its CPU kernel handles bf16
(KNOWN_BUGS bf16-cuda-unscale-kernel; seen on torch 2.11).

It hits torch.amp.GradScaler, torch's ShardedGradScaler and fairscale's ShardedGradScaler alike. In
real training bf16 grads on the GPU come from e.g. fairscale FSDP with mixed_precision=True,
compute_dtype=torch.bfloat16 and no CPU offload (world size 1), or from any model trained in bf16.

Setup: one rank, three bf16 params on CUDA with exactly known grads, one clean scaled step. The
grads must come out exactly unscaled and the step must apply. Needs one GPU.

    python -m fsdp_amp_suite.repro bf16_grads_on_cuda
"""
from fsdp_amp_suite.conformance.problem import Problem, build_scaler, equal_lists, sgd
from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case


def _bf16_step(scaler):
    pb = Problem("cuda", dtype="bfloat16")  # bf16 params (hence bf16 grads) on CUDA
    s = build_scaler(scaler, pb, init_scale=256.0)
    opt = sgd(pb.params)
    before = pb.snapshot()
    pb.backward(s)
    s.step(opt)  # unscales the bf16 CUDA grads
    s.update()
    return dict(stepped=not equal_lists(pb.snapshot(), before),
                grads_exact=equal_lists(pb.grads(), [c.cpu() for c in pb.targets]))


@case("bf16 grads on CUDA: one clean scaled step (1 rank)", bugs=["bf16-cuda-unscale-kernel"], needs="cuda")
def test_clean_step_with_bf16_grads_on_cuda(scaler):
    out = run_on_ranks(_bf16_step, scaler, world_size=1, device="cuda", timeout=60)[0]
    return Outcome(not (out["stepped"] and out["grads_exact"]),
                   f"bf16 grads on CUDA: stepped {out['stepped']}, grads exactly unscaled {out['grads_exact']}",
                   "unscales the bf16 grads exactly and steps")
