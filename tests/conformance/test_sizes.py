"""Sizes like real models: an overflow anywhere in many grads, or deep inside a big one, is seen.

A model under use_orig_params / FSDP2 hands the scaler hundreds of grads per optimizer, and
multi-tensor kernels walk them in list chunks of a few dozen tensors and each tensor in chunks of
65536 elements (CUDA). A defect past the first few dozen tensors or past the first chunk is
invisible to the 3-parameter, 6-element problem of the other files. Two shapes: "many" (320 grads
of mixed sizes, two param groups) and "big" (3 grads of three chunks and a bit); the inf goes in
the first element of the first grad, or in the last element of the last grad (of the last group).
A clean step must unscale every grad exactly; an overflow must skip the step and back off once.
"""
import math

import pytest
import torch

from tests.conformance.problem import Problem, build_scaler, harness_device, placement_params
from tests.harness import run_on_ranks

pytestmark = pytest.mark.conformance

CHUNK = 65536  # elements per chunk of CUDA's multi-tensor apply
SHAPES = {
    "many": dict(n_params=320, numel=[1 + (i * 37) % 97 for i in range(320)]),
    "big": dict(n_params=3, numel=3 * CHUNK + 7),
}


def _sized_step(spec, placement, shape, where):
    pb = Problem(placement, **SHAPES[shape])
    half = len(pb.params) // 2
    opt = torch.optim.SGD([{"params": pb.params[:half]}, {"params": pb.params[half:]}], lr=0.5)
    s = build_scaler(spec, pb, init_scale=256.0)
    before = pb.snapshot()
    pb.backward(s)
    if where != "clean":
        grad = pb.params[0 if where == "first" else -1].grad
        with torch.no_grad():
            grad.view(-1)[0 if where == "first" else -1] = math.inf
    s.unscale_(opt)
    exact = all(torch.equal(p.grad.cpu(), c.cpu()) for p, c in zip(pb.params, pb.targets))  # d(p.c)/dp = c
    s.step(opt)
    s.update()
    changed = [not torch.equal(a, b) for a, b in zip(pb.snapshot(), before)]
    return dict(exact=exact, stepped=sum(changed), scale=s.get_scale(), n=len(changed))


@pytest.mark.parametrize("where", ["clean", "first", "last"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("placement", placement_params(["cpu", "cuda", "mixed"]))
def test_an_overflow_anywhere_in_a_model_sized_problem_is_seen(scaler, placement, shape, where):
    out = run_on_ranks(_sized_step, scaler, placement, shape, where, world_size=1,
                       device=harness_device(placement, 1), timeout=120)[0]
    if where == "clean":
        assert out["exact"], f"{shape}: a clean step must leave every grad exactly unscaled"
        assert (out["stepped"], out["scale"]) == (out["n"], 256.0), f"{shape}: a clean step applies to every param"
    else:
        assert (out["stepped"], out["scale"]) == (0, 128.0), (
            f"{shape}: an inf in the {where} element of the {where} grad must skip the step (params changed: "
            f"{out['stepped']} of {out['n']}) and back off once (scale {out['scale']}, want 128.0)")
