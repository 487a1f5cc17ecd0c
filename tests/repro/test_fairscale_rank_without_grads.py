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

    python -m fsdp_amp_suite.repro fairscale_rank_without_grads
"""
from fsdp_amp_suite.repro.runner import case, rank_without_grads

# torch.amp.GradScaler has no cross-rank agreement; on the rank without grads it raises the same assert
@case("A rank without grads (2 gloo ranks, one GPU, grads on CUDA)",
      bugs=["fairscale-rank-without-grads", "torch-amp-not-shard-aware"], needs="cuda")
def test_rank_without_grads_on_cuda_takes_part(scaler):  # params and grads on CUDA
    return rank_without_grads(scaler, "cuda")
