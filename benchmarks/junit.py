"""Where a run's time went: worker-seconds per test file, from the JUnit XML of any run of the suite.

    python -m benchmarks.junit JUNIT.xml [JUNIT.xml ...]     e.g. ci-out/junit.xml ci-out/meta-junit.xml

Prints, per file, the seconds its tests took summed over workers (what -n N divides), the share of the total,
and the slowest tests. Where the run loaded benchmarks/cputime.py (ci/cpu.sh does), also the CPU-seconds per file,
the tests that mostly waited, and each worker's timeline: when its first test started and its last one ended,
counted from the session's start, and how busy it was in between. Last line: worker_seconds=<total>. ci/cpu.sh
and ci/gpu.sh write the XML (--junitxml); benchmarks/gpu.py reads the GPU gate's through per_file().
"""
import collections
import datetime
import sys
import xml.etree.ElementTree as ET


WAITED = (10.0, 0.2)  # a test of >= 10 s that used under a fifth of a core: it mostly waited


def cases(path: str) -> list[tuple[str, str, float, bool, float | None]]:
    """(file, test id, seconds, ran, CPU-seconds) per testcase; ran: not skipped (an xfail ran); CPU-seconds:
    benchmarks/cputime.py's cpu_s property, None where the run did not record it."""
    out = []
    for case in ET.parse(path).iter("testcase"):
        skipped = case.find("skipped")
        classname = case.get("classname", "")
        cpu = [float(p.get("value")) for p in case.iter("property") if p.get("name") == "cpu_s"]
        out.append((classname.split(".")[-1] or "?", f"{classname}::{case.get('name')}", float(case.get("time", 0)),
                    skipped is None or skipped.get("type") == "pytest.xfail", cpu[0] if cpu else None))
    return out


def per_file(rows, column: int = 2) -> collections.Counter:
    """Each file's sum of a column of cases(): 2 worker-seconds (the default), 4 CPU-seconds (None counts 0)."""
    total = collections.Counter()
    for row in rows:
        total[row[0]] += row[column] or 0.0
    return total


def timeline(path: str) -> dict[str, tuple[int, float, float, float]]:
    """worker -> (tests, first start, last end, busy seconds), in seconds from the session's start (the suite's
    timestamp), from benchmarks/cputime.py's worker and started properties; {} where the run did not record them."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None or not suite.get("timestamp"):
        return {}
    origin = datetime.datetime.fromisoformat(suite.get("timestamp")).timestamp()
    runs = collections.defaultdict(list)
    for case in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "worker" in props and "started" in props:
            start = float(props["started"]) - origin
            runs[props["worker"]].append((start, start + float(case.get("time", 0))))
    return {w: (len(r), min(s for s, _ in r), max(e for _, e in r), sum(e - s for s, e in r))
            for w, r in sorted(runs.items())}


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        sys.exit(__doc__)
    rows = [row for path in paths for row in cases(path)]
    files = per_file(rows)
    total = sum(files.values())
    cpu = per_file(rows, 4)
    has_cpu = any(row[4] is not None for row in rows)
    print(f"{'file':40s} {'worker-s':>9s} {'share':>6s}" + (f" {'cpu-s':>8s}" if has_cpu else ""))
    for file, seconds in files.most_common():
        print(f"{file:40s} {seconds:9.1f} {seconds / total:6.1%}" + (f" {cpu[file]:8.1f}" if has_cpu else ""))
    if has_cpu:
        waited = [(s, c, name) for _, name, s, _, c in rows if c is not None and s >= WAITED[0] and c < WAITED[1] * s]
        print(f"cpu_seconds={sum(cpu.values()):.0f}; mostly waiting: " + ("; ".join(
            f"{name.split('::', 1)[-1][:70]} {s:.0f}s/{c:.0f} cpu-s" for s, c, name in sorted(waited)[-8:]) or "none"))
    for path in paths:
        for worker, (n, first, last, busy) in timeline(path).items():
            print(f"{worker}: {n} tests from {first:.0f} s to {last:.0f} s, busy {busy:.0f} s of those "
                  f"{last - first:.0f} s")
    print("slowest: " + "; ".join(f"{name.split('::', 1)[-1][:70]} {s:.0f}s" for _, name, s, *_ in
                                   sorted(rows, key=lambda r: r[2])[-8:]))
    print(f"{sum(r[3] for r in rows)} checks ran, {len(rows)} collected")
    print(f"worker_seconds={total:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
