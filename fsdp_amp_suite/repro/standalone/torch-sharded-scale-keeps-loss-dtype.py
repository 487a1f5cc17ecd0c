"""ShardedGradScaler.scale() keeps an fp16 loss in fp16: the scaled loss it returns is inf where torch's is finite

torch's ShardedGradScaler.scale() casts the scaled output back to the output's dtype (on purpose: "For the
FSDP + Mixed Precision use case, the loss output is in the Mixed Precision format (fp16, bf16) and so the scaled
loss should be of the same dtype"). A 0-dim fp16 loss times the float32 scale is float32 in torch's arithmetic,
and that is what torch.amp.GradScaler returns; cast back, any loss * scale above 65504 is inf. The grads are
not affected (the cast's backward passes the scale through, and a step is skipped only for a non-finite grad),
but code that reads the scaled loss does: a NaN/inf guard on it, or a log of it, sees an overflow that did not
happen. Under FSDP fp16 mixed precision without autocast the loss is fp16, and every loss above 65504 / scale
(2.0 at a scale of 2**15) comes back inf. Seen on torch 2.13.0 and 2.15.0 CPU.

    python torch-sharded-scale-keeps-loss-dtype.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/sharded_grad_scaler.py, `ShardedGradScaler.scale`: `return
scaled_output.type(outputs.dtype)` (and `scaled_val.type(val.dtype)` for iterables).

Fix: return the product as torch.amp.GradScaler does (a 0-dim low-precision loss is promoted to float32,
a tensor with dims keeps its dtype by the usual promotion rules); the backward makes the same grads.
--with-fix makes ShardedGradScaler.scale return `outputs * scale` uncast.

Related: none found.
"""
import argparse
import datetime
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: scale() of a tensor returns the uncast product."""
    original = ShardedGradScaler.scale

    def scale(self, outputs):
        if not (self._enabled and isinstance(outputs, torch.Tensor)):
            return original(self, outputs)
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        return outputs * self._scale.to(device=outputs.device, non_blocking=True)

    ShardedGradScaler.scale = scale


def scaled_losses() -> tuple[str, bool]:
    got = {}
    for name, scaler in (("ShardedGradScaler", ShardedGradScaler(device="cpu", init_scale=2.0**15)),
                         ("torch.amp.GradScaler", torch.amp.GradScaler("cpu", init_scale=2.0**15))):
        got[name] = scaler.scale(torch.tensor(4.0, dtype=torch.float16))
    text = "; ".join(f"{k}: {v.item()} ({v.dtype})" for k, v in got.items())
    return f"scale(fp16 loss 4.0) at scale 2**15: {text}", all(v.isfinite() for v in got.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    # a 1-rank group, as a job's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    got, fine = scaled_losses()
    want = "131072.0 with both (a float32 product, as torch.amp.GradScaler returns)"
    dist.destroy_process_group()
    print(f"observed: {got}")
    print(f"expected: {want}")
    return 0 if fine else 1


if __name__ == "__main__":
    sys.exit(main())
