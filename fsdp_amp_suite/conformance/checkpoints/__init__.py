"""Scaler checkpoints saved by other torch versions, loaded by test_scale_rules.py into the scaler under test.

    python -m fsdp_amp_suite.conformance.checkpoints      write <source>-torch-<version>.pt for the installed torch

Each file is torch.save of a scaler's state_dict() after the first SPLIT steps of PATTERN with SETTINGS, as
torch.amp.GradScaler ("torch_amp"), torch's ShardedGradScaler ("torch_sharded") and ours saved it on that torch.
Only torch and scaler_impl are imported, so an environment with another torch and nothing else writes them:
PYTHONPATH=. python -m fsdp_amp_suite.conformance.checkpoints
"""
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = dict(init_scale=64.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
PATTERN = [False, True, False, False, False, False, True, False, False, False, False]  # True: an inf that step
SPLIT = 4  # saved 2 clean steps into a growth interval: scale 32, tracker 2


def files() -> list[Path]:
    return sorted(HERE.glob("*-torch-*.pt"))
