"""What a re-form costs each rank in memory, and what it moves: the state of a ZeRO-1/2 group
re-cut at a new world size from the partitions and mirrors its ranks kept
(`elastic.peer_state`), as it is (each rank receives only the slices of old partitions that
overlap its new one, `membership.plan_transfers`) and as it was at `--reference-rev` (every
old partition broadcast to every rank, concatenated, and the rank's slice cut from it).

Measured, for each model and resize: spawned gloo ranks on 127.0.0.1 hold an old layout's
partitions (fp32 weights and AdamW's moments at DeepSpeed's cut of the model's parameter
groups, known values) and mirror them over a ring; for a shrink rank 1 dies, for a growth a
joiner that holds nothing comes; the new group's ranks build a real DeepSpeed ZeRO-1 engine
at the new size and restore into it, with the current code, then with the reference's, each
into an engine of its own. A rank's extra memory is its peak resident set (VmHWM, reset through
/proc/self/clear_refs just before) less its resident set before, from the agreement on what to
restore to the engine loaded: every byte the restore touched, the engine's new moments (two
thirds of the partition) included, whoever allocated it (torch, gloo, the allocator). Large
blocks are mapped and unmapped (`MALLOC_MMAP_THRESHOLD_`), so what a restore frees leaves the
resident set and the next restore's peak is its own. Each rank checks its partition and its
weights against the known values, bit for bit, under both. The engine is on the CPU here: the
device's memory is the host's, and the new code's host buffer for a GPU is not used.

Modelled, for 7B and 70B at 64, 256 and 1,024 ranks, a node of 8 ranks lost and one back:
the per-rank memory by the formulas below (checked against the measured rows), the bytes each
rank sends and receives from `plan_transfers` on DeepSpeed's cut with the holders
`membership.mirror_ring` gives, and the time they take at a link of 100 and 400 Gb/s per
rank (the slowest rank's larger direction; gloo over TCP reaches less). The low-precision
weights' all-gather after the load (2 bytes a parameter in bf16, as DeepSpeed does after every
step) is a column of its own.

Planned (`--plan-only`), for Llama 2's 7B and 70B shapes at ZeRO-3 (a piece per parameter) at
64, 256 and 1,024 ranks, the last rank lost: what a rank spends planning the transfers, as it
is (`plan_transfers` with its rank: the sources, and the transfers it sends or receives) and
as it was at `--plan-reference-rev` (every rank planned every rank's transfers). The Transfer
objects built, the seconds (best of 3) and the peak Python memory (tracemalloc), of the rank
with the most transfers; the whole plans must be equal, and its plan their part that is its.

Usage: PYTHONPATH=platform .venv/bin/python bench/reform_memory.py [--models tiny 125m]
       [--resizes 2:1 3:2 4:3 1:2 2:3 3:4] [--reference-rev REV] [--no-model] [--model-only]
       [--plan-only] [--plan-reference-rev REV]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections import Counter
from dataclasses import astuple
from datetime import timedelta
from pathlib import Path
from types import MethodType, ModuleType, SimpleNamespace

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from reference import module_at

from wildtrain.batching import BatchPlan
from wildtrain.config import load_config
from wildtrain.elastic.membership import Cut, mirror_ring, plan_repartition, plan_transfers
from wildtrain.elastic.peer_state import Mirrors, load_state, partitioned_groups
from wildtrain.engine import EngineSettings, build_engine, param_groups
from wildtrain.model.transformer import Transformer

# The last revision whose re-form gathered every partition onto every rank.
REFERENCE_REV = "aa375d0"
# The last revision whose every rank planned every rank's transfers.
PLAN_REFERENCE_REV = "827bdc9"
# Llama 2's shapes (Touvron et al. 2023): 7B is the 7b preset; 70B has no preset here.
LLAMA = {
    "7B": ["model=7b"],
    "70B": [
        "model=7b",
        "model.dim=8192",
        "model.n_layers=80",
        "model.n_heads=64",
        "model.n_kv_heads=8",
        "model.ffn_dim=28672",
    ],
}
STEP, GLOBAL_BATCH = 7, 12
ROWS = 3  # fp32 weights, exp_avg, exp_avg_sq
CHUNK = 1 << 22  # values a check compares at a time
GIB = 2**30


def reference_modules(rev: str) -> ModuleType:
    """`elastic.peer_state` as it was at `rev`, with `elastic.membership` as it was then."""
    module_at(rev, "platform/wildtrain/elastic/membership.py")
    return module_at(
        rev, "platform/wildtrain/elastic/peer_state.py", {"wildtrain.elastic.membership": "membership_reference"}
    )


def config(model: str):
    return load_config([f"model={model}", "model.compile=false", "deepspeed.zero_stage=1"])


def group_numels(model: str) -> list[int]:
    """Each parameter group's values, as wildtrain's engine groups them (no memory: on meta)."""
    cfg = config(model)
    with torch.device("meta"):
        groups = param_groups(Transformer(cfg.model), cfg.optim)
    return [sum(p.numel() for p in group["params"]) for group in groups]


def known(group: int, start: int, end: int) -> torch.Tensor:
    """The [3, end - start] state at values [start, end) of `group`: distinct, exact in fp32
    at these sizes up to rounding, the same wherever computed."""
    index = torch.arange(start, end, dtype=torch.float64)
    weights = (index * 1e-9 + group).to(torch.float32)
    return torch.stack([weights, weights * 0.5, weights * 0.25 + 1.0])


def old_engine(numels: list[int], world: int, rank: int) -> SimpleNamespace:
    """What `peer_state.host_copy` reads of a ZeRO-1/2 engine of `world` ranks holding rank
    `rank`'s partition of the known state (and zeros in its padding)."""
    cut = Cut.of(numels, world)
    fp32, state = [], {}
    for group, numel in enumerate(numels):
        start, end = cut.span(group, rank, numel)
        values = torch.zeros(ROWS, cut.sizes[group])
        values[:, : end - start] = known(group, start, end)
        weights = values[0]  # one tensor object: AdamW's state is keyed by it
        fp32.append(weights)
        state[weights] = {"exp_avg": values[1], "exp_avg_sq": values[2]}
    return SimpleNamespace(
        optimizer=SimpleNamespace(
            single_partition_of_fp32_groups=fp32,
            bit16_groups_flat=[torch.empty(0) for _ in numels],
            bit16_groups=[[] for _ in numels],
            optimizer=SimpleNamespace(state=state),
        )
    )


