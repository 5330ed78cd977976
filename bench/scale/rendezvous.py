"""Rendezvous and heartbeats against N members (issue 60, table 1): the real `RendezvousServer`
on 127.0.0.1 (its TCPStore and its owner thread, every 10 ms) in this process, N members joined
with the real `ask_to_join` and beating with the real `beat` every `elastic.heartbeat_s` (0.1 s)
from a few sender processes (no model); after a steady window one member is silenced and a
failed collective reported (`report_error`), as its peers would.

Measured per N: the heartbeats the store took a second, the owner's round trips per turn and the
store operations a second in all, this process's CPU (the store's server thread and the owner:
100 % is one core), the owner's turn (median and max in the steady window), the time from the
error to the next generation published, and the members dropped that were alive (false deaths).
With `--reference-rev`, the same points run against that revision's `elastic/rendezvous.py`
(loaded beside the current one) first.

The members are simulated: S sender processes of T threads each, every thread a store client
beating for its share of the members in turn. On this 2-core machine the senders, the store and
the owner share the cores, so at large N the senders cannot beat every member every 0.1 s; the
table gives the interval they held (`beat every`). `--per-node K` makes each sender write K
members' heartbeats in one `multi_set`, as an agent per node of K GPUs would.

Usage: PYTHONPATH=platform .venv/bin/python bench/scale/rendezvous.py [--reference-rev REV]
    [--members 16 64 256 1024 4096 16384] [--reference-max 4096] [--per-node 1] [--steady-s 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Optional

import psutil
import torch.distributed as dist

from wildtrain.elastic import rendezvous as current_module
from wildtrain.elastic import rendezvous_keys

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from growth import growth_line, markdown  # noqa: E402
from reference import module_at  # noqa: E402

HOST = "127.0.0.1"
SILENCE, STOP = 0, 1  # the times in a sender's plan
HEARTBEAT_S, DEAD_AFTER_S, CONFIRM_S = 0.1, 10.0, 0.5  # the config's defaults (config/system.py)


class Counting:
    """The owner's store, counting the round trips made through it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def timed_turns(module: ModuleType) -> list[tuple[float, float]]:
    """Wraps `module.RendezvousOwner.turn` once; returns the list it appends (start time, seconds) to."""
    if not hasattr(module.RendezvousOwner, "_timed"):
        turns: list[tuple[float, float]] = []
        turn = module.RendezvousOwner.turn

        def timed(self, now, ending=False):
            started = time.perf_counter()
            try:
                return turn(self, now, ending)
            finally:
                turns.append((time.time(), time.perf_counter() - started))

        module.RendezvousOwner.turn = timed
        module.RendezvousOwner._timed = turns
    return module.RendezvousOwner._timed


