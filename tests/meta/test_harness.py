"""The rank harness keeps its promises: results, faults, hangs, isolation, no leftovers.

Every test here runs on a Harness of its own (the `harness` fixture, or one built for the test), never on
the session's: crashing, hanging and isolating ranks, small context budgets and short timeouts must not
reach the pools and settings that the other tests of this worker rely on."""
import ctypes
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from tests.child_run import ROOT, clean_env
from tests.harness import (Harness, RankDied, RankFailure, RankHung, RankRaised, missing_requirement, rank_device,
                           session)
from tests.harness import ranks as ranks_module

pytestmark = pytest.mark.harness
SESSIONS = os.path.join("tests", "meta", "sessions")


# ---------------------------------------------------------------- bodies (run on the ranks)

def _identity(tag):
    t = torch.full((3,), float(dist.get_rank()))
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "tag": tag, "sum": t, "pid": os.getpid()}


def _raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    return dist.get_rank()


def _raise_while_peer_waits():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up before the collective")
    _peer_waits_in_all_reduce()


def _peer_waits_in_all_reduce():
    dist.all_reduce(torch.ones(1))


def _segfault_on(bad_rank):
    if dist.get_rank() == bad_rank:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return dist.get_rank()


def _exit_on(bad_rank, code):
    if dist.get_rank() == bad_rank:
        os._exit(code)
    dist.barrier()


def _mismatched_collective():
    if dist.get_rank() == 0:
        _rank0_stuck_in_all_reduce()
    return dist.get_rank()


def _rank0_stuck_in_all_reduce():
    dist.all_reduce(torch.ones(1))


def _tiny_training(steps):
    """A few SGD steps of a 2-rank data-parallel MLP with random init and data: deterministic?"""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        x = torch.randn(4, 8) + dist.get_rank()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], torch.rand(2)


def _dirty_global_state():
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    return torch.rand(1)


def _observe_global_state():
    return torch.is_grad_enabled(), torch.get_default_dtype(), torch.rand(1)


class _Leftover:
    pass


_LEFTOVER_REFS = []  # weak references that outlive a task inside the rank process


def _leave_garbage_cycle_in_old_generation():
    import gc

    import weakref

    a, b = _Leftover(), _Leftover()
    a.other, b.other = b, a
    _LEFTOVER_REFS[:] = [weakref.ref(a), weakref.ref(b)]
    gc.collect()  # the cycle survives while referenced: it now sits in the oldest generation
    return None   # unreferenced from here on: only a full collection frees it


def _count_leftovers():
    return sum(ref() is not None for ref in _LEFTOVER_REFS)


def _shared_gpu_all_reduce():
    t = torch.ones(2, device=rank_device()) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return str(rank_device()), t


@pytest.fixture(scope="module")
def harness():
    """This module's own ranks: its faults and pools never touch the session's harness."""
    with Harness() as own:
        yield own


# ---------------------------------------------------------------- results

def test_every_rank_returns_its_result_in_rank_order(harness):
    out = harness.run(_identity, "x", world_size=2)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["tag"] == "x" for o in out)
    assert all(torch.equal(o["sum"], torch.full((3,), 1.0)) for o in out)
    assert out[0]["pid"] != out[1]["pid"] != os.getpid()


def test_pool_is_reused_between_tasks(harness):
    first = harness.run(_identity, "a", world_size=2)
    second = harness.run(_identity, "b", world_size=2)
    assert [o["pid"] for o in first] == [o["pid"] for o in second]


def test_world_size_one_and_three_get_their_own_pools(harness):
    assert [o["rank"] for o in harness.run(_identity, "x", world_size=1)] == [0]
    out = harness.run(_identity, "x", world_size=3)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert torch.equal(out[2]["sum"], torch.full((3,), 3.0))


def test_each_task_starts_from_clean_global_state(harness):
    harness.run(_dirty_global_state, world_size=2)
    for grad_enabled, dtype, r in harness.run(_observe_global_state, world_size=2):
        assert grad_enabled and dtype == torch.float32
    # seeds are reset per task: two tasks draw the same "random" numbers
    again = harness.run(_observe_global_state, world_size=2)
    assert torch.equal(again[0][2], harness.run(_observe_global_state, world_size=2)[0][2])


def test_objects_left_by_a_task_are_gone_before_the_next(harness):
    harness.run(_leave_garbage_cycle_in_old_generation, world_size=2)
    assert harness.run(_count_leftovers, world_size=2) == [0, 0]


def test_same_case_twice_is_bit_identical(harness):
    a = harness.run(_tiny_training, 3, world_size=2)
    b = harness.run(_tiny_training, 3, world_size=2)
    for rank in range(2):
        assert all(torch.equal(x, y) for x, y in zip(a[rank][0], b[rank][0]))
        assert torch.equal(a[rank][1], b[rank][1])
    assert all(torch.equal(x, y) for x, y in zip(a[0][0], a[1][0]))  # data parallel: ranks agree


