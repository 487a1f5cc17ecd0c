"""Run one picklable function on N ranks and return every rank's result: the API.

    results = run_on_ranks(body, arg, world_size=2)        # gloo, CPU tensors
    results = run_on_ranks(body, world_size=2, device="cuda-shared")  # gloo, both ranks on GPU 0
    results = run_on_ranks(body, world_size=2, device="cuda")         # NCCL, one GPU per rank

Three engines, one API:
- pool (default): ranks are spawned once per (world_size, backend, device) per pytest/xdist
  worker (where there is a GPU, CPU tasks run in its gloo ranks: pool_key), keep their process
  group, and run task after task (pool.py, and rank_process.py inside each rank). A rank that
  raises, dies or hangs fails the test with every rank's traceback or faulthandler stack, and the
  pool is torn down and rebuilt.
- isolation (`--isolate-ranks`): the same pool, spawned for one task and stopped after it.
- torchrun: when RANK/WORLD_SIZE are set, the body runs right here on the launcher's ranks (torchrun.py).

Every rank of either mode runs its task with the same runner (task.run_task). GPU pools share the GPUs
with the other xdist workers under a budget of CUDA contexts (budget.py). This module holds the settings
and their validation, the Harness that owns a session's pools, and the installed session harness. It
imports only the standard library: fsdp_amp_suite/options.py reads DEFAULT_TIMEOUT_S before torch is imported.
"""
from __future__ import annotations

import atexit
import collections
import os
import tempfile
import time
import weakref

from fsdp_amp_suite.harness import copies, task
from fsdp_amp_suite.harness.budget import GpuBudget, profile, worker_gpus
from fsdp_amp_suite.harness.pool import STARTUP_TIMEOUT_S, RankPool, stop_fork_server
from fsdp_amp_suite.harness.torchrun import run_under_torchrun, torchrun_world_size

DEFAULT_TIMEOUT_S = 120.0
DEVICES = ("cpu", "cuda", "cuda-shared")


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def missing_requirement(world_size: int, device: str = "cpu", backend: str | None = None) -> str | None:
    """Why this configuration cannot run here (a skip reason), or None."""
    import torch

    backend = backend or default_backend(device)
    ts = torchrun_world_size()
    if ts is not None and ts != world_size:
        return f"needs world_size {world_size}; torchrun launched {ts} ranks"
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"needs CUDA (device={device!r}); torch {torch.__version__} sees no GPU"
    need = world_size if device == "cuda" else 1
    if ts is not None and device == "cuda":  # torchrun: the ranks of this node share its GPUs
        need = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    have = torch.cuda.device_count()
    if have < need:
        return (f"needs {need} GPU(s) for {world_size} rank(s) on device={device!r} ({backend}, one GPU "
                f"per rank); {have} visible")
    return None


def pool_key(world_size: int, backend: str, device: str, cuda: bool) -> tuple[int, str, str]:
    """The pool (world_size, backend, device) a task runs in; cuda: this machine has a GPU.

    Where there is a GPU, a CPU task runs in the gloo ranks of its world size on the GPU (cuda-shared), with
    rank_device() the CPU: ranks of a CPU pool there would make CUDA contexts anyway (fairscale and the offload
    paths touch CUDA where it is available), as many again as the GPU pools' and outside their budget, and a
    GPU holds only about a hundred (budget.py CONTEXT_LIMIT)."""
    if device == "cpu" and cuda:
        return world_size, "gloo", "cuda-shared"
    return world_size, backend, device


