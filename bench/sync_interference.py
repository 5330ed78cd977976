"""A bulk sync next to a training run that reads the same store: what it costs the run.

Starts a SeaweedFS store holding a synthetic prepared dataset (bench/data_throughput.py's)
and a bulk folder (random checkpoint-like parts). A stand-in for a training rank reads its
batches from the store as Ray Data's read tasks do (one Parquet row group per step, pyarrow)
and spends a fixed compute per step (a torch matmul); meanwhile `wildtrain sync` copies the
bulk folder out of the same store to a local folder, uncapped or capped. Prints the median
step time and data wait per step for each case (the case without a sync is the reference),
and the sync's rate.

On one machine the store, rclone and the reader share the CPUs and the loopback: this
measures that contention, not a provider's network; the ratio between rows is the point.

Usage: .venv/bin/python bench/sync_interference.py [--bulk-mb 512] [--cap 20M] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import torch
from data_throughput import write_synthetic

from wildtrain import services, storage
from wildtrain.clusters.sync import Location, sync
from wildtrain.data.manifest import read_manifest
from wildtrain.data.stream import TOKENS


def train_steps(root: str, go_on: Callable[[int], bool], compute: torch.Tensor) -> tuple[list[float], list[float]]:
    """(step seconds, data wait seconds) of the steps taken while `go_on(step)`, each reading
    the next row group."""
    manifest = read_manifest(root)
    groups = [(shard.path, g) for shard in manifest.shards for g in range(len(shard.row_groups))]
    step_s, wait_s = [], []
    step = 0
    while go_on(step):
        step += 1
        started = time.perf_counter()
        path, group = groups[step % len(groups)]
        fs, file_path = storage.filesystem(storage.join(root, path))
        with fs.open_input_file(file_path) as f:
            pq.ParquetFile(f).read_row_group(group, columns=[TOKENS]).column(TOKENS).combine_chunks()
        waited = time.perf_counter() - started
        for _ in range(4):
            compute @ compute
        step_s.append(time.perf_counter() - started)
        wait_s.append(waited)
    return step_s, wait_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk-mb", type=int, default=512)
    parser.add_argument("--cap", default="20M", help="rclone --bwlimit of the capped case")
    parser.add_argument("--steps", type=int, default=60, help="steps of the case without a sync")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compute = torch.randn(512, 512)
    with tempfile.TemporaryDirectory(prefix="wt-sync-bench-") as folder:
        store = services.start_object_store(Path(folder) / "store", services.free_port(), "bench")
        try:
            os.environ.update(store.env())
            data, bulk = "s3://bench/datasets/synthetic", "s3://bench/runs/bulk"
            write_synthetic(data, 16e6)
            for i in range(args.bulk_mb // 16):
                storage.write_bytes(f"{bulk}/part-{i:04d}.bin", os.urandom(16 << 20))
            rows = []
            for case, cap in (("no sync", None), ("uncapped sync", "off"), (f"sync capped {args.cap}", args.cap)):
                copied = {}
                copying = None
                if cap is not None:
                    target = Path(folder) / f"copy-{len(rows)}"
                    copying = threading.Thread(
                        target=lambda: copied.update(result=sync(Location(bulk), Location(str(target)), cap))
                    )
                    copying.start()
                    # Every step measured overlaps the copy.
                    step_s, wait_s = train_steps(data, lambda step: copying.is_alive(), compute)
                    copying.join()
                else:
                    step_s, wait_s = train_steps(data, lambda step: step < args.steps, compute)
                result = copied.get("result")
                rate = result.copied_bytes / result.copy_seconds / 2**20 if result else None
                rows.append(
                    (
                        case,
                        len(step_s),
                        statistics.median(step_s) * 1e3,
                        statistics.median(wait_s) * 1e3,
                        max(wait_s) * 1e3,
                        rate,
                    )
                )
        finally:
            services.stop_process(store.pid)
    print(f"\n{'case':<22}{'steps':>6}{'step ms':>10}{'data wait ms':>14}{'max wait ms':>13}{'sync MiB/s':>12}")
    print("-" * 77)
    for case, steps, step, wait, worst, rate in rows:
        print(
            f"{case:<22}{steps:>6}{step:>10.1f}{wait:>14.1f}{worst:>13.1f}{'-' if rate is None else f'{rate:.1f}':>12}"
        )
    print(f"\nmedians per step; {args.bulk_mb} MiB bulk copy; with a sync, only the steps taken while it copies")


if __name__ == "__main__":
    main()