def test_isolation_mode_gives_the_same_results_as_the_pool(harness):
    pooled = harness.run(_tiny_training, 2, world_size=2)
    with Harness(isolate=True) as isolating:
        isolated = isolating.run(_tiny_training, 2, world_size=2)
        pids1 = [o["pid"] for o in isolating.run(_identity, "i", world_size=2)]
        pids2 = [o["pid"] for o in isolating.run(_identity, "i", world_size=2)]
        assert not isolating.pools, "isolation mode keeps no pool"
    for rank in range(2):
        assert all(torch.equal(x, y) for x, y in zip(pooled[rank][0], isolated[rank][0]))
    assert set(pids1).isdisjoint(pids2), "isolation mode must spawn fresh ranks for every case"


# ---------------------------------------------------------------- faults

def test_exception_on_rank_1_only_fails_with_that_traceback(harness):
    with pytest.raises(RankRaised) as info:
        harness.run(_raise_on, 1, world_size=2)
    text = str(info.value)
    assert "rank(s) [1]" in text and "ValueError: boom on rank 1" in text and "_raise_on" in text
    assert "----- rank 0" not in text  # rank 0 was fine
    # and as data: the failing ranks, their errors, whole after pickling (a repro file reads these)
    for exc in (info.value, pickle.loads(pickle.dumps(info.value))):
        assert (exc.what, sorted(exc.ranks), exc.world_size) == ("raised", [1], 2)
        assert exc.error() == "ValueError: boom on rank 1" and str(exc) == text
    pids = [o["pid"] for o in harness.run(_identity, "after", world_size=2)]
    assert len(pids) == 2  # the pool still works


def test_exception_while_peer_waits_in_collective_fails_fast_with_both_stories(harness):
    start = time.monotonic()
    with pytest.raises(RankRaised) as info:
        harness.run(_raise_while_peer_waits, world_size=2, timeout=120)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "rank 1 gave up before the collective" in text
    assert "_peer_waits_in_all_reduce" in text  # rank 0's faulthandler stack
    assert elapsed < ranks_module.PEER_GRACE_S + 10, f"took {elapsed:.1f} s: should not wait for the task timeout"
    assert [o["rank"] for o in harness.run(_identity, "after", world_size=2)] == [0, 1]


def test_segfaulting_rank_fails_with_its_stack_and_pool_is_rebuilt(harness):
    before = [o["pid"] for o in harness.run(_identity, "before", world_size=2)]
    with pytest.raises(RankDied) as info:
        harness.run(_segfault_on, 1, world_size=2, timeout=60)
    text = str(info.value)
    assert "SIGSEGV" in text and "Segmentation fault" in text and "_segfault_on" in text
    after = [o["pid"] for o in harness.run(_identity, "after", world_size=2)]
    assert set(before).isdisjoint(after)
    for pid in before:  # the old ranks are gone, not orphaned
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)


def test_rank_that_exits_fails_with_its_exit_code(harness):
    with pytest.raises(RankDied) as info:
        harness.run(_exit_on, 0, 7, world_size=2, timeout=60)
    assert "exit code 7" in str(info.value)
    assert [o["rank"] for o in harness.run(_identity, "after", world_size=2)] == [0, 1]


def test_hang_in_mismatched_collective_fails_within_timeout_and_next_case_passes(harness):
    start = time.monotonic()
    with pytest.raises(RankHung) as info:
        harness.run(_mismatched_collective, world_size=2, timeout=4)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "hung (no answer within 4 s)" in text and "rank(s) [0]" in text
    assert "_rank0_stuck_in_all_reduce" in text  # where it hung, from faulthandler
    assert elapsed < 4 + 10
    assert [o["rank"] for o in harness.run(_identity, "after", world_size=2)] == [0, 1]


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


# ---------------------------------------------------------------- bad input

def _local_closure_maker():
    def body():
        return 1
    return body


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
    ({"world_size": 2, "device": "tpu"}, "device must be one of"),
    ({"world_size": 2, "backend": "mpi"}, "backend must be 'gloo' or 'nccl'"),
    ({"world_size": 2, "backend": "nccl", "device": "cpu"}, "backend 'nccl' needs device='cuda'"),
])
def test_bad_configuration_is_a_clear_error(harness, kwargs, message):
    with pytest.raises(ValueError, match=message):
        harness.run(_identity, "x", **kwargs)


def test_unpicklable_body_is_a_clear_error_not_a_hang(harness):
    with pytest.raises(TypeError, match="must be picklable"):
        harness.run(_local_closure_maker(), world_size=2)


def test_missing_cuda_or_gpus_is_a_skip_with_a_reason():
    reason = missing_requirement(2, "cuda")
    if not torch.cuda.is_available():
        assert reason.startswith("needs CUDA")
    elif torch.cuda.device_count() < 2:
        assert "needs 2 GPU(s)" in reason
    else:
        assert reason is None
    assert missing_requirement(2, "cpu") is None


# ---------------------------------------------------------------- whole sessions (child pytest)

def _env(token, out_dir, **extra):
    return dict(clean_env(), HARNESS_LEAK_TOKEN=token, CASE_OUT_DIR=str(out_dir), **extra)


