"""Differential: the scaler under test against torch.amp.GradScaler itself, call for call.

Hypothesis draws the settings (enabled or not) and a list of calls, each public method with an argument form
torch's signature and docs allow: scale() of a tensor (0-dim or not, fp32 / fp16 / bf16, with autograd or
not), of a list, a tuple, a nested structure, or any other iterable; step() with and without a closure;
update() with None, a float or a 0-dim tensor (a shape-[1] one is test_update_with_new_scale's); state_dict(),
load_state_dict() of a drawn checkpoint or of
an empty one; the getters and setters; and between them a backward that writes finite, inf or NaN grads.
Both scalers run the same calls on equal params in one process (a rank of the pool, CPU, fp32 grads and plain
SGD, where no KNOWN_BUGS entry of torch.amp.GradScaler applies). After every call everything a caller can
observe must be equal: the return value (or the exception's type and message) and what it aliases, what the
scaler kept of what it was handed (a mutated state_dict or new_scale), the scale, the grads and the params.
A failure prints the calls as data.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from fsdp_amp_suite.conformance.problem import build_scaler, placement_params, run_at, Problem

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("single rank")]

N_PARAMS = 3
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GRADS = {"finite": 1.5, "inf": math.inf, "-inf": -math.inf, "nan": math.nan}

tensors = st.tuples(st.just("tensor"), st.sampled_from([(), (2,)]), st.sampled_from(list(DTYPES)), st.booleans())
outputs = st.recursive(tensors, lambda inner: st.tuples(st.sampled_from(["list", "tuple", "iter"]),
                                                        st.lists(inner, min_size=1, max_size=2)), max_leaves=3)
scales = st.sampled_from([2.0**-3, 0.75, 1.0, 3.0, 2.0**10, 65536.0])
CALLS = st.one_of(
    st.tuples(st.just("scale"), outputs),
    st.tuples(st.just("backward"), st.sampled_from(list(GRADS)), st.integers(0, N_PARAMS - 1)),
    st.tuples(st.just("unscale_")),
    st.tuples(st.just("step"), st.booleans()),  # with a closure or not
    st.tuples(st.just("update"), st.one_of(st.none(), st.tuples(st.sampled_from(["float", "tensor", "grad"]), scales))),
    st.tuples(st.just("state_dict")),
    st.tuples(st.just("load_state_dict"), st.one_of(st.just(None), st.tuples(scales, st.sampled_from([2.0, 3.0]),
                                                                              st.sampled_from([0.5, 0.25]),
                                                                              st.integers(1, 3), st.integers(0, 2)))),
    st.tuples(st.just("get"), st.sampled_from(["get_scale", "get_growth_factor", "get_backoff_factor",
                                               "get_growth_interval", "_get_growth_tracker", "is_enabled"])),
    st.tuples(st.just("set"), st.sampled_from([("set_growth_factor", 3.0), ("set_backoff_factor", 0.25),
                                               ("set_growth_interval", 1)])),
)
SETTINGS = st.fixed_dictionaries({"init_scale": scales, "growth_factor": st.sampled_from([2.0, 3.0]),
                                  "backoff_factor": st.sampled_from([0.5, 0.25]), "growth_interval": st.integers(1, 3),
                                  "enabled": st.booleans()})


def _build(form, seen):
    """An argument of the drawn form, and the tensors in it (to tell what a return value aliases)."""
    kind = form[0]
    if kind == "tensor":
        _, shape, dtype, grad = form
        t = torch.full(shape, 1.25, dtype=DTYPES[dtype], requires_grad=grad)
        seen.append(t)
        return t
    items = [_build(f, seen) for f in form[1]]
    return {"list": list, "tuple": tuple, "iter": iter}[kind](items)


def _observe(value, given_tensors=()):
    """What a caller sees of a value: types, dtypes, values (NaN by repr), and which given tensor it is."""
    if isinstance(value, torch.Tensor):
        alias = [i for i, t in enumerate(given_tensors) if t is value]
        return ("tensor", str(value.dtype), tuple(value.shape), repr(value.detach().float().tolist()),
                value.requires_grad, alias)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_observe(v, given_tensors) for v in value])
    if isinstance(value, dict):
        return ("dict", sorted((k, _observe(v)) for k, v in value.items()))
    if isinstance(value, (bool, int, float, type(None))):
        return (type(value).__name__, repr(value))
    if hasattr(value, "__iter__"):  # a lazy iterable (map, generator): what it yields
        return ("iterable", [_observe(v, given_tensors) for v in value])
    return (type(value).__name__,)


class _World:
    """One scaler, its params and optimizer, and what it was handed (to see what it keeps)."""

    def __init__(self, make):
        self.scaler = make()
        self.params = [torch.nn.Parameter(torch.full((2,), float(i + 1))) for i in range(N_PARAMS)]
        for p in self.params:  # grads from the start: with none at all, torch's step() raises where a shard-aware
            p.grad = torch.full((2,), 1.5)  # scaler must step (a rank can hold no grads; scaler_impl difference 6)
        self.opt = torch.optim.SGD(self.params, lr=0.5)
        self.handed = []  # (a state_dict handed out, what the caller saw of it then): a checkpoint must not change

    def call(self, call):
        name, *args = call
        s = self.scaler
        if name == "scale":
            given_tensors = []
            arg = _build(args[0], given_tensors)
            return _observe(s.scale(arg), given_tensors)
        if name == "backward":
            kind, bad = args
            for i, p in enumerate(self.params):
                p.grad = torch.full((2,), GRADS[kind] if i == bad else 1.5)
            return None
        if name == "unscale_":
            return _observe(s.unscale_(self.opt))
        if name == "step":
            return _observe(s.step(self.opt, closure=lambda: 7.0) if args[0] else s.step(self.opt))
        if name == "update":
            if args[0] is None:
                return _observe(s.update())
            form, value = args[0]
            new = value if form == "float" else torch.tensor(value, requires_grad=form == "grad")
            out = s.update(new)
            if form == "tensor":
                new.fill_(123.0)  # torch: "later in-place changes to that tensor will not further affect the scale"
            return _observe(out)
        if name == "state_dict":
            sd = s.state_dict()
            out = _observe(sd)
            sd["scale"] = -1.0  # the caller's dict: mutating it must not reach the scaler
            self.handed.append((sd, _observe(sd)))  # nor may the scaler change it later (a checkpoint in memory)
            return out
        if name == "load_state_dict":
            if args[0] is None:
                return _observe(s.load_state_dict({}))
            scale, growth, backoff, interval, tracker = args[0]
            sd = {"scale": scale, "growth_factor": growth, "backoff_factor": backoff, "growth_interval": interval,
                  "_growth_tracker": tracker}
            out = s.load_state_dict(sd)
            sd["scale"] = -1.0
            return _observe(out)
        if name == "get":
            return _observe(getattr(s, args[0])())
        if name == "set":
            method, value = args[0]
            return _observe(getattr(s, method)(value))
        raise ValueError(f"unknown call {call!r}")

    def facts(self):
        s = self.scaler
        return dict(scale=_fact(s.get_scale), tracker=_fact(s._get_growth_tracker), enabled=_fact(s.is_enabled),
                    settings=tuple(_fact(f)
                                   for f in (s.get_growth_factor, s.get_backoff_factor, s.get_growth_interval)),
                    params=[repr(p.detach().tolist()) for p in self.params],
                    grads=[None if p.grad is None else repr(p.grad.tolist()) for p in self.params],
                    handed_state_dicts_unchanged=[_observe(sd) == then for sd, then in self.handed])


def _fact(getter):
    """A getter's value, or the exception it raises (a disabled torch.amp.GradScaler has no factors)."""
    try:
        return repr(getter())
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}"


