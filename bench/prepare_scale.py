"""Preparation at scale: `prepare` on Ray tasks against a plain single-process `tokenizers` loop.

Is the driver a ceiling? Both run over the same files.

Writes a synthetic JSONL corpus of `--files` files (`--mb` MB in all) to a temporary folder,
then for each tokenizer (byte-level, and a BPE of `--vocab` ids trained beforehand on a
sample, so training is not timed) prints:

  - the plain loop: read each line, json.loads, `tokenizers.Tokenizer.encode_batch` in
    batches, count the ids: tokens/s and tokens per CPU-second (this process's CPU time,
    the tokenizer's threads included);
  - `prepare` with `--cpus` Ray CPUs (a task per partition, shards to a local folder): its
    wall time and tokens/s, the tasks' CPU seconds (each task measures its own) and tokens
    per task CPU-second, and the driver's CPU seconds: its share of the tasks' and its CPU
    time per token. The driver only submits, waits and orders, so its share is what
    bounds the cluster size at which it would become the bottleneck (1 / share cores).

Usage: .venv/bin/python bench/prepare_scale.py [--mb 100] [--files 8] [--cpus 2] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from wildtrain import services

# Ray reads its authentication mode once, on import.
os.environ.update(services.token_auth_env())

import numpy as np  # noqa: E402
import ray  # noqa: E402

from wildtrain.data.prepare import PrepareConfig, prepare  # noqa: E402
from wildtrain.data.tokenizer import ByteTokenizer, train_bpe  # noqa: E402

BATCH = 1024
SEQ_LEN = 1024


def write_corpus(folder: Path, megabytes: float, files: int) -> list[Path]:
    """JSONL files of documents of 50..2000 words drawn from a Zipf-like vocabulary."""
    rng = np.random.default_rng(0)
    words = np.array(
        ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 10))) for _ in range(20_000)]
    )
    weights = 1 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    paths = []
    for i in range(files):
        path = folder / f"part-{i:03d}.jsonl"
        written = 0
        with open(path, "w") as f:
            while written < megabytes * 1e6 / files:
                text = " ".join(rng.choice(words, rng.integers(50, 2000), p=weights))
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
        paths.append(path)
    return paths


def plain_loop(paths: list[Path], tokenizer_json: str) -> tuple[int, float, float]:
    """(tokens, wall s, CPU s) of the plain loop; each document's end id counted as prepare does."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokens = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for path in paths:
        batch = []
        with open(path, "rb") as f:
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == BATCH:
                    tokens += sum(len(e.ids) + 1 for e in tokenizer.encode_batch(batch, add_special_tokens=False))
                    batch = []
        if batch:
            tokens += sum(len(e.ids) + 1 for e in tokenizer.encode_batch(batch, add_special_tokens=False))
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


def prepared(folder: Path, output: Path, tokenizer: str, partition_mb: int) -> tuple[int, float, float, float]:
    """(tokens, wall s, driver CPU s, tasks' CPU s) of `prepare` on Ray tasks."""
    cfg = PrepareConfig(
        input=str(folder),
        output=str(output),
        seq_len=SEQ_LEN,
        tokenizer=tokenizer,
        rows_per_shard=1024,
        rows_per_group=256,
        partition_bytes=partition_mb << 20,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    result = prepare(cfg)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    read = [p for p in result.parts if p.read]
    return sum(p.part.tokens for p in read), wall, cpu, sum(p.cpu_s for p in read)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--cpus", type=int, default=2, help="Ray CPUs: tasks at once")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--partition-mb", type=int, default=256)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "in").mkdir()
        paths = write_corpus(root / "in", args.mb, args.files)
        sample = [json.loads(line)["text"] for line in open(paths[0]).readlines()[:2000]]
        bpe = root / "bpe.json"
        bpe.write_text(train_bpe(sample, args.vocab).json)
        rows = []
        for name, spec, hf_json in (
            ("byte", "byte", ByteTokenizer().hf_json()),
            (f"bpe:{args.vocab}", str(bpe), bpe.read_text()),
        ):
            tokens, wall, cpu = plain_loop(paths, hf_json)
            rows.append((name, "plain tokenizers loop", tokens, wall, cpu, None))
            tokens, wall, driver, tasks = prepared(root / "in", root / f"out-{name}", spec, args.partition_mb)
            rows.append((name, f"prepare ({args.cpus} Ray CPUs)", tokens, wall, tasks, driver))
    print(
        f"\n{args.mb:g} MB of JSONL in {args.files} files, seq_len {SEQ_LEN}; CPU s of the plain loop is its "
        "process's, of prepare its tasks' (each its own process)\n"
    )
    print(
        f"{'tokenizer':<12} {'path':<24} {'tokens':>12} {'wall s':>8} {'tokens/s':>12} {'CPU s':>8} "
        f"{'tokens/CPU-s':>13} {'driver CPU s':>13} {'driver share':>13} {'driver ns/token':>16}"
    )
    for name, path, tokens, wall, cpu, driver in rows:
        extra = (
            f"{driver:>13.2f} {driver / cpu:>13.1%} {1e9 * driver / tokens:>16.1f}"
            if driver is not None
            else f"{'':>13} {'':>13} {'':>16}"
        )
        print(
            f"{name:<12} {path:<24} {tokens:>12,} {wall:>8.1f} {tokens / wall:>12,.0f} {cpu:>8.1f} "
            f"{tokens / cpu:>13,.0f} {extra}"
        )


if __name__ == "__main__":
    main()
