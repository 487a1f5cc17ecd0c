"""Cost of one 2-rank case through the persistent rank pool vs. fresh ranks per case (isolation mode), and
what a rank's start costs forked from the preloaded fork server vs. spawned.

    python -m benchmarks.harness [--n 10]

The case: a tiny MLP under torch FSDP on CPU (gloo, 2 ranks), 3 SGD steps with a scaler. Both
engines run it N times in this one process; the first pooled run (which starts the pool) is
reported apart. Then N 2-rank pools are started and stopped each way, their CPU-seconds read from
/proc with every rank's (benchmarks.cputime). Last lines: start_cpu_ratio=<spawned CPU-s per pool /
forked CPU-s per pool>, pool_speedup=<isolated seconds per case / pool seconds per case>.
"""
import argparse
import statistics
import sys
import time

from benchmarks.cases import fsdp_mlp_three_steps
from benchmarks.cputime import tree_cpu
from fsdp_amp_suite.harness import Harness
from fsdp_amp_suite.harness.pool import RankPool


def timed(harness, n):
    times, results = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        results.append(harness.run(fsdp_mlp_three_steps, world_size=2))
        times.append(time.perf_counter() - t0)
    return times, results


def start_cost(method: str, n: int) -> tuple[float, float]:
    """Wall seconds and CPU-seconds per 2-rank CPU pool started and stopped with `method`."""
    t0, cpu0 = time.perf_counter(), tree_cpu()
    for _ in range(n):
        RankPool(2, "gloo", "cpu", [], [], start_method=method).shutdown()
    return (time.perf_counter() - t0) / n, (tree_cpu() - cpu0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
    server = start_cost("forkserver", 1)  # the first pool starts the fork server (its imports: once per process)
    with Harness() as pooled:
        t0 = time.perf_counter()
        first = pooled.run(fsdp_mlp_three_steps, world_size=2)
        start_up = time.perf_counter() - t0
        pool_times, pool_results = timed(pooled, args.n)
    with Harness(isolate=True) as isolated:
        fresh_times, fresh_results = timed(isolated, args.n)
    forked, spawned = start_cost("forkserver", args.n), start_cost("spawn", args.n)
    same = all(all(a.equal(b) for a, b in zip(r, first)) for r in pool_results + fresh_results)
    pool, fresh = statistics.median(pool_times), statistics.median(fresh_times)
    print(f"pool start-up (start + first case): {start_up * 1e3:.0f} ms")
    print(f"pool:  median {pool * 1e3:8.1f} ms per case over {args.n} (min {min(pool_times) * 1e3:.1f})")
    print(f"fresh: median {fresh * 1e3:8.1f} ms per case over {args.n} (min {min(fresh_times) * 1e3:.1f})")
    print(f"results identical across all runs and both engines: {same}")
    print(f"first 2-rank pool, the fork server's start included: {server[0]:.2f} s, {server[1]:.2f} CPU-s")
    for name, (wall, cpu) in (("forked", forked), ("spawned", spawned)):
        print(f"2-rank pool {name:8s} (start + stop): {wall:.2f} s, {cpu:.2f} CPU-s, mean of {args.n}")
    print(f"start_cpu_ratio={spawned[1] / forked[1]:.1f}")
    print(f"pool_speedup={fresh / pool:.1f}")
    if not same:
        sys.exit("results differ between runs: the benchmark case is not deterministic")


if __name__ == "__main__":
    main()
