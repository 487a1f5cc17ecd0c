"""One matrix cell on every rank: the same problem trained under FSDP and under a DDP reference.

The reference reproduces the FSDP side's numerics (the technique of PyTorch's FSDP2 mixed
precision tests): an fp32 master copy owns the optimizer; a copy in the cell's dtype, wrapped in
DDP, runs forward and backward and all-reduces its grads in that dtype, as FSDP reduces in its
reduce dtype; the grads are cast to fp32 onto the master params, the trusted torch.amp.GradScaler
unscales and steps, and the master params are cast back into the low-precision copy. FSDP does the
same with sharded fp32 params, so the two sides differ only in the order of the low-precision
reduction (all-reduce vs reduce-scatter), not in what is computed.

The schedule (STEPS steps) makes the scaler do everything it is for, in every cell:
  step 2         the scale grows (growth_interval 3; growth 4x and backoff 0.5x, so neither factor is
                 the default nor the inverse of the other)
  INJECT_STEP    +inf into the last element of the LAST grad of the LAST rank's local shard
  OVERFLOW_STEP  fp16 cells: rank 0's micro-batch overflows fp16 in the forward pass (inf and NaN);
                 other cells: -inf into the first element of the FIRST grad of rank 0's local shard
  RESUME_AFTER   the FSDP side's scaler is rebuilt from its saved state_dict (a checkpoint resume)
                 with its growth tracker at 1, so the growth at step 10 needs the tracker restored
  INPUT_INF_STEP every cell: rank 0's micro-batch holds an inf, so the overflow happens in forward and
                 backward and travels through the wrapper's reduction and hooks to the scaler (a wrapper
                 that zeros NaNs or clamps infs in reduced grads hides it; the injections cannot show that)
An injected value reaches every rank of the reference (DDP grads are replicated). The optimizer
has two param groups wherever there are two params (same hyperparameters, so FSDP's flat params
need not split like DDP's): the injected grads sit in different groups.

Natural-overflow cells (axes.natural_cells) run another schedule: nothing is injected and no input overflows;
CLIMB_SCALER_ARGS let the scale grow until the fp16 backward overflows by itself, then back off and regrow, for
NATURAL_STEPS steps (the checkpoint resume as above). In "reduction" cells every data-parallel rank gets the same
micro-batch, so every rank's grads are alike and finite while their fp16 sum overflows (axes.NATURAL says why at
world size 4). The reference then reduces as FSDP does in fp16 (fsdp_like_reduction: divide before and after an
fp16 sum), where plain DDP divides by the world size first and never overflows in its sum; its hook also records
whether this rank's own grads were finite before the sum. Each step records the non-finite values in the FSDP
side's reduced grads on each rank (+inf, -inf, NaN): how the overflow reaches the scaler, and where.

On a mesh (axes.AXES["mesh"]) the world is a 2D DeviceMesh of the cell's shape (2x2; 2x4 or 4x2 on 8 GPUs).
hsdp: every rank is data parallel, as on 1d. tp: the ranks of one dp group hold TP shards of one replica and
get the same micro-batch, so the reference is DDP over the dp group; the injections go into a TP-sharded grad
on the last rank and a TP-replicated grad (a Rowwise bias) on rank 0 (TP_INJECTIONS).
"""
from __future__ import annotations

import copy
import io
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_amp_suite.harness import cached_mesh, rank_device
from fsdp_amp_suite.matrix.implementations import Settings, record
from fsdp_amp_suite.scalers import make_scaler

STEPS = 13
INJECT_STEP = 4  # one clean step after the growth at step 2: a backoff must reset a non-zero tracker
OVERFLOW_STEP = 7
RESUME_AFTER = 8  # one clean step after the backoff at step 7: the tracker is 1
INPUT_INF_STEP = 12  # after the growth at step 10: a real overflow at a scale of 2**12
SCALER_ARGS = dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.5, growth_interval=3)
# natural cells: from the default init_scale, doubling every 2 clean steps; the small model's fp16 backward overflows
# at 2**17-2**18 (at world size 2: steps 4, 7, 8, 12 on CPU), so a 16-step run makes 3-5 overflow cycles
CLIMB_SCALER_ARGS = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
NATURAL_STEPS = 16


class Injection(NamedTuple):
    """An overflow as FSDP leaves it, in one element of one rank's local shard of one grad."""
    rank: str  # "first" | "last" rank of the world
    grad: str  # "first" | "last" grad (of those that match `tp`) in the model's order
    value: float
    tp: str | None = None  # only grads "sharded" | "replicated" along the mesh's tp dim


