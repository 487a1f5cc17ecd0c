"""Run one picklable function on N ranks and return every rank's result.

    results = run_on_ranks(body, arg, world_size=2)        # gloo, CPU tensors
    results = run_on_ranks(body, world_size=2, device="cuda-shared")  # gloo, both ranks on GPU 0
    results = run_on_ranks(body, world_size=2, device="cuda")         # NCCL, one GPU per rank

Three engines, one API:
- pool (default): ranks are spawned once per (world_size, backend, device) per pytest/xdist
  worker, keep their process group, and run task after task (spawning costs seconds, a
  task costs milliseconds). A rank that raises, dies or hangs fails the test with every
  rank's traceback or faulthandler stack, and the pool is torn down and rebuilt.
- isolation (`--isolate-ranks`): the same pool, spawned for one task and stopped after it.
- torchrun: when RANK/WORLD_SIZE are set, the body runs right here on the launcher's ranks.

Rendezvous is a FileStore in a private temp dir, so concurrent xdist workers never share a
port. Ranks die with their parent (PR_SET_PDEATHSIG plus a watchdog thread), also when
pytest is killed with SIGKILL, and end with os._exit because gloo+FSDP ranks sometimes abort
in interpreter teardown (seen in 14 of 170 spawns on a 2-core CPU machine; 0 of 115 with os._exit).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import dataclasses
import datetime
import faulthandler
import fcntl
import functools
import gc
import itertools
import json
import multiprocessing
import os
import pickle
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref

DEFAULT_TIMEOUT_S = 120.0
PEER_GRACE_S = 5.0  # after one rank raised, the others get this long before their stacks are taken
STARTUP_TIMEOUT_S = 180.0
DEVICES = ("cpu", "cuda", "cuda-shared")
# CUDA contexts: every rank of a GPU pool owns one, and idle pools stay alive, so without a bound the
# contexts on a GPU grow with xdist workers x pool sizes until it is full (seen: 14 workers x 7 ranks
# = 98 contexts ran an H200's 140 GiB out of memory: ~1.4 GiB each with a task's working set). Each
# GPU has a budget of context slots shared by every worker (flock'ed slot files); a pool holds one
# per rank on that GPU for its life.
CONTEXT_GIB = 2.0  # one rank's CUDA context plus a task's working set, with margin over the ~1.4 seen

_rank_device = None  # set inside a rank: the torch.device its tensors belong on


class RankFailure(Exception):
    """A task failed on one or more ranks. Data, not just a message:

        what        what happened ("raised", "hung (no answer within 15 s)", "died", ...)
        ranks       {rank: text} of the ranks it happened to: a traceback, or an exit code + stack + output
        others      {rank: text} of the other ranks with something to say (their stacks, their errors)
        world_size  the size of the group (None for a failure before any rank ran)

    str() renders all of it: a header line, then each rank's text.
    """

    def __init__(self, what: str, ranks: dict | None = None, others: dict | None = None,
                 world_size: int | None = None):
        self.what, self.world_size = what, world_size
        self.ranks, self.others = dict(ranks or {}), dict(others or {})
        super().__init__(self._render())

    def _render(self) -> str:
        if self.world_size is None:
            return self.what
        parts = [f"rank(s) {sorted(self.ranks)} of world_size {self.world_size} {self.what}"]
        parts += [f"----- rank {r} -----\n{self.ranks[r]}" for r in sorted(self.ranks)]
        parts += [f"----- rank {r} (also) -----\n{self.others[r]}" for r in sorted(self.others)]
        return "\n".join(parts)

    def error(self, rank: int | None = None) -> str:
        """The last line of a rank's text (the first failing rank's by default): its exception, e.g.
        "RuntimeError: ..."."""
        rank = min(self.ranks) if rank is None else rank
        lines = [line for line in self.ranks[rank].splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


class RankRaised(RankFailure):
    pass


class RankDied(RankFailure):
    pass


class RankHung(RankFailure):
    pass


def _profile(event: str, seconds: float, **info) -> None:
    """Where a run's time goes (benchmarks/gpu.py): with FSDP_AMP_PROFILE_DIR set, one JSON line per
    pool start-up and per lock wait, in a file per xdist worker."""
    folder = os.environ.get("FSDP_AMP_PROFILE_DIR")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps(dict(event=event, seconds=round(seconds, 4), **info)) + "\n")


def rank_device():
    """Inside a rank: the device this rank's tensors belong on (cpu, or its cuda:k)."""
    if _rank_device is None:
        raise RuntimeError("rank_device() is only defined inside a body run by run_on_ranks")
    return _rank_device


