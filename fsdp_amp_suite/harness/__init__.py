"""The rank harness: run a function on N ranks, get every rank's result back. ranks.py is the API and
says which module does what; docs/harness.md is the guide."""
from fsdp_amp_suite.harness.failures import RankDied, RankFailure, RankHung, RankRaised
from fsdp_amp_suite.harness.ranks import (DEFAULT_TIMEOUT_S, Harness, install, missing_requirement, run_on_ranks,
                                          session,
                                 shutdown_pools)
from fsdp_amp_suite.harness.task import cached_group, cached_mesh, rank_device
from fsdp_amp_suite.harness.torchrun import torchrun_world_size

__all__ = ["DEFAULT_TIMEOUT_S", "Harness", "RankDied", "RankFailure", "RankHung", "RankRaised", "cached_group",
           "cached_mesh", "install", "missing_requirement", "rank_device", "run_on_ranks", "session", "shutdown_pools",
           "torchrun_world_size"]