def _validate(world_size, device, backend):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be an int >= 1, got {world_size!r}")
    if device not in DEVICES:
        raise ValueError(f"run_on_ranks: device must be one of {DEVICES}, got {device!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_on_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"run_on_ranks: backend 'nccl' needs device='cuda' (one GPU per rank), got {device!r}")


def run_on_ranks(fn, *args, **kwargs) -> list:
    """Run fn(*args, **kwargs) on every rank of the session's harness (Harness.run says how)."""
    return session().run(fn, *args, **kwargs)


class Harness:
    """The ranks of one pytest session (or one script): its settings, its pools and its lock files.

    The root conftest builds the session's from --isolate-ranks / --rank-timeout and installs it
    (`install`); run_on_ranks runs on the installed one. A test that needs other settings, pools of its
    own or lock files of its own builds its own Harness and calls its run(): nothing it does reaches
    the pools or the settings that the other tests of its worker rely on.

        isolate          spawn fresh ranks for every task (and stop them after it)
        timeout          seconds a task may run before its ranks' stacks are taken and it fails
        startup_timeout  seconds a pool may take to start, waiting for CUDA context slots included
        contexts         CUDA contexts allowed per GPU (None: context_budget(gpu), shared by every worker)
        lock_dir         where the GPU locks and context slot files live (shared by the workers that use it)

    `pools` maps (world_size, backend, device) to the live RankPool; `gpu_budget` is its GpuBudget.
    """

    def __init__(self, isolate: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
                 startup_timeout: float = STARTUP_TIMEOUT_S, contexts: int | None = None, lock_dir: str | None = None):
        for name, value in (("timeout", timeout), ("startup_timeout", startup_timeout)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"Harness: {name} must be a positive number of seconds, got {value!r}")
        self.isolate, self.timeout, self.startup_timeout = bool(isolate), float(timeout), float(startup_timeout)
        self.gpu_budget = GpuBudget(lock_dir or tempfile.gettempdir(), contexts, self.startup_timeout)
        self.pools: dict[tuple[int, str, str], RankPool] = {}
        _LIVE.add(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def run(self, fn, *args, world_size: int = 2, device: str = "cpu", backend: str | None = None,
            timeout: float | None = None, seed: int = 0, exclusive_gpu: bool = False, memory_heavy: bool = False,
            **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return [result of rank 0, result of rank 1, ...].

        GPU tasks of different xdist workers share a GPU; exclusive_gpu=True waits until the task is
        alone on its GPUs (for a check that other processes' GPU work could hide; the busy-GPU race
        checks need no such thing: other work only makes the GPU busier). memory_heavy=True: the task needs a
        large share of a GPU's memory, and takes turns with the other such tasks (ordinary ones go on beside it).

        Skips the calling test (pytest.skip) when the configuration needs hardware that is missing, or
        when the body called pytest.skip on every rank.
        Raises RankRaised / RankDied / RankHung with every rank's traceback or stack.
        """
        import pytest

        backend = backend or default_backend(device)
        _validate(world_size, device, backend)
        reason = missing_requirement(world_size, device, backend)
        if reason:
            pytest.skip(reason)
        timeout = self.timeout if timeout is None else float(timeout)
        if copies.requested():  # a race-free run (copies.py): the body's copies are made blocking in its ranks too
            fn, args, kwargs = copies.call_with_blocking_copies, (fn, args, kwargs), {}
        try:
            payload = task.dumps((fn, args, kwargs))
        except Exception as exc:  # lambdas, closures, local classes, open handles ...
            raise TypeError(f"run_on_ranks: {getattr(fn, '__qualname__', fn)!r} and its arguments must be "
                            f"picklable (a module-level function, no lambdas or closures): {exc}") from exc
        if torchrun_world_size() is not None:
            return run_under_torchrun(payload, device, backend, seed)
        import torch

        key = pool_key(world_size, backend, device, torch.cuda.is_available())
        on_cpu = device == "cpu"
        exclusive_gpu = exclusive_gpu or os.environ.get("FSDP_AMP_EXCLUSIVE_GPUS") == "1"  # to measure the gain
        self.gpu_budget.yield_idle_contexts(self.pools, keep=key)
        with self.gpu_budget.task_locks(world_size, device, exclusive_gpu, memory_heavy):
            if self.isolate:
                pool = self._new_pool(*key)
                try:
                    return pool.run(payload, timeout, seed, on_cpu)
                finally:
                    pool.shutdown()
            pool = self.pools.get(key)
            if pool is None or not pool.healthy:
                self.pools.pop(key, None)
                pool = self.pools[key] = self._new_pool(*key)
            return pool.run(payload, timeout, seed, on_cpu)

    def shutdown(self) -> None:
        """Stop every pool of this harness (its ranks exit, its context slots are released)."""
        for key in list(self.pools):
            self.pools.pop(key).shutdown()

    def _new_pool(self, world_size: int, backend: str, device: str) -> RankPool:
        gpus = worker_gpus() if device != "cpu" else []
        wanted = collections.Counter(gpus[:world_size] if device == "cuda" else gpus[:1] * world_size)
        slots = self.gpu_budget.wait_for_slots(wanted, self.pools) if wanted else []
        started = time.monotonic()
        pool = RankPool(world_size, backend, device, gpus, slots, self.startup_timeout,
                        {g: self.gpu_budget.budget(g) for g in wanted})
        profile("pool_start", time.monotonic() - started, world_size=world_size, device=device)
        return pool


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every harness of this process, stopped at exit
_installed: Harness | None = None


def install(harness: Harness | None) -> Harness | None:
    """Make `harness` the one run_on_ranks uses (the root conftest does, once per session); returns the one before."""
    global _installed
    previous, _installed = _installed, harness
    return previous


def session() -> Harness:
    """The installed harness; outside pytest (a repro file or a benchmark run as a program), a default one."""
    global _installed
    if _installed is None:
        _installed = Harness()
    return _installed


def shutdown_pools() -> None:
    """Stop every pool of every harness of this process (at exit, and where a script ends)."""
    for harness in list(_LIVE):
        harness.shutdown()


def _at_exit() -> None:
    shutdown_pools()
    stop_fork_server()


atexit.register(_at_exit)
