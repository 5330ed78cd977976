"""Steps per second against how often a run logs: reports must never hold a step back.

Ray Train keeps one report per worker, and a second waits until the controller polls
(`elastic.poll_interval_s`, 2 s). Before the loop sent its log steps' metrics together at
most once a poll, a tiny run logging every step trained one step per poll. This script
trains the tiny model with `train.log_every` 1, 5 (the demo's) and 1000 (only the first
and last steps), at world size 1 and 2, on one local fake cluster with the default 2 s
poll, one run after the other, `--repeats` times in alternating order (so that the load of
a shared machine drifts over every cadence alike), and prints the median steps/s of each
and its ratio to the `log_every=1000` runs at the same size (the goal: within 3%).

steps/s is read back from MLflow over the run's logged span (bench/tiny_runs.py).
`report wait` and `validation` are the shares of that span spent handing reports over and
scoring the validation set (goodput's report_wait and eval; the demo's experiment validates
at its last step on the 5% of documents `make demo` holds out), `load` the machine's 1-minute
load average meanwhile.

Usage: .venv/bin/python bench/report_cadence.py [--steps 150] [--log-every 1,5,1000] [--world-sizes 1,2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

from progress import say
from tiny_runs import add_services_nice, tiny_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--log-every", default="1,5,1000")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    add_services_nice(parser)
    args = parser.parse_args()
    cadences = [int(n) for n in args.log_every.split(",")]
    sizes = [int(n) for n in args.world_sizes.split(",")]
    rows = []
    # Two training workers and a CPU for Ray Data's reads, as `wildtrain up`'s head offers.
    with tiny_bench("bench-report-cadence", max(sizes) + 1, args.services_nice) as bench:
        for size in sizes:
            for repeat in range(args.repeats):
                for every in cadences if repeat % 2 == 0 else cadences[::-1]:
                    cfg = bench.config(
                        f"cadence-w{size}-log{every}-{repeat}",
                        f"train.steps={args.steps}",
                        f"train.log_every={every}",
                        f"checkpoint.every={args.steps}",
                        f"elastic.min_workers={size}",
                        f"elastic.max_workers={size}",
                        "elastic.poll_interval_s=2",
                    )
                    say(f"world size {size}, log_every {every}, run {repeat + 1}: training {args.steps} steps")
                    load_before = os.getloadavg()[0]
                    timed = bench.train(cfg)
                    rows.append(
                        {
                            "world size": size,
                            "log_every": every,
                            "steps/s": timed.steps_per_s,
                            "report wait": timed.report_wait,
                            "eval": timed.validation,
                            "load": (load_before + os.getloadavg()[0]) / 2,
                        }
                    )
                    say(f"world size {size}, log_every {every}, run {repeat + 1}: {timed.steps_per_s:.2f} steps/s")

    def median(size: int, every: int, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["world size"] == size and r["log_every"] == every)

    print(f"\nmedians of {args.repeats} runs each, {args.steps} steps a run")
    print(
        "| world size | log_every | steps/s | vs log_every=1000 | report wait | validation | load "
        "| each run's steps/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for every in cadences:
            rate = median(size, every, "steps/s")
            ratio = f"{rate / median(size, 1000, 'steps/s'):.3f}" if 1000 in cadences else "-"
            each = ", ".join(f"{r['steps/s']:.2f}" for r in rows if r["world size"] == size and r["log_every"] == every)
            print(
                f"| {size} | {every} | {rate:.2f} | {ratio} | {median(size, every, 'report wait'):.1%} | "
                f"{median(size, every, 'eval'):.1%} | {median(size, every, 'load'):.1f} | {each} |"
            )


if __name__ == "__main__":
    main()