def _processes_with(token):
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or _is_zombie(int(pid)):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"HARNESS_LEAK_TOKEN={token}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _wait_until_gone(token, seconds):
    deadline = time.monotonic() + seconds
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _processes_with(token)


def test_no_process_outlives_a_pytest_session(tmp_path):
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(SESSIONS, "case_pool.py")],
                          cwd=ROOT, env=_env(token, tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rank_pids = {int(p) for f in tmp_path.iterdir() for p in f.read_text().split()[2:]}
    assert len(rank_pids) == 2, "all four tests should have shared one pool"
    assert _wait_until_gone(token, 5) == []


def test_no_process_outlives_a_killed_pytest(tmp_path):
    token = uuid.uuid4().hex
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              os.path.join(SESSIONS, "case_pool.py")],
                             cwd=ROOT, env=_env(token, tmp_path, CASE_SLEEP_S="60"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_processes_with(token)) < 3 and time.monotonic() < deadline:  # pytest + 2 ranks
            time.sleep(0.2)
        assert len(_processes_with(token)) >= 3, "the child session never started its ranks"
        time.sleep(1.0)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert _wait_until_gone(token, 10) == []
    finally:
        if child.poll() is None:
            child.kill()


def test_two_xdist_workers_run_pools_at_once(tmp_path):
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "load", os.path.join(SESSIONS, "case_pool.py")],
                          cwd=ROOT, env=_env(token, tmp_path, CASE_SLEEP_S="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [f.read_text().split() for f in tmp_path.iterdir()]
    workers = {row[0] for row in rows}
    assert workers == {"gw0", "gw1"}, rows
    pools = {tuple(row[2:]) for row in rows}
    assert len(pools) == 2, "each worker should have its own pool of two ranks"
    assert _wait_until_gone(token, 5) == []


def test_torchrun_mode_runs_bodies_on_launcher_ranks(tmp_path):
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-rs", os.path.join(SESSIONS, "case_torchrun.py")],
                          cwd=ROOT, env=_env(token, tmp_path, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("1 passed, 1 skipped") == 2, out  # each launcher rank ran the session
    assert "needs world_size 3; torchrun launched 2 ranks" in out


# ---------------------------------------------------------------- the CUDA context budget

FAKE_GPU = 97  # slot files only: no CUDA needed to check the bookkeeping


def test_context_slots_are_taken_all_or_none_within_the_budget(tmp_path):
    with Harness(contexts=3, lock_dir=str(tmp_path)) as own:
        two = own.take_context_slots({FAKE_GPU: 2})
        assert len(two) == 2
        assert own.take_context_slots({FAKE_GPU: 2}) is None, "only 1 of 3 slots is left"
        one = own.take_context_slots({FAKE_GPU: 1})
        assert len(one) == 1, "the refused take of 2 must not keep the slot it found"
        for f in two:
            f.close()
        assert len(own.take_context_slots({FAKE_GPU: 2})) == 2


class _IdlePool:
    """Stands for an idle GPU pool of a harness: holds context slots on one GPU; shutdown releases them."""

    def __init__(self, harness, gpu, seconds_to_stop=0.0):
        self.slots, self.slot_gpus, self.seconds_to_stop = harness.take_context_slots({gpu: 1}), {gpu}, seconds_to_stop
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
        held = own.take_context_slots({FAKE_GPU: 2})  # another worker's pool
        elsewhere = own.pools["elsewhere"] = _IdlePool(own, FAKE_GPU + 1, seconds_to_stop=30)
        t0 = time.monotonic()
        try:
            with pytest.raises(RankFailure, match=r"could not get CUDA contexts for 1 rank\(s\) on GPU\(s\) "
                               r"\{97: 1\} within 0.5 s: every slot of the per-GPU budget \{97: 2\} is held"):
                own.context_slots({FAKE_GPU: 1})
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
        got = own.context_slots({FAKE_GPU: 1})
        assert len(got) == 1 and "mine" not in own.pools, "the idle pool holding the slot must be retired"
        assert mine.stopped_within is not None and mine.stopped_within <= 2.0, \
            f"retiring was given {mine.stopped_within} s: the bound must cover it"
        assert time.monotonic() - t0 < 2.0 + 5


def test_run_on_ranks_uses_the_session_harness_built_from_the_options(request):
    import conftest

    harness, _ = request.config.stash[conftest.HARNESS]
    assert session() is harness
    assert (harness.isolate, harness.timeout) == (request.config.getoption("--isolate-ranks"),
                                                  request.config.getoption("--rank-timeout"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU): CUDA contexts are what is budgeted")
def test_workers_pools_share_a_small_context_budget(tmp_path):
    """Two workers want 2 x (4 + 2 + 1) contexts under a budget of 5: they retire idle pools and take
    turns instead of running the GPU out of memory or waiting forever."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           os.path.join(SESSIONS, "case_gpu_budget.py")],
                          cwd=ROOT, env=_env(uuid.uuid4().hex, tmp_path, FSDP_AMP_GPU_CONTEXTS="5",
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
