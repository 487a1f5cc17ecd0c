"""The calls of a GradScaler sequence (test_sequences.py), each a type that knows its three sides:

    on_rank(rank)       what it does to the real scaler on a rank, and the facts a user can see after it
    on_model(model)     what the contract model (problem.ScalerModel) says every rank must see after it
    describe()          the call in words, for a failure's listing

A call is plain data (a frozen dataclass): it travels to the ranks pickled, and into the replay command as
JSON (`as_data` / `from_data`). What a step did to the params is a `Moved`, compared as a value.

The problem is drawn too (the config): each param's dtype, so one optimizer holds grads of several dtypes
and an fp16 grad overflows in backward itself at a high enough scale; params stored transposed (strided
grads) and a param whose shard on rank 1 is empty; which params a backward reaches, so grads appear late
and vanish; growth and backoff factors and new scales that are not powers of two, so unscaling rounds;
checkpoints kept in memory and loaded later into a fresh or a used scaler; and the process group: WORLD
of 2 ranks, or 4 ranks in two halves, each scaler given its half (HSDP's shard group), where an overflow
in one half must not touch the other; or 4 ranks on a 2x2 (dp, tp) DeviceMesh, each param a DTensor of a
drawn kind (MESH_KINDS), where an overflow on any rank must make the whole job skip.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from fsdp_amp_suite.conformance.problem import (INF_VALUES, Problem, ScalerModel, build_scaler, grad_overflows, local,
                                       scaled_grad, unscaled)
from fsdp_amp_suite.conformance.meshes import R, on_mesh
from fsdp_amp_suite.harness import cached_group, cached_mesh

N_PARAMS = 4  # one optimizer: all four; two: params 0-1 and 2-3
# config["groups"] -> the ranks of each process group; "mesh": one group, the params DTensors on MESH
GROUPS = {"world": [[0, 1]], "halves": [[0, 1], [2, 3]], "mesh": [[0, 1, 2, 3]]}
MESH = ((2, 2), ("dp", "tp"))  # shape and dim names: rank 1 differs from rank 0 along tp, rank 2 along dp
# config["kinds"][i] -> param i's mesh dims and its placement along each (its local shard is the Problem's)
MESH_KINDS = {
    "sharded": (("dp", "tp"), (0, 0)),        # a TP-sharded weight under FSDP over dp
    "tp_replicated": (("dp", "tp"), (0, R)),  # a norm or bias: sharded over dp, replicated over tp
    "dp_replicated": (("dp", "tp"), (R, 0)),  # HSDP: sharded within a replica, replicated across replicas
    "expert": (("tp",), (0,)),                # an expert's param on the tp sub-mesh only
}
EMPTY_ON_RANK = 1  # config["empty"]: the param whose shard is empty on this rank (an uneven FSDP shard)
LR = 0.5  # SGD without momentum: a step moves p by exactly -LR * grad (all values are dyadic and small)


class Moved(enum.Enum):
    NOT_AT_ALL = "not at all"
    EXACTLY = "exactly by -lr * unscaled grad"
    WRONGLY = "wrongly"


def owner(param: int, n_optimizers: int) -> int:
    """The optimizer that holds this param."""
    return 0 if n_optimizers == 1 else param * 2 // N_PARAMS


def dtypes_of(config: dict) -> list:
    """Each param's dtype (a replay from before dtypes were drawn: all float32)."""
    return list(config.get("dtypes") or ["float32"] * N_PARAMS)


def groups_of(config: dict) -> list:
    return GROUPS[config.get("groups", "world")]


def group_of(config: dict, rank: int) -> int:
    return next(g for g, ranks in enumerate(groups_of(config)) if rank in ranks)


def world_size(config: dict) -> int:
    return sum(len(ranks) for ranks in groups_of(config))


def process_groups(config: dict) -> list:
    """The config's process groups ([] for WORLD), made once per rank process (harness.cached_group): every
    rank makes every group, in the table's order."""
    if len(groups_of(config)) == 1:
        return []
    return [cached_group(ranks) for ranks in groups_of(config)]


def holds(config: dict, rank: int, param: int) -> bool:
    """Does this rank's shard of the param have elements?"""
    return not (config.get("empty") == param and rank == EMPTY_ON_RANK)


