"""Which processes hold the GPU's memory, every few seconds, until killed (ci/gpu.sh runs it beside the gate).

    python -m benchmarks.gpu_processes OUT.csv [SECONDS]

One CSV row per process with a CUDA context per sample: time, pid, parent pid, MiB in use, its name
(/proc/PID/comm: a pool rank names itself rankRofW:DEVICE, fsdp_amp_suite/harness/rank_process.py) and the start of
its command line. gpu-memory.csv says how much; this says whose: pool ranks (budgeted by
fsdp_amp_suite/harness/budget.py), pytest workers, child runs.
"""
import csv
import shutil
import subprocess
import sys
import time

FIELDS = ["time", "pid", "ppid", "mib", "name", "command"]


def rows(apps: str, now: float) -> list[dict]:
    """The rows for nvidia-smi's `--query-compute-apps=pid,used_memory --format=csv,noheader,nounits` output."""
    out = []
    for line in apps.splitlines():
        pid, _, mib = line.partition(",")
        if not pid.strip().isdigit():
            continue
        pid = pid.strip()
        out.append(dict(time=round(now, 1), pid=pid,
                        ppid=_read(f"/proc/{pid}/stat", lambda s: s.rsplit(")", 1)[1].split()[1]),
                        mib=mib.strip(), name=_read(f"/proc/{pid}/comm", str.strip),
                        command=_read(f"/proc/{pid}/cmdline", lambda s: s.replace("\0", " ").strip()[:120])))
    return out


def _read(path: str, parse) -> str:
    try:
        with open(path, errors="replace") as f:
            return parse(f.read())
    except (OSError, IndexError):
        return ""  # the process ended between nvidia-smi's answer and this read


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    every = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    if shutil.which("nvidia-smi") is None:
        sys.exit("benchmarks.gpu_processes needs nvidia-smi (a machine with an NVIDIA driver)")
    with open(sys.argv[1], "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        while True:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            writer.writerows(rows(apps, time.time()))
            f.flush()
            time.sleep(every)


if __name__ == "__main__":
    main()
