"""Training data throughput: the Ray Data path against a plain pyarrow read of the same shards.

Starts a SeaweedFS object store and a local Ray instance, writes a synthetic prepared dataset
(random token ids, the real shard format) into the store, then prints:

  1. tokens/s of one rank streaming a whole epoch through `RankStream` (Ray Data read tasks,
     segment routing), next to a plain loop that reads the same row groups with pyarrow in
     the same process, and their ratio: from the first batch on (steady state), the medians
     of `--repeats` passes of each, run alternately so a shared machine's load hits both;
  2. the time from creating a rank's stream to its first batch, at the start of the epoch
     and mid-epoch (what every restart and resize pays again);
  3. the data-wait share of step time in a short tiny-model training run on the same stack;
  4. one rank of the tiny experiment streaming the bundled corpus across `--epochs` epoch ends,
     each step followed by `--step-ms` of pretend training: the data wait of an epoch's first step
     against the other steps', and with `--reference-rev` the same for that revision's stream,
     run alternately, with the ratios.

bench/sync_interference.py reuses its synthetic dataset (`write_synthetic`).

Usage: .venv/bin/python bench/data_throughput.py [--tokens 64e6] [--repeats 3] [--skip-training]
           [--epochs 8] [--step-ms 60] [--reference-rev REV] [--epochs-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from reference import module_at

from wildtrain import services

# Ray reads its authentication mode once, on import.
os.environ.update(services.token_auth_env())

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402

from wildtrain import storage  # noqa: E402
from wildtrain.config import load_config  # noqa: E402
from wildtrain.data import stream as current_stream  # noqa: E402
from wildtrain.data.manifest import Manifest, encode_shard, write_manifest  # noqa: E402
from wildtrain.data.prepare import PrepareConfig, prepare  # noqa: E402
from wildtrain.data.stream import TOKENS, RankStream, columns  # noqa: E402
from wildtrain.data.tokenizer import ByteTokenizer  # noqa: E402
from wildtrain.driver import open_data  # noqa: E402
from wildtrain.tracking.record import mlflow_key  # noqa: E402

SEQ_LEN = 1024
GLOBAL_BATCH = 32
SHARDS = 8
ROWS_PER_GROUP = 256
REPO = Path(__file__).resolve().parents[1]
RAY_CPUS = 4
PLAIN, RAY_DATA = "plain pyarrow", "Ray Data (RankStream)"


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
    write_manifest(
        root,
        Manifest(
            seq_len=SEQ_LEN,
            tokenizer=ByteTokenizer().describe(),
            source="synthetic",
            shards=shards,
            rows=sum(s.rows for s in shards),
            tokens=sum(s.tokens for s in shards),
        ),
    )


@dataclass(frozen=True)
class Pass:
    """One pass over the data: all of it, and the part up to the first batch."""

    tokens: int
    seconds: float
    first_tokens: int
    first_s: float

    @property
    def steady(self) -> float:
        """Tokens/s from the first batch on: what training sees between restarts."""
        return (self.tokens - self.first_tokens) / (self.seconds - self.first_s)


def plain_pyarrow(root: str, shard_paths: tuple[str, ...]) -> Pass:
    """Every row group of every shard, decoded to the (rows, seq_len+1) int32 arrays
    RankStream's read tasks decode for a plain causal run (the tokens), in one loop in this process."""
    read = columns(doc_ids=False)
    started, tokens, first = time.perf_counter(), 0, None
    for path in shard_paths:
        fs, file_path = storage.filesystem(storage.join(root, path))
        with fs.open_input_file(file_path) as f:
            parquet = pq.ParquetFile(f)
            for group in range(parquet.num_row_groups):
                table = parquet.read_row_group(group, columns=list(read))
                arrays = [
                    table.column(c).combine_chunks().flatten().to_numpy().reshape(len(table), SEQ_LEN + 1) for c in read
                ]
                tokens += arrays[read.index(TOKENS)].size
                first = first or (tokens, time.perf_counter() - started)
    return Pass(tokens, time.perf_counter() - started, *first)


def ray_data_epoch(datasets, cfg) -> Pass:
    """One rank (of one) streaming the whole epoch through RankStream."""
    started = time.perf_counter()
    stream = RankStream(
        datasets.datasets, cfg.data, cfg.train, cfg.storage, rank=0, world_size=1, from_step=0, doc_ids=False
    )
    tokens = stream.next_step().tokens.size
    first = (tokens, time.perf_counter() - started)
    for _ in range(datasets.steps_per_epoch - 1):
        tokens += stream.next_step().tokens.size
    stream.close()  # and the next epoch's reads, begun ahead, which would compete with the next pass
    return Pass(tokens, time.perf_counter() - started, *first)


