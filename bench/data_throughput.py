"""Training data throughput: the Ray Data path against a plain pyarrow read of the same shards.

Starts a SeaweedFS object store and a local Ray instance, writes a synthetic prepared dataset
(random token ids, the real shard format) into the store, then prints:

  1. tokens/s of one rank streaming a whole epoch through `RankStream` (Ray Data read tasks,
     segment routing), next to a plain loop that reads the same row groups with pyarrow in
     the same process, and their ratio;
  2. the time from creating a rank's stream to its first batch, at the start of the epoch
     and mid-epoch (what every restart and resize pays again);
  3. the data-wait share of step time in a short tiny-model training run on the same stack.

Usage: .venv/bin/python bench/data_throughput.py [--tokens 64e6] [--skip-training]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from wildtrain import services

# Ray reads its authentication mode once, on import.
os.environ.update(services.token_auth_env())

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402

from wildtrain import storage  # noqa: E402
from wildtrain.config import load_config  # noqa: E402
from wildtrain.data.dataset import open_datasets  # noqa: E402
from wildtrain.data.manifest import Manifest, encode_shard, write_manifest  # noqa: E402
from wildtrain.data.prepare import PrepareConfig, prepare  # noqa: E402
from wildtrain.data.stream import TOKENS, RankStream  # noqa: E402
from wildtrain.data.tokenizer import ByteTokenizer  # noqa: E402

SEQ_LEN = 1024
GLOBAL_BATCH = 32
SHARDS = 8
ROWS_PER_GROUP = 256
REPO = Path(__file__).resolve().parents[1]


def write_synthetic(root: str, total_tokens: float) -> None:
    rows_per_shard = int(total_tokens) // (SEQ_LEN + 1) // SHARDS
    rng = np.random.default_rng(0)
    shards = []
    for index in range(SHARDS):
        tokens = rng.integers(0, 256, (rows_per_shard, SEQ_LEN + 1), dtype=np.int32)
        doc_ids = np.zeros_like(tokens)
        shard, data = encode_shard(f"shard-{index:05d}.parquet", tokens, doc_ids, ROWS_PER_GROUP)
        storage.write_bytes(storage.join(root, shard.path), data)
        shards.append(shard)
    write_manifest(root, Manifest(seq_len=SEQ_LEN, tokenizer=ByteTokenizer().describe(), source="synthetic",
                                  shards=shards, rows=sum(s.rows for s in shards), tokens=sum(s.tokens for s in shards)))


def plain_pyarrow(root: str, shard_paths: tuple[str, ...]) -> tuple[int, float]:
    """Every row group of every shard, decoded to a (rows, seq_len+1) array, as RankStream's
    read tasks do; (tokens, seconds)."""
    started, tokens = time.perf_counter(), 0
    for path in shard_paths:
        fs, file_path = storage.filesystem(storage.join(root, path))
        with fs.open_input_file(file_path) as f:
            parquet = pq.ParquetFile(f)
            for group in range(parquet.num_row_groups):
                column = parquet.read_row_group(group, columns=[TOKENS]).column(TOKENS).combine_chunks()
                rows = column.flatten().to_numpy().reshape(len(column), SEQ_LEN + 1).astype(np.int64)
                tokens += rows.size
    return tokens, time.perf_counter() - started


def ray_data_epoch(datasets, cfg) -> tuple[int, float, float]:
    """One rank (of one) streaming the whole epoch; (tokens, seconds, first batch seconds)."""
    started = time.perf_counter()
    stream = RankStream(datasets.datasets, cfg, rank=0, world_size=1, from_step=0)
    stream.next_step()
    first = time.perf_counter() - started
    tokens = GLOBAL_BATCH * (SEQ_LEN + 1)
    for _ in range(datasets.steps_per_epoch - 1):
        tokens += stream.next_step().tokens.size
    return tokens, time.perf_counter() - started, first


def first_batch(datasets, cfg, from_step: int) -> float:
    started = time.perf_counter()
    RankStream(datasets.datasets, cfg, rank=0, world_size=1, from_step=from_step).next_step()
    return time.perf_counter() - started


def training_data_wait(root: Path, dataset_uri: str) -> tuple[float, float]:
    """(mean data wait, mean step time) per step of a short tiny run, as rank 0 reported them."""
    from mlflow.tracking import MlflowClient

    from wildtrain import driver

    port = services.free_port()
    mlflow = services.start_mlflow(root / "mlflow", port)
    try:
        uri = f"http://{services.HOST}:{port}"
        cfg = load_config(["experiment=tiny", f"run.storage={root / 'runs'}", f"tracking.uri={uri}",
                           f"data.datasets=[{{uri: {dataset_uri}}}]", "train.steps=40", "train.log_every=5",
                           "elastic.max_workers=1"])
        summary = driver.run(cfg)
        client = MlflowClient(uri)
        waits = [m.value for m in client.get_metric_history(summary.run_id, "time/data_wait_s") if m.step > 1]
        steps = [m.value for m in client.get_metric_history(summary.run_id, "step_time_s") if m.step > 1]
        return statistics.mean(waits), statistics.mean(steps)
    finally:
        services.stop_process(mlflow.pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=64e6)
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wildtrain-bench-data-"))
    store = services.start_object_store(root / "objectstore", services.free_port(), "bench")
    os.environ.update(store.env())
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        uri = f"s3://{store.bucket}/synthetic"
        write_synthetic(uri, args.tokens)
        cfg = load_config([f"data.datasets=[{{uri: {uri}}}]", f"data.seq_len={SEQ_LEN}", "model.max_seq_len=1024",
                           f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=4"])
        datasets = open_datasets(cfg)
        plain_tokens, plain_s = plain_pyarrow(uri, datasets.datasets[0].shard_paths)
        ray_tokens, ray_s, first_at_start = ray_data_epoch(datasets, cfg)
        mid_epoch = [first_batch(datasets, cfg, datasets.steps_per_epoch // 2) for _ in range(3)]

        print(f"\n{plain_tokens / 1e6:.1f}M tokens in {len(datasets.datasets[0].shard_paths)} shards "
              f"(SeaweedFS, row groups of {ROWS_PER_GROUP} rows of {SEQ_LEN + 1} tokens), one rank:\n")
        print("| path | tokens | seconds | tokens/s | ratio to pyarrow |")
        print("|---|---|---|---|---|")
        print(f"| plain pyarrow | {plain_tokens:,} | {plain_s:.2f} | {plain_tokens / plain_s / 1e6:.1f}M | 1.00 |")
        print(f"| Ray Data (RankStream) | {ray_tokens:,} | {ray_s:.2f} | {ray_tokens / ray_s / 1e6:.1f}M | "
              f"{(ray_tokens / ray_s) / (plain_tokens / plain_s):.2f} |")
        print("\n| first batch after creating the stream | seconds |")
        print("|---|---|")
        print(f"| epoch start | {first_at_start:.2f} |")
        print(f"| mid-epoch (a restart), 3 tries | {', '.join(f'{t:.2f}' for t in mid_epoch)} |")

        if not args.skip_training:
            tiny = f"s3://{store.bucket}/tiny"
            prepare(PrepareConfig(input=str(REPO / "tests/assets/tiny_corpus.jsonl"), output=tiny, rows_per_group=128))
            wait, step = training_data_wait(root, tiny)
            print(f"\ntiny model, 40 steps, 1 worker: data wait {wait * 1e3:.2f} ms of {step * 1e3:.0f} ms "
                  f"per step = {wait / step:.2%} of step time")
    finally:
        ray.shutdown()
        services.stop_process(store.pid)


if __name__ == "__main__":
    main()