def _run_both(spec, config, calls):
    """Every call on both scalers: [(call, (ours, torch's) outcome, (ours, torch's) facts)] up to the first
    difference."""
    pb = Problem("cpu")  # the scaler on CPU, as torch.amp.GradScaler("cpu")
    worlds = [_World(lambda: build_scaler(spec, pb, **config)), _World(lambda: torch.amp.GradScaler("cpu", **config))]
    trace = []
    for call in calls:
        outcomes = []
        for w in worlds:
            try:
                outcomes.append(("returned", w.call(call)))
            except Exception as exc:  # noqa: BLE001  (the exception is the outcome compared)
                # an AttributeError names the class: compare it as torch's
                outcomes.append(("raised", type(exc).__name__, str(exc).replace(type(w.scaler).__name__, "GradScaler")))
        facts = [w.facts() for w in worlds]
        trace.append((call, tuple(outcomes), tuple(facts)))
        if outcomes[0] != outcomes[1] or facts[0] != facts[1]:
            break
    return trace


ENABLED = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1, "enabled": True}


@pytest.mark.parametrize("placement", placement_params(["cpu"]))
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(config=SETTINGS, calls=st.lists(CALLS, min_size=1, max_size=10))
# always tried first: a 0-dim fp16 loss, structures of outputs, and a state_dict() after a backoff
@example(config=ENABLED, calls=[("scale", ("tensor", (), "float16", False))])
@example(config=ENABLED, calls=[("scale", ("tuple", [("tensor", (2,), "float32", False),
                                                     ("list", [("tensor", (), "bfloat16", True)])])),
                                ("scale", ("iter", [("tensor", (), "float16", False)]))])
@example(config=ENABLED, calls=[("scale", ("tensor", (), "float32", False)), ("backward", "inf", 0), ("step", False),
                                ("update", None), ("state_dict",)])
# what the scaler keeps of what it was given or gave: a new_scale tensor and a loaded dict the caller changes after,
# a state_dict that changes after it was handed out (the derandomized search need not draw these short sequences)
@example(config=ENABLED, calls=[("scale", ("tensor", (), "float32", False)), ("update", ("tensor", 3.0)),
                                ("get", "get_scale")])
@example(config=ENABLED, calls=[("load_state_dict", (3.0, 2.0, 0.5, 2, 1)), ("get", "get_scale")])
@example(config=ENABLED, calls=[("state_dict",), ("scale", ("tensor", (), "float32", False)), ("backward", "finite", 0),
                                ("step", False), ("update", None)])
def test_every_call_matches_torch_amp_grad_scaler(scaler, placement, config, calls):
    trace = run_at(placement, _run_both, scaler, config, calls)[0]
    call, (got, want), (facts, want_facts) = trace[-1]
    if got != want or facts != want_facts:
        listing = "\n".join(f"  {c!r}" for c, _, _ in trace)
        what = (f"outcome {got}\n  torch.amp.GradScaler: {want}" if got != want
                else "after it: " + "; ".join(f"{k} {facts[k]} vs torch's {want_facts[k]}"
                                              for k in facts if facts[k] != want_facts[k]))
        pytest.fail(f"settings {config}; the calls up to the first difference:\n{listing}\n{call!r}: {what}",
                    pytrace=False)