# step -> the injection there. Not at OVERFLOW_STEP in fp16 cells: the data overflows there.
INJECTIONS = {INJECT_STEP: Injection("last", "last", math.inf), OVERFLOW_STEP: Injection("first", "first", -math.inf)}
TP_INJECTIONS = {INJECT_STEP: Injection("last", "last", math.inf, tp="sharded"),
                 OVERFLOW_STEP: Injection("first", "first", -math.inf, tp="replicated")}
# mesh -> its dim names (1d has none: FSDP shards over the world's one group); the cell gives the shape
MESH_DIMS = {"hsdp": ("replicate", "shard"), "tp": ("dp", "tp")}
# the tp cells' plan on build_model(even=True): two Colwise/Rowwise pairs; the Rowwise biases are TP-replicated
TP_PLAN = {"0.lin": "colwise", "1.lin": "rowwise", "1.inner.lin": "colwise", "2": "rowwise"}
GLOBAL_BATCH = 16  # split evenly over 1, 2, 4 or 8 ranks
LR = {"sgd": 0.05, "adamw": 0.01}
MOMENTUM = 0.9
MAX_NORM = 0.5  # small enough that clipping bites every clean step
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class Block(nn.Module):
    """A unit FSDP can wrap on its own; `inner` makes a block inside a block."""

    def __init__(self, d_in: int, d_out: int, inner: nn.Module | None = None):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.inner = inner

    def forward(self, x):
        x = torch.relu(self.lin(x))
        return x if self.inner is None else self.inner(x)


