"""How long a joiner's new process takes to be ready to join (`train.loop.ready_to_join`).

A worker started on a lost member's slot (`elastic.in_process`) unpickles the run's inputs
(wildtrain's, torch's and Ray Data's imports), then does its first-time work before it asks
to join: DeepSpeed's and torch._dynamo's imports, its save process's start, Ray Data's first
read and, on a CPU, the peak FLOP/s. `ready_to_join` runs the save process's imports and the
first read beside the imports; the reference does the same steps one after the other, as
before. Each trial is a new Ray actor process on an idle local Ray (as on a node that has
just come back: nothing else runs on it), the two alternating. Prints per trial and the
medians, from the process's start:

    inputs      the actor's arguments unpickled (its method starts)
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
from wildtrain.train.entry import LoopInputs  # noqa: E402


@ray.remote(num_cpus=1)
class Joiner:
    def ready(self, inputs: LoopInputs, overlapped: bool) -> tuple[float, float]:
        import torch

        from wildtrain.checkpoint.save_process import SaveProcess
        from wildtrain.data import stream
        from wildtrain.engine import import_ahead
        from wildtrain.tracking.worker.mfu import device_peak
        from wildtrain.train.loop import ready_to_join

        started = psutil.Process().create_time()
        unpickled = time.time() - started
        device = torch.device("cpu")
        if overlapped:
            ready_to_join(inputs, device)
        else:  # the reference: one after the other
            import_ahead()
            SaveProcess()
            stream.warm_up(inputs.data.datasets, inputs.cfg)
            device_peak(device, inputs.cfg.cluster.peak_flops_per_device)
        return unpickled, time.time() - started


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
            rows = {"one after the other": [], "ready_to_join": []}
            for trial in range(args.trials):
                for how, overlapped in (("one after the other", False), ("ready_to_join", True)):
                    # A runtime env of its own, as a joiner's: a new process, not an idle worker of Ray's.
                    actor = Joiner.options(runtime_env={"env_vars": {"WILDTRAIN_TRIAL": f"{how}-{trial}"}}).remote()
                    unpickled, ready = ray.get(actor.ready.remote(inputs, overlapped))
                    ray.kill(actor)
                    rows[how].append((unpickled, ready))
                    say(f"trial {trial + 1}, {how}: inputs {unpickled:.2f} s, ready {ready:.2f} s")
        finally:
            ray.shutdown()
    print("\n| how | inputs (median) | ready (median) | ready, each trial |")
    print("|---|---|---|---|")
    for how, trials in rows.items():
        print(f"| {how} | {statistics.median(u for u, _ in trials):.2f} s | {statistics.median(r for _, r in trials):.2f} s"
              f" | {', '.join(f'{r:.2f}' for _, r in trials)} |")
    reference, overlapped = (statistics.median(r for _, r in rows[how]) for how in rows)
    print(f"\nready_to_join / one after the other: {overlapped / reference:.2f}x")


if __name__ == "__main__":
    main()
