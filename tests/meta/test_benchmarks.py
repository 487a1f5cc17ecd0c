"""The benchmarks measure what they say: benchmarks/cputime.py counts the CPU of a test's process tree (its
reaped children and its live ones, as a rank pool is) and not its waiting, and benchmarks/junit.py sums it per file
and names the tests that mostly waited."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks import junit
from fsdp_amp_suite.child_run import ROOT, clean_env

pytestmark = pytest.mark.slow  # a child pytest run: CPU work, ci/cpu.sh runs it, the GPU gate leaves it out

CHILD = textwrap.dedent('''
    import subprocess, sys, time
    import pytest

    # a fixed amount of work: its CPU-seconds do not grow with the machine's load, only its wall time does
    WORK = "sum(i * i for i in range(10_000_000)); print('done', flush=True)"


    @pytest.fixture(scope="module")
    def live():
        proc = subprocess.Popen([sys.executable, "-c", WORK + "; import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        yield proc
        proc.stdin.close()
        proc.wait()


    def test_burns_in_a_reaped_child():
        subprocess.run([sys.executable, "-c", WORK], check=True, capture_output=True)


    def test_burns_in_a_live_child(live):
        assert live.stdout.readline().strip() == "done"  # its work is done; it lives on past this test


    def test_sleeps(live):
        time.sleep(1.0)
''')
MIN_WORK_S = 0.2  # the work above takes ~0.8 CPU-s on the 2-core CI machine; a 4x faster core still passes
MAX_IDLE_S = 0.2  # a test that sleeps spends milliseconds of CPU, however loaded the machine


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    where = tmp_path_factory.mktemp("cputime")
    (where / "test_child.py").write_text(CHILD)
    xml = where / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.cputime", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-c", "/dev/null", "--rootdir", str(where), f"--junitxml={xml}",
                           str(where / "test_child.py")], cwd=ROOT, env=dict(clean_env(), PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name.rsplit("::", 1)[-1]: cpu for _, name, _, _, cpu in junit.cases(str(xml))}


@pytest.mark.parametrize("test", ["test_burns_in_a_reaped_child", "test_burns_in_a_live_child"])
def test_a_childs_cpu_counts_reaped_or_alive(measured, test):
    assert measured[test] is not None and measured[test] >= MIN_WORK_S, measured


def test_waiting_is_not_cpu(measured):
    assert measured["test_sleeps"] is not None and measured["test_sleeps"] < MAX_IDLE_S, measured


def test_junit_sums_cpu_per_file_and_names_the_waits(tmp_path, capsys):
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.a.test_x" name="test_busy" time="12.0">'
        '<properties><property name="cpu_s" value="11.5"/></properties></testcase>'
        '<testcase classname="tests.a.test_x" name="test_waits" time="30.0">'
        '<properties><property name="cpu_s" value="0.4"/></properties></testcase>'
        '<testcase classname="tests.a.test_y" name="test_short_wait" time="2.0">'
        '<properties><property name="cpu_s" value="0.0"/></properties></testcase>'
        '</testsuite></testsuites>')
    assert junit.main([str(tmp_path / "j.xml")]) == 0
    out = capsys.readouterr().out
    assert [line.split() for line in out.splitlines()[1:3]] == [["test_x", "42.0", "95.5%", "11.9"],
                                                                ["test_y", "2.0", "4.5%", "0.0"]], out
    assert "cpu_seconds=12; mostly waiting: test_waits 30s/0 cpu-s\n" in out, out


def test_gpu_summarizes_a_gate_run(tmp_path, monkeypatch, capsys):
    """benchmarks/gpu.py reads what ci/gpu.sh leaves (faked here: the gate needs a GPU) into its summary."""
    from benchmarks import gpu

    def fake_gate(argv, cwd, env, **_):
        out = argv[2]
        (tmp_path / "junit.xml").write_text(
            '<testsuites><testsuite><testcase classname="tests.a.test_x" name="test_one" time="40.0">'
            '<properties><property name="cpu_s" value="30.0"/></properties></testcase>'
            '<testcase classname="tests.a.test_x" name="test_two" time="20.0"><skipped type="pytest.skip"/>'
            '</testcase></testsuite></testsuites>')
        with open(f"{env['FSDP_AMP_PROFILE_DIR']}/gw0.jsonl", "w") as f:
            f.write('{"event": "pool_start", "seconds": 9.5, "world_size": 4, "device": "cuda"}\n')
        assert out == str(tmp_path)
        return subprocess.CompletedProcess(argv, 0, "ci/gpu.sh: 1 GPU(s) -> pytest -n 2; torch x\n", "")

    monkeypatch.setattr(gpu.subprocess, "run", fake_gate)
    monkeypatch.setattr(sys, "argv", ["gpu", str(tmp_path)])
    gpu.main()
    out = capsys.readouterr().out
    assert "pool_start cuda" in out and "n=    1  total     9.5 s" in out, out
    assert "test_one 40s" in out.split("slowest: ")[1] and "1 checks ran in" in out, out


def test_junit_draws_each_workers_timeline_from_the_session_start(tmp_path, capsys):
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite timestamp="2026-12-07T04:00:00+00:00">'
        '<testcase classname="tests.a.test_x" name="test_a" time="10.0"><properties>'
        '<property name="worker" value="gw0"/><property name="started" value="1796616020.0"/></properties></testcase>'
        '<testcase classname="tests.a.test_x" name="test_b" time="5.0"><properties>'
        '<property name="worker" value="gw0"/><property name="started" value="1796616040.0"/></properties></testcase>'
        '<testcase classname="tests.a.test_x" name="test_c" time="1.0"><skipped type="pytest.skip"/></testcase>'
        '</testsuite></testsuites>')
    assert junit.timeline(str(tmp_path / "j.xml")) == {"gw0": (2, 20.0, 45.0, 15.0)}
    assert junit.main([str(tmp_path / "j.xml")]) == 0
    assert "gw0: 2 tests from 20 s to 45 s, busy 15 s of those 25 s\n" in capsys.readouterr().out


def test_gpu_processes_names_each_process_nvidia_smi_lists():
    """benchmarks/gpu_processes.py (ci/gpu.sh samples it): whose memory, from /proc; a process that ended in
    between gets empty fields, not an error that would end the sampling."""
    from benchmarks import gpu_processes

    ended = 2**22 + 7  # above Linux's pid_max default: no such process
    child = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 30
        while _cmdline(child.pid) != "sleep\0" + "30\0" and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd: before, /proc shows its parent's command line, or none
        rows = gpu_processes.rows(f"{child.pid}, 812\n{ended}, 500\nNo running processes found\n", now=12.34)
    finally:
        child.kill()
        child.wait()
    assert rows[0] == dict(time=12.3, pid=str(child.pid), ppid=str(os.getpid()), mib="812", name="sleep",
                           command="sleep 30")
    assert rows[1] == dict(time=12.3, pid=str(ended), ppid="", mib="500", name="", command="")
    assert len(rows) == 2


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read()


@pytest.mark.parametrize("module, args, says", [
    ("benchmarks.gpu_processes", ["{tmp}/out.csv", "1"], "benchmarks.gpu_processes needs nvidia-smi"),
    ("benchmarks.context_count", [], "benchmarks.context_count needs a GPU"),
])
def test_a_gpu_benchmark_without_nvidia_smi_says_so(tmp_path, module, args, says):
    env = dict(clean_env(), PATH=str(tmp_path))  # no nvidia-smi on it, whatever the machine
    proc = subprocess.run([sys.executable, "-m", module, *(a.format(tmp=tmp_path) for a in args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and says in proc.stderr, proc.stderr


def test_context_count_counts_the_contexts_held_until_the_first_failure(tmp_path, monkeypatch, capsys):
    from benchmarks import context_count

    # a stand-in for the driver: the first 5 processes get a context, the rest fail as the GPU's limit does
    monkeypatch.setattr(context_count, "CHILD", f"""
import os, sys
n = len(os.listdir({str(tmp_path)!r}))
open(os.path.join({str(tmp_path)!r}, str(n)), "w").close()
print("ok" if n < 5 else "cuDevicePrimaryCtxRetain returned CUresult 2", flush=True)
sys.stdin.read()
""")
    monkeypatch.setattr(context_count, "visible_gpus", lambda: 1)
    monkeypatch.setattr(context_count, "gpu_memory_mib", lambda gpu, field: 4321.0)
    monkeypatch.setattr(sys, "argv", ["context_count", "--limit", "50"])
    context_count.main()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "max_contexts=5; process 6 failed: cuDevicePrimaryCtxRetain returned CUresult 2, with 4321 MiB of GPU "
        "memory in use")
    assert len(os.listdir(tmp_path)) == 8, "it stops at the third failure"
