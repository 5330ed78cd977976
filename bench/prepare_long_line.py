"""`prepare` on one very long JSONL line: is time linear and memory bounded in the line?

For each size, writes a JSONL file to a temporary folder: a few ordinary documents, then one
line of `{"text": "xxx..."}` of that many bytes, then a few more; then runs `prepare` on it
(local executor, byte-level tokenizer, --skip-bad-records) in a fresh process and prints the
wall time, the throughput over the file, and that process's peak resident memory beside
the same process's right after its imports. A line longer than --max-record-mb (64 MiB by
default) is counted as a bad record and never held whole, so the peak stays flat as the
line grows, and the time grows with it linearly (one pass to hash the input, one to read it).

Usage: .venv/bin/python bench/prepare_long_line.py [--mb 256 512 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time
from wildtrain.data.prepare import PrepareConfig, prepare
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
result = prepare(PrepareConfig(input=sys.argv[1], output=sys.argv[2], seq_len=64, executor="local",
                               skip_bad_records=True, val_fraction=0, progress_every=1e9))
print(json.dumps({"seconds": time.perf_counter() - started, "imported_kb": imported,
                  "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "bad": sum(result.manifest.bad_records.values()), "rows": result.manifest.rows}))
"""


def write_long_line(path: Path, size: int) -> None:
    ordinary = "".join(json.dumps({"text": f"an ordinary document, number {i}, " * 20}) + "\n" for i in range(50))
    block = b"x" * (8 << 20)
    with open(path, "wb") as f:
        f.write(ordinary.encode())
        f.write(b'{"text": "')
        left = size
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.write(b'"}\n')
        f.write(ordinary.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "platform")}
    print(f"{'line':>8} {'file':>8} {'time':>8} {'MB/s':>7} {'peak RSS':>9} {'after imports':>14} {'bad':>4}")
    for mb in args.mb:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "long.jsonl"
            write_long_line(path, mb << 20)
            size = path.stat().st_size
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(path), str(Path(tmp) / "out")],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(done.stdout.splitlines()[-1])
            print(
                f"{mb:>5} MB {size / 1e6:>6.0f} MB {r['seconds']:>6.1f} s {size / 1e6 / r['seconds']:>7.0f} "
                f"{r['peak_kb'] / 1024:>6.0f} MB {r['imported_kb'] / 1024:>11.0f} MB {r['bad']:>4}"
            )


if __name__ == "__main__":
    main()
