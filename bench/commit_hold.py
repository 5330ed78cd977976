"""How soon a held checkpoint commits once let go, and how often the store is read meanwhile.

The checkpoint's parts are all in; what is timed is `checkpoint.store.commit_when_complete`.

Rank 0 commits a checkpoint only once the controller has collected its step's report
(`AsyncSaver.release`), which happens at the controller's next poll
(`elastic.poll_interval_s`, 2 s): every save waits for it. Each trial writes a one-rank
checkpoint's part record into a local store, holds the commit for a given time, and measures
from the hold's end to the commit; with `--reference-rev`, the same trials run against that
revision's `commit_when_complete` too, in the same process: the reference a change is
measured against. Prints one table row per revision: the holds, the commit's delay after
each, their median, and the store polls of each trial.

Usage: PYTHONPATH=platform .venv/bin/python bench/commit_hold.py [--reference-rev REV] [--holds 0.5 1 1.7 2.5 3.3 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import ModuleType

from reference import module_at

from wildtrain.checkpoint import store as current
from wildtrain.checkpoint.format import FileEntry, checkpoint_name


def trial(module: ModuleType, hold_s: float) -> tuple[float, int]:
    """(seconds from the hold's end to the commit, store polls)."""
    store = module.Store.from_uri(tempfile.mkdtemp())
    name = checkpoint_name(20, "a")
    module.write_part(store, name, 0, [FileEntry("latest", 4, "a" * 64)])
    polls, poll_parts = [0], module.poll_parts

    def counted(*args):
        polls[0] += 1
        return poll_parts(*args)

    module.poll_parts = counted
    committed: list[float] = []
    lifted = time.monotonic() + hold_s
    try:
        module.commit_when_complete(
            [(store, lifted + 60)],
            name,
            1,
            lambda store, files: committed.append(time.monotonic()),
            held_by=lambda: None if time.monotonic() >= lifted else "held",
        )
    finally:
        module.poll_parts = poll_parts
    return committed[0] - lifted, polls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-rev", help="a git revision whose commit_when_complete runs beside this one's")
    parser.add_argument("--holds", type=float, nargs="+", default=[0.5, 1.0, 1.7, 2.5, 3.3, 4.0])
    args = parser.parse_args()
    variants = [("this checkout", current)]
    if args.reference_rev:
        variants.append((args.reference_rev, module_at(args.reference_rev, "platform/wildtrain/checkpoint/store.py")))
    results: dict[str, list[tuple[float, int]]] = {label: [] for label, _ in variants}
    for hold in args.holds:  # the variants in turn at each hold
        for label, module in variants:
            results[label].append(trial(module, hold))
    print("| commit_when_complete | held (s) | commit after the hold (s) | median | store polls |")
    print("|---|---|---|---|---|")
    for label, rows in results.items():
        print(
            f"| {label} | {' '.join(f'{h:g}' for h in args.holds)} | {' '.join(f'{s:.2f}' for s, _ in rows)} "
            f"| {statistics.median(s for s, _ in rows):.2f} | {' '.join(str(p) for _, p in rows)} |"
        )


if __name__ == "__main__":
    main()