def resident() -> tuple[int, int]:
    """(resident set, its peak since the last reset), in bytes."""
    status = open("/proc/self/status").read()
    return tuple(int(re.search(rf"{key}:\s+(\d+)", status).group(1)) * 1024 for key in ("VmRSS", "VmHWM"))


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def exact(engine, numels: list[int], world: int, rank: int) -> bool:
    """Whether this rank's partition and every weight hold the known state, bit for bit."""
    adamw = engine.optimizer.optimizer
    for index, (group, numel) in enumerate(zip(partitioned_groups(engine), numels)):
        size = group.fp32.numel()
        start, end = min(rank * size, numel), min((rank + 1) * size, numel)
        moments = adamw.state[group.fp32]
        rows = [group.fp32, moments["exp_avg"], moments["exp_avg_sq"]]
        for at in range(start, end, CHUNK):
            stop = min(end, at + CHUNK)
            want = known(index, at, stop)
            if any(not torch.equal(row[at - start : stop - start], want[r]) for r, row in enumerate(rows)):
                return False
        if any(row[end - start :].any() for row in rows):
            return False
        for at in range(0, numel, CHUNK):
            stop = min(numel, at + CHUNK)
            if not torch.equal(group.flat[at:stop], known(index, at, stop)[0].to(group.flat.dtype)):
                return False
    return True


