"""The rank harness runs a task on every rank and reports every way it can fail: results in rank order,
a pool reused and cleaned between tasks, isolation, raising / dying / hanging / skipping ranks, bad input,
and the one task runner that both modes share.

Every test here runs on a Harness of its own (the `harness` fixture, or one built for the test), never on
the session's: crashing, hanging and isolating ranks and short timeouts must not reach the pools and
settings that the other tests of this worker rely on. Whole child sessions: test_harness_sessions.py;
GPUs and the CUDA context budget: test_harness_gpu.py."""
import ast
import ctypes
import os
import pathlib
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_amp_suite.harness import Harness, RankDied, RankHung, RankRaised, missing_requirement
from fsdp_amp_suite.child_run import ROOT as REPO
from fsdp_amp_suite.harness.copies import blocking_copies
from fsdp_amp_suite.harness.ranks import pool_key
from fsdp_amp_suite.harness.pool import PEER_GRACE_S, unmatched_collective
from fsdp_amp_suite.harness.task import Task, run_task
from fsdp_amp_suite.sessions.children import is_zombie

pytestmark = pytest.mark.harness

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


def _rank0_waits_for_async_all_reduce():
    if dist.get_rank() == 0:
        _rank0_waits_in_its_own_code(dist.all_reduce(torch.ones(1), async_op=True))
    return dist.get_rank()


def _rank0_waits_in_its_own_code(work):
    while not work.is_completed():
        time.sleep(0.01)


