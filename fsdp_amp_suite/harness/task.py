"""One task on one rank: the messages between the parent and its ranks, and the ONE task runner.

Both modes run a task the same way: a pool rank (rank_process.py) and a torchrun rank (torchrun.py) call
run_task, which turns whatever the body did into an Outcome, never an exception. That includes pytest's
outcomes (pytest.skip raises Skipped, a BaseException), so one rank's skip is reported to the others instead
of leaving them waiting for it in a collective. The messages are plain picklable records: they cross
process boundaries (multiprocessing queues, all_gather_object).
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import random
import sys
import traceback
import types

from fsdp_amp_suite import paths
from fsdp_amp_suite.harness.failures import RankRaised

def dumps(obj) -> bytes:
    """pickle.dumps, but a function or class of the suite's test modules travels by its file: pytest imports those
    by path (--import-mode=importlib), and a rank cannot import them by name, where `tests` may be a consumer's
    package. The rank loads the file as pytest did (paths.load_file)."""
    out = io.BytesIO()
    _ByFile(out).dump(obj)
    return out.getvalue()


class _ByFile(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and "<locals>" not in obj.__qualname__:
            file = getattr(sys.modules.get(getattr(obj, "__module__", None) or ""), "__file__", None)
            if file and os.path.realpath(file).startswith(_TESTS):  # the checkout's, by whatever path pytest took
                return _from_file, (file, obj.__module__, obj.__qualname__)
        return NotImplemented  # pickled as pickle does it (a local function fails there, with pickle's error)


_TESTS = os.path.realpath(paths.TESTS) + os.sep


def _from_file(file: str, module: str, qualname: str):
    found = paths.load_file(file, module)
    for name in qualname.split("."):
        found = getattr(found, name)
    return found


_device = None  # inside a rank: the torch.device its tensors belong on


def rank_device():
    """Inside a rank: the device this rank's tensors belong on (cpu, or its cuda:k)."""
    if _device is None:
        raise RuntimeError("rank_device() is only defined inside a body run by run_on_ranks")
    return _device


def set_rank_device(device) -> None:
    global _device
    _device = device


# Process groups and device meshes, made once per rank process and kept for its life. Making one is a
# collective over WORLD that every rank must call in the same order, and slow enough (a store barrier, new
# connections) that making them afresh for every check could outlast a task's time bound on a loaded machine.
_GROUPS: dict = {}  # ranks -> their process group
_MESHES: dict = {}  # (device type, shape, dim names) -> the DeviceMesh


def cached_group(ranks):
    """The process group of these ranks (call it on every rank, for every group, in the same order)."""
    import torch.distributed as dist

    if tuple(ranks) not in _GROUPS:
        _GROUPS[tuple(ranks)] = dist.new_group(list(ranks))
    return _GROUPS[tuple(ranks)]


def cached_mesh(device_type: str, shape: tuple, names: tuple):
    """The DeviceMesh over the whole world with this shape and these dim names (call it on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]


@dataclasses.dataclass(frozen=True)
class Task:
    """Parent -> each rank: run pickle.loads(payload) = (fn, args, kwargs) after resetting every RNG to `seed`;
    on_cpu: its tensors belong on the CPU (rank_device()), whatever GPU the rank holds (ranks.pool_key)."""
    id: int
    payload: bytes
    seed: int = 0
    on_cpu: bool = False


@dataclasses.dataclass(frozen=True)
class Stop:
    """Parent -> a pool rank: leave the task loop and exit."""


@dataclasses.dataclass(frozen=True)
class Ready:
    """A pool rank -> the parent, once: its process group is up (error None), or why it could not start."""
    rank: int
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A rank -> the parent: how task `task` went on `rank`.

        value      the result, copied to the host and pickled (None unless it returned)
        error      the traceback, when it raised (pytest.skip and pytest.fail included)
        skipped    pytest.skip's reason, when that is what it raised
        sequences  group_sequences() once the body ended: the collectives it issued, per group
    """
    task: int
    rank: int
    value: bytes | None = None
    error: str | None = None
    skipped: str | None = None
    sequences: dict | None = None


@dataclasses.dataclass(frozen=True)
class Issued:
    """A pool rank -> the parent, while task `task` runs: the collectives its body has issued so far
    (group_sequences()), sent when they change. The parent compares them with what the ranks that ended the
    task issued (pool.unmatched_collective)."""
    task: int
    rank: int
    sequences: dict


def group_sequences() -> dict:
    """{group name: (collectives issued on it, its global ranks)} for every process group this rank is in:
    c10d's per-group sequence number, which a collective increments when it is issued. {} where this torch
    does not say (the parent then waits for the task's timeout)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return {}
        return {name: (pg._get_sequence_number_for_group(), tuple(dist.get_process_group_ranks(pg)))
                for pg, name in list(c10d._world.pg_names.items())}
    except Exception:  # noqa: BLE001 - private API: without it, hangs are only found by the timeout
        return {}


def run_task(task: Task, rank: int) -> Outcome:
    """Run one task on this rank; every way it can end is an Outcome.

    BaseException, not Exception: pytest.skip / pytest.fail raise BaseExceptions, and one rank that let one
    escape would leave its peers waiting for its answer. The result is pickled here, so that a result that
    cannot be pickled is this task's error too, not a lost message.
    """
    try:
        reset_state(task.seed)
        fn, args, kwargs = pickle.loads(task.payload)
        value = fn(*args, **kwargs)
        _synchronize()
        return Outcome(task.id, rank, value=pickle.dumps(to_host(value)), sequences=group_sequences())
    except BaseException as exc:  # noqa: BLE001 - everything is reported, pytest's outcomes included
        return Outcome(task.id, rank, error=traceback.format_exc(), skipped=_skip_reason(exc),
                       sequences=group_sequences())


def values(outcomes: list[Outcome]) -> list:
    """Every rank's result in rank order. A skip on every rank skips the calling test; anything else that is
    not a result on every rank raises RankRaised with each failing rank's traceback."""
    failed = {o.rank: o.error for o in outcomes if o.error is not None}
    if not failed:
        return [pickle.loads(o.value) for o in sorted(outcomes, key=lambda o: o.rank)]
    if all(o.skipped is not None for o in outcomes):
        import pytest

        pytest.skip(outcomes[0].skipped)
    raise RankRaised("raised", failed, {}, len(outcomes))


def _skip_reason(exc: BaseException) -> str | None:
    pytest = sys.modules.get("pytest")  # a body can only have called pytest.skip if pytest is imported
    if pytest is not None and isinstance(exc, pytest.skip.Exception):
        return exc.msg
    return None


def _synchronize() -> None:
    """An async CUDA error belongs to this task, not the next."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def reset_state(seed: int) -> None:
    """Every task starts from the same global state: grad mode on, float32 default, seeds reset."""
    import torch

    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)


def to_host(obj):
    """obj with its tensors on the CPU (in lists, tuples, dicts and dataclasses too): the parent must never
    build a CUDA context to unpickle a result."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a task's result record (e.g. CellRun)
        return dataclasses.replace(obj, **{f.name: to_host(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    return obj
