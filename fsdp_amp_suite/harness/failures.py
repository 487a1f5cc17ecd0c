"""How a task fails: RankRaised, RankDied, RankHung, all RankFailure. Its own module so that every
other part of the harness can raise them without importing another part."""
from __future__ import annotations

import dataclasses
import functools
import os
import re


class RankFailure(Exception):
    """A task failed on one or more ranks. Data, not just a message:

        what        what happened ("raised", "hung (no answer within 15 s)", "died", ...)
        ranks       {rank: text} of the ranks it happened to: a traceback, or an exit code + stack + output
        others      {rank: text} of the other ranks with something to say (their stacks, their errors)
        world_size  the size of the group (None for a failure before any rank ran)

    str() renders all of it: a header line, then each rank's text.
    """

    def __init__(self, what: str, ranks: dict | None = None, others: dict | None = None,
                 world_size: int | None = None):
        self.what, self.world_size = what, world_size
        self.ranks, self.others = dict(ranks or {}), dict(others or {})
        super().__init__(self._render())

    def _render(self) -> str:
        if self.world_size is None:
            return self.what
        parts = [f"rank(s) {sorted(self.ranks)} of world_size {self.world_size} {self.what}"]
        parts += [f"----- rank {r} -----\n{self.ranks[r]}" for r in sorted(self.ranks)]
        parts += [f"----- rank {r} (also) -----\n{self.others[r]}" for r in sorted(self.others)]
        return "\n".join(parts)

    def error(self, rank: int | None = None) -> str:
        """The last line of a rank's text (the first failing rank's by default): its exception, e.g.
        "RuntimeError: ..."."""
        rank = min(self.ranks) if rank is None else rank
        lines = [line for line in self.ranks[rank].splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


class RankRaised(RankFailure):
    pass


class RankDied(RankFailure):
    """`deaths`: a Death per rank that died, for the report (a death in torch's code is not a scaler verdict)."""

    def __init__(self, what: str, ranks: dict | None = None, others: dict | None = None,
                 world_size: int | None = None, deaths: tuple = ()):
        self.deaths = tuple(deaths)
        super().__init__(what, ranks, others, world_size)


@dataclasses.dataclass(frozen=True)
class Death:
    """How one rank died: `how` its signal ("SIGABRT") or "exit code N"; `frame` the innermost Python frame of its
    faulthandler stack ("torch/distributed/_functional_collectives.py:203 all_gather_tensor"; "" where it printed
    none); `owner` whose code that frame is: "torch", "fairscale", "native" (the thread that died runs no Python:
    a library's own thread, such as gloo's), or "other" (the suite, the scaler under test, anything else). Only a
    death in torch's, fairscale's or native code is not the scaler's; any other can be."""
    rank: int
    how: str
    frame: str = ""
    owner: str = "other"

    def __str__(self) -> str:
        if self.owner == "native":
            where = " in a thread without Python frames (native code)"
        elif self.frame:
            where = f" in {self.owner}'s code at {self.frame}" if self.owner != "other" else f" at {self.frame}"
        else:
            where = " (no Python stack printed)"
        return f"rank {self.rank} {self.how}{where}"

    def as_data(self) -> dict:
        return dataclasses.asdict(self)


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
_OWNERS = ("torch", "fairscale")  # the top-level packages whose own crash is not the scaler's


def death(rank: int, exitcode: int | None, stack: str) -> Death:
    """A Death from a dead rank's exit code (negative: the signal) and its faulthandler output: the first frame of
    the "Current thread" block (faulthandler's "most recent call first"), else of the first block."""
    import signal

    how = signal.Signals(-exitcode).name if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
    start = stack.find("Current thread")
    if start < 0:
        start = stack.find("Thread 0x")
    if start < 0:
        return Death(rank, how)
    block = stack[start:].split("\n\n", 1)[0]  # that thread's frames only: the next thread's are not its
    match = _FRAME.search(block)
    if match is None:  # a native thread (gloo's, CUDA's): no Python frame, no Python code of anyone's
        return Death(rank, how, "", "native") if "<no Python frame>" in block else Death(rank, how)
    path, owner = match["path"], "other"
    for pkg, root in _package_roots().items():
        if path.startswith(root + os.sep):
            path, owner = os.path.join(pkg, os.path.relpath(path, root)), pkg
    return Death(rank, how, f"{path}:{match['line']} {match['func']}", owner)


@functools.cache
def _package_roots() -> dict:
    """{package: the directory it is imported from} for the installed _OWNERS."""
    import importlib.util

    specs = {pkg: importlib.util.find_spec(pkg) for pkg in _OWNERS}
    return {pkg: os.path.dirname(spec.origin) for pkg, spec in specs.items() if spec and spec.origin}


class RankHung(RankFailure):
    pass
