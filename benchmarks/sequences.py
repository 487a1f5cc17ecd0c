"""Speed of the stateful contract test (fsdp_amp_suite/conformance/sequences.py): examples per second.

    python -m benchmarks.sequences [--scaler ours] [--placement cpu] [--examples 40] [--steps 30]

Runs the state machine directly, with the ci profile's settings at the given budget (derandomized), on
2 ranks of the pool (started before the clock), and counts the sequences that ran on the ranks and their
calls. Last line: sequence_examples_per_second=<sequences run / wall seconds>.
"""
import argparse
import time

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from fsdp_amp_suite import profiles
from fsdp_amp_suite.conformance import sequences
from fsdp_amp_suite.conformance.calls import GROUPS, Backward
from fsdp_amp_suite.harness import shutdown_pools


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scaler", default="ours")
    ap.add_argument("--placement", default="cpu")
    ap.add_argument("--examples", type=int, default=40)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    counted = {"sequences": 0, "calls": 0}

    class Counted(sequences.ScalerContract):
        def teardown(self):
            counted["sequences"] += bool(self.sequence)
            counted["calls"] += len(self.sequence)
            super().teardown()

    # the pools' start-up is not the test's speed: one sequence on each world size first, off the clock
    for groups in GROUPS:
        config = dict(init_scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, n_optimizers=1,
                      groups=groups)
        sequences.check_sequence(args.scaler, args.placement, config, [Backward()],
                                      sequences.expected_facts(config, [Backward()]))
    profiles.register()
    budget = settings(settings.get_profile("ci"), max_examples=args.examples, stateful_step_count=args.steps,
                      deadline=None, suppress_health_check=[HealthCheck.too_slow])
    t0 = time.perf_counter()
    run_state_machine_as_test(lambda: Counted(args.scaler, args.placement), settings=budget)
    wall = time.perf_counter() - t0
    shutdown_pools()
    print(f"{args.scaler} on {args.placement}: {counted['sequences']} sequences, {counted['calls']} calls "
          f"in {wall:.2f} s ({counted['calls'] / wall:.0f} calls/s, on 2 or 4 ranks)")
    print(f"sequence_examples_per_second={counted['sequences'] / wall:.1f}")


if __name__ == "__main__":
    main()