def first_batch(datasets, cfg, from_step: int) -> float:
    started = time.perf_counter()
    stream = RankStream(
        datasets.datasets, cfg.data, cfg.train, cfg.storage, rank=0, world_size=1, from_step=from_step, doc_ids=False
    )
    stream.next_step()
    took = time.perf_counter() - started
    stream.close()
    return took


def training_data_wait(root: Path, dataset_uri: str) -> tuple[float, float]:
    """(mean data wait, mean step time) per step of a short tiny run, as rank 0 reported them."""
    from mlflow.tracking import MlflowClient

    from wildtrain import driver

    port = services.free_port()
    mlflow = services.start_mlflow(root / "mlflow", port)
    try:
        uri = f"http://{services.HOST}:{port}"
        cfg = load_config(
            [
                "experiment=tiny",
                f"run.storage={root / 'runs'}",
                f"tracking.uri={uri}",
                f"data.datasets=[{{uri: {dataset_uri}}}]",
                "train.steps=40",
                "train.log_every=5",
                "elastic.max_workers=1",
            ]
        )
        summary = driver.run(cfg)
        client = MlflowClient(uri)
        waits = [
            m.value for m in client.get_metric_history(summary.run_id, mlflow_key("time/data_wait_s")) if m.step > 1
        ]
        steps = [m.value for m in client.get_metric_history(summary.run_id, mlflow_key("step_time_s")) if m.step > 1]
        return statistics.mean(waits), statistics.mean(steps)
    finally:
        services.stop_process(mlflow.pid)


@dataclass(frozen=True)
class Crossing:
    """One stream's data wait per step, at an epoch's first step and at the others."""

    boundary_ms: list[float]
    other_ms: list[float]


def cross_epochs(module: ModuleType, datasets, cfg, epochs: int, step_s: float) -> Crossing:
    """Rank 0 of 1 streaming from step 0 to the end of `epochs` epochs through `module`'s
    RankStream, `step_s` of pretend training after each step. The stream's start (step 0) is
    neither kind: every stream pays it once."""
    steps_per_epoch = datasets.steps_per_epoch
    reader = module.RankStream(
        datasets.datasets, cfg.data, cfg.train, cfg.storage, rank=0, world_size=1, from_step=0, doc_ids=False
    )
    boundary, other = [], []
    try:
        for step in range(epochs * steps_per_epoch):
            waited = reader.wait_s
            reader.next_step()
            if step:
                (other if step % steps_per_epoch else boundary).append((reader.wait_s - waited) * 1e3)
            time.sleep(step_s)
    finally:
        reader.close()
    return Crossing(boundary, other)


def epoch_crossings(datasets, cfg, epochs: int, step_s: float, reference_rev: str | None) -> None:
    variants = [("this tree", current_stream)]
    if reference_rev:
        reference = module_at(reference_rev, "platform/wildtrain/data/stream.py")
        # Ray's workers run its read tasks and cannot import a module loaded from a temporary file.
        ray.cloudpickle.register_pickle_by_value(reference)
        variants.append((reference_rev, reference))
    crossings: dict[str, list[Crossing]] = {name: [] for name, _ in variants}
    for repeat in range(2):  # alternately, so a shared machine's load hits both
        for name, module in variants:
            progress(f"epoch crossings, {name}, pass {repeat + 1}/2: {epochs} epochs ...")
            crossings[name].append(cross_epochs(module, datasets, cfg, epochs, step_s))
    print(
        f"\none rank of the tiny experiment (global batch {cfg.train.global_batch_size}, "
        f"{datasets.steps_per_epoch} steps an epoch), {step_s * 1e3:.0f} ms of pretend training a step, "
        f"2 passes of {epochs} epochs each; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores:\n"
    )
    print(
        "| stream | epoch ends crossed | wait at an epoch's first step, mean (max) ms | wait at other steps, mean ms |"
    )
    print("|---|---|---|---|")
    means = {}
    for name, _ in variants:
        boundary = [w for c in crossings[name] for w in c.boundary_ms]
        other = [w for c in crossings[name] for w in c.other_ms]
        means[name] = statistics.mean(boundary), statistics.mean(other)
        print(
            f"| {name} | {len(boundary)} | {means[name][0]:.1f} ({max(boundary):.1f}) | {statistics.mean(other):.2f} |"
        )
    if reference_rev:
        (now_boundary, now_other), (then_boundary, then_other) = means["this tree"], means[reference_rev]
        print(
            f"\nthis tree / {reference_rev}: {now_boundary / then_boundary:.3f} at an epoch's first step, "
            f"{now_other / then_other:.2f} at other steps"
        )


