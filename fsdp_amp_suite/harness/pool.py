"""The parent side of a pool: world_size long-lived rank processes sharing one process group.

The ranks are started once and run task after task (starting one costs seconds, a task milliseconds). They
fork from multiprocessing's fork server, which has imported torch (PRELOAD) once for this process: a spawned
rank imports it anew, most of a rank's start (benchmarks/harness.py). The server never initializes CUDA, so
its forks may. A rank takes the environment and working directory of the process that starts its pool, as
spawned ones do.
Rendezvous is a FileStore in a private temp dir, so concurrent xdist workers never share a port. The
parent sends each rank a Task and collects one Outcome per rank; a rank that raises, dies or hangs fails
the task with every rank's traceback or faulthandler stack (SIGUSR1) and recent output, and a pool whose
ranks died or hung is stopped (the harness builds a new one for the next task).
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
from typing import Callable, Union

from fsdp_amp_suite.harness.failures import RankDied, RankFailure, RankHung, RankRaised, death
from fsdp_amp_suite.harness.rank_process import rank_main
from fsdp_amp_suite.harness.task import Issued, Outcome, Ready, Stop, Task, rank_device, values

PEER_GRACE_S = 5.0  # after one rank raised, the others get this long before their stacks are taken
STARTUP_TIMEOUT_S = 180.0
START_METHOD = "forkserver"  # "spawn" for a rank that imports everything itself (benchmarks/harness.py compares)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp"]  # imported once, before the server forks
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)

Answer = Union[Ready, Outcome]  # what a rank puts on the results queue


class RankPool:
    """world_size long-lived rank processes sharing one process group."""

    def __init__(self, world_size: int, backend: str, device: str, gpus: list[int], slots: list,
                 startup_timeout: float = STARTUP_TIMEOUT_S, budget: dict | None = None,
                 start_method: str = START_METHOD):
        """Start the ranks on `gpus` (worker_gpus(); [] on CPU) holding `slots` (their CUDA context slots,
        released by shutdown); `budget` ({GPU: contexts}) is quoted by a rank that cannot get its context."""
        self.world_size, self.backend, self.device = world_size, backend, device
        self.slots = slots
        self.slot_gpus = set(gpus[:world_size] if device == "cuda" else gpus[:1])  # where those slots are
        self.dir = tempfile.mkdtemp(prefix=f"rankpool-ws{world_size}-")
        self.logs = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self._task_ids = itertools.count()
        ctx = multiprocessing.get_context(start_method)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=rank_main, name=f"rank{r}-of-{world_size}", daemon=True,
                        args=(r, world_size, backend, device, gpus, os.path.join(self.dir, "store"),
                              self.tasks[r], self.results, os.getpid(), self.logs[r], budget or {},
                              dict(os.environ)))
            for r in range(world_size)
        ]
        self.healthy = True
        try:
            for p in self.procs:
                p.start()
            ready = self._collect(lambda m: isinstance(m, Ready), startup_timeout, (0,) * world_size,
                                  late="did not start")
            failed = _errors(ready)
            if failed:  # every rank answered, some of them that it could not start
                raise RankRaised("could not start", failed, {}, world_size)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(self, payload: bytes, timeout: float, seed: int, on_cpu: bool = False) -> list:
        """Every rank's result of pickle.loads(payload) = (fn, args, kwargs), in rank order (task.values);
        on_cpu: a CPU task in this pool's GPU ranks (task.Task)."""
        offsets = self._log_ends()
        try:
            outcomes = self._send_and_collect(payload, seed, timeout, offsets, on_cpu)
        except RankFailure:
            self.shutdown(graceful=False)
            raise
        if any(o.error is not None for o in outcomes):
            self._check_still_aligned()
        return values(outcomes)

    def _send_and_collect(self, payload: bytes, seed: int, timeout: float,
                          offsets: tuple[int, ...], on_cpu: bool = False) -> list[Outcome]:
        task = Task(next(self._task_ids), payload, seed, on_cpu)
        for q in self.tasks:
            q.put(task)
        got = self._collect(lambda m: isinstance(m, Outcome) and m.task == task.id, timeout, offsets,
                            late=f"hung (no answer within {timeout:g} s)", task=task.id)
        return [got[r] for r in range(self.world_size)]

    def _check_still_aligned(self):
        """After an exception the group may be left mid-collective; rebuild unless it still agrees."""
        try:
            out = self._send_and_collect(pickle.dumps((_aligned_probe, (), {})), 0, 15.0, self._log_ends())
            if values(out) != [self.world_size] * self.world_size:
                raise RankFailure("probe disagreed")
        except RankFailure:
            self.shutdown(graceful=False)

    def _log_ends(self) -> tuple[int, ...]:
        """Where each rank's log ends now: a task's failure quotes what each rank wrote after that."""
        return tuple(os.path.getsize(log) if os.path.exists(log) else 0 for log in self.logs)

    def _collect(self, answers: Callable[[Answer], bool], timeout: float, offsets: tuple[int, ...],
                 late: str, task: int | None = None) -> dict[int, Answer]:
        """Wait for every rank's answer (the messages `answers` accepts); raise on death, hang (`late` says
        what that is), a peer stuck after another rank's error, or, for `task`, as soon as every rank that has
        not answered has issued a collective that the ranks that did never issued (unmatched_collective)."""
        got: dict[int, Answer] = {}
        issued: dict[int, Issued] = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        while len(got) < self.world_size:
            try:
                message = self.results.get(timeout=0.05)
                if isinstance(message, Issued):
                    if message.task == task:
                        issued[message.rank] = message
                elif answers(message):
                    got[message.rank] = message
                    if message.error is not None and first_error_at is None:
                        first_error_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            dead = {r: p.exitcode for r, p in enumerate(self.procs) if r not in got and not p.is_alive()}
            if dead:
                time.sleep(0.2)  # a result sent just before exiting may still be in the pipe
                self._drain(answers, got)
                dead = {r: c for r, c in dead.items() if r not in got}
            if dead:
                stacks = self._stacks(got, offsets, dead)
                lines = {r: f"exit code {c}" + (f" ({signal.Signals(-c).name})" if c and c < 0 else "")
                         for r, c in dead.items()}
                deaths = tuple(death(r, c, stacks.get(r, "")) for r, c in sorted(dead.items()))
                raise RankDied("died", {r: f"{lines[r]}\n{stacks.pop(r, '')}" for r in dead},
                               {**stacks, **_errors(got)}, self.world_size, deaths)
            finished = {r: getattr(m, "sequences", None) for r, m in got.items()}
            unmatched = {r: w for r, m in issued.items()
                         if r not in got and (w := unmatched_collective(r, m.sequences, finished))}
            stuck = bool(unmatched) and len(unmatched) + len(got) == self.world_size  # no rank left can answer
            if first_error_at is not None and (stuck or now > first_error_at + PEER_GRACE_S):
                stacks = self._stacks(got, offsets)
                raise RankRaised("raised (the other ranks were stuck after it)", _errors(got), stacks,
                                 self.world_size)
            if stuck:
                raise RankHung("hung in a collective that no other rank issued: "
                               + "; ".join(f"rank {r} waits for {w}" for r, w in unmatched.items()),
                               self._stacks(got, offsets), {}, self.world_size)
            if now > deadline:
                raise RankHung(late, self._stacks(got, offsets), _errors(got), self.world_size)
        return got

    def _drain(self, answers, got):
        while True:
            try:
                message = self.results.get_nowait()
            except queue.Empty:
                return
            if answers(message):
                got[message.rank] = message

    def _stacks(self, got, offsets: tuple[int, ...], dead=()) -> dict[int, str]:
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
            try:
                with open(self.logs[r], errors="replace") as f:
                    f.seek(offsets[r])
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
                    q.put(Stop())
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


