"""The harness on GPUs: the device modes (gloo ranks sharing a GPU, NCCL ranks on one GPU each), results
back on the host, and the CUDA context budget that the xdist workers share (budget.py): slots taken all or
none, a spent budget failing in bounded time saying so, idle pools retired to make room; memory-heavy tasks
taking turns on a GPU.

The budget's bookkeeping is checked on slot files of a fake GPU, so most of it runs without CUDA."""
import ctypes
import dataclasses
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from fsdp_amp_suite.child_run import ROOT
from fsdp_amp_suite.harness import Harness, RankFailure, budget, rank_device, run_on_ranks
from fsdp_amp_suite.conformance.problem import keep_gpu_busy
from fsdp_amp_suite.harness.copies import blocking_copies
from fsdp_amp_suite.sessions.children import SESSIONS, child_env

pytestmark = pytest.mark.harness


def _shared_gpu_all_reduce():
    t = torch.ones(2, device=rank_device()) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return str(rank_device()), t


@pytest.fixture(scope="module")
def harness():
    """This module's own ranks: its pools never touch the session's harness."""
    with Harness() as own:
        yield own


# ---------------------------------------------------------------- the CUDA context budget

FAKE_GPU = 97  # slot files only: no CUDA needed to check the bookkeeping


def test_context_slots_are_taken_all_or_none_within_the_budget(tmp_path):
    with Harness(contexts=3, lock_dir=str(tmp_path)) as own:
        two = own.gpu_budget.take_slots({FAKE_GPU: 2})
        assert len(two) == 2
        assert own.gpu_budget.take_slots({FAKE_GPU: 2}) is None, "only 1 of 3 slots is left"
        one = own.gpu_budget.take_slots({FAKE_GPU: 1})
        assert len(one) == 1, "the refused take of 2 must not keep the slot it found"
        for f in two:
            f.close()
        assert len(own.gpu_budget.take_slots({FAKE_GPU: 2})) == 2


class _IdlePool:
    """Stands for an idle GPU pool of a harness: holds context slots on one GPU; shutdown releases them."""

    def __init__(self, harness, gpu, seconds_to_stop=0.0):
        self.slots, self.slot_gpus = harness.gpu_budget.take_slots({gpu: 1}), {gpu}
        self.seconds_to_stop = seconds_to_stop
        self.stopped_within = None

    def shutdown(self, graceful=True, within=10.0):
        self.stopped_within = within
        time.sleep(min(self.seconds_to_stop, within))
        for f in self.slots:
            f.close()
        self.slots = []


def test_a_spent_context_budget_fails_in_bounded_time_saying_so(tmp_path):
    """The budget is spent by another worker's pool (slots held here), this harness has idle pools on other
    GPUs only, and retiring one would take 30 s: none is retired, and the wait ends at startup_timeout."""
    with Harness(contexts=2, lock_dir=str(tmp_path), startup_timeout=0.5) as own:
        held = own.gpu_budget.take_slots({FAKE_GPU: 2})  # another worker's pool
        elsewhere = own.pools["elsewhere"] = _IdlePool(own, FAKE_GPU + 1, seconds_to_stop=30)
        t0 = time.monotonic()
        try:
            with pytest.raises(RankFailure, match=r"could not get CUDA contexts for 1 rank\(s\) on GPU\(s\) "
                               r"\{97: 1\} within 0.5 s: every slot of the per-GPU budget \{97: 2\} is held"):
                own.gpu_budget.wait_for_slots({FAKE_GPU: 1}, own.pools)
        finally:
            seconds = time.monotonic() - t0
            stand_ins, own.pools = dict(own.pools), {}  # nothing real to stop on the way out
        assert seconds < 5, f"took {seconds:.1f} s"
        assert "elsewhere" in stand_ins and elsewhere.stopped_within is None, \
            "a pool on another GPU was retired: it frees nothing on the GPU waited for"
        del held


def test_an_idle_pool_on_the_gpu_waited_for_is_retired_within_the_bound(tmp_path):
    with Harness(contexts=1, lock_dir=str(tmp_path), startup_timeout=2.0) as own:
        mine = own.pools["mine"] = _IdlePool(own, FAKE_GPU, seconds_to_stop=30)  # the budget's one slot
        t0 = time.monotonic()
        got = own.gpu_budget.wait_for_slots({FAKE_GPU: 1}, own.pools)
        assert len(got) == 1 and "mine" not in own.pools, "the idle pool holding the slot must be retired"
        assert mine.stopped_within is not None and mine.stopped_within <= 2.0, \
            f"retiring was given {mine.stopped_within} s: the bound must cover it"
        assert time.monotonic() - t0 < 2.0 + 5