def torchrun_world_size() -> int | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


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


@functools.lru_cache(maxsize=None)
def context_budget(gpu: int) -> int:
    """How many CUDA contexts of this suite may live on one GPU at once, across xdist workers:
    FSDP_AMP_GPU_CONTEXTS, else 90% of the GPU's memory (nvidia-smi; no CUDA context is made
    for asking) over CONTEXT_GIB, else 16."""
    if os.environ.get("FSDP_AMP_GPU_CONTEXTS"):
        return max(1, int(os.environ["FSDP_AMP_GPU_CONTEXTS"]))
    try:
        mib = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i",
                              str(gpu)], capture_output=True, text=True, timeout=30, check=True).stdout
        return max(1, int(float(mib.split()[0]) / 1024 * 0.9 / CONTEXT_GIB))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 16


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
    """

    def __init__(self, isolate: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
                 startup_timeout: float = STARTUP_TIMEOUT_S, contexts: int | None = None, lock_dir: str | None = None):
        for name, value in (("timeout", timeout), ("startup_timeout", startup_timeout)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"Harness: {name} must be a positive number of seconds, got {value!r}")
        self.isolate, self.timeout, self.startup_timeout = bool(isolate), float(timeout), float(startup_timeout)
        self.contexts, self.lock_dir = contexts, lock_dir or tempfile.gettempdir()
        self.pools: dict = {}  # (world_size, backend, device) -> RankPool
        _LIVE.add(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def run(self, fn, *args, world_size: int = 2, device: str = "cpu", backend: str | None = None,
            timeout: float | None = None, seed: int = 0, exclusive_gpu: bool = False, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return [result of rank 0, result of rank 1, ...].

        GPU tasks of different xdist workers share a GPU; exclusive_gpu=True waits until the task is
        alone on its GPUs (for a check that other processes' GPU work could hide; the busy-GPU race
        checks need no such thing: other work only makes the GPU busier).

        Skips the calling test (pytest.skip) when the configuration needs hardware that is missing.
        Raises RankRaised / RankDied / RankHung with every rank's traceback or stack.
        """
        import pytest

        backend = backend or default_backend(device)
        _validate(world_size, device, backend)
        reason = missing_requirement(world_size, device, backend)
        if reason:
            pytest.skip(reason)
        timeout = self.timeout if timeout is None else float(timeout)
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:  # lambdas, closures, local classes, open handles ...
            raise TypeError(f"run_on_ranks: {getattr(fn, '__qualname__', fn)!r} and its arguments must be "
                            f"picklable (a module-level function, no lambdas or closures): {exc}") from exc
        if torchrun_world_size() is not None:
            return _run_under_torchrun(payload, device, backend, seed)
        key = (world_size, backend, device)
        exclusive_gpu = exclusive_gpu or os.environ.get("FSDP_AMP_EXCLUSIVE_GPUS") == "1"  # to measure the gain
        self._yield_idle_contexts(keep=key)
        with self._gpu_locks(world_size, device, exclusive_gpu):
            if self.isolate:
                pool = self._new_pool(*key)
                try:
                    return pool.run(payload, timeout, seed)
                finally:
                    pool.shutdown()
            pool = self.pools.get(key)
            if pool is None or not pool.healthy:
                self.pools.pop(key, None)
                pool = self.pools[key] = self._new_pool(*key)
            return pool.run(payload, timeout, seed)

    def shutdown(self) -> None:
        """Stop every pool of this harness (its ranks exit, its context slots are released)."""
        for key in list(self.pools):
            self.pools.pop(key).shutdown()

    def _new_pool(self, world_size: int, backend: str, device: str) -> RankPool:
        gpus = worker_gpus() if device != "cpu" else []
        wanted = collections.Counter(gpus[:world_size] if device == "cuda" else gpus[:1] * world_size)
        slots = self.context_slots(wanted) if wanted else []
        return RankPool(world_size, backend, device, gpus, slots, self.startup_timeout,
                        {g: self.budget(g) for g in wanted})

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.lock_dir, f"fsdp-amp-suite-{name}.lock")

    def budget(self, gpu: int) -> int:
        return self.contexts if self.contexts is not None else context_budget(gpu)

    def take_context_slots(self, per_gpu: dict[int, int]) -> list | None:
        """Take per_gpu[g] free context slots on each GPU g, all or none (no hold-and-wait): the open,
        flock'ed slot files (closing one releases it), or None."""
        held = []
        for gpu, n in sorted(per_gpu.items()):
            got = 0
            for i in range(self.budget(gpu)):
                if got == n:
                    break
                f = open(self._lock_path(f"gpu{gpu}-context{i}"), "w")
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

    def context_slots(self, per_gpu: dict[int, int]) -> list:
        """The context slots a new pool's ranks need (per_gpu: GPU -> ranks on it). While a GPU's budget is
        spent, this harness's idle pools that hold slots on the GPUs wanted are retired (no others: retiring
        a CUDA pool costs seconds and frees nothing here); then the other workers are asked to retire theirs
        (a 'wanted' file they look at before each task). The whole wait, retiring included, is bounded by
        startup_timeout; past it, the failure says what is held."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            held = self.take_context_slots(per_gpu)
            if held is not None:
                return held
            left = deadline - time.monotonic()
            if left <= 0:
                budget = {g: self.budget(g) for g in per_gpu}
                raise RankFailure(f"could not get CUDA contexts for {sum(per_gpu.values())} rank(s) on GPU(s) "
                                  f"{dict(per_gpu)} within {self.startup_timeout:g} s: every slot of the per-GPU "
                                  f"budget {budget} is held by other pools of this suite (set FSDP_AMP_GPU_CONTEXTS, "
                                  f"or run fewer xdist workers)")
            retire = [k for k, p in self.pools.items() if p.slot_gpus & set(per_gpu)]
            if retire:
                self.pools.pop(retire[0]).shutdown(within=left)
                continue
            with open(self._lock_path("contexts-wanted"), "w"):
                pass  # its mtime tells the other workers to retire their idle GPU pools
            time.sleep(min(0.1, left))

    def _yield_idle_contexts(self, keep) -> None:
        """Another worker waits for context slots: retire this harness's idle GPU pools (not the one wanted now)."""
        try:
            wanted = time.time() - os.stat(self._lock_path("contexts-wanted")).st_mtime < 2.0
        except FileNotFoundError:
            return
        if wanted:
            for k in [k for k, p in self.pools.items() if p.slots and k != keep]:
                self.pools.pop(k).shutdown()

    @contextlib.contextmanager
    def _gpu_locks(self, world_size: int, device: str, exclusive: bool):
        """flock each GPU the task uses: shared by ordinary tasks, exclusive for timing-sensitive ones.

        A timing check (an async copy racing queued kernels) must see only its own queued work, so it
        waits until no other worker's task runs on its GPUs; everything else shares them. The shared
        take is made under a brief exclusive gate, as the exclusive one is, so a stream of shared tasks
        cannot starve an exclusive one (flock alone has no writer preference). CPU tasks take no lock.
        """
        if device == "cpu":
            yield
            return
        gpus = worker_gpus()[: world_size if device == "cuda" else 1]

        def lock_file(name):
            return stack.enter_context(open(self._lock_path(name), "w"))

        with contextlib.ExitStack() as stack:
            asked = time.monotonic()
            gate = lock_file("gate")
            fcntl.flock(gate, fcntl.LOCK_EX)
            for g in sorted(gpus):  # one global order: no lock-order deadlock between workers
                fcntl.flock(lock_file(f"gpu{g}"), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            _profile("lock_wait", time.monotonic() - asked, exclusive=exclusive)
            held = time.monotonic()
            try:
                yield
            finally:
                if exclusive:  # every other worker's GPU task waits this long
                    _profile("exclusive_hold", time.monotonic() - held)


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


atexit.register(shutdown_pools)


class RankPool:
    """world_size long-lived rank processes sharing one process group."""

    def __init__(self, world_size: int, backend: str, device: str, gpus: list[int], slots: list,
                 startup_timeout: float = STARTUP_TIMEOUT_S, budget: dict | None = None):
        """Spawn the ranks on `gpus` (worker_gpus(); [] on CPU) holding `slots` (their CUDA context slots,
        released by shutdown); `budget` ({GPU: contexts}) is quoted by a rank that cannot get its context."""
        self.world_size, self.backend, self.device = world_size, backend, device
        self.slots = slots
        self.slot_gpus = set(gpus[:world_size] if device == "cuda" else gpus[:1])  # where those slots are
        self.dir = tempfile.mkdtemp(prefix=f"rankpool-ws{world_size}-")
        self.logs = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self._task_ids = itertools.count()
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_rank_main, name=f"rank{r}-of-{world_size}", daemon=True,
                        args=(r, world_size, backend, device, gpus, os.path.join(self.dir, "store"),
                              self.tasks[r], self.results, os.getpid(), self.logs[r], budget or {}))
            for r in range(world_size)
        ]
        self.healthy = True
        started = time.monotonic()
        try:
            for p in self.procs:
                p.start()
            failed = _errors(self._collect("ready", startup_timeout, 0))
            if failed:  # every rank answered, some of them that it could not start
                raise RankRaised("could not start", failed, {}, world_size)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        _profile("pool_start", time.monotonic() - started, world_size=world_size, device=device)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(self, payload: bytes, timeout: float, seed: int) -> list:
        task_id = next(self._task_ids)
        offsets = [os.path.getsize(log) if os.path.exists(log) else 0 for log in self.logs]
        for q in self.tasks:
            q.put((task_id, payload, seed))
        try:
            outcome = self._collect(task_id, timeout, offsets)
        except RankFailure:
            self.shutdown(graceful=False)
            raise
        failed = {r: text for r, (ok, text) in outcome.items() if not ok}
        if failed:
            self._check_still_aligned()
            raise RankRaised("raised", failed, {}, self.world_size)
        return [outcome[r][1] for r in range(self.world_size)]

    def _check_still_aligned(self):
        """After an exception the group may be left mid-collective; rebuild unless it still agrees."""
        try:
            out = self._collect_task(pickle.dumps((_aligned_probe, (), {})), 15.0)
            if not all(ok and val == self.world_size for ok, val in out.values()):
                raise RankFailure("probe disagreed")
        except RankFailure:
            self.shutdown(graceful=False)

    def _collect_task(self, payload, timeout):
        task_id = next(self._task_ids)
        for q in self.tasks:
            q.put((task_id, payload, 0))
        return self._collect(task_id, timeout, 0)

    def _collect(self, task_id, timeout, offsets) -> dict:
        """Wait for every rank's answer to task_id; raise on death, hang or a stuck peer."""
        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        while len(got) < self.world_size:
            try:
                tid, rank, ok, data = self.results.get(timeout=0.05)
                if tid == task_id:
                    got[rank] = (ok, pickle.loads(data) if ok else data)
                    if not ok and first_error_at is None:
                        first_error_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            dead = {r: p.exitcode for r, p in enumerate(self.procs) if r not in got and not p.is_alive()}
            if dead:
                time.sleep(0.2)  # a result sent just before exiting may still be in the pipe
                self._drain(task_id, got)
                dead = {r: c for r, c in dead.items() if r not in got}
            if dead:
                stacks = self._stacks(got, offsets, dead)
                lines = {r: f"exit code {c}" + (f" ({signal.Signals(-c).name})" if c and c < 0 else "")
                         for r, c in dead.items()}
                raise RankDied("died", {r: f"{lines[r]}\n{stacks.pop(r, '')}" for r in dead},
                               {**stacks, **_errors(got)}, self.world_size)
            if first_error_at is not None and now > first_error_at + PEER_GRACE_S:
                stacks = self._stacks(got, offsets)
                raise RankRaised("raised (the other ranks were stuck after it)", _errors(got), stacks,
                                 self.world_size)
            if now > deadline:
                stacks = self._stacks(got, offsets)
                what = "did not start" if task_id == "ready" else f"hung (no answer within {timeout:g} s)"
                raise RankHung(what, stacks, _errors(got), self.world_size)
        return got

    def _drain(self, task_id, got):
        while True:
            try:
                tid, rank, ok, data = self.results.get_nowait()
            except queue.Empty:
                return
            if tid == task_id:
                got[rank] = (ok, pickle.loads(data) if ok else data)

    def _stacks(self, got, offsets, dead=()) -> dict[int, str]:
        """faulthandler stacks (SIGUSR1) of the ranks that did not answer, plus their recent output."""
        missing = [r for r in range(self.world_size) if r not in got]
        for r in missing:
            if r not in dead and self.procs[r].is_alive():
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        out = {}
        for r in missing:
            start = offsets[r] if isinstance(offsets, list) else 0
            try:
                with open(self.logs[r], errors="replace") as f:
                    f.seek(start)
                    text = f.read()
            except OSError:
                text = ""
            out[r] = "output and stack (faulthandler):\n" + _tail(text, 150)
        return out

    def shutdown(self, graceful: bool = True, within: float = 10.0) -> None:
        """Stop the ranks: asked to exit (graceful) and given `within` seconds in all, then killed."""
        if not self.healthy:
            return
        self.healthy = False
        deadline = time.monotonic() + within
        if graceful:
            for q in self.tasks:
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(timeout=10)  # a killed process is reaped at once
        for q in (*self.tasks, self.results):
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        for f in self.slots:  # the ranks are gone: their contexts with them
            f.close()
        self.slots = []


