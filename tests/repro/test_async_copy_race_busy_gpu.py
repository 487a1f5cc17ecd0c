"""CUDA scale + CPU grads + a GPU still busy when step() runs: upstream scalers read CPU copies of
inv_scale / found_inf before those copies land, so CPU grads are zeroed or an inf is missed
(KNOWN_BUGS async-copy-race-busy-gpu, and fairscale-busy-gpu for fairscale's scaler; docs/bugs.md).

The scalers copy inv_scale / found_inf from the GPU to the CPU with non_blocking=True (into pinned
memory) and then use the CPU copy at once on the CPU. While the GPU is idle the copy lands in time;
with work queued on the GPU (here ~20 ms of matmuls between backward and step, as a metric or
the next batch's preprocessing would queue) it never does, and:
  - torch.amp.GradScaler misses an inf in the CPU grads (and steps on it);
  - torch's ShardedGradScaler multiplies every CPU grad by the unlanded inv_scale (zeroes them) and
    misses the inf;
  - fairscale's ShardedGradScaler zeroes every CPU grad (it still sees the inf at world size 1).
A real loop is hit only when GPU work is queued between backward and unscale_/step (measured on an
H200, torch 2.11: with one matmul queued, torch.amp.GradScaler skipped 3 of 20 clean steps under FSDP1
CPU offload).

Setup: one rank, the loss and scale on CUDA, the params and grads on CPU (as under FSDP CPU
offload); 20 trials, each with a new power-of-two scale (a stale copy from the last trial is always
wrong); the clean case must leave exactly the unscaled grads and step; the inf case must skip and
back off. The bug shows if any trial goes wrong. Needs one GPU, alone (a timing check).

    python -m fsdp_amp_suite.repro async_copy_race_busy_gpu
"""
import math

from fsdp_amp_suite.conformance.problem import Problem, build_scaler, equal_lists, sgd
from fsdp_amp_suite.conformance.problem import keep_gpu_busy
from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case

TRIALS = 20


def _busy_trials(scaler, with_inf):
    out = []
    for t in range(TRIALS):
        pb = Problem("offload", numel=4096)  # grads on CPU; loss and scale on CUDA
        init_scale = 2.0 ** (4 + t % 8)  # a new scale every trial
        s = build_scaler(scaler, pb, init_scale=init_scale)
        opt = sgd(pb.params)
        before = pb.snapshot()
        pb.backward(s, inject={0: math.inf} if with_inf else None)  # ends with the GPU idle (synchronized)
        keep_gpu_busy()  # queue ~20 ms of matmuls and return at once
        s.step(opt)
        s.update()
        out.append(dict(stepped=not equal_lists(pb.snapshot(), before), backed_off=s.get_scale() == init_scale / 2,
                        kept_scale=s.get_scale() == init_scale,
                        grads_exact=equal_lists(pb.grads(), [c.cpu() for c in pb.targets])))
    return out


def _trials(scaler, with_inf):
    return run_on_ranks(_busy_trials, scaler, with_inf, world_size=1, device="cuda", timeout=120)[0]


@case("CPU grads, CUDA scale, GPU busy at step(): a clean step (1 rank)",
      bugs=["async-copy-race-busy-gpu", "fairscale-busy-gpu"], needs="cuda")
def test_clean_cpu_grads_are_unscaled_exactly(scaler):
    trials = _trials(scaler, with_inf=False)
    not_exact = sum(not t["grads_exact"] for t in trials)
    unstepped = sum(not (t["stepped"] and t["kept_scale"]) for t in trials)
    return Outcome(not_exact > 0 or unstepped > 0,
                   f"clean grads, GPU busy at step(), {TRIALS} trials: grads not exactly unscaled in {not_exact}, "
                   f"params unchanged (skipped or zero grads) or scale changed in {unstepped}",
                   f"every trial leaves exactly the unscaled grads, steps and keeps its scale (0 and 0 of {TRIALS})")


# not fairscale: it replaces found_inf's storage on an inf, so at world size 1 it sees it
@case("CPU grads, CUDA scale, GPU busy at step(): an inf in a CPU grad (1 rank)", bugs=["async-copy-race-busy-gpu"],
      needs="cuda")
def test_inf_in_cpu_grads_is_seen(scaler):
    trials = _trials(scaler, with_inf=True)
    missed = sum(t["stepped"] for t in trials)
    no_backoff = sum(not t["backed_off"] for t in trials)
    return Outcome(missed > 0 or no_backoff > 0,
                   f"an inf in a CPU grad, GPU busy at step(), {TRIALS} trials: the inf was missed and the step "
                   f"applied in {missed}, no backoff in {no_backoff}",
                   f"every trial skips the step and backs off once (0 and 0 of {TRIALS})")
