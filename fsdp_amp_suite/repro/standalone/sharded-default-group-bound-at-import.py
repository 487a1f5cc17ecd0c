"""ShardedGradScaler cannot be pickled when its module was first imported after init_process_group

ShardedGradScaler.__init__'s default `process_group=dist.group.WORLD` is evaluated once, when the module is
imported: None if no process group exists yet, the WORLD ProcessGroup object if one does. The scaler keeps
it in self.process_group (fairscale's: self.group), and GradScaler.__getstate__ copies __dict__, so a scaler
built with the default in a process that imported the module after init_process_group (a lazy import, as
frameworks make) raises TypeError on pickle.dumps / copy.deepcopy / torch.save(scaler): ProcessGroups do not
pickle. Imported before init, the same line pickles; given process_group=dist.group.WORLD explicitly, it never
does. torch.amp.GradScaler pickles at the start or end of an iteration (it was made picklable for spawn-based
launchers, pytorch#38296). Seen on torch 2.13.0 and 2.15.0 CPU (1-rank gloo group); fairscale 0.4.13's
ShardedGradScaler has the same default.

    python sharded-default-group-bound-at-import.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/sharded_grad_scaler.py, `ShardedGradScaler.__init__(...,
process_group: ProcessGroup | None = dist.group.WORLD)`: a default evaluated at import, stored on the
instance and pickled by the inherited `GradScaler.__getstate__`. fairscale/optim/grad_scaler.py,
`ShardedGradScaler.__init__(..., process_group: Any = dist.group.WORLD)` alike.

Fix: default `process_group=None` (collectives with group=None use WORLD); and a `__getstate__` that stores
a WORLD group as None, so the copy uses its own process's WORLD. --with-fix does the second.

Related: pytorch#38296 (GradScaler made picklable for spawn), pytorch#12168 and pytorch#73825 (process
groups do not pickle).
"""
import argparse
import datetime
import pickle
import sys
import warnings

import torch
import torch.distributed as dist


def apply_fix(scaler_class):
    """The proposed fix, monkeypatched: __getstate__ stores the WORLD group as None."""
    original = scaler_class.__getstate__

    def __getstate__(self):
        state = original(self)
        if state.get("process_group") is not None and state["process_group"] is dist.group.WORLD:
            state["process_group"] = None
        return state

    scaler_class.__getstate__ = __getstate__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    # imported after init_process_group, as a framework's lazy import is
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if args.with_fix:
        apply_fix(ShardedGradScaler)
    scaler = ShardedGradScaler(device="cpu", init_scale=1024.0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()  # the end of an iteration: GradScaler's documented point to pickle
    try:
        copy = pickle.loads(pickle.dumps(scaler))
        got = f"the copy has scale {copy.get_scale()}"
    except TypeError as exc:
        got = f"TypeError: {exc}"
    dist.destroy_process_group()
    want = f"the copy has scale {scaler.get_scale()}"
    print(f"observed: pickle.dumps(ShardedGradScaler(device='cpu')) after update(): {got}")
    print(f"expected: {want}")
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