def _errors(got) -> dict[int, str]:
    return {r: text for r, (ok, text) in got.items() if not ok}


def _tail(text: str, n: int) -> str:
    lines = text.splitlines()
    return "\n".join(lines[-n:]) if lines else "(no output)"


def _aligned_probe():
    import torch
    import torch.distributed as dist

    t = torch.ones((), device=rank_device())
    dist.all_reduce(t)
    return int(t.item())


# ----------------------------------------------------------------------------- inside a rank

def _die_with_parent(parent_pid: int) -> None:
    try:  # immediate on Linux: the kernel signals us when the parent dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch():  # fallback and double check: polled
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()
    if os.getppid() != parent_pid:
        os._exit(3)


_tasks_done = itertools.count(1)


def _clean_up() -> None:
    """After a task: free its garbage (and the CUDA memory it held), then freeze the survivors.

    gc.freeze keeps the next collection to objects created since, so cleaning costs ~1 ms
    instead of ~100 ms with torch and FSDP imported. Cycles that form among frozen objects later
    are swept by a full unfrozen collection every 64 tasks.
    """
    import torch

    if next(_tasks_done) % 64 == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _reset_state(seed: int) -> None:
    import torch

    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)


def _to_host(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a task's result record (e.g. CellRun)
        return dataclasses.replace(obj, **{f.name: _to_host(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    return obj


def _rank_main(rank, world_size, backend, device, gpus, store_path, tasks, results, parent_pid, log_path, budget):
    global _rank_device
    _die_with_parent(parent_pid)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:
        # every worker's every rank at the default thread count oversubscribes the cores, and
        # spinning OpenMP threads can then stall a tiny step for seconds
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world_size * workers)))
    if device == "cpu":
        _rank_device = torch.device("cpu")
    else:
        gpu = gpus[rank] if device == "cuda" else gpus[0]
        try:
            torch.cuda.set_device(gpu)
            torch.zeros(1, device=f"cuda:{gpu}")  # the context is made here, not in the first task
        except RuntimeError as exc:
            results.put(("ready", rank, False, f"rank {rank} could not get a CUDA context on GPU {gpu}: {exc}\n"
                         f"(this suite's budget is {budget.get(gpu, '?')} contexts per GPU; other processes may "
                         f"hold its memory)"))
            results.close()
            results.join_thread()  # the message must leave before the process does
            os._exit(4)
        _rank_device = torch.device("cuda", gpu)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(hours=1))  # the parent times tasks out, not the PG
    _clean_up()
    results.put(("ready", rank, True, pickle.dumps(None)))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, payload, seed = task
        try:
            _reset_state(seed)
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # an async CUDA error belongs to this task, not the next
            message = (task_id, rank, True, pickle.dumps(_to_host(value)))
        except BaseException:  # noqa: B902 - report everything, including pytest.fail/skip
            message = (task_id, rank, False, traceback.format_exc())
        results.put(message)
        task = payload = fn = args = kwargs = value = message = None  # let _clean_up free them
        _clean_up()  # while the parent checks the result
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo+FSDP ranks can abort in it


# ----------------------------------------------------------------------------- torchrun

def _run_under_torchrun(payload: bytes, device: str, backend: str, seed: int) -> list:
    global _rank_device
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if device != "cpu":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    if device == "cpu":
        _rank_device = torch.device("cpu")
    else:
        _rank_device = torch.device("cuda", torch.cuda.current_device())
    try:
        _reset_state(seed)
        fn, args, kwargs = pickle.loads(payload)
        mine = (True, _to_host(fn(*args, **kwargs)))
    except Exception:
        mine = (False, traceback.format_exc())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = {r: text for r, (ok, text) in enumerate(every) if not ok}
    if failed:
        raise RankRaised("raised", failed, {}, len(every))
    return [value for _, value in every]
