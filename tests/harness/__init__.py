"""The rank harness: run a function on N ranks, get every rank's result back. ranks.py is the API and
says which module does what; docs/harness.md is the guide."""
from tests.harness.ranks import (  # noqa: F401
    DEFAULT_TIMEOUT_S,
    RankDied,
    RankFailure,
    RankHung,
    Harness,
    cached_group,
    cached_mesh,
    RankRaised,
    install,
    missing_requirement,
    rank_device,
    run_on_ranks,
    session,
    shutdown_pools,
    torchrun_world_size,
)