def test_memory_heavy_tasks_take_turns_on_a_gpu_and_not_across_gpus(tmp_path):
    """Two memory-heavy tasks (a free-memory check, then the allocation) never overlap on one GPU: overlapped,
    both passed the check and one ran out of memory. A turn on another GPU is not held up."""
    with Harness(lock_dir=str(tmp_path)) as own:
        budget, holding, release, second_in, other_gpu_in = (own.gpu_budget, threading.Event(), threading.Event(),
                                                             threading.Event(), threading.Event())

        def hold(gpu, entered, until=None):
            with budget.memory_turn([gpu]):
                entered.set()
                if until is not None:
                    until.wait(30)

        first = threading.Thread(target=hold, args=(FAKE_GPU, holding, release))
        first.start()
        assert holding.wait(30), "the first memory-heavy task never got its turn on a free GPU"
        threads = [first] + [threading.Thread(target=hold, args=args) for args in
                             ((FAKE_GPU, second_in), (FAKE_GPU + 1, other_gpu_in))]
        for t in threads[1:]:
            t.start()
        try:
            assert other_gpu_in.wait(30), "a memory-heavy task on another GPU waited for this GPU's turn"
            assert not second_in.wait(1.0), "a second memory-heavy task ran on the GPU while the first held its turn"
        finally:
            release.set()
            assert second_in.wait(30), "the second memory-heavy task never got its turn after the first ended"
            for t in threads:
                t.join(30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU): CUDA contexts are what is budgeted")
