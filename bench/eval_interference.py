"""Steps per second with downstream evaluations running beside training, and without.

With eval.tasks set, every committed checkpoint due (eval.every_checkpoints) is exported
and evaluated by lm-eval as a Ray task on resources of its own (eval.num_cpus CPUs, or a
GPU), while training goes on: the goal is steps/s within 5% of a run without evaluations.
This script trains the tiny model at world size 1 on one local fake cluster whose CPUs are
one worker's, Ray Data's reads' and one evaluation's, checkpointing every
`--checkpoint-every` steps, with the bundled task of tests/assets/evals evaluated at each
checkpoint and without evaluations, `--repeats` times in alternating order, and prints the
median steps/s of each, their ratio, and how many evaluations ended while the run trained.

On a machine with fewer cores than the cluster declares (CI's and this one's: 2), the
evaluation's process takes CPU time from the worker's, which a node whose evaluation has a
core or a GPU of its own does not: the ratio printed there is the worst case, not the
platform's overhead. `load` is the 1-minute load average over the run. So is a store and
an MLflow server on the training node at `wildtrain up`'s priority (0, above Ray's workers
at 15): serving the evaluation's checkpoint read and results there takes training's CPU;
`--services-nice 19` runs them below training, as if they ran elsewhere. Figures:
docs/benchmarks.md, evaluation.

Usage: .venv/bin/python bench/eval_interference.py [--steps 150] [--checkpoint-every 25] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

from mlflow.tracking import MlflowClient
from progress import say
from tiny_runs import REPO, add_services_nice, tiny_bench

from wildtrain.tracking.record import mlflow_key

TASK = "wildtrain_tiny_choice"  # tests/assets/evals/tiny_choice.yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2)
    add_services_nice(parser)
    args = parser.parse_args()
    modes = {
        "without": [],
        "with evaluations": [
            f"eval.tasks=[{TASK}]",
            f"eval.include_path={REPO / 'tests/assets/evals'}",
            "eval.every_checkpoints=1",
        ],
    }
    rows = []
    with tiny_bench("bench-eval-interference", 3, args.services_nice) as bench:
        client = MlflowClient(bench.mlflow_url)
        for repeat in range(args.repeats):
            for mode in list(modes) if repeat % 2 == 0 else list(modes)[::-1]:
                cfg = bench.config(
                    f"evals-{'on' if modes[mode] else 'off'}-{repeat}",
                    f"train.steps={args.steps}",
                    f"checkpoint.every={args.checkpoint_every}",
                    "elastic.max_workers=1",
                    *modes[mode],
                )
                say(f"{mode}, run {repeat + 1}: training {args.steps} steps")
                load_before = os.getloadavg()[0]
                timed = bench.train(cfg)
                span = sorted(m.step for m in client.get_metric_history(timed.run_id, mlflow_key("step_time_s")))
                evaluated = [
                    m
                    for m in client.get_metric_history(timed.run_id, f"eval/{TASK}/acc")
                    if span[0] <= m.step < span[-1]
                ]
                rows.append(
                    {
                        "mode": mode,
                        "steps/s": timed.steps_per_s,
                        "evaluations": len(evaluated),
                        "load": (load_before + os.getloadavg()[0]) / 2,
                    }
                )
                say(
                    f"{mode}, run {repeat + 1}: {timed.steps_per_s:.2f} steps/s, "
                    f"{len(evaluated)} evaluations while training"
                )

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    print(
        f"\nmedians of {args.repeats} runs each, {args.steps} steps a run, a checkpoint every {args.checkpoint_every}"
    )
    print("| mode | steps/s | vs without | evaluations while training | load | each run's steps/s |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        each = ", ".join(f"{r['steps/s']:.2f}" for r in rows if r["mode"] == mode)
        print(
            f"| {mode} | {median(mode, 'steps/s'):.2f} "
            f"| {median(mode, 'steps/s') / median('without', 'steps/s'):.3f} | "
            f"{median(mode, 'evaluations'):g} | {median(mode, 'load'):.1f} | {each} |"
        )


if __name__ == "__main__":
    main()
