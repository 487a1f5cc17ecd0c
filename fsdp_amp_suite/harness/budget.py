"""How the suite's xdist workers share the GPUs: which GPUs a worker uses, the locks a GPU task holds, and
the CUDA context budget.

Every rank of a GPU pool owns a CUDA context, and idle pools stay alive, so without a bound the contexts on
a GPU grow with xdist workers x pool sizes until it runs out of memory. Each GPU has a budget of context slots
shared by every worker (flock'ed slot files); a pool holds one per rank on that GPU for its life. A worker
waiting for slots touches a 'wanted' file, and the other workers retire their idle GPU pools when they see it.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import subprocess
import time

from fsdp_amp_suite.harness.failures import RankFailure

# one rank's CUDA context plus a task's working set: the GPU gate's peak GPU memory over the pool ranks holding
# contexts then (the memory of pytest workers and child runs included; the ranks' contexts without their stack
# reservation, release_cuda_stack), plus a quarter for headroom. More per context means fewer workers on a GPU
# and a slower gate; less risks running out of GPU memory.
CONTEXT_GIB = 1.0
# A GPU holds about 100 CUDA contexts at once, whatever memory is free: past that, making one fails with
# CUDA_ERROR_OUT_OF_MEMORY (benchmarks/context_count.py). The pools' budget leaves room under it for the contexts
# that no slot counts: a pytest process's own and, at times, a child run's, for each of the ten workers that the
# rest allows (gate_workers).
CONTEXT_LIMIT = 100
UNBUDGETED_CONTEXTS = 16
CU_LIMIT_STACK_SIZE = 0  # cuda.h CUlimit


def profile(event: str, seconds: float, **info) -> None:
    """Where a run's time goes (benchmarks/gpu.py): with FSDP_AMP_PROFILE_DIR set, one JSON line per
    pool start-up and per lock wait, in a file per xdist worker."""
    folder = os.environ.get("FSDP_AMP_PROFILE_DIR")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps(dict(event=event, seconds=round(seconds, 4), **info)) + "\n")


def worker_gpus() -> list[int]:
    """Every visible GPU, rotated so that xdist worker k starts at GPU k (spreads the load).

    Different workers may share a GPU: their ranks are separate process groups. Only the ranks of
    one NCCL group need distinct GPUs, which missing_requirement checks.
    """
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return [(index + g) % n for g in range(n)]


def visible_gpus() -> int:
    """The GPUs a CUDA process here may use, without importing torch or making a CUDA context (ci/gpu.sh sizes
    the gate with it before pytest starts; importing torch for that cost seconds): nvidia-smi's count, narrowed
    by CUDA_VISIBLE_DEVICES (narrowed_gpus); 0 where nvidia-smi does not answer."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return narrowed_gpus(len(out.split()), os.environ.get("CUDA_VISIBLE_DEVICES"))


def narrowed_gpus(present: int, visible: str | None) -> int:
    """How many of `present` GPUs CUDA_VISIBLE_DEVICES=`visible` leaves: unset, all; else its entries up to the
    first that names no GPU (CUDA ignores the rest: "-1" hides every GPU), indices or UUIDs."""
    if visible is None:
        return present
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or (entry.lstrip("-").isdigit() and not 0 <= int(entry) < present):
            break
        count += 1
    return min(count, present)


@functools.lru_cache(maxsize=None)
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_stack_bytes() -> int | None:
    """The per-thread stack size of this thread's current CUDA context (CU_LIMIT_STACK_SIZE); None where there is
    no CUDA driver or no current context."""
    libcuda, size = _libcuda(), ctypes.c_size_t()
    if libcuda is None or libcuda.cuCtxGetLimit(ctypes.byref(size), CU_LIMIT_STACK_SIZE) != 0:
        return None
    return size.value


def release_cuda_stack() -> bool:
    """Set the current CUDA context's per-thread stack size to 0, which frees the memory the driver reserves
    for it: 1 KiB by default for every thread the GPU can hold resident, about a quarter GiB per context on
    an H100, in every rank of every pool. No kernel goes without: the driver grows the stack for a launch
    that needs more (and keeps it grown, so the ranks call this after each task). True where there was a
    context to shrink."""
    if not cuda_stack_bytes():
        return False
    return _libcuda().cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(0)) == 0


