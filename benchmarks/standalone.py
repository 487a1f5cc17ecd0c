"""What a standalone repro's run costs forked from the preloaded fork server (fsdp_amp_suite/upstream/forked.py,
how the main job runs them) vs started fresh (`python FILE`, how `fsdp_amp_suite.upstream.reports --record` runs them).

    python -m benchmarks.standalone [--n 3] [--only STEM ...]

Runs each standalone file that this machine runs without CUDA (plain mode) N times each way, in this one
process, and reads each run's CPU-seconds from /proc with its children's (benchmarks.cputime). The first forked
run starts the fork server and is reported apart. Says whether both ways exited alike and printed the same
lines. Last line: standalone_start_cpu_ratio=<fresh CPU-s per run / forked CPU-s per run>.
"""
import argparse
import sys
import time

from benchmarks.cputime import tree_cpu
from fsdp_amp_suite.known_bugs import standalone_files
from fsdp_amp_suite.upstream.runs import PLAIN, run_file


def measured(stem: str, python) -> tuple[float, float, tuple]:
    """Wall seconds, CPU-seconds and (exit status, stdout) of one plain run."""
    t0, cpu0 = time.perf_counter(), tree_cpu()
    proc = run_file(stem, PLAIN, python)
    return time.perf_counter() - t0, tree_cpu() - cpu0, (proc.returncode, proc.stdout)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.standalone")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--only", action="append", default=[], metavar="STEM")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only) - set(standalone_files()))
    if unknown:
        sys.exit(f"--only: not a standalone file (fsdp_amp_suite/repro/standalone): {', '.join(unknown)}")
    stems = [s for s, shown in standalone_files().items() if shown[0].needs in ("", "dtensor")
             and (not args.only or s in args.only)]
    if not stems:
        sys.exit(f"no standalone file runs here without CUDA among {args.only or 'all'}")
    first = measured(stems[0], None)  # starts the fork server: its torch import, once per process
    runs = {"forked": [], "fresh": []}
    same = True
    for stem in stems:
        for _ in range(args.n):
            forked, fresh = measured(stem, None), measured(stem, sys.executable)
            runs["forked"].append(forked)
            runs["fresh"].append(fresh)
            same &= forked[2] == fresh[2]
    print(f"first forked run, the fork server's start included: {first[0]:.2f} s, {first[1]:.2f} CPU-s")
    for way, got in runs.items():
        print(f"{way:6s}: {sum(w for w, _, _ in got) / len(got):.2f} s, {sum(c for _, c, _ in got) / len(got):.2f} "
              f"CPU-s per run, mean of {len(got)} ({len(stems)} files x {args.n})")
    print(f"each file exited alike and printed the same lines both ways: {same}")
    cpu = {way: sum(c for _, c, _ in got) for way, got in runs.items()}
    print(f"standalone_start_cpu_ratio={cpu['fresh'] / cpu['forked']:.1f}")
    if not same:
        sys.exit("a file's forked and fresh runs differ")


if __name__ == "__main__":
    main()
