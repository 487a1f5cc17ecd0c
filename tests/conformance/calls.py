"""The calls of a GradScaler sequence (test_sequences.py), each a type that knows its three sides:

    on_rank(rank)       what it does to the real scaler on a rank, and the facts a user can see after it
    on_model(model)     what the contract model (problem.ScalerModel) says every rank must see after it
    describe()          the call in words, for a failure's listing

A call is plain data (a frozen dataclass): it travels to the ranks pickled, and into the replay command as
JSON (`as_data` / `from_data`). What a step did to the params is a `Moved`, compared as a value.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from tests.conformance.problem import INF_VALUES, Problem, ScalerModel, build_scaler

N_PARAMS = 4  # one optimizer: all four; two: params 0-1 and 2-3
LR = 0.5  # SGD without momentum: a step moves p by exactly -LR * grad (all values are dyadic and small)


class Moved(enum.Enum):
    NOT_AT_ALL = "not at all"
    EXACTLY = "exactly by -lr * unscaled grad"
    WRONGLY = "wrongly"


def owner(param: int, n_optimizers: int) -> int:
    """The optimizer that holds this param."""
    return 0 if n_optimizers == 1 else param * 2 // N_PARAMS


class Rank:
    """One rank's side of a sequence: its problem, scaler and optimizers, and the backwards of this iteration."""

    def __init__(self, spec: str, placement: str, config: dict, rank: int):
        self.spec, self.rank = spec, rank
        self.pb = Problem(placement, n_params=N_PARAMS, seed_offset=rank)  # each rank its own shard
        n_opt = config["n_optimizers"]
        self.groups = [[p for i, p in enumerate(self.pb.params) if owner(i, n_opt) == o] for o in range(n_opt)]
        self.opts = [torch.optim.SGD(g, lr=LR) for g in self.groups]
        settings = {k: config[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}
        self.scaler = build_scaler(spec, self.pb, **settings)
        self.backwards = 0

    def targets_of(self, opt: int) -> list:
        """The exact grads (of one backward) of this optimizer's params, on CPU."""
        return [c.cpu() for p, c in zip(self.pb.params, self.pb.targets) if any(p is q for q in self.groups[opt])]

    def seen(self) -> dict:
        """After every call: only update() (or a resume) may change them."""
        return dict(scale=float(self.scaler.get_scale()), tracker=int(self.scaler.state_dict()["_growth_tracker"]))


@dataclass(frozen=True)
class Overflow:
    rank: int
    param: int
    element: str  # "first" or "last"
    value: str    # a key of INF_VALUES


@dataclass(frozen=True)
class Backward:
    """A scaled backward that accumulates into .grad; with `bad`, then one element of a grad overwritten."""
    bad: Overflow | None = None
    op = "backward"

    def describe(self) -> str:
        b = self.bad
        return "backward()" if not b else (f"backward() with {b.value} in the {b.element} element of grad {b.param} "
                                           f"on rank {b.rank}")

    def on_rank(self, r: Rank) -> dict:
        if r.backwards == 0:
            r.pb.zero_grad()
        r.scaler.scale(r.pb.loss()).backward()
        if self.bad and self.bad.rank == r.rank:
            grad = r.pb.params[self.bad.param].grad.view(-1)
            with torch.no_grad():
                grad[0 if self.bad.element == "first" else grad.numel() - 1] = INF_VALUES[self.bad.value]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # an idle GPU at step(), as in problem.Problem.backward
        r.backwards += 1
        return {}

    def on_model(self, model: ScalerModel) -> dict:
        model.backward(None if not self.bad else owner(self.bad.param, len(model.stage)))
        return {}


@dataclass(frozen=True)
class Unscale:
    opt: int
    op = "unscale_"

    def describe(self) -> str:
        return f"unscale_(optimizer {self.opt})"

    def on_rank(self, r: Rank) -> dict:
        r.scaler.unscale_(r.opts[self.opt])
        grads = [p.grad.cpu() for p in r.groups[self.opt]]
        return dict(exact=all(torch.equal(g, r.backwards * c) for g, c in zip(grads, r.targets_of(self.opt))))

    def on_model(self, model: ScalerModel) -> dict:
        return {} if model.unscale_(self.opt) else dict(exact=True)  # clean: every grad exactly unscaled


@dataclass(frozen=True)
class Step:
    opt: int
    op = "step"

    def describe(self) -> str:
        return f"step(optimizer {self.opt})"

    def on_rank(self, r: Rank) -> dict:
        params = r.groups[self.opt]
        before = [p.detach().cpu().clone() for p in params]
        r.scaler.step(r.opts[self.opt])
        after = [p.detach().cpu() for p in params]
        if all(torch.equal(a, b) for a, b in zip(after, before)):
            return dict(moved=Moved.NOT_AT_ALL)
        exact = all(torch.equal(a, b - LR * r.backwards * c) for a, b, c in zip(after, before, r.targets_of(self.opt)))
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
        r.backwards = 0
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
        r.scaler = build_scaler(r.spec, r.pb)
        r.scaler.load_state_dict(saved)
        return {}

    def on_model(self, model: ScalerModel) -> dict:
        return {}


CALLS = {cls.__name__: cls for cls in (Backward, Unscale, Step, Update, Resume)}


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
    return cls(**fields)


def advance(model: ScalerModel, call) -> dict:
    """One call on the model; -> what every rank must see after it. ValueError for a call the API forbids here."""
    if not model.allows(call.op, getattr(call, "opt", 0)):
        raise ValueError(f"{call.describe()} is not a legal call here (the API forbids it, or it means nothing)")
    want = call.on_model(model)
    return dict(want, scale=model.scale, tracker=model.tracker)