class Fan(nn.Module):
    """n linears side by side, their outputs averaged: many parameters at little depth."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        return torch.stack([h(x) for h in self.heads]).mean(0)


def build_model(kind: str = "small", even: bool = False) -> nn.Module:
    """small: uneven shapes (13 and 3 rows shard unevenly; the head's 3 rows leave rank 3 of 4 empty). even (tp
    cells): its widths rounded to multiples of 4, which TP_PLAN splits evenly over a tp dim of 2 or 4 (DTensor
    infers a sharded activation's global shape from its local one, so uneven TP shards of activations are not
    an option).
    wide (the model axis): what a real model hands the scaler, hundreds of grads (150 linears side by side:
    310 params) and a weight of 1100 x 256 = 281600 elements, more than four 65536-element chunks of CUDA's
    multi-tensor kernels (more than one in each rank's shard at world size 4)."""
    torch.manual_seed(1234)
    if kind == "wide":
        return nn.Sequential(Block(7, 256), Block(256, 1100, inner=Block(1100, 11)), Block(11, 11, inner=Fan(11, 150)),
                             nn.Linear(11, 3))
    if even:
        return nn.Sequential(Block(7, 12), Block(12, 8, inner=Block(8, 8)), nn.Linear(8, 3))
    return nn.Sequential(Block(7, 13), Block(13, 11, inner=Block(11, 11)), nn.Linear(11, 3))


def injections(cell) -> dict:
    if cell.overflow != "injected":
        return {}
    return TP_INJECTIONS if cell.mesh == "tp" else INJECTIONS


def scaler_args(cell) -> dict:
    return SCALER_ARGS if cell.overflow == "injected" else CLIMB_SCALER_ARGS


def steps(cell) -> int:
    return STEPS if cell.overflow == "injected" else NATURAL_STEPS


def data_parallel(cell, mesh) -> tuple:
    """(this rank's index among the data-parallel replicas, their number, their process group (None: WORLD))."""
    if cell.mesh == "tp":
        return mesh.get_local_rank("dp"), mesh["dp"].size(), mesh.get_group("dp")
    return dist.get_rank(), dist.get_world_size(), None


def micro_batch(step: int, rank: int, world_size: int, overflow: str | None):
    """This rank's share of the step's batch; overflow "fp16": scaled past fp16's range (1e5 > 65504, so the
    input itself overflows in an fp16 cell); "inf": its first element is inf."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    n = GLOBAL_BATCH // world_size
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    if overflow == "fp16":
        x = x * 1e5
    elif overflow == "inf":
        x[0, 0] = math.inf
    return x, y


def data_overflow(step: int, dtype, cell) -> str | None:
    """The overflow rank 0's micro-batch carries at this step (micro_batch's `overflow`), if any: none in a
    natural-overflow cell."""
    if cell.overflow != "injected":
        return None
    if step == OVERFLOW_STEP and dtype == torch.float16:
        return "fp16"
    return "inf" if step == INPUT_INF_STEP else None


def param_groups(named_params, order: str) -> list[list]:
    """The optimizer's two groups (axes.AXES["groups"]): the first and the second half of the params in the
    model's order; or the weights (decay) and the biases (no decay), in that order or the other."""
    named = list(named_params)
    if order == "halves":
        params = [p for _, p in named]
        return [params[:len(params) // 2], params[len(params) // 2:]]
    decay = [p for name, p in named if not name.endswith("bias")]
    no_decay = [p for name, p in named if name.endswith("bias")]
    return [decay, no_decay] if order == "decayfirst" else [no_decay, decay]


def make_optimizer(kind: str, named_params, low_precision_grads: bool, order: str = "halves"):
    """Two param groups, as real training has (decay / no decay), with the same hyperparameters."""
    groups = [{"params": g} for g in param_groups(named_params, order) if g]
    if kind == "sgd":  # foreach rejects fp16/bf16 grads on fp32 params
        return torch.optim.SGD(groups, lr=LR[kind], momentum=MOMENTUM, foreach=not low_precision_grads)
    return torch.optim.AdamW(groups, lr=LR[kind], fused=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor -> this rank's shard


def _along_tp(p) -> str | None:
    """"sharded" | "replicated": the param's placement along a mesh dim named tp (None: it has none)."""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    if "tp" not in names:
        return None
    return "replicated" if p.placements[names.index("tp")].is_replicate() else "sharded"


def inject_in_local_shard(params, which: str, value: float, tp: str | None = None) -> str:
    """value into the first element of the first param's local grad that has one, or the last of the last's;
    tp: only among params of that placement along the mesh's tp dim."""
    order = [(i, p) for i, p in enumerate(params) if tp is None or _along_tp(p) == tp]
    for i, p in (order if which == "first" else reversed(order)):
        if p.grad is not None and _local(p.grad).numel() > 0:
            local = _local(p.grad)
            with torch.no_grad():
                local.view(-1)[0 if which == "first" else -1] = value
            return f"{value} into param {i} {tuple(local.shape)} on {local.device}"
    raise AssertionError(f"this rank holds no grad shard to inject into (among params {tp or 'of any placement'})")


def resume(scaler, scaler_spec: str, device: torch.device, args: dict = SCALER_ARGS):
    """A checkpoint round trip: state_dict -> torch.save -> torch.load -> a fresh scaler."""
    buf = io.BytesIO()
    torch.save(scaler.state_dict(), buf)
    buf.seek(0)
    fresh = make_scaler(scaler_spec, device=device.type, **args)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    return fresh


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter, gathered full (a collective for FSDP), fp32 on CPU, under its plain name."""
    out = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            if value.device.type == "cpu" and dist.get_backend() == "nccl":  # FSDP2 offload: NCCL gathers CUDA
                value = value.to(rank_device())
            value = value.full_tensor()
        plain = ".".join(part for part in name.split(".") if not part.startswith("_") and part != "module")
        out[plain] = value.detach().float().cpu().clone()  # not an alias of the live param
    return out


def _zero_grad_probe(model, opt) -> dict[str, torch.Tensor]:
    """One optimizer step on zero grads moves each param by -lr * momentum * its momentum buffer
    (SGD; AdamW by its moment estimates): the gathered params after it expose the optimizer state."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()  # in place: keeps its dtype and FSDP1's views into the flat grad
        elif _local(p).numel():
            p.grad = torch.zeros_like(p)
    opt.step()
    return full_params(model)


def predivide_factor(world_size: int) -> int:
    """FSDP's split of the 1/world_size average around an fp16 sum (FSDP1 DefaultState._get_gradient_predivide_factor;
    FSDP2 and fairscale compute the same): the largest power of 2 f with world_size % f == 0 and f * f <= world_size,
    roughly sqrt(world_size), so that neither the terms nor the sum leave fp16's range as easily."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


def fsdp_like_reduction(group, world_size: int, local_finite: list):
    """A DDP comm hook that reduces as FSDP does in fp16: divide by predivide_factor, SUM in the grads' dtype, divide
    by the rest. Appends to local_finite whether this rank's own bucket was finite before the sum."""
    pre = predivide_factor(world_size)
    post = world_size / pre

    def hook(state, bucket):
        grads = bucket.buffer()
        local_finite.append(bool(grads.isfinite().all()))
        grads.div_(pre)
        fut = dist.all_reduce(grads, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(post))
    return hook


def nonfinite(params) -> tuple[int, int, int]:
    """(+inf, -inf, NaN) counts in this rank's local shards of the grads: how an overflow reaches the scaler."""
    pos = neg = nan = 0
    for p in params:
        if p.grad is not None:
            g = _local(p.grad)
            pos, neg, nan = (pos + int((g == math.inf).sum()), neg + int((g == -math.inf).sum()),
                             nan + int(g.isnan().sum()))
    return pos, neg, nan


def _local_params(params) -> list[torch.Tensor]:
    return [_local(p).detach().clone() for p in params]


def _changed(params, before) -> bool:
    """Did the step touch this rank's params? (A fused optimizer is called even on a skipped step.)"""
    return any(not torch.equal(_local(p), b) for p, b in zip(params, before))


class Reference:
    """DDP over a low-precision replica; fp32 master params own the optimizer; torch.amp.GradScaler.

    In keeplow cells the FSDP side's optimizer gets grads in the cell's dtype (so its momentum
    buffers are in that dtype too): the reference unscales (and clips) fp32 grads, which the trusted
    scaler requires, then rounds them to that dtype before the optimizer step. Unscaling by a power
    of two is exact, so both sides hand their optimizers the same values."""

    def __init__(self, base: nn.Module, cell, device: torch.device, group=None, dp_size: int = 1):
        from torch.nn.parallel import DistributedDataParallel as DDP

        dtype = DTYPES[cell.precision]
        self.master = copy.deepcopy(base).to(device)
        self.replica = copy.deepcopy(self.master).to(dtype or torch.float32)
        self.ddp = DDP(self.replica, device_ids=[device] if device.type == "cuda" else None, process_group=group)
        self.local_finite = []  # natural cells: per bucket, whether this rank's own grads were finite before the sum
        if cell.overflow != "injected":
            self.ddp.register_comm_hook(None, fsdp_like_reduction(group, dp_size, self.local_finite))
        self.low_grads = dtype if cell.grads == "keeplow" else None
        self.opt = make_optimizer(cell.optimizer, self.master.named_parameters(), self.low_grads is not None,
                                  cell.groups)
        self.scaler = torch.amp.GradScaler(device.type, **scaler_args(cell))

    def backward(self, x, y) -> torch.Tensor:
        loss = F.mse_loss(self.ddp(x).float(), y)
        self.scaler.scale(loss).backward()
        for master, low in zip(self.master.parameters(), self.replica.parameters()):
            master.grad = None if low.grad is None else low.grad.float()
            low.grad = None
        return loss

    def unscale_clip_step(self, clip: bool):
        if clip or self.low_grads:
            self.scaler.unscale_(self.opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), MAX_NORM)
        if self.low_grads:
            for p in self.master.parameters():
                if p.grad is not None:  # through .data, as FSDP1 does: .grad itself must match the param's dtype
                    p.grad.data = p.grad.data.to(self.low_grads)
        self.scaler.step(self.opt)
        self.scaler.update()

    def sync_replica(self):
        with torch.no_grad():
            for master, low in zip(self.master.parameters(), self.replica.parameters()):
                low.copy_(master)


def _record(log, loss, params, before, scaler):
    log["loss"].append(loss.detach().float().item())
    log["stepped"].append(_changed(params, before))
    log["scale"].append(float(scaler.get_scale()))


@dataclass
class CellRun:
    """What one rank reports of one cell: train_cell's return, read by the controller (test_matrix.py)."""
    unsupported: str | None = None  # the wrapper cannot build this configuration here (the cell skips: why)
    log: dict = field(default_factory=dict)  # {"fsdp" | "ref": {"loss": [..], "stepped": [..], "scale": [..]}}, a step
                                             # each
    injected: dict = field(default_factory=dict)  # {step: where the inf went in this rank's shard}
    crashed: str | None = None  # the FSDP side stopped before the last step (its scaler could not resume): why
    grad_devices: list = field(default_factory=list)  # where the FSDP side's grads were after the last step
    grad_dtypes: list = field(default_factory=list)
    params: dict = field(default_factory=dict)  # {"fsdp" | "ref": {name: full fp32 tensor}} after the last step
    probe: dict = field(default_factory=dict)  # the same after one zero-grad step (what the optimizer state does)
    nonfinite: list = field(default_factory=list)  # natural cells, a step each: (+inf, -inf, NaN) in this rank's
                                                   # reduced FSDP grads before unscale
    local_finite: list = field(default_factory=list)  # natural cells, a step each: this rank's own reference grads
                                                      # were finite before the sum


def train_cell(cell, scaler_spec: str, impl_spec: str) -> CellRun:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    dtype = DTYPES[cell.precision]
    base = build_model(cell.model, even=cell.mesh == "tp")
    mesh = cached_mesh(device.type, cell.shape, MESH_DIMS[cell.mesh]) if cell.mesh in MESH_DIMS else None
    dp_rank, dp_size, dp_group = data_parallel(cell, mesh)
    settings = Settings(device=device, dtype=dtype, offload=cell.offload == "offload",
                        nested=cell.wrapping == "nested", block_cls=Block, flat_params=cell.params == "flat",
                        reshard=cell.reshard == "reshard", low_precision_grads=cell.grads == "keeplow",
                        mesh=mesh, tp_plan=TP_PLAN if cell.mesh == "tp" else None)
    try:
        model = record(impl_spec).wrap(copy.deepcopy(base), settings)
    except NotImplementedError as exc:  # the wrapper cannot build this configuration here
        return CellRun(unsupported=f"{impl_spec}: {exc}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"--fsdp {impl_spec}: factory(module, settings) returned an object of type "
                        f"{type(model).__name__}, not the wrapped torch.nn.Module")
    opt = make_optimizer(cell.optimizer, model.named_parameters(), settings.low_precision_grads, cell.groups)
    scaler = make_scaler(scaler_spec, device=device.type, **scaler_args(cell))
    ref = Reference(base, cell, device, dp_group, dp_size)
    fsdp_params, ref_params = list(model.parameters()), list(ref.master.parameters())
    # an implementation may move the loss to its params' device before scaling (fairscale's seed path: CPU with
    # offload, so the scale lives on CPU); elsewhere it is scaled where it was computed
    seed_path = record(impl_spec).loss_on_param_device
    clip = getattr(model, "clip_grad_norm_", None) or (
        lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    log = {side: {"loss": [], "stepped": [], "scale": []} for side in ("fsdp", "ref")}
    injected, seen, local_finite = {}, [], []
    same_data = cell.overflow == "reduction"  # every rank's grads alike: their fp16 sum is twice a finite term
    for step in range(steps(cell)):
        overflow = data_overflow(step, dtype, cell)
        x, y = micro_batch(step, 0 if same_data else dp_rank, dp_size, overflow=overflow if dp_rank == 0 else None)
        x, y = x.to(device, dtype or torch.float32), y.to(device)
        inject = None if overflow else injections(cell).get(step)
        owner = None if inject is None else {"first": 0, "last": world_size - 1}[inject.rank]

        # --- FSDP side, the scaler under test
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y)
        scaled = scaler.scale(loss.to(next(model.parameters()).device) if seed_path else loss)
        scaled.backward()
        if inject and rank == owner:
            injected[step] = inject_in_local_shard(fsdp_params, inject.grad, inject.value, inject.tp)
        if cell.overflow != "injected":
            seen.append(nonfinite(fsdp_params))
        if cell.clip == "clip":
            scaler.unscale_(opt)
            clip(MAX_NORM)
        before = _local_params(fsdp_params)
        scaler.step(opt)
        scaler.update()
        _record(log["fsdp"], loss, fsdp_params, before, scaler)

        # --- the reference: DDP, torch.amp.GradScaler, the inf on every rank (grads are replicated)
        ref.opt.zero_grad(set_to_none=True)
        ref.local_finite.clear()
        ref_loss = ref.backward(x, y)
        if cell.overflow != "injected":
            local_finite.append(all(ref.local_finite))
        if inject:
            inject_in_local_shard(ref_params, inject.grad, inject.value)
        before = _local_params(ref_params)
        ref.unscale_clip_step(cell.clip == "clip")
        ref.sync_replica()
        _record(log["ref"], ref_loss, ref_params, before, ref.scaler)
        if step == RESUME_AFTER:
            try:
                scaler = resume(scaler, scaler_spec, device, scaler_args(cell))
            except Exception as exc:  # noqa: BLE001 - reported after any earlier divergence (the likelier cause)
                return CellRun(log=log, injected=injected, nonfinite=seen, local_finite=local_finite,
                               crashed=f"resuming the FSDP side's scaler from its state_dict after step {step} "
                                       f"raised {type(exc).__name__}: {exc}")

    grad_devices = sorted({str(_local(p.grad).device) for p in model.parameters() if p.grad is not None})
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return CellRun(log=log, injected=injected, nonfinite=seen, local_finite=local_finite,
                   grad_devices=grad_devices, grad_dtypes=grad_dtypes,
                   params=dict(fsdp=full_params(model), ref=full_params(ref.master)),
                   probe=dict(fsdp=_zero_grad_probe(model, opt), ref=_zero_grad_probe(ref.master, ref.opt)))
