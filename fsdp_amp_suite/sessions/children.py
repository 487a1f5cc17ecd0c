"""What the harness meta-tests need to run a child session and watch the processes it leaves behind.

Every process of a child session (its pytest, its workers, their ranks) inherits HARNESS_LEAK_TOKEN, so
the processes still alive afterwards can be found by that token in /proc.
"""
import os
import time

from fsdp_amp_suite.child_run import clean_env

SESSIONS = os.path.join("fsdp_amp_suite", "sessions")  # the case_*.py files, relative to the suite's root


def child_env(token: str, out_dir, **extra) -> dict:
    """A child session's environment: tagged with `token`; its case files write their rows into out_dir."""
    return dict(clean_env(), HARNESS_LEAK_TOKEN=token, CASE_OUT_DIR=str(out_dir), **extra)


def is_zombie(pid: int) -> bool:
    """Exited and not yet reaped (or gone): no longer running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def processes_with(token: str) -> list[int]:
    """The running processes whose environment carries this token."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or is_zombie(int(pid)):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"HARNESS_LEAK_TOKEN={token}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def wait_until_gone(token: str, seconds: float) -> list[int]:
    """The token's processes still running after up to `seconds` of waiting for them to end."""
    deadline = time.monotonic() + seconds
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_with(token)
