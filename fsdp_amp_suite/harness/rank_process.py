"""Inside each rank process of a pool: set up once, then run task after task until told to stop.

A rank writes its output to its own log file (the parent reads it back for a failure), dumps its stacks on
SIGUSR1 (faulthandler: the parent asks for them when a task hangs), dies with the pytest process that started
it, also when that is SIGKILLed (its parent is the fork server, which exits with that process: PR_SET_PDEATHSIG,
plus a watchdog thread), and ends with os._exit: gloo+FSDP ranks sometimes abort in interpreter teardown.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import gc
import itertools
import os
import signal
import sys
import threading
import time

from fsdp_amp_suite.harness.budget import release_cuda_stack
from fsdp_amp_suite.harness.task import Issued, Ready, Task, group_sequences, run_task, set_rank_device

WATCH_S = 0.2  # how often a rank looks at the collectives its task has issued


def rank_main(rank: int, world_size: int, backend: str, device: str, gpus: list[int], store_path: str,
              tasks, results, owner_pid: int, log_path: str, budget: dict, environ: dict) -> None:
    """The target of a pool's rank process: `tasks` brings a Task (or Stop), `results` takes one Ready, then
    run_task's Outcome of each Task. `budget` ({GPU: contexts}) is quoted if the rank gets no CUDA context.
    `environ` is the owner's (the pool's process) at the rank's start: the fork server's is older (multiprocessing
    itself brings the working directory)."""
    _die_with_owner(owner_pid)
    _name_process(f"rank{rank}of{world_size}:{device}")
    os.environ.clear()
    os.environ.update(environ)
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
    home = torch.device("cpu")
    if device != "cpu":
        gpu = gpus[rank] if device == "cuda" else gpus[0]
        try:
            torch.cuda.set_device(gpu)
            torch.zeros(1, device=f"cuda:{gpu}")  # the context is made here, not in the first task
        except RuntimeError as exc:
            results.put(Ready(rank, f"rank {rank} could not get a CUDA context on GPU {gpu}: {exc}\n"
                                    f"(this suite's budget is {budget.get(gpu, '?')} contexts per GPU; other "
                                    f"processes may hold its memory)"))
            results.close()
            results.join_thread()  # the message must leave before the process does
            os._exit(4)
        home = torch.device("cuda", gpu)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(hours=1))  # the parent times tasks out, not the PG
    _clean_up()
    running = [None]  # the id of the task the main thread runs, for the watcher
    threading.Thread(target=_watch_collectives, args=(rank, results, running),
                     daemon=True, name="collective-watcher").start()
    results.put(Ready(rank))
    while isinstance(task := tasks.get(), Task):
        running[0] = task.id
        set_rank_device(torch.device("cpu") if task.on_cpu else home)
        outcome = run_task(task, rank)
        running[0] = None
        results.put(outcome)
        task = outcome = None  # let _clean_up free them
        _clean_up()  # while the parent checks the result
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo+FSDP ranks can abort in it


def _name_process(name: str) -> None:
    """The name ps, top and benchmarks/gpu_processes.py show (/proc/PID/comm, 15 bytes): a fork keeps its
    server's, which says nothing of the pool."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def _die_with_owner(owner_pid: int) -> None:
    try:  # immediate on Linux: the kernel signals us when our parent (the fork server) dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.getppid()

    def alive() -> bool:
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return os.getppid() == parent

    def watch():  # fallback and double check: polled
        while alive():
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="owner-watchdog").start()
    if not alive():
        os._exit(3)


def _watch_collectives(rank: int, results, running: list) -> None:
    """While a task runs, tell the parent the collectives this rank has issued (group_sequences()) whenever they
    change: the parent can then see one that the ranks which ended the task never issued, and fail the task at
    once instead of at its timeout, wherever the body waits for it (in torch.distributed, in a library's
    work.wait(), in a CUDA sync)."""
    sent = None
    while True:
        time.sleep(WATCH_S)
        task = running[0]
        if task is None:
            continue
        message = Issued(task, rank, group_sequences())
        if message.sequences and message != sent:
            results.put(message)
            sent = message


_tasks_done = itertools.count(1)


def _clean_up() -> None:
    """After a task: free its garbage (and the CUDA memory it held, the context's stack reservation included:
    budget.release_cuda_stack), then freeze the survivors.

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
        release_cuda_stack()  # after a CPU task too: fairscale and the CPU offload paths launch kernels
