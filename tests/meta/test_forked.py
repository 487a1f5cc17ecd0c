"""fsdp_amp_suite/upstream/forked.py runs a file as `python FILE` would: a probe file prints what a script can see of
its
interpreter, and a forked run must print what a fresh run prints, exit as it exits, and leave no process behind
when it hangs past its timeout."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from fsdp_amp_suite.upstream import forked

# child processes: CPU work, which ci/cpu.sh runs and the GPU gate leaves out
pytestmark = [pytest.mark.harness, pytest.mark.slow]

PROBE = textwrap.dedent('''
    import atexit, importlib.util, json, multiprocessing, os, sys

    if __name__ == "__mp_main__":  # imported by the spawned child, and by the fork server before it forks
        with open(os.path.join(os.environ["FORKED_PROBE_DIR"], "mp-main"), "a") as f:
            f.write(json.dumps([os.getcwd(), sys.path]) + "\\n")

    def child():
        sys.exit(5)

    def server_child():  # what a rank started the way CUDA repros start theirs sees
        print(json.dumps({"server child": [os.environ.get("FORKED_PROBE"), os.environ.get("FORKED_PROBE_LATE"),
                                           os.getcwd(), sys.path, sys.modules["__main__"].__name__],
                          "its open fds": len(os.listdir("/proc/self/fd"))}), flush=True)
        with open(os.path.join(os.environ["FORKED_PROBE_DIR"], "server-child"), "w") as f:
            f.write(" ".join(sorted(m for m in sys.modules if m == "torch")))  # imported: no fresh interpreter
        sys.exit(6)

    if __name__ == "__main__":
        atexit.register(print, "atexit ran")
        ctx = multiprocessing.get_context("spawn")  # a child that imports this file as __mp_main__
        p = ctx.Process(target=child)
        p.start()
        p.join()
        os.environ["FORKED_PROBE_LATE"] = "set before the fork server started"
        q = multiprocessing.get_context("forkserver").Process(target=server_child)
        q.start()
        q.join()
        print(json.dumps({
            "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "file": __file__,
            "env": os.environ.get("FORKED_PROBE"), "repo importable": importlib.util.find_spec("tests") is not None,
            "repo imported": sorted(m for m in sys.modules if m == "tests" or m.startswith(("tests.", "scaler_impl"))),
            "spawned child's status": p.exitcode, "fork server child's status": q.exitcode}, indent=0))
        print("to stderr", file=sys.stderr)
        if sys.argv[1:] == ["--raise"]:
            raise ValueError("the probe raised")
        sys.exit(int(sys.argv[1]))
''')


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe").mkdir()
    path = tmp_path / "probe" / "probe.py"
    path.write_text(PROBE, encoding="utf-8")
    (tmp_path / "cwd").mkdir()
    env = dict(os.environ, FORKED_PROBE="set", PYTHONPATH="", FORKED_PROBE_DIR=str(tmp_path))
    return str(path), env, str(tmp_path / "cwd")


@pytest.mark.parametrize("args", [["3"], ["--raise"]])
def test_a_forked_run_sees_and_does_what_a_fresh_one_does(probe, args):
    path, env, cwd = probe
    server_child, mp_main = (os.path.join(env["FORKED_PROBE_DIR"], name) for name in ("server-child", "mp-main"))
    fresh = subprocess.run([sys.executable, path, *args], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=120)
    assert open(server_child).read() == ""
    fresh_imports = open(mp_main).read()
    os.remove(mp_main)
    fork = forked.run(path, args, env, cwd, timeout=120)
    assert open(server_child).read() == "torch", "the file's fork server was a fresh interpreter, not the zygote"
    assert open(mp_main).read() == fresh_imports  # where the child and the server imported the file from
    assert fork.returncode == fresh.returncode, (fork.stderr, fresh.stderr)
    assert fork.stdout == fresh.stdout
    assert fork.stderr.strip().splitlines()[-1] == fresh.stderr.strip().splitlines()[-1]
    assert '"repo importable": false' in fork.stdout and '"repo imported": []' in fork.stdout


def test_a_forked_run_past_its_timeout_is_killed_with_its_children(tmp_path):
    path = tmp_path / "hang.py"
    pids = tmp_path / "pids"
    path.write_text(textwrap.dedent(f'''
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        print("started", flush=True)
        time.sleep(600)
    '''), encoding="utf-8")
    with pytest.raises(subprocess.TimeoutExpired) as info:
        forked.run(str(path), [], dict(os.environ), str(tmp_path), timeout=5)
    assert "started" in info.value.stdout
    left = [int(p) for p in pids.read_text().split()]
    deadline = time.monotonic() + 10  # the killed grandchild is reaped by init: not at once
    while any(_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in left if _alive(p)], "the file or its child outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended, its parent not yet reaped
    except FileNotFoundError:
        return False
