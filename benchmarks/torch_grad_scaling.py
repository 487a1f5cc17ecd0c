"""How many of PyTorch's own grad-scaling tests pass with DeviceSplitGradScaler swapped in for torch's scalers, on CPU.

    python -m benchmarks.torch_grad_scaling --torch-src DIR [--ref LABEL] [--pythonpath DIR]
    python -m benchmarks.torch_grad_scaling --git-dir MIRROR.git [--ref v2.13.0]

DIR holds torch's test files as in its repository: test/test_torch.py (the CPU instantiations of
TestTorchDeviceType's grad-scaling tests: test_grad_scaling_*, test_grad_scale_will_not_overflow,
test_grad_scaler_*, test_pickle_gradscaler, test_params_invalidated_*) and
test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py (all of it). With --git-dir both are read with
`git show REF:path` (REF: --ref, else the tag v<installed torch version> if the mirror has it, else HEAD).
torch.testing._internal needs `expecttest`; --pythonpath adds a folder that holds it (pip install --target).

Two child pytest runs, one after the other, single process (-p no:xdist, --noconftest, our own empty ini, one
intra-op thread): first torch's own scalers (the baseline), then ours. For ours, a plugin loaded with -p, so
before any test module imports, rebinds torch.GradScaler, torch.amp(.grad_scaler).GradScaler,
torch.cpu/cuda.amp(.grad_scaler).GradScaler and torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler to
subclasses of scaler_impl.DeviceSplitGradScaler with each original's constructor signature (ShardedGradScaler's
backoff-before-growth order and process_group; its default, the WORLD bound at import, becomes ours: WORLD at call
time). The deprecated torch.cpu/cuda.amp aliases keep torch's FutureWarning, text taken from the original.
Proof the swap is real: every construction is appended from inside the child to a file, with whether the object
is a DeviceSplitGradScaler; at the end the child lists any module that still binds one of torch's classes.

Counted: the tests that ran (were not skipped) in the torch baseline; under ours, one of them skipped or missing
counts as failed. Prints one line per failing test and run with its first error line, a line on what was
skipped, `ours_constructed=<k>`, then the last line:
torch=<version> ref=<ref> tests=<N> ours_passed=<a> ours_failed=<b> torch_passed=<c> torch_failed=<d>.
Exits 1 when no DeviceSplitGradScaler was constructed (or a test module kept torch's class), 2 when a run broke.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TORCH_FILE = "test/test_torch.py"
SHARDED_FILE = "test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py"
SELECT = ("(TestTorchDeviceTypeCPU and (grad_scal or gradscaler or params_invalidated))"
          " or TestShardGradScaler or TestShardedGradScalerParityWithDDP")
PLUGIN = "_torch_grad_scaling_swap"
PLUGIN_SOURCE = textwrap.dedent('''
    """Rebinds torch's grad scalers to DeviceSplitGradScaler subclasses; loaded with -p, before test modules import."""
    import json
    import os
    import sys
    import warnings

    import torch
    import torch.amp.grad_scaler
    import torch.cpu.amp
    import torch.cpu.amp.grad_scaler
    import torch.cuda.amp
    import torch.cuda.amp.grad_scaler
    import torch.distributed.fsdp.sharded_grad_scaler as sharded

    from scaler_impl import DeviceSplitGradScaler

    ORIGINALS = (torch.amp.grad_scaler.GradScaler, torch.cpu.amp.grad_scaler.GradScaler,
                 torch.cuda.amp.grad_scaler.GradScaler, sharded.ShardedGradScaler)
    LOG = os.environ["TORCH_GRAD_SCALING_LOG"]
    _TORCH_DEFAULT_GROUP = object()


    def _record(scaler):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(LOG, "a") as f:
            f.write(json.dumps({"class": type(scaler).__name__, "test": test,
                                "ours": isinstance(scaler, DeviceSplitGradScaler)}) + "\\n")


    def _deprecation(original):
        return getattr(original.__init__, "__deprecated__", None)


    class AmpGradScaler(DeviceSplitGradScaler):
        """torch.amp.GradScaler's signature."""

        def __init__(self, device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000, enabled=True):
            super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
            _record(self)


    class CpuAmpGradScaler(AmpGradScaler):
        """torch.cpu.amp.GradScaler's signature and deprecation warning."""
        MESSAGE = _deprecation(torch.cpu.amp.grad_scaler.GradScaler)

        def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                     enabled=True):
            if self.MESSAGE:
                warnings.warn(self.MESSAGE, FutureWarning, stacklevel=2)
            super().__init__("cpu", init_scale, growth_factor, backoff_factor, growth_interval, enabled)


    class CudaAmpGradScaler(AmpGradScaler):
        """torch.cuda.amp.GradScaler's signature and deprecation warning."""
        MESSAGE = _deprecation(torch.cuda.amp.grad_scaler.GradScaler)

        def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                     enabled=True):
            if self.MESSAGE:
                warnings.warn(self.MESSAGE, FutureWarning, stacklevel=2)
            super().__init__("cuda", init_scale, growth_factor, backoff_factor, growth_interval, enabled)


    class ShardedGradScaler(DeviceSplitGradScaler):
        """torch's ShardedGradScaler signature: backoff_factor before growth_factor, then process_group."""

        def __init__(self, device="cuda", init_scale=2.0**16, backoff_factor=0.5, growth_factor=2.0,
                     growth_interval=2000, enabled=True, process_group=_TORCH_DEFAULT_GROUP):
            group = None if process_group is _TORCH_DEFAULT_GROUP else process_group  # None: WORLD at call time
            super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled,
                             process_group=group)
            _record(self)


    REPLACEMENT = dict(zip(ORIGINALS, (AmpGradScaler, CpuAmpGradScaler, CudaAmpGradScaler, ShardedGradScaler)))


    def _bindings():
        """(module, name, original) for every module attribute still bound to one of torch's classes."""
        for name, module in list(sys.modules.items()):
            if module is None or name == __name__:
                continue
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for attr, value in items:
                if isinstance(value, type) and value in REPLACEMENT:
                    yield module, attr, value


    for _module, _attr, _original in list(_bindings()):
        setattr(_module, _attr, REPLACEMENT[_original])


    def pytest_sessionfinish(session):
        kept = sorted(f"{m.__name__}.{a}" for m, a, _ in _bindings())
        with open(LOG, "a") as f:
            f.write(json.dumps({"unswapped": kept}) + "\\n")