def throughput(store, tokens: float, repeats: int) -> None:
    """Sections 1 and 2: the stream against plain pyarrow, and the first batch of a restart."""
    uri = f"s3://{store.bucket}/synthetic"
    progress(f"setup: writing {tokens / 1e6:.0f}M synthetic tokens in {SHARDS} shards to {uri}")
    write_synthetic(uri, tokens)
    cfg = load_config(
        [
            f"data.datasets=[{{uri: {uri}}}]",
            f"data.seq_len={SEQ_LEN}",
            "model.max_seq_len=1024",
            f"train.global_batch_size={GLOBAL_BATCH}",
            "train.micro_batch_size=4",
        ]
    )
    datasets = open_data(cfg)
    passes: dict[str, list[Pass]] = {PLAIN: [], RAY_DATA: []}
    for repeat in range(1, repeats + 1):
        for name, run in (
            (PLAIN, lambda: plain_pyarrow(uri, datasets.datasets[0].shard_paths)),
            (RAY_DATA, lambda: ray_data_epoch(datasets, cfg)),
        ):
            progress(f"{name}, pass {repeat}/{repeats} ...")
            passes[name].append(run())
            p = passes[name][-1]
            progress(
                f"{name}, pass {repeat}/{repeats}: {p.steady / 1e6:.1f}M tokens/s from the first batch on, "
                f"first batch {p.first_s:.2f} s"
            )
    progress("Ray Data: first batch of a stream created mid-epoch (a restart), 3 tries")
    mid_epoch = [first_batch(datasets, cfg, datasets.steps_per_epoch // 2) for _ in range(3)]

    plain = statistics.median(p.steady for p in passes[PLAIN])
    print(
        f"\n{passes[PLAIN][0].tokens / 1e6:.1f}M tokens in {SHARDS} shards (SeaweedFS, row groups of "
        f"{ROWS_PER_GROUP} rows of {SEQ_LEN + 1} tokens), one rank, data.read_cpus={cfg.data.read_cpus:g}; "
        f"medians of {repeats} passes, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores:\n"
    )
    print("| path | tokens/s from the first batch on | ratio to pyarrow | whole pass s | first batch s |")
    print("|---|---|---|---|---|")
    for name in (PLAIN, RAY_DATA):
        steady = statistics.median(p.steady for p in passes[name])
        print(
            f"| {name} | {steady / 1e6:.1f}M | {steady / plain:.2f} | "
            f"{statistics.median(p.seconds for p in passes[name]):.2f} | "
            f"{statistics.median(p.first_s for p in passes[name]):.2f} |"
        )
    print("\n| first batch after creating the stream | seconds |")
    print("|---|---|")
    print(f"| mid-epoch (a restart), 3 tries | {', '.join(f'{t:.2f}' for t in mid_epoch)} |")


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=64e6)
    parser.add_argument("--repeats", type=int, default=3, help="passes of each path, alternating; medians reported")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--epochs", type=int, default=8, help="epoch ends each stream crosses in section 4")
    parser.add_argument("--step-ms", type=float, default=60, help="pretend training after each step in section 4")
    parser.add_argument("--reference-rev", help="a git revision whose data/stream.py crosses the same epochs")
    parser.add_argument("--epochs-only", action="store_true", help="only section 4: the epoch crossings")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wildtrain-bench-data-"))
    progress(f"setup: SeaweedFS and a local Ray with {RAY_CPUS} CPUs")
    store = services.start_object_store(root / "objectstore", services.free_port(), "bench")
    os.environ.update(store.env())
    # A Ray of its own, not whichever cluster on this machine started last.
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, logging_level="WARNING")
    try:
        if not args.epochs_only:
            throughput(store, args.tokens, args.repeats)
        tiny = f"s3://{store.bucket}/tiny"
        progress("setup: preparing the tiny corpus")
        prepare(PrepareConfig(input=str(REPO / "tests/assets/tiny_corpus.jsonl"), output=tiny, rows_per_group=128))
        if not (args.skip_training or args.epochs_only):
            progress("training: running 40 steps of the tiny model")
            wait, step = training_data_wait(root, tiny)
            print(
                f"\ntiny model, 40 steps, 1 worker: data wait {wait * 1e3:.2f} ms of {step * 1e3:.0f} ms "
                f"per step = {wait / step:.2%} of step time"
            )
        tiny_cfg = load_config(["experiment=tiny", f"data.datasets=[{{uri: {tiny}}}]"])
        epoch_crossings(open_data(tiny_cfg), tiny_cfg, args.epochs, args.step_ms / 1e3, args.reference_rev)
    finally:
        ray.shutdown()
        services.stop_process(store.pid)


if __name__ == "__main__":
    main()
