"""Where the GPU gate's time goes, and its throughput: checks run per minute of wall time.

    python -m benchmarks.gpu OUT_DIR [extra ci/gpu.sh / pytest args ...]

Runs `bash ci/gpu.sh OUT_DIR` with FSDP_AMP_PROFILE_DIR set (the rank harness then logs every pool
start-up, lock wait and exclusive hold), reads each test's time from the JUnit XML, and prints: the
run's wall time and workers, time per test file, pool start-ups, lock waits, exclusive holds, how
busy the workers were, the slowest tests. Last line: gpu_checks_per_minute=<checks that ran (not
skipped) / wall minutes>. Needs a GPU (ci/gpu.sh exits 2 without one).
"""
import collections
import json
import os
import re
import subprocess
import sys
import time

from benchmarks import junit
from fsdp_amp_suite import paths

ROOT = str(paths.ROOT)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out, extra = os.path.abspath(sys.argv[1]), sys.argv[2:]
    profile = os.path.join(out, "profile")
    os.makedirs(profile, exist_ok=True)
    env = dict(os.environ, FSDP_AMP_PROFILE_DIR=profile)
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "ci/gpu.sh", out, *extra], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sys.stdout.write(proc.stdout[-1500:])
    if proc.returncode not in (0, 1):
        sys.exit(f"ci/gpu.sh exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    workers = int(re.search(r"pytest -n (\d+)", proc.stdout + proc.stderr).group(1))

    rows = junit.cases(os.path.join(out, "junit.xml"))
    per_file, ran = junit.per_file(rows), sum(r[3] for r in rows)
    slow = [(seconds, name) for _, name, seconds, *_ in rows]
    events = collections.defaultdict(list)
    for name in os.listdir(profile):
        with open(os.path.join(profile, name)) as f:
            for line in f:
                e = json.loads(line)
                events[e["event"], e.get("exclusive"), e.get("device")].append(e["seconds"])

    print(f"\nwall {wall:.0f} s, {workers} workers; test time {sum(per_file.values()):.0f} s = "
          f"{sum(per_file.values()) / (wall * workers):.0%} of workers x wall")
    print("test time per file (s):  " + ", ".join(f"{f} {t:.0f}" for f, t in per_file.most_common(12)))
    for (event, exclusive, device), secs in sorted(events.items(), key=lambda kv: -sum(kv[1])):
        what = event + (f" exclusive={exclusive}" if exclusive is not None else "") + (f" {device}" if device else "")
        print(f"{what:32s} n={len(secs):5d}  total {sum(secs):7.1f} s  max {max(secs):6.1f} s")
    print("slowest: " + "; ".join(f"{name.split('::', 1)[-1][:70]} {s:.0f}s" for s, name in sorted(slow)[-8:]))
    print(f"{ran} checks ran in {wall:.0f} s wall (-n {workers})")
    print(f"gpu_checks_per_minute={ran / (wall / 60):.0f}")


if __name__ == "__main__":
    main()
