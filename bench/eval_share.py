"""The share of the demo's run spent on validation, for the validation cadences it could ship.

Trains `make demo`'s run (`experiment=tiny`: 60 steps, two workers) with each setting of
`--settings` (a `;`-separated list of override groups, `,` between the overrides of one),
one after the other, `--repeats` times in alternating order, and prints the median share of
the run's logged span spent scoring the validation set (goodput's `eval` cause) and its
steps/s. The settings are read against one another; the default's `eval.every=0`
(validation at the last step only) is the least a run validates. The goal: the shipped
setting at or under 2%.

Usage: .venv/bin/python bench/eval_share.py [--repeats 2] [--settings "eval.every=20;eval.every=0"]
"""

from __future__ import annotations

import argparse
import statistics

from progress import say
from tiny_runs import tiny_bench

SETTINGS = "eval.every=20;eval.every=0;eval.every=0,eval.micro_batch_size=16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=SETTINGS)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    settings = [group.split(",") for group in args.settings.split(";")]
    rows: dict[str, list] = {",".join(s): [] for s in settings}
    # Two training workers and a CPU for Ray Data's reads, as `wildtrain up`'s head offers.
    with tiny_bench("bench-eval-share", 3) as bench:
        for repeat in range(args.repeats):
            for overrides in settings if repeat % 2 == 0 else settings[::-1]:
                label = ",".join(overrides)
                say(f"{label}, run {repeat + 1}")
                rows[label].append(bench.train(bench.config(f"eval-share-{repeat}", *overrides)))
                say(f"{label}, run {repeat + 1}: validation {rows[label][-1].validation:.1%}")

    print(f"\nmedians of {args.repeats} runs each, the demo's run (60 steps, 2 workers)")
    print("| setting | validation share | steps/s |")
    print("|---|---|---|")
    for label, timed in rows.items():
        print(
            f"| {label} | {statistics.median(t.validation for t in timed):.1%} | "
            f"{statistics.median(t.steps_per_s for t in timed):.2f} |"
        )


if __name__ == "__main__":
    main()