def _rank0_sleeps():
    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def _slow_peer(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


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


def _environment(name):
    return os.environ.get(name), os.getcwd()


def _skip_on(rank):
    if dist.get_rank() == rank:
        pytest.skip(f"rank {rank} has nothing to check")
    return dist.get_rank()


def _skip_everywhere():
    pytest.skip("no rank has anything to check")


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
    for grad_enabled, dtype, _rank in harness.run(_observe_global_state, world_size=2):
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


@pytest.mark.parametrize("world_size, backend, device, cuda, key", [
    (2, "gloo", "cpu", False, (2, "gloo", "cpu")),
    (3, "gloo", "cpu", True, (3, "gloo", "cuda-shared")),  # the GPU's gloo ranks, rank_device() the CPU
    (2, "gloo", "cuda-shared", True, (2, "gloo", "cuda-shared")),
    (2, "nccl", "cuda", True, (2, "nccl", "cuda")),  # NCCL ranks cannot reduce CPU tensors
    (1, "nccl", "cuda", True, (1, "nccl", "cuda")),
])
def test_a_task_runs_in_the_pool_of_its_world_size_backend_and_device(world_size, backend, device, cuda, key):
    assert pool_key(world_size, backend, device, cuda) == key


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


def test_a_new_pool_takes_the_environment_and_directory_of_its_start(harness, monkeypatch, tmp_path):
    """The ranks fork from a server started with an older environment: they must not see that one."""
    harness.run(_identity, "x", world_size=1)  # the fork server is up from here on
    monkeypatch.setenv("FSDP_AMP_CHECK_ENV", "set after the server started")
    monkeypatch.chdir(tmp_path)
    with Harness() as fresh:
        assert fresh.run(_environment, "FSDP_AMP_CHECK_ENV", world_size=2) == \
            [("set after the server started", str(tmp_path))] * 2


# ---------------------------------------------------------------- faults

def _process_name():
    with open("/proc/self/comm") as f:
        return f.read().strip()


def test_a_rank_names_its_process_by_its_pool(harness):
    """ps and benchmarks/gpu_processes.py tell a pool rank from the other processes by this name (15 bytes)."""
    device = pool_key(2, "gloo", "cpu", torch.cuda.is_available())[2]
    assert harness.run(_process_name, world_size=2) == [f"rank{r}of2:{device}"[:15] for r in range(2)]


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


def _timed_failure(harness, failure, body, timeout):
    """The text of the `failure` that running `body` on 2 ranks raises, and how long that took."""
    start = time.monotonic()
    with pytest.raises(failure) as info:
        harness.run(body, world_size=2, timeout=timeout)
    return str(info.value), time.monotonic() - start


def test_exception_while_peer_waits_in_collective_fails_fast_with_both_stories(harness):
    text, elapsed = _timed_failure(harness, RankRaised, _raise_while_peer_waits, timeout=120)
    assert "rank 1 gave up before the collective" in text
    assert "_peer_waits_in_all_reduce" in text  # rank 0's faulthandler stack
    assert elapsed < PEER_GRACE_S + 10, f"took {elapsed:.1f} s: should not wait for the task timeout"
    assert [o["rank"] for o in harness.run(_identity, "after", world_size=2)] == [0, 1]


def test_segfaulting_rank_fails_with_its_stack_and_pool_is_rebuilt(harness):
    before = [o["pid"] for o in harness.run(_identity, "before", world_size=2)]
    with pytest.raises(RankDied) as info:
        harness.run(_segfault_on, 1, world_size=2, timeout=60)
    text = str(info.value)
    assert "SIGSEGV" in text and "Segmentation fault" in text and "_segfault_on" in text
    (died,) = info.value.deaths  # for the report: how, where, and whose code (ctypes: not torch's)
    assert (died.rank, died.how, died.owner) == (1, "SIGSEGV", "other") and died.frame.endswith(" string_at"), died
    after = [o["pid"] for o in harness.run(_identity, "after", world_size=2)]
    assert set(before).isdisjoint(after)
    for pid in before:  # the old ranks are gone, not orphaned
        assert not os.path.exists(f"/proc/{pid}") or is_zombie(pid)


def test_rank_that_exits_fails_with_its_exit_code(harness):
    with pytest.raises(RankDied) as info:
        harness.run(_exit_on, 0, 7, world_size=2, timeout=60)
    assert "exit code 7" in str(info.value)
    assert [o["rank"] for o in harness.run(_identity, "after", world_size=2)] == [0, 1]


def test_hang_in_mismatched_collective_fails_at_once_and_next_case_passes(harness):
    """Rank 1 ended the task without the collective rank 0 waits in: that is a hang long before the timeout."""
    text, elapsed = _timed_failure(harness, RankHung, _mismatched_collective, timeout=60)
    assert "rank(s) [0] of world_size 2 hung in a collective that no other rank issued: rank 0 waits for " \
           "collective #" in text and "which rank(s) [1] ended the task without" in text
    assert "_rank0_stuck_in_all_reduce" in text  # where it hung, from faulthandler
    assert elapsed < 30, f"took {elapsed:.1f} s: waited for the timeout"
    assert [o["rank"] for o in harness.run(_identity, "after", world_size=2)] == [0, 1]


def test_an_unmatched_collective_waited_for_outside_torch_distributed_fails_at_once(harness):
    """Libraries wait for async work in their own code (fairscale's scaler: work.wait()): the issued collective
    is what counts, not where the body waits."""
    text, elapsed = _timed_failure(harness, RankHung, _rank0_waits_for_async_all_reduce, timeout=60)
    assert "rank 0 waits for collective #" in text and "_rank0_waits_in_its_own_code" in text
    assert elapsed < 30, f"took {elapsed:.1f} s: waited for the timeout"


def test_hang_outside_a_collective_fails_within_timeout_and_next_case_passes(harness):
    text, elapsed = _timed_failure(harness, RankHung, _rank0_sleeps, timeout=4)
    assert "hung (no answer within 4 s)" in text and "rank(s) [0]" in text
    assert "_rank0_sleeps" in text  # where it hung, from faulthandler
    assert elapsed < 4 + 10
    assert [o["rank"] for o in harness.run(_identity, "after", world_size=2)] == [0, 1]


def test_a_rank_waiting_for_a_slow_peer_in_a_collective_is_not_a_hang(harness):
    """Rank 0 sits in the all_reduce while rank 1 is still busy: rank 1 has not ended the task, so it may yet
    join (it does), and the task passes."""
    assert harness.run(_slow_peer, 1.5, world_size=2, timeout=60) == [2.0, 2.0]


@pytest.mark.parametrize("waiting, finished, concluded", [
    ({"0": (5, (0, 1))}, {1: {"0": (4, (0, 1))}}, True),  # rank 1 ended one collective short
    ({"0": (5, (0, 1))}, {1: {"0": (5, (0, 1))}}, False),  # it issued this one too: it may still be running
    ({"0": (5, (0, 1))}, {}, False),  # rank 1 has not ended the task
    ({"0": (5, (0, 1))}, {1: None}, False),  # rank 1 said nothing of its groups
    ({"0": (5, (0, 1))}, {1: {}}, False),
    ({"3": (2, (0, 1))}, {1: {"3": (1, (1, 2))}}, False),  # the same name for another group
    ({"0": (5, (0, 1, 2))}, {1: {"0": (4, (0, 1, 2))}}, False),  # rank 2 may still join
    ({"0": (5, (0, 1, 2))}, {1: {"0": (4, (0, 1, 2))}, 2: {"0": (4, (0, 1, 2))}}, True),
    ({"2": (1, (0,))}, {1: {"0": (4, (0, 1))}}, False),  # a group of rank 0 alone waits for nobody
    ({"0": (4, (0, 1)), "1": (2, (0, 1))}, {1: {"0": (4, (0, 1)), "1": (1, (0, 1))}}, True),  # a subgroup's
])
def test_a_collective_is_unmatched_only_once_every_other_member_ended_without_it(waiting, finished, concluded):
    said = unmatched_collective(0, waiting, finished)
    assert (said is not None) is concluded, said
# ---------------------------------------------------------------- pytest.skip on the ranks, and the one task runner

def test_a_skip_on_one_rank_fails_with_its_reason(harness):
    with pytest.raises(RankRaised) as info:
        harness.run(_skip_on, 1, world_size=2)
    assert "rank(s) [1]" in str(info.value) and "Skipped: rank 1 has nothing to check" in str(info.value)
    assert harness.run(_skip_on, 5, world_size=2) == [0, 1]  # the pool still works


def test_a_skip_on_every_rank_skips_the_test(harness):
    with pytest.raises(pytest.skip.Exception, match="no rank has anything to check"):
        harness.run(_skip_everywhere, world_size=2)


def _returns_a_closure():
    return lambda: None


@pytest.mark.parametrize("body, args, skipped, error", [
    (_skip_everywhere, (), "no rank has anything to check", "Skipped: no rank has anything to check"),
    (_raise_on, (0,), None, "ValueError: boom on rank 0"),
    (_returns_a_closure, (), None, "pickle"),  # the result itself cannot travel to the parent
])
def test_the_task_runner_turns_every_ending_into_an_outcome(monkeypatch, body, args, skipped, error):
    """run_task (the one runner of both modes) returns a record instead of raising, pytest's skip included:
    a torchrun rank that let it escape would leave the other ranks waiting for it in all_gather_object."""
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    try:
        outcome = run_task(Task(7, pickle.dumps((body, args, {})), seed=0), rank=0)
    except BaseException as exc:  # noqa: BLE001 - a skip escaping is the failure this test is for
        pytest.fail(f"run_task let {type(exc).__name__} escape: {exc}")
    assert (outcome.task, outcome.rank, outcome.value, outcome.skipped) == (7, 0, None, skipped)
    assert error in outcome.error.strip().splitlines()[-1]  # the exception's own line


def test_the_task_runner_returns_the_result_on_the_host():
    outcome = run_task(Task(0, pickle.dumps((torch.ones, (2,), {}))), rank=3)
    assert outcome.error is None and torch.equal(pickle.loads(outcome.value), torch.ones(2))


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


# ---------------------------------------------------------------- race-free runs (copies.py)

class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "non_blocking" in kwargs:
            self.seen.append(kwargs["non_blocking"])
        return func(*args, **kwargs)


def _copies_made():
    with _Recorder() as recorder:  # inside the task's own mode: what the body asked for
        torch.ones(2).to("cpu", non_blocking=True)
    blocking = any(type(m).__name__ == "BlockingCopies" for m in torch.overrides._get_current_function_mode_stack())
    return recorder.seen, blocking


def test_blocking_copies_make_every_non_blocking_copy_blocking_here_and_in_the_ranks(harness):
    with _Recorder() as recorder:  # outside blocking_copies' mode: what reaches torch
        with blocking_copies():
            torch.ones(2).to("cpu", non_blocking=True)
            torch.zeros(2).copy_(torch.ones(2), non_blocking=True)
            in_ranks = harness.run(_copies_made, world_size=2)
        torch.ones(2).to("cpu", non_blocking=True)  # after it: as asked
    assert recorder.seen == [False, False, True]
    assert in_ranks == [([True], True), ([True], True)]  # the body's own calls, under the task's blocking mode
    assert harness.run(_copies_made, world_size=2) == [([True], False), ([True], False)]  # a task without it


# ---------------------------------------------------------------- process groups live as long as their ranks

# Scripts that start processes of their own (no pool rank runs them), and the harness that keeps the groups.
OWN_PROCESSES = ("fsdp_amp_suite/harness/", "tests/meta/", "fsdp_amp_suite/repro/standalone/",
                 "fsdp_amp_suite/matrix/probe_fsdp2_cpu.py",
                 "fsdp_amp_suite/conformance/checkpoints/__main__.py")
GROUP_MAKERS = {"new_group", "destroy_process_group", "init_device_mesh", "DeviceMesh"}


def test_checks_make_process_groups_and_meshes_only_through_the_harness_cache():
    """A pool rank serves many checks for its life: a process group or mesh made per check is never freed (and where
    CUDA is there, torch makes even a 1-D full-world mesh of a gloo job a new group), so groups pile up in the rank.
    Checks make them through cached_group / cached_mesh, once per rank process; nobody destroys one."""
    found = []
    root = pathlib.Path(REPO)
    for path in sorted(root.glob("tests/**/*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(OWN_PROCESSES):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name in GROUP_MAKERS:
                    found.append(f"{rel}:{node.lineno} {name}(...)")
    assert not found, "make them with fsdp_amp_suite.harness cached_group / cached_mesh instead:\n" + "\n".join(found)
