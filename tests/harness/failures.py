"""How a task fails: RankRaised, RankDied, RankHung, all RankFailure. Its own module so that every
other part of the harness can raise them without importing another part."""
from __future__ import annotations


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
    pass


class RankHung(RankFailure):
    pass