def start_fork_server() -> None:
    """Start this process's fork server now, in the background: it imports PRELOAD (seconds) while the caller goes
    on (an xdist worker collects its tests), instead of when the first pool starts. multiprocessing starts it on
    first use otherwise; this only moves the start earlier."""
    from multiprocessing import forkserver

    forkserver.ensure_running()


def stop_fork_server() -> None:
    """Stop this process's fork server and reap it (at exit, after the pools). Left to notice its owner's exit,
    it would end as an orphan that nobody reaps, and the CPU of the ranks it reaped would be counted nowhere
    (benchmarks.cputime reads a test's process tree). multiprocessing has no public call for this."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def unmatched_collective(rank: int, issued: dict, finished: dict[int, dict | None]) -> str | None:
    """The collective `rank` issued that no other rank will ever join, if any; else None.

    issued: its group_sequences() during the task ({group: (collectives issued, ranks)}); finished: those of
    the ranks that ended the task (None: unknown). A group whose other members all ended the task having issued
    fewer collectives on it than `rank` never matches its last one: a rank issues none between tasks, and the
    next task waits for this one. Each member must report the group under the same ranks (a name made on one
    rank only is another group), else nothing is concluded and the timeout decides.
    """
    for name, (count, ranks) in sorted(issued.items()):
        others = [r for r in ranks if r != rank]
        theirs = [(finished.get(r) or {}).get(name) for r in others]
        if others and all(t is not None and tuple(t[1]) == tuple(ranks) and t[0] < count for t in theirs):
            return (f"collective #{count} of process group {name!r} (ranks {list(ranks)}), which rank(s) "
                    f"{others} ended the task without (their last: #{max(t[0] for t in theirs)})")
    return None


def _errors(got: dict[int, Answer]) -> dict[int, str]:
    return {r: m.error for r, m in got.items() if m.error is not None}


def _tail(text: str, n: int) -> str:
    lines = text.splitlines()
    return "\n".join(lines[-n:]) if lines else "(no output)"


def _aligned_probe():
    import torch
    import torch.distributed as dist

    t = torch.ones((), device=rank_device())
    dist.all_reduce(t)
    return int(t.item())