def sender(port: int, token: str, names: list[str], threads: int, per_node: int, victim: str, plan, counts, slot):
    """A sender process: `threads` store clients beating for `names` (each member beats
    first, then asks to join) until `plan[STOP]`; `victim` stops at `plan[SILENCE]` (times shared with the parent)."""
    from wildtrain.elastic.rendezvous import ask_to_join, beat

    def run(index: int, mine: list[str]) -> None:
        store = dist.PrefixStore(token, dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=120)))
        for name in mine:
            beat(store, name)
            ask_to_join(store, name)
        groups = [mine[i : i + per_node] for i in range(0, len(mine), per_node)]
        beats = 0
        while time.time() < plan[STOP]:
            round_start = time.time()
            silence = plan[SILENCE]
            for group in groups:
                now = time.time()
                alive = [n for n in group if n != victim or now < silence]
                if per_node == 1:
                    for name in alive:
                        beat(store, name)
                elif alive:
                    store.multi_set([rendezvous_keys.heartbeat(n) for n in alive], [repr(now)] * len(alive))
                beats += len(alive)
            counts[slot + index] = beats
            time.sleep(max(0.0, round_start + HEARTBEAT_S - time.time()))

    workers = [threading.Thread(target=run, args=(i, names[i::threads])) for i in range(threads) if names[i::threads]]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def point(module: ModuleType, n: int, senders: int, threads: int, per_node: int, steady_s: float) -> dict:
    turns = timed_turns(module)
    server = module.RendezvousServer(HOST, DEAD_AFTER_S, CONFIRM_S, turn_s=0.01)
    client = dist.TCPStore(HOST, server.port, is_master=False, timeout=timedelta(seconds=120))
    token = f"scale{n}"
    module.register_group(client, token, n)
    group = dist.PrefixStore(token, client)
    names = [module.member_name(r) for r in range(n)]
    victim = names[-1]
    ctx = mp.get_context("spawn")
    counts = ctx.Array("d", senders * threads, lock=False)
    plan = ctx.Array("d", [1e18, time.time() + 600], lock=False)
    procs = [
        ctx.Process(
            target=sender,
            args=(server.port, token, names[s::senders], threads, per_node, victim, plan, counts, s * threads),
            daemon=True,
        )
        for s in range(senders)
    ]
    started = time.time()
    for p in procs:
        p.start()
    while module.latest(group).generation < 1:
        if time.time() - started > 300:
            raise RuntimeError(f"{n} members: no first generation in 300 s")
        time.sleep(0.05)
    formed_s = time.time() - started
    time.sleep(2.0)  # the senders settle into their rounds
    server.owner.store = owner_store = Counting(server.owner.store)
    me = psutil.Process()
    me.cpu_percent(None)
    beats0, calls0, t0 = sum(counts), owner_store.calls, time.time()
    time.sleep(steady_s)
    cpu = me.cpu_percent(None)
    elapsed = time.time() - t0
    beats_s = (sum(counts) - beats0) / elapsed
    steady = [d for at, d in turns if t0 <= at <= t0 + elapsed]
    calls_per_turn = (owner_store.calls - calls0) / max(1, len(steady))
    ops_s = beats_s / per_node + (owner_store.calls - calls0) / elapsed
    interval = n / beats_s if beats_s else float("inf")
    # The victim falls silent; its peers' collective fails a little later and one reports it.
    plan[SILENCE] = time.time()
    time.sleep(0.2)
    error_at = time.monotonic()  # the owner's clock
    module.report_error(group, 1)
    published: Optional[float] = None
    while time.monotonic() - error_at < 15:
        if 2 in server.owner.published if server.owner else False:
            published = server.owner.published[2][0]
            break
        time.sleep(0.005)
    second = server.owner.published.get(2, (None, ()))[1] if server.owner else ()
    false_deaths = len(set(names) - set(second) - {victim}) if published else None
    server.stop()  # first: members that stop beating while it still turns would be found dead
    plan[STOP] = 0.0
    for p in procs:
        p.join(timeout=30)
    return {
        "n": n,
        "formed_s": formed_s,
        "beats_s": beats_s,
        "interval": interval,
        "calls_per_turn": calls_per_turn,
        "ops_s": ops_s,
        "cpu": cpu,
        "turn_median_ms": 1000 * statistics.median(steady) if steady else float("nan"),
        "turn_max_ms": 1000 * max(steady) if steady else float("nan"),
        "turns": len(steady),
        "publish_s": None if published is None else published - error_at,
        "false_deaths": false_deaths,
    }


def row(variant: str, r: dict) -> list[object]:
    return [
        variant,
        f"{r['n']:,}",
        f"{r['beats_s']:,.0f}",
        f"{r['interval']:.2f} s",
        f"{r['calls_per_turn']:.1f}",
        f"{r['ops_s']:,.0f}",
        f"{r['cpu']:.0f} %",
        f"{r['turn_median_ms']:.1f} / {r['turn_max_ms']:.1f} ms",
        "-" if r["publish_s"] is None else f"{r['publish_s']:.2f} s",
        "-" if r["false_deaths"] is None else r["false_deaths"],
        f"{r['formed_s']:.1f} s",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-rev", help="a git revision whose rendezvous runs the same points first")
    parser.add_argument("--members", type=int, nargs="+", default=[16, 64, 256, 1024, 4096, 16384])
    parser.add_argument("--reference-max", type=int, default=4096, help="the largest N the reference runs")
    parser.add_argument("--senders", type=int, default=2, help="sender processes")
    parser.add_argument("--threads", type=int, default=4, help="store clients per sender process")
    parser.add_argument("--per-node", type=int, default=1, help="members' heartbeats per store request")
    parser.add_argument("--steady-s", type=float, default=4.0)
    args = parser.parse_args()
    variants = [("current", current_module, args.members)]
    if args.reference_rev:
        reference = module_at(args.reference_rev, "platform/wildtrain/elastic/rendezvous.py")
        variants.insert(0, (args.reference_rev, reference, [n for n in args.members if n <= args.reference_max]))
    headers = [
        "rendezvous",
        "members",
        "heartbeats/s taken",
        "beat every",
        "owner round trips/turn",
        "store requests/s",
        "store host CPU",
        "owner turn median / max",
        "error -> generation published",
        "false deaths",
        "first generation formed",
    ]
    rows, results = [], {}
    for variant, module, members in variants:
        for n in members:
            r = point(module, n, args.senders, args.threads, args.per_node, args.steady_s)
            results.setdefault(variant, []).append(r)
            rows.append(row(variant, r))
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(markdown(headers, rows))
    print()
    for variant, rs in results.items():
        ns = [r["n"] for r in rs]
        print(growth_line(f"{variant} owner turn (median)", ns, [r["turn_median_ms"] for r in rs]))
        print(growth_line(f"{variant} owner round trips per turn", ns, [r["calls_per_turn"] for r in rs]))
        print(growth_line(f"{variant} store host CPU", ns, [r["cpu"] for r in rs]))


if __name__ == "__main__":
    main()