def test_workers_pools_share_a_small_context_budget(tmp_path):
    """Two workers want 2 x (4 + 2 + 1) contexts under a budget of 5: they retire idle pools and take
    turns instead of running the GPU out of memory or waiting forever."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           os.path.join(SESSIONS, "case_gpu_budget.py")],
                          cwd=ROOT, env=child_env(uuid.uuid4().hex, tmp_path, FSDP_AMP_GPU_CONTEXTS="5",
                                                  TMPDIR=str(tmp_path)),  # slot files of its own
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "18 passed" in proc.stdout, proc.stdout[-3000:]


# ---------------------------------------------------------------- GPU device modes

@pytest.mark.gpu
def test_two_gloo_ranks_share_one_gpu(harness):
    out = harness.run(_shared_gpu_all_reduce, world_size=2, device="cuda-shared")
    assert [dev for dev, _ in out] == ["cuda:0", "cuda:0"] or len({dev for dev, _ in out}) == 1
    assert all(torch.equal(t, torch.full((2,), 3.0)) for _, t in out)


def _where():
    return str(rank_device()), os.getpid()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU): the GPU's gloo ranks")
def test_a_cpu_task_runs_on_the_cpu_in_the_gpus_gloo_ranks(harness):
    """Where there is a GPU, a CPU task runs in the GPU's gloo ranks of its world size (ranks.pool_key), its
    rank_device() the CPU; the next GPU task there is on the GPU again. A CPU pool of its own would hold CUDA
    contexts outside the budget."""
    on_cpu = harness.run(_where, world_size=2, device="cpu")
    on_gpu = harness.run(_where, world_size=2, device="cuda-shared")
    again = harness.run(_where, world_size=2, device="cpu")
    assert [d for d, _ in on_cpu] == [d for d, _ in again] == ["cpu", "cpu"]
    assert all(d.startswith("cuda:") for d, _ in on_gpu), on_gpu
    assert [p for _, p in on_cpu] == [p for _, p in on_gpu] == [p for _, p in again], \
        "the CPU task ran in ranks of its own"
    assert (2, "gloo", "cpu") not in harness.pools


@pytest.mark.gpu
def test_one_nccl_rank_on_one_gpu(harness):
    out = harness.run(_shared_gpu_all_reduce, world_size=1, device="cuda")
    assert out[0][0].startswith("cuda:") and torch.equal(out[0][1], torch.ones(2))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_nccl_ranks_on_two_gpus(harness):
    out = harness.run(_shared_gpu_all_reduce, world_size=2, device="cuda")
    assert out[0][0] != out[1][0]
    assert all(torch.equal(t, torch.full((2,), 3.0)) for _, t in out)


@dataclasses.dataclass
class _Record:
    where: str
    tensors: dict


def _record_on_the_gpu():
    return _Record(str(rank_device()), {"t": torch.ones(2, device=rank_device())})


@pytest.mark.gpu
def test_a_result_record_comes_back_on_the_host(harness):
    """A task's dataclass result (e.g. the matrix's CellRun) keeps its type, its tensors copied to the host:
    the controller must never build a CUDA context to unpickle a result."""
    out = harness.run(_record_on_the_gpu, world_size=1, device="cuda")
    assert isinstance(out[0], _Record) and out[0].where.startswith("cuda")
    assert out[0].tensors["t"].device.type == "cpu", "a CUDA tensor inside a result record was not moved to the host"


def _grow_cuda_stack():
    torch.zeros(1, device="cuda")  # a CPU task touches the GPU as fairscale's .cuda() does
    torch.cuda.synchronize()
    budget._libcuda().cuCtxSetLimit(budget.CU_LIMIT_STACK_SIZE, ctypes.c_size_t(1024))  # as a launch needing it does
    return budget.cuda_stack_bytes()


def _cuda_stack_bytes():
    torch.cuda.synchronize()  # the context is this thread's current one
    return budget.cuda_stack_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU): the ranks' CUDA contexts")
@pytest.mark.parametrize("device, world_size", [("cuda", 1), ("cuda-shared", 2), ("cpu", 2)])
def test_ranks_give_back_the_cuda_stack_reservation_after_each_task(device, world_size):
    """A context's stack reservation is about a quarter GiB on an H100, per rank, after a CPU task that touched
    CUDA too (it runs in the GPU's gloo ranks: ranks.pool_key); CONTEXT_GIB counts the contexts without it. A
    task that grew the stack leaves none to the next. On the session's pools: more pools in this module's
    harness would be more for its teardown to close."""
    assert run_on_ranks(_grow_cuda_stack, world_size=world_size, device=device) == [1024] * world_size
    assert run_on_ranks(_cuda_stack_bytes, world_size=world_size, device=device) == [0] * world_size, \
        "a rank kept its CUDA stack reservation after a task (rank_process._clean_up: budget.release_cuda_stack)"


def test_without_a_cuda_context_there_is_no_stack_to_release():
    """A fresh process, which has made no CUDA context (a pytest worker may have): nothing to do, and no error,
    with or without a CUDA driver."""
    out = subprocess.run([sys.executable, "-c", "from fsdp_amp_suite.harness import budget; "
                          "print(budget.cuda_stack_bytes(), budget.release_cuda_stack())"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "None False\n"), out.stderr


@pytest.mark.parametrize("cores, contexts, workers", [
    (16, 79, 8),   # an H100 80 GB on 16 cores: the core bound (16 // 2)
    (16, 35, 4),   # the context budget binds (35 // 8)
    (8, 84, 4),    # an H200 141 GB on 8 cores: the core bound
    (128, 84, 10),  # many cores: the budget's cap binds (84 // 8)
    (2, 42, 1),    # a 2-core runner: one worker
    (16, 5, 1),    # a budget smaller than one worker's pools: still one (its pools take turns)
    (1, 1, 1),
])
def test_the_gate_sizes_its_workers_by_cores_and_context_budget(cores, contexts, workers):
    assert budget.gate_workers(cores, contexts) == workers


@pytest.mark.parametrize("gib, contexts", [
    (79.6, 79),   # an H100 80 GB: one per CONTEXT_GIB
    (139.8, 84),  # an H200 141 GB: the GPU's limit on contexts, less the pytest processes' and child runs'
    (0.5, 1),     # too little for one: still one (its pools take turns)
])
def test_the_context_budget_follows_memory_up_to_the_gpus_context_limit(gib, contexts):
    assert budget.budget_for_memory(gib) == contexts


@pytest.mark.parametrize("present, visible, gpus", [
    (8, None, 8),  # unset: every GPU
    (8, "", 0),
    (8, "0,3", 2),
    (8, "-1", 0),  # the usual way to hide them all
    (8, "1,-1,2", 1),  # CUDA ignores the entries after the first that names no GPU
    (2, "0,1,5", 2),
    (2, "GPU-8c4f1a2b,GPU-11aa", 2),  # UUIDs
    (0, "0", 0),
])
def test_the_gate_counts_the_gpus_cuda_visible_devices_leaves(present, visible, gpus):
    assert budget.narrowed_gpus(present, visible) == gpus


def test_gate_workers_refuses_a_machine_with_nothing():
    with pytest.raises(ValueError, match="gate_workers\\(cores=0, contexts=42\\): both must be at least 1"):
        budget.gate_workers(0, 42)


def _early_reads(trials: int) -> int:
    """Trials in which a non_blocking CUDA -> CPU copy, queued behind a busy GPU's matmuls, is read before it lands."""
    early = 0
    for _ in range(trials):
        # ~150 ms of matmuls on an idle H100: under the gate's load a rank can wait tens of ms for a core between
        # the copy and its read, and the default ~20 ms then let the copy land first in every trial
        keep_gpu_busy(matmuls=64)
        value = torch.full((), 3.0, device="cuda")  # queued behind the matmuls
        early += value.to("cpu", non_blocking=True).item() != 3.0
        torch.cuda.synchronize()
    return early


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU): the async-copy race lives there")
def test_blocking_copies_close_the_async_copy_race_window(harness):
    """The race-free runs (fsdp_amp_suite/expectations.py rule 2) really close the window: read early without, never
    with."""
    trials = 5
    assert harness.run(_early_reads, trials, world_size=1, device="cuda")[0] > 0, \
        "no early read without blocking copies: this check cannot tell the window closed"
    with blocking_copies():
        assert harness.run(_early_reads, trials, world_size=1, device="cuda")[0] == 0