def rank_main(rank: int, port: int, case: dict, out: str) -> None:
    torch.set_num_threads(1)
    old_world, new_world, model = case["old"], case["new"], case["model"]
    numels = group_numels(model)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    shrink = new_world < old_world
    mirrors = Mirrors()

    def join(generation: int, rank: int, world: int) -> None:
        os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed asserts them
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{generation}/", store), rank=rank, world_size=world)
        mirrors.group = dist.new_group(backend="gloo")

    if rank < old_world:
        join(1, rank, old_world)
        mirrors.use_layout(1, old_world)
        mirrors.exchange(old_engine(numels, old_world, rank), STEP)
        mirrors.settle()
        dist.barrier()  # every mirror in place: then rank 1 dies
        if shrink and rank == 1:
            os._exit(0)
        dist.destroy_process_group()
    members = [r for r in range(max(old_world, new_world)) if not (shrink and r == 1)]
    new_rank = members.index(rank)
    join(2, new_rank, new_world)
    cfg = config(model)
    settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
    reference = reference_modules(case["reference_rev"]) if "reference" in case["implementations"] else None
    results = []
    for implementation in case["implementations"]:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = build_engine(
                settings,
                BatchPlan(new_world, 1, GLOBAL_BATCH // new_world),
                Transformer(cfg.model),
                torch.device("cpu"),
            )
        sizes = [group.fp32.numel() for group in partitioned_groups(engine)]
        assert tuple(sizes) == Cut.of(numels, new_world).sizes, ("DeepSpeed cut otherwise", sizes)
        gc.collect()
        dist.barrier()
        before, _ = resident()
        reset_peak()
        started = time.perf_counter()
        if implementation == "current":
            load_state(engine, mirrors, mirrors.agree(fresh=False), GLOBAL_BATCH)
        else:
            # Its agreement reads what is held through its own `_cuts` (sizes per group, not `Pieces`).
            mirrors._cuts = MethodType(reference.Mirrors._cuts, mirrors)
            plan, full = reference.Mirrors.gather(mirrors, fresh=False)
            del mirrors._cuts
            reference.load_state(engine, full, plan.step, GLOBAL_BATCH)
            del full
        took = time.perf_counter() - started
        _, peak = resident()
        dist.barrier()
        results.append(
            {
                "implementation": implementation,
                "rank": new_rank,
                "partition_bytes": ROWS * 4 * sum(sizes),
                "extra_bytes": peak - before,
                "seconds": took,
                "exact": exact(engine, numels, new_world, new_rank),
            }
        )
        del engine
        gc.collect()
    Path(out, f"{new_rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # skips the destructors of groups whose peers have gone


def measure(model: str, old_world: int, new_world: int, implementations: list[str], rev: str) -> list[dict]:
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    case = {
        "model": model,
        "old": old_world,
        "new": new_world,
        "implementations": implementations,
        "reference_rev": rev,
    }
    os.environ.update(GLOO_SOCKET_IFNAME="lo", DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(port, case, out), nprocs=max(old_world, new_world))
        rows = [row for rank in range(new_world) for row in json.loads(Path(out, f"{rank}.json").read_text())]
    del store
    return rows


def _free_port() -> int:
    from wildtrain import services

    return services.free_port()


def reference_fits(numels: list[int], old_world: int, new_world: int) -> bool:
    """Whether every rank of the reference's re-form fits in this host's free memory: each
    holds the whole state twice over (`formula`), an engine, and its snapshots."""
    model = sum(numels)
    per_rank = 24 * model + 2 * 4 * model + 2 * ROWS * 4 * model / old_world
    return new_world * per_rank < 0.8 * psutil.virtual_memory().available


def formula(numels: list[int], old_world: int, new_world: int) -> dict[str, float]:
    """Bytes of extra memory per rank a re-form takes, by implementation and place.

    current: the engine's AdamW moments (8 bytes a value of the new partition, written where
    they stay), and on a GPU one host buffer of a parameter group's new partition, which gloo
    receives into (12 bytes a value); nothing else. reference: every old partition received
    (12 bytes a value of the whole padded model) and concatenated (12 more, the received ones
    freed after), then moved to the device (12; none on the CPU) and padded to the new layout
    there (12 a value of the new padded model), with the moments."""
    new, old = Cut.of(numels, new_world), Cut.of(numels, old_world)
    partition = sum(new.sizes)
    whole_old, whole_new = old_world * sum(old.sizes), new_world * partition
    return {
        "current cpu": 8 * partition,
        "current gpu host": 12 * max(new.sizes),
        "current gpu device": 8 * partition,
        "reference cpu": max(24 * whole_old, 12 * whole_old + 12 * whole_new + 8 * partition),
        "reference gpu host": 24 * whole_old,
        "reference gpu device": 12 * whole_old + 12 * whole_new + 8 * partition,
    }


def measured_table(models: list[str], resizes: list[tuple[int, int]], rev: str) -> None:
    print(
        "\n| model | resize | new rank | partition (MiB) | current: peak extra (MiB) | x partition | formula (MiB) "
        "| reference: peak extra (MiB) | x partition | formula (MiB) | exact | seconds (current / reference) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        numels = group_numels(model)
        for old_world, new_world in resizes:
            implementations = ["current"] + (["reference"] if reference_fits(numels, old_world, new_world) else [])
            rows = measure(model, old_world, new_world, implementations, rev)
            model_bytes = formula(numels, old_world, new_world)
            for rank in range(new_world):
                by = {row["implementation"]: row for row in rows if row["rank"] == rank}
                current, reference = by["current"], by.get("reference")
                part = current["partition_bytes"]
                cells = [
                    f"{current['extra_bytes'] / 2**20:,.1f}",
                    f"{current['extra_bytes'] / part:.2f}",
                    f"{model_bytes['current cpu'] / 2**20:,.1f}",
                ]
                if reference:
                    cells += [
                        f"{reference['extra_bytes'] / 2**20:,.1f}",
                        f"{reference['extra_bytes'] / part:.2f}",
                        f"{model_bytes['reference cpu'] / 2**20:,.1f}",
                    ]
                else:
                    cells += ["(does not fit here)", "", f"{model_bytes['reference cpu'] / 2**20:,.1f}"]
                ok = all(row["exact"] for row in by.values())
                seconds = " / ".join(f"{row['seconds']:.2f}" for row in by.values())
                print(
                    f"| {model} | {old_world} -> {new_world} | {rank} | {part / 2**20:,.1f} | {' | '.join(cells)} "
                    f"| {'yes' if ok else 'NO'} | {seconds} |"
                )


def ring_holders(old_world: int, new_world: int, per_node: int = 8) -> tuple[tuple[int, ...], ...]:
    """By old rank, the new ranks that hold its partition when the last ranks are lost
    (`old_world` > `new_world`) or joiners come (the reverse), each rank's mirror held by its
    successor on the ring `mirror_ring` gives for nodes of `per_node` ranks."""
    world = max(old_world, new_world)
    nodes = [str(rank // per_node) for rank in range(world)]
    ring = mirror_ring(nodes[:old_world])
    held = [dict() for _ in range(new_world)]  # new rank -> partitions held
    for old_rank in range(min(old_world, new_world)):  # survivors keep their ranks here
        successor = ring[(ring.index(old_rank) + 1) % len(ring)]
        held[old_rank][(1, old_world, old_rank)] = {STEP}
        if successor < new_world:
            held[successor][(1, old_world, old_rank)] = {STEP}
    for old_rank in range(new_world, old_world):  # the lost ranks' partitions: on their mirrors' holders
        successor = ring[(ring.index(old_rank) + 1) % len(ring)]
        held[successor][(1, old_world, old_rank)] = {STEP}
    return plan_repartition(held).holders


def moved(numels: list[int], old_world: int, new_world: int) -> tuple[int, int]:
    """The most bytes a rank sends and receives when a node of 8 ranks is lost (`old_world` >
    `new_world`; the node of the last ranks) or joins (the reverse), with `ring_holders`."""
    holders = ring_holders(old_world, new_world)
    plan = plan_transfers(numels, Cut.of(numels, old_world), Cut.of(numels, new_world), holders)
    sent, received = [0] * new_world, [0] * new_world
    for t in plan.transfers:
        if t.src != t.dst:
            sent[t.src] += ROWS * 4 * t.length
            received[t.dst] += ROWS * 4 * t.length
    return max(sent), max(received)


def model_table() -> None:
    print(
        "\n| model | resize | partition (GiB) | current: host extra (GiB) | device extra (GiB) | most sent / received "
        "by a rank (GiB) | at 100 Gb/s | at 400 Gb/s | bf16 weights' all-gather at 100 / 400 Gb/s "
        "| reference: host extra (GiB) | device extra (GiB) | received by each rank (GiB) | at 100 Gb/s | at 400 Gb/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, params in (("7B", 7e9), ("70B", 70e9)):
        numels = [int(params)]  # the norms' group is 0.01 % of it
        for world in (64, 256, 1024):
            for old_world, new_world in ((world, world - 8), (world - 8, world)):
                f = formula(numels, old_world, new_world)
                partition = ROWS * 4 * sum(Cut.of(numels, new_world).sizes)
                sent, received = moved(numels, old_world, new_world)
                most = max(sent, received)
                weights = 2 * params * (new_world - 1) / new_world
                whole = ROWS * 4 * params
                print(
                    f"| {name} | {old_world} -> {new_world} | {partition / GIB:.2f} "
                    f"| {f['current gpu host'] / GIB:.2f} | {f['current gpu device'] / GIB:.2f} (its moments) "
                    f"| {sent / GIB:.2f} / {received / GIB:.2f} "
                    f"| {most / 12.5e9:.2f} s | {most / 50e9:.2f} s | {weights / 12.5e9:.2f} / {weights / 50e9:.2f} s "
                    f"| {f['reference gpu host'] / GIB:,.0f} | {f['reference gpu device'] / GIB:,.0f} "
                    f"| {whole * (old_world - 1) / old_world / GIB:,.0f} "
                    f"| {whole / 12.5e9:.1f} s | {whole / 50e9:.1f} s |"
                )


def parameter_numels(overrides: list[str]) -> list[int]:
    """Each parameter's values, in the order wildtrain's engine groups them (on meta: no memory)."""
    cfg = load_config([*overrides, "model.compile=false", "deepspeed.zero_stage=3"])
    with torch.device("meta"):
        groups = param_groups(Transformer(cfg.model), cfg.optim)
    return [p.numel() for group in groups for p in group["params"]]


def cost(plan) -> tuple[object, float, float]:
    """`plan()`'s result, its best seconds of 3, and its peak Python memory in bytes."""
    seconds = []
    for _ in range(3):
        gc.collect()
        started = time.perf_counter()
        result = plan()
        seconds.append(time.perf_counter() - started)
        del result
    gc.collect()
    tracemalloc.start()
    result = plan()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, min(seconds), peak


def plan_table(rev: str) -> None:
    reference = module_at(rev, "platform/wildtrain/elastic/membership.py")
    print(
        "\n| model | parameters (pieces) | resize | transfers built: ratio | seconds: ratio | peak memory: ratio "
        "| transfers built (whole plan / this rank's) | seconds | peak Python memory (MiB) | exact |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, overrides in LLAMA.items():
        numels = parameter_numels(overrides)
        for world in (64, 256, 1024):
            holders = ring_holders(world, world - 1)
            old, new = Cut.of_parameters(numels, world), Cut.of_parameters(numels, world - 1)
            whole = plan_transfers(numels, old, new, holders)
            involved = Counter(r for t in whole.transfers for r in {t.src, t.dst})
            rank = max(range(world - 1), key=lambda r: (involved[r], -r))
            then, then_s, then_peak = cost(
                lambda: reference.plan_transfers(
                    numels,
                    reference.Cut.of_parameters(numels, world),
                    reference.Cut.of_parameters(numels, world - 1),
                    holders,
                )
            )
            mine, now_s, now_peak = cost(lambda: plan_transfers(numels, old, new, holders, rank))
            exact = (
                then.sources == whole.sources == mine.sources
                and [astuple(t) for t in then.transfers] == [astuple(t) for t in whole.transfers]
                and mine.transfers == tuple(t for t in whole.transfers if rank in (t.src, t.dst))
            )
            print(
                f"| {name} | {len(numels)} | {world} -> {world - 1} "
                f"| {len(then.transfers) / len(mine.transfers):,.0f} x fewer | {then_s / now_s:,.0f} x faster "
                f"| {then_peak / now_peak:,.0f} x less "
                f"| {len(then.transfers):,} / {len(mine.transfers):,} | {then_s:.3f} / {now_s:.4f} "
                f"| {then_peak / 2**20:,.1f} / {now_peak / 2**20:,.2f} | {'yes' if exact else 'NO'} |",
                flush=True,
            )
            del then, whole, mine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "125m"])
    parser.add_argument("--resizes", nargs="+", default=["2:1", "3:2", "4:3", "1:2", "2:3", "3:4"])
    parser.add_argument("--reference-rev", default=REFERENCE_REV)
    parser.add_argument("--no-model", action="store_true", help="the measured table only")
    parser.add_argument("--model-only", action="store_true", help="the modelled table only")
    parser.add_argument("--plan-only", action="store_true", help="the planning cost table only")
    parser.add_argument("--plan-reference-rev", default=PLAN_REFERENCE_REV)
    args = parser.parse_args()
    resizes = [tuple(int(w) for w in resize.split(":")) for resize in args.resizes]
    if args.plan_only:
        plan_table(args.plan_reference_rev)
        return
    if not args.model_only:
        measured_table(args.models, resizes, args.reference_rev)
    if not args.no_model:
        model_table()


if __name__ == "__main__":
    main()
