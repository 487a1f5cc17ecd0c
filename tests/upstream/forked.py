"""`python FILE ARGS` without the interpreter's start: a fork of the harness's fork server (tests/harness/pool.py,
torch already imported) runs FILE as `__main__`, as `python FILE` would, and the caller gets the same
subprocess.CompletedProcess. A fresh interpreter spends seconds importing torch before the file's first line; on a
gVisor GPU host that is most of a standalone file's run.

What the fork sees is what `python FILE` would see: sys.argv, sys.path (a fresh interpreter's, asked once per
process, with the file's folder first), the environment, the working directory, stdout and stderr of its own, the
exit status of SystemExit or of an uncaught exception, the atexit handlers (its own and those torch's import
registered). This repository's modules, which the fork imported to run _main, are dropped before the file runs.
One difference stays: torch (pool.PRELOAD) is imported before the file's first line, so a file that must set
something before torch's import has to run fresh (run_file's `python`). tests/meta/test_forked.py compares a
forked and a fresh run of a probe file.

This module imports only the standard library: the fork imports it to run _main.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

PROBE_SYS_PATH = "import json, sys; print(json.dumps(sys.path))"


def run(path: str, args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """`python path *args` in cwd with env, forked; subprocess.TimeoutExpired after timeout seconds, its process
    group (the file's own children included) killed."""
    import multiprocessing
    import tempfile

    import tests.harness.ranks  # noqa: F401  the server's preload (pool.py) and its stop at exit (ranks.py)

    sys_path = _fresh_sys_path(env.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="forked-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        for name in (out, err):  # there to read also if the fork dies before it opens them
            open(name, "w").close()
        proc = multiprocessing.get_context("forkserver").Process(
            target=_main, name=os.path.basename(path), args=(path, args, env, cwd, out, err, sys_path))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it had not made its group yet
                proc.kill()
            proc.join()
        with open(out, encoding="utf-8", errors="replace") as f_out, \
                open(err, encoding="utf-8", errors="replace") as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    argv = [sys.executable, path, *args]
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, proc.exitcode, stdout, stderr)


@functools.lru_cache(maxsize=None)  # one interpreter start per PYTHONPATH and process
def _fresh_sys_path(pythonpath: str) -> tuple[str, ...]:
    """sys.path of `python -c` under this PYTHONPATH, without its leading '' (the working directory)."""
    import json
    import tempfile

    env = dict(os.environ, PYTHONPATH=pythonpath)
    with tempfile.TemporaryDirectory() as cwd:
        got = subprocess.run([sys.executable, "-c", PROBE_SYS_PATH], cwd=cwd, env=env, capture_output=True,
                             text=True, check=True).stdout
    return tuple(p for p in json.loads(got) if p)


def _main(path: str, args: list[str], env: dict, cwd: str, out: str, err: str, sys_path: tuple[str, ...]) -> None:
    """The fork's target: become `python path *args`."""
    import atexit
    import runpy

    os.setpgrp()  # the caller kills the group on timeout: the file's own children with it
    _die_with_parent()
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name, module in list(sys.modules.items()):  # this repository's modules, which unpickling _main imported
        origin = getattr(module, "__file__", None) or ""
        if origin.startswith(root + os.sep) and not origin.startswith(sys.prefix + os.sep):
            del sys.modules[name]
    sys.path[:] = [os.path.dirname(os.path.abspath(path)), *sys_path]
    sys.argv[:] = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        atexit._run_exitfuncs()


def _die_with_parent() -> None:
    import ctypes

    try:  # the server exits with its owner; the file then ends with it, as a rank does (rank_process.py)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
