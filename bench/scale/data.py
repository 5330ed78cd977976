"""The data order at scale (issue 60, table 4): what every rank does when its stream opens
(`data/stream.py`'s `RankStream`), over a synthetic manifest of up to 100,000 shards, with no
Parquet read: parse the manifest (`Manifest.from_json`), plan the epoch (`order.plan_epoch`,
which every rank runs at its start and at each epoch) and find its segments from a step
(`order.rank_segments`), for world sizes up to 1,024 ranks; and the memory this costs a rank
(tracemalloc: the parsed manifest, its `Source` and the epoch's plan). Times are CPU seconds
of this process (`time.process_time`), as the machine's cores are shared. A rank's stream
opening is measured on `RankStream` itself (rank 1023 of 1,024 from mid-epoch: its
constructor and `_open`), with the Parquet read (`epoch_dataset`, Ray Data) stubbed.

Each shard has 4 row groups of 256 rows (sequences); the global batch is 4 rows per rank at
1,024 ranks (4,096), the same at every world size.

Usage: PYTHONPATH=platform .venv/bin/python bench/scale/data.py [--shards 1000 10000 100000]
    [--ranks 16 64 256 1024]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

from wildtrain.config import Config
from wildtrain.data import stream
from wildtrain.data.manifest import Manifest, Shard
from wildtrain.data.order import Source, plan_epoch, rank_segments, split_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from growth import growth_line, markdown  # noqa: E402

ROW_GROUPS, ROWS_PER_GROUP, SEQ_LEN = 4, 256, 2048
GLOBAL_BATCH, SEED = 4096, 1234


class NoRead:
    """`epoch_dataset`'s stand-in: the order's work of opening a stream, without Ray Data."""

    def __init__(self, *args) -> None:
        pass

    def iter_batches(self, **options) -> list:
        return []


def open_stream(source: Source, from_step: int) -> None:
    cfg = Config()
    cfg.train.global_batch_size, cfg.train.seed = GLOBAL_BATCH, SEED
    opened = stream.RankStream(
        [stream.Dataset("bench", (), source)], cfg.data, cfg.train, cfg.storage, 1023, 1024, from_step, doc_ids=False
    )
    opened._open(*split_step(opened.step, opened.steps_per_epoch))


def manifest_text(shards: int) -> str:
    rows = ROW_GROUPS * ROWS_PER_GROUP
    entries = [
        Shard(
            f"shards/{i:07d}.parquet", rows, rows * (SEQ_LEN + 1), 8 * rows * SEQ_LEN, f"{i:064x}", [ROWS_PER_GROUP] * 4
        )
        for i in range(shards)
    ]
    manifest = Manifest(
        seq_len=SEQ_LEN,
        tokenizer={"kind": "byte", "vocab_size": 259, "eos_id": 256},
        source="synthetic",
        shards=entries,
        rows=rows * shards,
        tokens=rows * shards * (SEQ_LEN + 1),
    )
    return manifest.to_json()


def timed(f, *args):
    """(result, CPU seconds): this machine's 2 cores are shared, so its wall time is not the work's."""
    started = time.process_time()
    result = f(*args)
    return result, time.process_time() - started


def measured_memory(f, *args):
    """(result, bytes it still holds once built, peak bytes while built)."""
    gc.collect()
    tracemalloc.start()
    result = f(*args)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, held, peak


def source_of(manifest: Manifest) -> Source:
    return Source(tuple(tuple(s.row_groups) for s in manifest.shards))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parser.parse_args()
    stream.epoch_dataset = NoRead  # the order alone: no Ray Data, no Parquet
    stream._EpochReads.next_block = lambda self: None

    rows, results = [], []
    for shards in args.shards:
        text = manifest_text(shards)
        manifest, parse_s = timed(Manifest.from_json, text)
        _, manifest_bytes, parse_peak = measured_memory(Manifest.from_json, text)
        source, source_bytes, _ = measured_memory(source_of, manifest)
        plan, plan_s = timed(plan_epoch, [source], GLOBAL_BATCH, SEED, 0)
        _, plan_bytes, plan_peak = measured_memory(plan_epoch, [source], GLOBAL_BATCH, SEED, 0)
        middle = plan.steps // 2
        _, segments_s = timed(rank_segments, plan, 1023, 1024, GLOBAL_BATCH, middle)
        _, open_s = timed(open_stream, source, middle)
        r = dict(
            shards=shards,
            json_mb=len(text) / 1e6,
            parse_s=parse_s,
            manifest_mb=manifest_bytes / 1e6,
            source_mb=source_bytes / 1e6,
            plan_s=plan_s,
            plan_mb=plan_bytes / 1e6,
            peak_mb=max(parse_peak, plan_peak) / 1e6,
            segments_ms=1000 * segments_s,
            open_s=open_s,
        )
        results.append(r)
        rows.append(
            [
                f"{shards:,}",
                f"{r['json_mb']:.1f} MB",
                f"{r['parse_s'] * 1000:.0f} ms",
                f"{r['manifest_mb']:.1f} MB",
                f"{r['source_mb']:.1f} MB",
                f"{r['plan_s'] * 1000:.0f} ms",
                f"{r['plan_mb']:.1f} MB",
                f"{r['segments_ms']:.1f} ms",
                f"{r['open_s'] * 1000:.0f} ms",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
        del manifest, source, plan
    print()
    print(
        markdown(
            [
                "shards",
                "manifest JSON",
                "parse",
                "parsed manifest (held)",
                "Source (held)",
                "plan_epoch",
                "epoch plan (held)",
                "rank_segments (rank 1023 of 1,024, mid-epoch)",
                "a rank's stream opening (RankStream, no read)",
            ],
            rows,
        )
    )
    ns = [r["shards"] for r in results]
    for key in ("parse_s", "plan_s", "plan_mb", "segments_ms", "open_s"):
        print(growth_line(f"{key} against shards", ns, [r[key] for r in results]))

    # Against the world size, at the largest manifest: one rank's segments, and one step's rows for every rank.
    text = manifest_text(max(args.shards))
    source = source_of(Manifest.from_json(text))
    plan = plan_epoch([source], GLOBAL_BATCH, SEED, 0)
    middle = plan.steps // 2
    rows, per_rank = [], []
    for world in args.ranks:
        _, one = timed(rank_segments, plan, world - 1, world, GLOBAL_BATCH, middle)
        started = time.process_time()
        for rank in range(world):
            rank_segments(plan, rank, world, GLOBAL_BATCH, middle)
        every = time.process_time() - started
        per_rank.append(one)
        rows.append([f"{world:,}", f"{GLOBAL_BATCH // world}", f"{one * 1000:.2f} ms", f"{every * 1000:.0f} ms"])
        print(" | ".join(rows[-1]), flush=True)
    print()
    print(
        markdown(
            [
                "ranks",
                "streams per rank",
                "one rank's rank_segments",
                f"every rank's, one after another ({max(args.shards):,} shards)",
            ],
            rows,
        )
    )
    print(growth_line("one rank's rank_segments against ranks", args.ranks, per_rank))


if __name__ == "__main__":
    main()
