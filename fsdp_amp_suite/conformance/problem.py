"""An exact toy problem for scaler checks and a pure-Python model of the rules (the placements: placements.py).

loss = sum_i <p_i, c_i> computed on the loss device, so grad p_i == c_i exactly: with power-of-two
scales, every scaled and unscaled grad is exact in fp32, fp16 and bf16, and any deviation is a bug.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from fsdp_amp_suite.placements import CPU_PLACEMENTS, GPU_PLACEMENTS, PLACEMENTS
from fsdp_amp_suite.scalers import make_scaler

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def placement_params(names=None):
    """pytest params for placements: the GPU ones carry the gpu marker (skipped without CUDA)."""
    names = names or CPU_PLACEMENTS + GPU_PLACEMENTS
    return [pytest.param(n, id=n, marks=[pytest.mark.gpu] if PLACEMENTS[n]["scaler"] != "cpu" else [])
            for n in names]


def device_mode(placement: str, world_size: int) -> str:
    """The rank harness's device mode for a placement: CPU, NCCL on one GPU, or gloo ranks sharing it."""
    if PLACEMENTS[placement]["scaler"] == "cpu":
        return "cpu"
    return "cuda" if world_size == 1 else "cuda-shared"


def run_at(placement: str, body, *args, world_size: int = 1, timeout: float = 60) -> list:
    """run_on_ranks for a check of this placement: every rank's result."""
    from fsdp_amp_suite.harness import run_on_ranks  # the harness imports nothing of the problem; ranks import this
                                                     # module

    return run_on_ranks(body, *args, world_size=world_size, device=device_mode(placement, world_size),
                        timeout=timeout)


@contextlib.contextmanager
def deterministic_fill():
    """Uninitialised memory (torch.empty*) holds NaN for the duration, as in deterministic mode: a read of
    it shows on every run instead of only when the allocator's garbage happens to be non-zero."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def device_of(kind: str) -> torch.device:
    """A placement's device kind ("cpu" or "cuda") as this process's torch.device."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


PEAK = 0.5  # the largest |c_i| element; Problem(peak=True) puts it first in every target, on every rank


class Problem:
    """n_params parameters (round-robin over the placement's devices) with exact targets c_i."""

    def __init__(self, placement: str, dtype: str | list[str] = "float32", n_params: int = 3, seed_offset: int = 0,
                 numel: int | list[int] = 6, peak: bool = False, transposed=()):
        # dtype, numel: a list gives each param its own; transposed: the params stored as the transpose of a
        # 2-row matrix, non-contiguous, so their grads are too (autograd gives a grad its param's strides)
        spec = PLACEMENTS[placement]
        dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * n_params
        self.placement, self.dtype = placement, DTYPES[dtypes[0]]
        self.loss_device = device_of(spec["loss"])
        self.scaler_device = spec["scaler"]
        g = torch.Generator().manual_seed(1234 + seed_offset)
        self.params, self.targets = [], []
        for i in range(n_params):
            dev, dt = device_of(spec["params"][i % len(spec["params"])]), DTYPES[dtypes[i]]
            n = numel[i] if isinstance(numel, list) else numel
            p = (torch.randint(-8, 8, (n,), generator=g).to(dt) / 8).to(dev)
            c = (torch.randint(-4, 4, (n,), generator=g).to(dt) / 8).to(dev)
            if i in transposed and n:
                p, c = p.view(2, n // 2).t(), c.view(2, n // 2).t().contiguous()
            if peak and n:  # whether a low-precision grad overflows is then the same on every rank (grad_overflows)
                c.view(-1)[0] = -PEAK
            self.params.append(p.requires_grad_())
            self.targets.append(c)

    def loss(self, only=None) -> torch.Tensor:
        """sum_i <p_i, c_i> over the params in `only` (all when None): the others get no grad from it. A DTensor
        param counts its local shard (to_local's backward gives it a DTensor grad of its own placements)."""
        dev = self.loss_device
        return sum((local(p).to(dev).float() * c.to(dev).float()).sum()
                   for i, (p, c) in enumerate(zip(self.params, self.targets)) if only is None or i in only)

    def backward(self, scaler, inject: dict | None = None) -> None:
        """scaler.scale(loss).backward(); then write inject {param index: value} into grad element 0."""
        scaler.scale(self.loss()).backward()
        for i, value in (inject or {}).items():
            with torch.no_grad():
                self.params[i].grad.view(-1)[0] = value
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # an idle GPU at step(): the contract checks stay deterministic; the async-copy race
            # that a busy GPU exposes is checked on purpose in test_busy_gpu.py
            torch.cuda.synchronize()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().cpu().clone() for p in self.params]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.detach().cpu().clone() for p in self.params]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def run_steps(scaler, problem, opt, pattern, bad_index=0) -> list[float]:
    """One backward/step/update per entry of pattern (truthy: inf in grad bad_index); scale after each."""
    scales = []
    for bad in pattern:
        problem.zero_grad()
        problem.backward(scaler, inject={bad_index: math.inf} if bad else None)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def build_scaler(spec: str, problem: "Problem", **kw):
    """The scaler under test, on the device the problem's placement puts the scaler on."""
    return make_scaler(spec, device=problem.scaler_device, **kw)


def sgd(params, **kw):
    return torch.optim.SGD(params, lr=kw.pop("lr", 0.5), momentum=kw.pop("momentum", 0.9), **kw)


def reference_sgd_run(problem_args: dict, clean_steps: int, clip: float | None = None) -> list[torch.Tensor]:
    """Params after `clean_steps` SGD+momentum steps on the exact grads, with no scaler at all."""
    ref = Problem(**problem_args)
    opt = sgd(ref.params)
    for _ in range(clean_steps):
        ref.zero_grad()
        ref.loss().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.params, clip)
        opt.step()
    return ref.snapshot()