def gpu_memory_mib(gpu: int, field: str) -> float:
    """One GPU's memory.<field> (total, used, ...) in MiB from nvidia-smi: no CUDA context is made for asking."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu=memory.{field}", "--format=csv,noheader,nounits", "-i",
                          str(gpu)], capture_output=True, text=True, timeout=30, check=True).stdout
    return float(out.split()[0])


@functools.lru_cache(maxsize=None)
def context_budget(gpu: int) -> int:
    """How many CUDA contexts the rank pools of this suite may hold on one GPU at once, across xdist workers:
    FSDP_AMP_GPU_CONTEXTS, else budget_for_memory of the GPU's memory (nvidia-smi; no CUDA context is made for
    asking), else 16."""
    if os.environ.get("FSDP_AMP_GPU_CONTEXTS"):
        return max(1, int(os.environ["FSDP_AMP_GPU_CONTEXTS"]))
    try:
        return budget_for_memory(gpu_memory_mib(gpu, "total") / 1024)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 16


def budget_for_memory(gib: float) -> int:
    """The pools' context budget on a GPU of `gib` GiB: one per CONTEXT_GIB, within the GPU's limit on contexts
    less those that no slot counts (CONTEXT_LIMIT - UNBUDGETED_CONTEXTS); at least 1."""
    return max(1, min(int(gib / CONTEXT_GIB), CONTEXT_LIMIT - UNBUDGETED_CONTEXTS))


# the contexts one xdist worker's pools hold at once on one GPU: NCCL world size 1, gloo world sizes 1, 2 and 4
# (CPU tasks run in the gloo ones: ranks.pool_key)
POOL_CONTEXTS = 1 + 1 + 2 + 4
CORES_PER_WORKER = 2  # a worker's ranks and its pytest process; more workers per core were slower on the gate


def gate_workers(cores: int, contexts: int) -> int:
    """The GPU gate's xdist workers (ci/gpu.sh): one per CORES_PER_WORKER cores, and no more than the GPU's context
    budget keeps alive without pools taking turns (contexts // POOL_CONTEXTS); at least 1."""
    if cores < 1 or contexts < 1:
        raise ValueError(f"gate_workers(cores={cores}, contexts={contexts}): both must be at least 1")
    return max(1, min(cores // CORES_PER_WORKER, contexts // POOL_CONTEXTS))


class GpuBudget:
    """One harness's side of the sharing: its lock files, its context budget, its wait for slots.

        lock_dir         where the GPU locks and context slot files live (shared by the workers that use it)
        contexts         CUDA contexts allowed per GPU (None: context_budget(gpu), shared by every worker)
        startup_timeout  seconds a wait for context slots may take, retiring idle pools included

    The pools it retires are the harness's: a dict {key: pool} passed in, each pool with `slots` (its
    open slot files), `slot_gpus` (the GPUs they are on) and shutdown(within=seconds).
    """

    def __init__(self, lock_dir: str, contexts: int | None, startup_timeout: float):
        self.lock_dir, self.contexts, self.startup_timeout = lock_dir, contexts, startup_timeout

    def lock_path(self, name: str) -> str:
        return os.path.join(self.lock_dir, f"fsdp-amp-suite-{name}.lock")

    def budget(self, gpu: int) -> int:
        return self.contexts if self.contexts is not None else context_budget(gpu)

    def take_slots(self, per_gpu: dict[int, int]) -> list | None:
        """Take per_gpu[g] free context slots on each GPU g, all or none (no hold-and-wait): the open,
        flock'ed slot files (closing one releases it), or None."""
        held = []
        for gpu, n in sorted(per_gpu.items()):
            got = 0
            for i in range(self.budget(gpu)):
                if got == n:
                    break
                f = open(self.lock_path(f"gpu{gpu}-context{i}"), "w")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    continue
                held.append(f)
                got += 1
            if got < n:
                for f in held:
                    f.close()
                return None
        return held

    def wait_for_slots(self, per_gpu: dict[int, int], pools: dict) -> list:
        """The context slots a new pool's ranks need (per_gpu: GPU -> ranks on it). While a GPU's budget is
        spent, the idle `pools` that hold slots on the GPUs wanted are retired (no others: retiring a CUDA
        pool costs seconds and frees nothing here); then the other workers are asked to retire theirs (the
        'wanted' file they look at before each task). The whole wait, retiring included, is bounded by
        startup_timeout; past it, the failure says what is held."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            held = self.take_slots(per_gpu)
            if held is not None:
                return held
            left = deadline - time.monotonic()
            if left <= 0:
                budget = {g: self.budget(g) for g in per_gpu}
                raise RankFailure(f"could not get CUDA contexts for {sum(per_gpu.values())} rank(s) on GPU(s) "
                                  f"{dict(per_gpu)} within {self.startup_timeout:g} s: every slot of the per-GPU "
                                  f"budget {budget} is held by other pools of this suite (set FSDP_AMP_GPU_CONTEXTS, "
                                  f"or run fewer xdist workers)")
            retire = [k for k, p in pools.items() if p.slot_gpus & set(per_gpu)]
            if retire:
                pools.pop(retire[0]).shutdown(within=left)
                continue
            with open(self.lock_path("contexts-wanted"), "w"):
                pass  # its mtime tells the other workers to retire their idle GPU pools
            time.sleep(min(0.1, left))

    def yield_idle_contexts(self, pools: dict, keep) -> None:
        """If another worker waits for context slots, retire the idle GPU `pools` (all but the one keyed `keep`)."""
        try:
            wanted = time.time() - os.stat(self.lock_path("contexts-wanted")).st_mtime < 2.0
        except FileNotFoundError:
            return
        if wanted:
            for k in [k for k, p in pools.items() if p.slots and k != keep]:
                pools.pop(k).shutdown()

    @contextlib.contextmanager
    def memory_turn(self, gpus: list[int]):
        """One memory-heavy task at a time on each of `gpus` (an exclusive flock that ordinary tasks never take).

        A task that needs a large share of a GPU's memory (a grad past 2**31 elements: 8 GiB in fp32) checks the
        free memory, then allocates; two such tasks of different workers both passed the check and one ran out
        of memory, or one saw the other's memory and skipped. Ordinary tasks go on beside it. Taken before the
        GPU locks, so a task waiting for its turn holds nothing another task waits for.
        """
        with contextlib.ExitStack() as stack:
            asked = time.monotonic()
            for g in sorted(gpus):  # one global order: no lock-order deadlock between workers
                fcntl.flock(stack.enter_context(open(self.lock_path(f"gpu{g}-memory"), "w")), fcntl.LOCK_EX)
            profile("memory_wait", time.monotonic() - asked)
            yield

    @contextlib.contextmanager
    def task_locks(self, world_size: int, device: str, exclusive: bool, memory_heavy: bool = False):
        """flock each GPU the task uses: shared by ordinary tasks, exclusive for timing-sensitive ones.

        A timing check (an async copy racing queued kernels) must see only its own queued work, so it
        waits until no other worker's task runs on its GPUs; everything else shares them. The shared
        take is made under a brief exclusive gate, as the exclusive one is, so a stream of shared tasks
        cannot starve an exclusive one (flock alone has no writer preference). CPU tasks take no lock.
        A memory-heavy task first waits for its turn among the memory-heavy ones (memory_turn).
        """
        if device == "cpu":
            yield
            return
        gpus = worker_gpus()[: world_size if device == "cuda" else 1]

        def lock_file(name):
            return stack.enter_context(open(self.lock_path(name), "w"))

        with contextlib.ExitStack() as stack:
            if memory_heavy:
                stack.enter_context(self.memory_turn(gpus))
            asked = time.monotonic()
            gate = lock_file("gate")
            fcntl.flock(gate, fcntl.LOCK_EX)
            for g in sorted(gpus):  # one global order: no lock-order deadlock between workers
                fcntl.flock(lock_file(f"gpu{g}"), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            profile("lock_wait", time.monotonic() - asked, exclusive=exclusive)
            held = time.monotonic()
            try:
                yield
            finally:
                if exclusive:  # every other worker's GPU task waits this long
                    profile("exclusive_hold", time.monotonic() - held)