class Rank:
    """One rank's side of a sequence: its problem, scaler and optimizers, the backward passes each param's grad
    accumulates this iteration, and the checkpoints kept so far."""

    def __init__(self, spec: str, placement: str, config: dict, rank: int):
        self.spec, self.rank = spec, rank
        # each rank its own shard; every target's largest element first, so fp16 overflows alike on every rank
        self.pb = Problem(placement, dtype=dtypes_of(config), n_params=N_PARAMS, seed_offset=rank, peak=True,
                          numel=[6 if holds(config, rank, i) else 0 for i in range(N_PARAMS)],
                          transposed=config.get("transposed", ()))
        if config.get("kinds"):  # each rank's values as its local shard of a DTensor of the param's kind
            mesh = cached_mesh(self.pb.params[0].device.type, *MESH)
            self.pb.params = [on_mesh(p.detach(), mesh, *MESH_KINDS[kind]).requires_grad_()
                              for p, kind in zip(self.pb.params, config["kinds"])]
        n_opt = config["n_optimizers"]
        self.members = [[i for i in range(N_PARAMS) if owner(i, n_opt) == o] for o in range(n_opt)]
        self.opts = [torch.optim.SGD([self.pb.params[i] for i in m], lr=LR) for m in self.members]
        settings = {k: config[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}
        self.groups = process_groups(config)
        self.build = lambda **kw: build_scaler(spec, self.pb, process_group=(
            self.groups[group_of(config, rank)] if self.groups else None), **kw)
        self.scaler = self.build(**settings)
        self.backwards = 0
        self.accumulated = [0] * N_PARAMS
        self.kept = {}

    def expected_grad(self, i: int) -> torch.Tensor:
        """Param i's grad once unscaled exactly (on CPU), from the scale of this iteration."""
        scale = float(self.scaler.get_scale())
        return unscaled(scaled_grad(self.pb.targets[i].cpu(), scale, self.accumulated[i]), scale)

    def seen(self) -> dict:
        """After every call: only update() (or a load) may change them."""
        return dict(scale=float(self.scaler.get_scale()), tracker=int(self.scaler.state_dict()["_growth_tracker"]))


class ProblemModel(ScalerModel):
    """The contract model plus what it must know of the drawn problem: each param's dtype and optimizer, and the
    backward passes its grad accumulates this iteration (an fp16 grad overflows in backward at a high scale)."""

    def __init__(self, config: dict, group_ranks=()):
        super().__init__(config["init_scale"], config["growth_factor"], config["backoff_factor"],
                         config["growth_interval"], config["n_optimizers"])
        self.group_ranks = tuple(group_ranks)  # the ranks this model speaks for
        self.dtypes = dtypes_of(config)
        self.accumulated = [0] * N_PARAMS
        self.kept = {}

    def update(self, found_inf=None, new_scale=None) -> None:
        super().update(found_inf, new_scale)
        self.accumulated = [0] * N_PARAMS


@dataclass(frozen=True)
class Overflow:
    rank: int
    param: int
    element: str  # "first" or "last"
    value: str    # a key of INF_VALUES


@dataclass(frozen=True)
class Backward:
    """A scaled backward of the loss over `reaches` (None: every param) that accumulates into .grad; the other
    params get no grad from it (None if they had none). With `bad`, then one element of a grad overwritten."""
    bad: Overflow | None = None
    reaches: tuple | None = None
    op = "backward"

    def describe(self) -> str:
        b, reach = self.bad, "" if self.reaches is None else f" reaching params {list(self.reaches)}"
        return f"backward(){reach}" if not b else (f"backward(){reach} with {b.value} in the {b.element} element "
                                                   f"of grad {b.param} on rank {b.rank}")

    def on_rank(self, r: Rank) -> dict:
        if r.backwards == 0:
            r.pb.zero_grad()
        r.scaler.scale(r.pb.loss(self.reaches)).backward()
        for i in range(N_PARAMS) if self.reaches is None else self.reaches:
            r.accumulated[i] += 1
        if self.bad and self.bad.rank == r.rank:
            grad = local(r.pb.params[self.bad.param].grad)  # indexed, not viewed: it may be strided
            where = tuple(0 if self.bad.element == "first" else n - 1 for n in grad.shape)
            with torch.no_grad():
                grad[where] = INF_VALUES[self.bad.value]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # an idle GPU at step(), as in problem.Problem.backward
        r.backwards += 1
        return {}

    def on_model(self, model: ProblemModel) -> dict:
        n_opt = len(model.stage)
        for i in range(N_PARAMS) if self.reaches is None else self.reaches:
            model.accumulated[i] += 1
        # a param held by no rank of the group cannot overflow there; here every param has elements on some rank
        bad = {owner(i, n_opt) for i in range(N_PARAMS)
               if model.accumulated[i] and grad_overflows(model.dtypes[i], model.scale, model.accumulated[i])}
        if self.bad:
            bad.add(owner(self.bad.param, n_opt))
        model.backward(None)
        for opt in bad:  # an injected overflow, or a low-precision grad that overflowed in backward itself
            model.nonfinite[opt] = True
        return {}


@dataclass(frozen=True)
class Unscale:
    opt: int
    op = "unscale_"

    def describe(self) -> str:
        return f"unscale_(optimizer {self.opt})"

    def on_rank(self, r: Rank) -> dict:
        r.scaler.unscale_(r.opts[self.opt])
        params = [r.pb.params[i] for i in r.members[self.opt]]
        exact = all(p.grad is None if not r.accumulated[i] else torch.equal(local(p.grad).cpu(), r.expected_grad(i))
                    for i, p in zip(r.members[self.opt], params))
        return dict(exact=exact)

    def on_model(self, model: ScalerModel) -> dict:
        return {} if model.unscale_(self.opt) else dict(exact=True)  # clean: every grad exactly unscaled


@dataclass(frozen=True)
class Step:
    opt: int
    op = "step"

    def describe(self) -> str:
        return f"step(optimizer {self.opt})"

    def on_rank(self, r: Rank) -> dict:
        members = r.members[self.opt]
        before = [local(r.pb.params[i]).detach().cpu().clone() for i in members]
        want = [b if not r.accumulated[i] else b.add(r.expected_grad(i), alpha=-LR) for i, b in zip(members, before)]
        r.scaler.step(r.opts[self.opt])
        after = [local(r.pb.params[i]).detach().cpu() for i in members]
        if all(torch.equal(a, b) for a, b in zip(after, before)):
            return dict(moved=Moved.NOT_AT_ALL)
        exact = all(torch.equal(a, w) for a, w in zip(after, want))  # SGD's add_(grad, alpha=-lr), as torch does it
        return dict(moved=Moved.EXACTLY if exact else Moved.WRONGLY)

    def on_model(self, model: ScalerModel) -> dict:
        return dict(moved=Moved.EXACTLY if model.step(self.opt) else Moved.NOT_AT_ALL)


@dataclass(frozen=True)
class Update:
    new_scale: float | None = None
    op = "update"

    def describe(self) -> str:
        return "update()" if self.new_scale is None else f"update(new_scale={self.new_scale!r})"

    def on_rank(self, r: Rank) -> dict:
        r.scaler.update(self.new_scale)
        r.backwards, r.accumulated = 0, [0] * N_PARAMS
        return {}

    def on_model(self, model: ScalerModel) -> dict:
        model.update(new_scale=self.new_scale)
        return {}


@dataclass(frozen=True)
class Resume:
    """A checkpoint round trip into a scaler built with the defaults: load_state_dict must restore every setting."""
    op = "resume"

    def describe(self) -> str:
        return "state_dict() -> a scaler built with the defaults -> load_state_dict()"

    def on_rank(self, r: Rank) -> dict:
        saved = r.scaler.state_dict()
        r.scaler = r.build()
        r.scaler.load_state_dict(saved)
        return {}

    def on_model(self, model: ScalerModel) -> dict:
        return {}


@dataclass(frozen=True)
class Keep:
    """A checkpoint kept in memory as state_dict() returned it (async checkpointing, rollback, EMA of states)."""
    slot: int
    op = "resume"

    def describe(self) -> str:
        return f"keep state_dict() as checkpoint {self.slot}"

    def on_rank(self, r: Rank) -> dict:
        r.kept[self.slot] = r.scaler.state_dict()
        return {}

    def on_model(self, model: ProblemModel) -> dict:
        model.kept[self.slot] = (model.scale, model.tracker)
        return {}


@dataclass(frozen=True)
class Load:
    """load_state_dict(a checkpoint kept earlier), into the scaler that has run since (`fresh` False) or into a
    new one built with the defaults: scale and tracker become the checkpoint's."""
    slot: int
    fresh: bool
    op = "load"

    def describe(self) -> str:
        into = "a scaler built with the defaults" if self.fresh else "the running scaler"
        return f"load checkpoint {self.slot} into {into}"

    def on_rank(self, r: Rank) -> dict:
        if self.fresh:
            r.scaler = r.build()
        r.scaler.load_state_dict(r.kept[self.slot])
        return {}

    def on_model(self, model: ProblemModel) -> dict:
        model.scale, model.tracker = model.kept[self.slot]
        return {}


CALLS = {cls.__name__: cls for cls in (Backward, Unscale, Step, Update, Resume, Keep, Load)}


def as_data(call) -> dict:
    """A call as JSON-able data (the replay command): its type's name and its fields."""
    return {"call": type(call).__name__, **dataclasses.asdict(call)}


def from_data(data: dict):
    """as_data's inverse; ValueError naming what is not a call."""
    fields = dict(data)
    cls = CALLS.get(fields.pop("call", None))
    if cls is None:
        raise ValueError(f"{data!r}: 'call' must be one of {sorted(CALLS)}")
    if cls is Backward and fields.get("bad") is not None:
        fields["bad"] = Overflow(**fields["bad"])
    if cls is Backward and fields.get("reaches") is not None:
        fields["reaches"] = tuple(fields["reaches"])
    return cls(**fields)


def advance_groups(models: list, call) -> list[dict]:
    """One call on each group's model (an overflow belongs to the group of its rank); -> each group's facts."""
    out = []
    for model in models:
        mine = call
        if isinstance(call, Backward) and call.bad and model.group_ranks and call.bad.rank not in model.group_ranks:
            mine = dataclasses.replace(call, bad=None)
        out.append(advance(model, mine))
    return out


def advance(model: ScalerModel, call) -> dict:
    """One call on the model; -> what every rank must see after it. ValueError for a call the API forbids here."""
    legal = (model.allows("resume") and call.slot in model.kept) if call.op == "load" else (
        model.allows(call.op, getattr(call, "opt", 0)))
    if not legal:
        raise ValueError(f"{call.describe()} is not a legal call here (the API forbids it, or it means nothing)")
    want = call.on_model(model)
    return dict(want, scale=model.scale, tracker=model.tracker)