INF_VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).float().item()


# What backward and unscale_ compute, as torch's arithmetic does it (the oracle's rounding, not the code under
# test): the scaled loss's grad of p_i is c_i * scale in float32, cast to p_i's dtype; a second backward adds
# in that dtype; unscale_ multiplies by float32(1 / scale) in float32 and casts back.
def scaled_grad(c: torch.Tensor, scale: float, backwards: int) -> torch.Tensor:
    one = (c.float() * torch.tensor(f32(scale))).to(c.dtype)
    grad = one
    for _ in range(backwards - 1):
        grad = (grad.float() + one.float()).to(c.dtype)
    return grad


def unscaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    return (grad.float() * torch.tensor(f32(1.0 / f32(scale)))).to(grad.dtype)


def grad_overflows(dtype: str, scale: float, backwards: int) -> bool:
    """Does a Problem(peak=True) grad of this dtype overflow after this many backward passes at this scale?
    (Its largest element, -PEAK, overflows first.)"""
    return not bool(torch.isfinite(scaled_grad(torch.tensor([-PEAK], dtype=DTYPES[dtype]), scale, backwards)).all())


class ScalerModel:
    """The GradScaler contract in plain Python: the oracle of test_sequences.py and reference_scales.

    scale and growth tracker follow torch._amp_update_scale_ (float32 scale; a growth that would be inf
    is not taken); each optimizer moves READY -> UNSCALED -> STEPPED until update(); an optimizer's step
    is skipped iff any of its grads, on any rank, is inf or NaN since the last update(); update() backs
    off once if any optimizer that was unscaled or stepped saw one, and new_scale replaces the scale,
    keeping the tracker. Preconditions (allows) keep a sequence inside the API's legal uses.
    """

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, n_optimizers=1):
        self.scale, self.tracker = f32(init_scale), 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.stage = ["READY"] * n_optimizers
        self.nonfinite = [False] * n_optimizers  # a non-finite grad since the last update(), per optimizer
        self.backwards = 0  # backward passes since the last update() (gradient accumulation)

    def allows(self, op: str, opt: int = 0) -> bool:
        if op == "backward":  # before any unscale_/step of this iteration
            return all(s == "READY" for s in self.stage)
        if op == "resume":  # a checkpoint between iterations
            return self.backwards == 0
        if op == "update":
            return any(s != "READY" for s in self.stage)
        if opt >= len(self.stage) or not self.backwards:
            return False
        return self.stage[opt] == "READY" if op == "unscale_" else self.stage[opt] != "STEPPED"

    def backward(self, bad_optimizer: int | None = None) -> None:
        self.backwards += 1
        if bad_optimizer is not None:
            self.nonfinite[bad_optimizer] = True

    def unscale_(self, opt: int) -> bool:
        """-> whether this optimizer found inf/NaN (then its grads are not defined)."""
        self.stage[opt] = "UNSCALED"
        return self.nonfinite[opt]

    def step(self, opt: int) -> bool:
        """-> whether the optimizer stepped."""
        self.stage[opt] = "STEPPED"
        return not self.nonfinite[opt]

    def update(self, found_inf: bool | None = None, new_scale: float | None = None) -> None:
        """found_inf None: from the optimizers' stages (the stateful model); a bool: given (reference_scales)."""
        if found_inf is None:
            found_inf = any(bad for bad, s in zip(self.nonfinite, self.stage) if s != "READY")
        if new_scale is not None:
            self.scale = f32(new_scale)
        elif found_inf:
            self.scale, self.tracker = f32(self.scale * self.backoff_factor), 0
        elif self.tracker + 1 == self.growth_interval:
            grown = f32(self.scale * self.growth_factor)
            self.scale = grown if math.isfinite(grown) else self.scale
            self.tracker = 0
        else:
            self.tracker += 1
        self.stage = ["READY"] * len(self.stage)
        self.nonfinite = [False] * len(self.stage)
        self.backwards = 0


def reference_scales(init_scale, growth_factor, backoff_factor, growth_interval, found_inf_per_step):
    """The GradScaler rules (torch._amp_update_scale_) in plain Python: scale after each update."""
    model = ScalerModel(init_scale, growth_factor, backoff_factor, growth_interval)
    out = []
    for found in found_inf_per_step:
        model.update(bool(found))
        out.append(model.scale)
    return out


def equal_lists(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def step_with_rank1_without_grads(spec, placement, bad=False):
    """One scaled step on 2 ranks where rank 1 got no grads this step (an unused branch, a frozen part, an
    empty shard) but still steps with the others; rank 0's first grad holds an inf if bad. Runs on a rank.
    -> {stepped, scale}: a correct scaler steps rank 0 only (if clean) and keeps both scales equal."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pb = Problem(placement, seed_offset=rank)
    s = build_scaler(spec, pb, init_scale=256.0)
    opt = sgd(pb.params)
    before = pb.snapshot()
    if rank == 0:
        pb.backward(s, inject={0: math.inf} if bad else None)
    else:
        s.scale(pb.loss().detach())
    s.step(opt)
    s.update()
    return dict(stepped=not equal_lists(pb.snapshot(), before), scale=s.get_scale())


def keep_gpu_busy(matmuls: int = 8, n: int = 4096) -> None:
    """Queue matmuls on the current stream and return at once (nothing here waits for them): ~20 ms on an idle
    H100, tens of times the CPU's path from here to the unscale kernel, and longer on a GPU others share."""
    a = torch.ones(n, n, device="cuda") / n
    b = torch.empty_like(a)
    for _ in range(matmuls):
        torch.mm(a, a, out=b)
        a, b = b, a
