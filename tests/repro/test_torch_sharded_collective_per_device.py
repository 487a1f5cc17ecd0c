"""torch ShardedGradScaler issues one found_inf all_reduce per device that holds grads: a rank with
grads on CPU and on CUDA makes two collectives, a rank without grads makes one, and the group hangs.

ShardedGradScaler.unscale_ all-reduces each entry of found_inf_per_device separately. Since
pytorch#99174 a rank without grads records one found_inf (on the scale's device), so it takes part
in one all_reduce; a rank whose optimizer holds grads on two devices (here some params offloaded to
CPU, the rest on the GPU) waits for a second all_reduce that no peer ever issues. Any difference in
the set of grad devices between ranks does the same.

Setup: 2 gloo ranks sharing one GPU, the scale on CUDA; rank 0 has params (hence grads) on CPU and
on CUDA and runs a clean scaled backward; rank 1 only scales a detached loss (no grads); both call
step() and update(). Rank 0 must step, rank 1 must take part without stepping, both keep scale 256.
The hang is bounded by a 20 s timeout. Needs one GPU.

    python -m fsdp_amp_suite.repro torch_sharded_collective_per_device
"""
from fsdp_amp_suite.repro.runner import case, rank_without_grads

# not this bug, but deterministic here: fairscale records no found_inf on the rank without grads
# (test_fairscale_rank_without_grads.py), and torch.amp.GradScaler has no cross-rank agreement
@case("Grads on CPU and CUDA on rank 0, none on rank 1 (2 gloo ranks, one GPU, scale on CUDA)",
      bugs=["torch-sharded-collective-per-device", "fairscale-rank-without-grads", "torch-amp-not-shard-aware"],
      needs="cuda")
def test_rank_with_grads_on_two_devices_and_rank_without_grads(scaler):  # params 0, 2 on CPU, 1 on CUDA; scale on CUDA
    return rank_without_grads(scaler, "mixed")
