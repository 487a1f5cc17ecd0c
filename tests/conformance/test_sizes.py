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

from fsdp_amp_suite.conformance.problem import DTYPES, Problem, build_scaler, device_mode, placement_params
from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.scalers import make_scaler

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("model sizes")]

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
                       device=device_mode(placement, 1), timeout=120)[0]
    if where == "clean":
        assert out["exact"], f"{shape}: a clean step must leave every grad exactly unscaled"
        assert (out["stepped"], out["scale"]) == (out["n"], 256.0), f"{shape}: a clean step applies to every param"
    else:
        assert (out["stepped"], out["scale"]) == (0, 128.0), (
            f"{shape}: an inf in the {where} element of the {where} grad must skip the step (params changed: "
            f"{out['stepped']} of {out['n']}) and back off once (scale {out['scale']}, want 128.0)")


# ------------------------------------------------------------------ past 2**31 elements (CUDA only)
# Multi-tensor kernels index with 32 bits in places: an element past 2**31 is where such a kernel wraps
# around. One grad of HUGE elements: 4 GiB in fp16/bf16, 8 GiB in fp32; grad and param both on the GPU.
HUGE = 2**31 + 17
HUGE_BYTES_PER_ELEMENT = {"float16": 2, "bfloat16": 2, "float32": 4}
HEADROOM = 3  # param + grad, and as much again for the kernels' temporaries (the bf16 isfinite fallback)


def _huge_step(spec, dtype, where):
    free = torch.cuda.mem_get_info()[0]
    need = HEADROOM * HUGE * HUGE_BYTES_PER_ELEMENT[dtype]
    if free < need:
        return dict(skip=f"a grad of 2**31 + 17 {dtype} elements needs {need / 2**30:.0f} GiB free on the GPU, "
                         f"{free / 2**30:.0f} GiB are")
    p = torch.nn.Parameter(torch.zeros(HUGE, dtype=DTYPES[dtype], device="cuda"))
    try:
        opt = torch.optim.SGD([p], lr=0.5)
        s = make_scaler(spec, device="cuda", init_scale=256.0)
        s.scale(torch.ones((), device="cuda"))  # sets the scale's device, as a scaled loss would
        p.grad = torch.full((HUGE,), 256.0 * 0.25, dtype=p.dtype, device="cuda")  # scale * the true grad 0.25
        if where == "last":
            p.grad[-1] = math.inf
        s.unscale_(opt)
        ends = [p.grad[i].item() for i in (0, 2**31 - 1, 2**31, HUGE - 1)]
        s.step(opt)
        s.update()
        moved = [p[i].item() for i in (0, 2**31 - 1, 2**31, HUGE - 1)]
        return dict(ends=ends, moved=moved, scale=s.get_scale())
    finally:  # the pool's rank outlives the task: a step that raised must not keep 8-16 GiB cached either
        p.grad, p.data = None, torch.empty(0, dtype=p.dtype, device="cuda")
        torch.cuda.empty_cache()


@pytest.mark.parametrize("where", ["clean", "last"])
@pytest.mark.parametrize("dtype", sorted(HUGE_BYTES_PER_ELEMENT))
@pytest.mark.parametrize("placement", placement_params(["cuda"]))
def test_an_overflow_past_2_31_elements_is_seen(scaler, placement, dtype, where):
    # memory_heavy: the free-memory check and the allocation are one turn among such tasks of every worker
    out = run_on_ranks(_huge_step, scaler, dtype, where, world_size=1, device=device_mode(placement, 1),
                       timeout=120, memory_heavy=True)[0]
    if "skip" in out:
        pytest.skip(out["skip"])
    if where == "clean":
        assert out["ends"][1:] == [0.25] * 3, (
            f"elements 2**31 - 1, 2**31 and the last of a clean grad must be unscaled exactly to 0.25: {out['ends']}")
        assert out["moved"] == [-0.125] * 4 and out["scale"] == 256.0, (
            f"a clean step applies to every element (want -0.125 at 0, 2**31 - 1, 2**31, last): {out}")
    else:
        assert out["moved"] == [0.0] * 4 and out["scale"] == 128.0, (
            f"an inf in element 2**31 + 16 must skip the step and back off once: params {out['moved']}, "
            f"scale {out['scale']} (want 128.0)")
