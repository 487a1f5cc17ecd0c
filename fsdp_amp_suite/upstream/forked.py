"""`python FILE ARGS` without the interpreter's start: a fork of the harness's fork server
(fsdp_amp_suite/harness/pool.py,
torch already imported) runs FILE as `__main__`, as `python FILE` would, and the caller gets the same
subprocess.CompletedProcess. A fresh interpreter spends seconds importing torch before the file's first line; on a
gVisor GPU host that is most of a standalone file's run.

What the fork sees is what `python FILE` would see: sys.argv, sys.path (a fresh interpreter's, asked once per
process, with the file's folder first), the environment, the working directory, stdout and stderr of its own, the
exit status of SystemExit or of an uncaught exception, the atexit handlers (its own and those torch's import
registered). This repository's modules, which the fork imported to run _main, are dropped before the file runs.
A fork server that the file starts (multiprocessing's "forkserver", the way a CUDA repro starts its ranks) is not
a fresh interpreter either: a copy of the fork made before the file's first line becomes it (_Zygote), with the
environment and open fds the fresh one would get (its forks, the file's ranks, take the rest from multiprocessing's
preparation data). Made later, the copy would carry the file's CUDA calls: a copy of a process that has used CUDA
cannot use it.
One difference stays: torch (pool.PRELOAD) is imported before the file's first line, so a file that must set
something before torch's import has to run fresh (run_file's `python`). tests/meta/test_forked.py compares a
forked and a fresh run of a probe file.

This module imports only the standard library: the fork imports it to run _main.
"""
from __future__ import annotations

import functools
import os
import pickle
import signal
import socket
import subprocess
import sys

PROBE_SYS_PATH = "import json, sys; print(json.dumps(sys.path))"


def run(path: str, args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """`python path *args` in cwd with env, forked; subprocess.TimeoutExpired after timeout seconds, its process
    group (the file's own children included) killed."""
    import multiprocessing
    import tempfile

    import fsdp_amp_suite.harness.ranks  # noqa: F401  the server's preload (pool.py) and its stop at exit (ranks.py)

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
    _Zygote().install()
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        atexit._run_exitfuncs()


class _Zygote:
    """A copy of this process, forked before the file runs, that becomes the file's fork server.

    multiprocessing starts a fork server with util.spawnv_passfds(python, [python, -c, "...main(fds...)"], fds):
    a fresh interpreter, which imports torch again. install() routes the first such start here instead: the
    copy keeps only stdin, stdout, stderr and the passed fds, at the numbers the command names, takes the
    environment of that moment (what the fresh interpreter would inherit), and runs the command. Any other
    start, and a second one, goes to the real spawnv_passfds. Unused, the copy exits when this process does (its
    socket closes).
    """

    COMMAND = "from multiprocessing.forkserver import main"  # how ForkServer.ensure_running's -c code starts

    def install(self) -> None:
        from multiprocessing import util

        sys.stdout.flush()
        sys.stderr.flush()
        ours, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            self._serve(theirs)  # does not return
        theirs.close()
        self.sock, self.real = ours, util.spawnv_passfds
        util.spawnv_passfds = self.spawnv_passfds

    def spawnv_passfds(self, path, args, passfds):
        from multiprocessing import reduction, util

        if self.sock is None or not any(isinstance(a, str) and a.startswith(self.COMMAND) for a in args):
            return self.real(path, args, passfds)
        sock, self.sock = self.sock, None
        util.spawnv_passfds = self.real
        with sock:
            fds = sorted(map(int, passfds))
            request = pickle.dumps((args, fds, dict(os.environ)))
            sock.sendall(len(request).to_bytes(8, "big") + request)
            reduction.sendfds(sock, fds)
            if sock.recv(1) != b"1":
                raise OSError("the fork server's zygote did not start")
        return self.pid

    @staticmethod
    def _serve(sock) -> None:
        import fcntl
        from multiprocessing import reduction

        code = 0
        try:
            head = _receive(sock, 8)
            if len(head) < 8:
                os._exit(0)  # the file ended without starting a fork server
            args, numbers, env = pickle.loads(_receive(sock, int.from_bytes(head, "big")))
            got = reduction.recvfds(sock, len(numbers))
            sock.sendall(b"1")
            sock.close()
            # as the fresh interpreter: only 0, 1, 2 and the passed fds, at the numbers the command names
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, max(numbers) + 1) for fd in got]
            for fd in map(int, os.listdir("/proc/self/fd")):
                if fd > 2 and fd not in high:
                    try:
                        os.close(fd)
                    except OSError:  # the listing's own fd, closed already
                        pass
            for low, fd in zip(numbers, high):
                os.dup2(fd, low)
                os.close(fd)
            os.environ.clear()
            os.environ.update(env)
            exec(compile(args[args.index("-c") + 1], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0
        except BaseException:  # noqa: BLE001 - the traceback goes where a fresh server's would
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _receive(sock, n: int) -> bytes:
    """n bytes, or fewer at EOF. Never more: a buffered read could swallow the byte that carries the fds."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _die_with_parent() -> None:
    import ctypes

    try:  # the server exits with its owner; the file then ends with it, as a rank does (rank_process.py)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
