"""The registry of planted defects: what each one is called, and what must catch it.

A mutant scaler is declared on its class,

    @mutant("misses_nan", caught_by=["test_inf_or_nan_skips_step_and_backs_off"], matrix="small")
    class MissesNaN(DeviceSplitGradScaler):
        ...

    misses_nan = MissesNaN.factory  # in the module's table of factories

and a broken FSDP wrapper on its factory (`@broken_wrapper("fsdp1_sums_grads")`). The name is the
factory's name in its module, so the --scaler / --fsdp spec is `module:name`; the module binds it
itself (tests/meta/test_planted.py checks that every name resolves, through the suite's own
resolution, to the registered factory, that names are unique, and that every mutant has a job).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# matrix roles: which teeth run (tests/meta/test_teeth.py) a mutant must fail
ROLES = {
    None: "not run through the matrix",
    "small": "fails cells of the world-size-2 FSDP1/FSDP2 slice (the small model)",
    "wide": "fails the wide model's cells only (hundreds of grads, multi-chunk grads)",
    "mesh": "fails the FSDP2 cells on a 2x2 mesh (hsdp, tp) of the mesh slice",
}


@dataclass(frozen=True)
class Mutant:
    name: str  # the factory's name in the class's module: the spec is module:name
    cls: type
    factory: Callable
    caught_by: tuple  # the conformance test functions that must fail on it (tests/meta/test_mutants.py)
    matrix: str | None  # a key of ROLES

    @property
    def spec(self) -> str:
        return f"{self.cls.__module__}:{self.name}"


@dataclass(frozen=True)
class BrokenWrapper:
    name: str  # the factory's own name: the --fsdp spec is module:name
    factory: Callable
    matrix: str = "small"  # a key of ROLES: the slice whose cells it must fail

    @property
    def spec(self) -> str:
        return f"{self.factory.__module__}:{self.name}"


REGISTERED_SCALERS: list[Mutant] = []  # in registration order, a repeated name included (the meta-test names it)
REGISTERED_WRAPPERS: list[BrokenWrapper] = []


def mutant(name: str, caught_by=(), matrix: str | None = None):
    """Register the decorated scaler class as the planted defect `name`; its factory is `cls.factory`."""
    if matrix not in ROLES:
        raise ValueError(f"mutant {name!r}: matrix={matrix!r} is none of {list(ROLES)}")

    def register(cls):
        def factory(**kwargs):
            return cls(**kwargs)
        factory.__name__ = factory.__qualname__ = name
        factory.__module__ = cls.__module__
        cls.factory = staticmethod(factory)
        REGISTERED_SCALERS.append(Mutant(name, cls, factory, tuple(caught_by), matrix))
        return cls
    return register


def broken_wrapper(name: str, matrix: str = "small"):
    """Register the decorated --fsdp factory as the planted broken wrapper `name`, which must fail cells of the
    `matrix` slice (a key of ROLES)."""
    if matrix not in ROLES or matrix is None:
        raise ValueError(f"broken wrapper {name!r}: matrix={matrix!r} is none of {[r for r in ROLES if r]}")

    def register(factory):
        REGISTERED_WRAPPERS.append(BrokenWrapper(name, factory, matrix))
        return factory
    return register