''')


def git(git_dir: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=False, capture_output=True,
                          text=True)


def from_mirror(git_dir: str, ref: str | None, into: Path) -> str:
    """Write the two test files at REF into `into`; returns the ref used (and says when HEAD stands in)."""
    if ref is None:
        tag = "v" + torch.__version__.split("+")[0]
        if git(git_dir, "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}").returncode == 0:
            ref = tag
        else:
            ref = "HEAD"
            print(f"tag {tag} is not in {git_dir}: using its HEAD")
    sha = git(git_dir, "rev-parse", "--verify", f"{ref}^{{commit}}").stdout.strip()
    for path in (TORCH_FILE, SHARDED_FILE):
        shown = git(git_dir, "show", f"{ref}:{path}")
        if shown.returncode != 0:
            raise SystemExit(f"{ref}:{path}: {shown.stderr.strip()}")
        (into / path).parent.mkdir(parents=True, exist_ok=True)
        (into / path).write_text(shown.stdout)
    return f"{ref}@{sha[:12]}" if sha and sha != ref else ref


def worktree_ref(src: Path) -> str:
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], check=False, capture_output=True,
                          text=True)
    return head.stdout.strip()[:12] if head.returncode == 0 and head.stdout.strip() else "unknown"


def child_env(extra_paths: list[str], plugin_dir: Path | None, log: Path, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TORCH_GRAD_SCALING_"))}
    paths = ([str(plugin_dir)] if plugin_dir else []) + [str(ROOT)] + extra_paths
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1", TORCH_GRAD_SCALING_LOG=str(log),
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
    return env


def run_pytest(python: str, src: Path, work: Path, which: str, env: dict, timeout: int) -> dict:
    """One child pytest run; returns {test id: (outcome, first line)} from its JUnit XML."""
    xml, out = work / f"{which}.xml", work / f"{which}.log"
    cmd = [python, "-m", "pytest", "-c", str(work / "pytest.ini"), "--rootdir", str(src), "--noconftest",
           "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={xml}", "-k", SELECT,
           str(src / TORCH_FILE), str(src / SHARDED_FILE)]
    if which == "ours":
        cmd[3:3] = ["-p", PLUGIN]
    with open(out, "w") as f:
        proc = subprocess.run(cmd, check=False, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              preexec_fn=lambda: os.nice(5))
    if proc.returncode not in (0, 1) or not xml.exists():
        tail = out.read_text()[-4000:]
        print(f"the {which} run broke (pytest exit {proc.returncode}):\n{tail}", file=sys.stderr)
        raise SystemExit(2)  # the docstring's "2 when a run broke"
    return outcomes(xml)


def outcomes(xml: Path) -> dict:
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            results[test] = ("failed", first_line(bad))
        elif skipped is not None:
            results[test] = ("skipped", first_line(skipped))
        else:
            results[test] = ("passed", "")
    return results


def junit_id(nodeid: str) -> str:
    """A pytest node id (path/to/test_x.py::Class::test) as outcomes() names it (path.to.test_x.Class::test)."""
    path, *names = nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *names[:-1]]) + "::" + (names[-1] if names else "")


def first_line(element) -> str:
    for text in (element.get("message"), element.text):
        for line in (text or "").splitlines():
            if line.strip():
                return line.strip()[:300]
    return element.tag


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src_arg = ap.add_mutually_exclusive_group(required=True)
    src_arg.add_argument("--torch-src", help="folder holding torch's test/ files")
    src_arg.add_argument("--git-dir", help="a (bare) torch git mirror to read the test files from")
    ap.add_argument("--ref", help="with --git-dir the ref to read (default v<torch version>, else HEAD); "
                                  "with --torch-src only the label printed")
    ap.add_argument("--pythonpath", action="append", default=[],
                    help="folder for the child's sys.path (e.g. one holding expecttest); repeatable")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the child runs")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of the child runs")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds a child run may take")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="torch_grad_scaling-") as tmp:
        work = Path(tmp)
        if args.git_dir:
            src = work / "torch-src"
            ref = from_mirror(args.git_dir, args.ref, src)
        else:
            src = Path(args.torch_src).resolve()
            ref = args.ref or worktree_ref(src)
        missing = [p for p in (TORCH_FILE, SHARDED_FILE) if not (src / p).is_file()]
        if missing:
            raise SystemExit(f"{src} lacks {missing}")
        (work / "pytest.ini").write_text("[pytest]\n")
        plugin_dir = work / "plugin"
        plugin_dir.mkdir()
        (plugin_dir / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
        log = work / "constructions.jsonl"

        base_env = child_env(args.pythonpath, None, work / "unused.jsonl", args.threads)
        code = "import torch, torch.testing._internal.common_utils; print(torch.__version__)"
        probe = subprocess.run([args.python, "-c", code], check=False, env=base_env, capture_output=True, text=True)
        if probe.returncode != 0:
            print(probe.stderr[-2000:])
            print("torch.testing._internal does not import in the child (expecttest missing? see --pythonpath)")
            return 2
        version = probe.stdout.strip().splitlines()[-1]

        theirs = run_pytest(args.python, src, work, "torch", base_env, args.timeout)
        ours = run_pytest(args.python, src, work, "ours", child_env(args.pythonpath, plugin_dir, log, args.threads),
                          args.timeout)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    counted = sorted(t for t, (outcome, _) in theirs.items() if outcome != "skipped")
    for test in counted:
        for which, results in (("ours", ours), ("torch", theirs)):
            outcome, line = results.get(test, ("missing", "not run"))
            if outcome != "passed":
                print(f"FAIL {which} {test}: {line if outcome == 'failed' else f'{outcome} under ours: {line}'}")
    skipped = collections.Counter(line for outcome, line in theirs.values() if outcome == "skipped")
    print(f"skipped_on_this_machine={sum(skipped.values())} "
          + "; ".join(f"{n} x {reason!r}" for reason, n in skipped.most_common()))

    built = [r for r in records if "class" in r]
    constructed = sum(r["ours"] for r in built)
    unswapped = next((r["unswapped"] for r in records if "unswapped" in r), None)
    by_class = collections.Counter(r["class"] for r in built)
    with_scaler = {junit_id(r["test"]) for r in built}
    without = [t for t in counted if t not in with_scaler]
    print(f"ours_tests_without_a_scaler={len(without)} {[t.rsplit('::', 1)[1] for t in without]}")
    if unswapped:
        print(f"unswapped_bindings={unswapped}")
    print(f"ours_constructed={constructed} ({dict(by_class)}; not ours: {len(built) - constructed})")
    ours_passed = sum(ours.get(t, ("missing",))[0] == "passed" for t in counted)
    torch_passed = sum(theirs[t][0] == "passed" for t in counted)
    print(f"torch={version} ref={ref} tests={len(counted)} ours_passed={ours_passed} "
          f"ours_failed={len(counted) - ours_passed} torch_passed={torch_passed} "
          f"torch_failed={len(counted) - torch_passed}")
    kept_in_tests = [b for b in unswapped or [] if b.startswith(("test_", "torch.testing._internal"))]
    return 1 if constructed == 0 or constructed != len(built) or kept_in_tests else 0


if __name__ == "__main__":
    sys.exit(main())
