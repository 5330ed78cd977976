"""How long a joiner's new process takes to be ready to join (`train.loop.ready_to_join`).

A worker started on a lost member's slot (`elastic.in_process`) does its first-time work
before it asks to join: the loop's imports (torch, Ray Train, the model's torch._dynamo),
DeepSpeed's, its save process's start, Ray Data's first read and, on a CPU, the peak FLOP/s.
The first read mostly waits for Ray to start its read tasks' processes. `train.entry.joiner_main`
begins it before the loop's imports ("read first"); the reference begins it after them, as
before ("read after the imports"). Each trial is a new Ray actor process on an idle local Ray
(as on a node that has just come back: nothing else runs on it), the two alternating. Prints
per trial and the medians, from the process's start:

    called      Ray called the actor's method (its process runs, its arguments unpickled)
    ready       ready to ask to join

Usage: PYTHONPATH=platform:bench .venv/bin/python bench/joiner_ready.py [--trials 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from progress import say
from recovery import tiny_services
from wildtrain import services

os.environ.update(services.token_auth_env())  # as a cluster of `wildtrain up`'s: before Ray's import

import psutil  # noqa: E402
import ray  # noqa: E402

from wildtrain import storage  # noqa: E402
from wildtrain.config import load_config  # noqa: E402
from wildtrain.data.dataset import open_datasets  # noqa: E402
from wildtrain.elastic import scaling  # noqa: E402
from wildtrain.train.entry import LoopInputs, begin_first_read  # noqa: E402


@ray.remote(num_cpus=1)
class Joiner:
    def ready(self, inputs: LoopInputs, read_first: bool) -> tuple[float, float]:
        started = psutil.Process().create_time()
        called = time.time() - started
        if read_first:  # as train.entry.joiner_main does
            first_read = begin_first_read(inputs)
            from wildtrain.train.loop import ready_to_join
        else:
            from wildtrain.train.loop import ready_to_join

            first_read = begin_first_read(inputs)
        import torch

        ready_to_join(inputs, torch.device("cpu"), first_read)
        return called, time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=4, help="trials of each")
    args = parser.parse_args()
    with tiny_services("bench-joiner-ready") as (root, dataset, mlflow_url):
        cfg = load_config(["experiment=tiny", f"run.storage={root / 'runs'}", f"tracking.uri={mlflow_url}",
                           f"data.datasets=[{{uri: {dataset}}}]", "cluster.use_gpu=false"])
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        try:
            inputs = LoopInputs(cfg, open_datasets(cfg), scaling.worker_resources(cfg),
                                storage.StorageView.here(cfg.storage))
            rows = {"read after the imports": [], "read first": []}
            for trial in range(args.trials):
                for how, read_first in (("read after the imports", False), ("read first", True)):
                    # A runtime env of its own, as a joiner's: a new process, not an idle worker of Ray's.
                    actor = Joiner.options(runtime_env={"env_vars": {"WILDTRAIN_TRIAL": f"{how}-{trial}"}}).remote()
                    called, ready = ray.get(actor.ready.remote(inputs, read_first))
                    ray.kill(actor)
                    rows[how].append((called, ready))
                    say(f"trial {trial + 1}, {how}: called {called:.2f} s, ready {ready:.2f} s")
        finally:
            ray.shutdown()
    print("\n| how | called (median) | ready (median) | ready, each trial |")
    print("|---|---|---|---|")
    for how, trials in rows.items():
        print(f"| {how} | {statistics.median(u for u, _ in trials):.2f} s | {statistics.median(r for _, r in trials):.2f} s"
              f" | {', '.join(f'{r:.2f}' for _, r in trials)} |")
    reference, read_first = (statistics.median(r for _, r in rows[how]) for how in rows)
    print(f"\nready, read first / read after the imports: {read_first / reference:.2f}x")


if __name__ == "__main__":
    main()
