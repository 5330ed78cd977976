"""One rank of tests/unit/test_in_process.py: two workers that form a group as Ray would (a
gloo group on the given store), then join the driver's rendezvous (`elastic.in_process.Member`)
and train a step's all-reduce in its first generation. Then, by --drill:

- `dies`: rank 1 exits; rank 0's next all-reduce fails, and `lost_member` must find a member
  lost and the next generation must be rank 0 alone;
- `fails`: rank 1 meets an error of its own; neither rank may take it for a lost member, and
  rank 0 must end with rank 1's reason (`PeerFailed`);
- `joins`: as `dies`, then a third process (--rank 2, not in Ray's group: a worker the
  controller started on the lost slot) joins once rank 0 trains alone, and both form the
  third generation and all-reduce in it;
- `ghost`: as `joins`, but the third process dies once it arrived at the third generation's
  rendezvous, before its groups form: rank 0 must give that generation up and form the next
  alone, rather than wait out the groups' timeout (60 s here) for it;
- `hangs`: rank 1 stops (SIGSTOP) instead of exiting: nothing fails, and rank 0's all-reduce
  must be freed once the owner finds rank 1 silent, not at the collective's timeout (60 s);
- `pair`: no membership, only Ray's group and a step's all-reduce in it: what every other
  drill needs of the backend and the device (two NCCL ranks on one GPU, for `--device cuda`).

Each all-reduce is a step's: a sum over the default group on the training device, then the
commit over the control group that a step takes (`collectives`). `--device cuda` trains on
NCCL, as a GPU worker does: ranks sharing the test machine's one GPU, each its own NCCL
host (`NCCL_HOSTID`: NCCL refuses two ranks of one host on one device).

    python -m tests.helpers.member_rank --store-port P --rank R --rendezvous-port Q \
        --drill dies|fails|joins|ghost|hangs|pair [--device cpu|cuda]

Prints what happened, a line each.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from wildtrain.config.system import ElasticConfig
from wildtrain.elastic.rendezvous import current_group, current_token, latest
from wildtrain.train import collectives
from wildtrain.train.failures import Superseded
from wildtrain.train.in_process import Member

_FIRST = ["formed 1 w0,w1", "all-reduced 2"]
_ALONE = _FIRST + ["lost True", "formed 2 w0", "all-reduced 1"]
# What a drill's ranks print first, in order, where it goes as it must (rank -> lines).
SAYS = {
    "dies": {0: _ALONE, 1: _FIRST},
    "fails": {0: _FIRST + ["lost False"], 1: _FIRST + ["lost False", "ended RuntimeError rank 1's own error"]},
    "joins": {
        0: _ALONE + ["joiners waiting", "formed 3 w0,w1.1", "all-reduced 2"],
        2: ["formed 3 w0,w1.1", "all-reduced 2"],
    },
    "ghost": {0: _ALONE + ["joiners waiting", "superseded True", "formed 4 w0", "all-reduced 1"], 2: ["arrived 3"]},
    "hangs": {0: _ALONE},
    "pair": {0: ["all-reduced 2"], 1: ["all-reduced 2"]},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rendezvous-port", type=int, required=True)
    parser.add_argument("--drill", choices=tuple(SAYS), required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--linger-s",
        type=float,
        default=0.0,
        help="dies, hangs: the survivor steps alone once more this long after its first step alone",
    )
    parser.add_argument(
        "--stacks-after-s",
        type=float,
        default=100.0,
        help="still running this long: print every thread's stack to stderr and exit",
    )
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.stacks_after_s, exit=True)
    cfg = ElasticConfig(collective_timeout_s=60)
    address = ("127.0.0.1", args.rendezvous_port)
    device, backend = torch.device(args.device), "gloo"
    if args.device == "cuda":
        os.environ["NCCL_HOSTID"] = f"wildtrain-test-{args.rank}"
        torch.cuda.set_device(0)
        device, backend = torch.device("cuda", 0), "nccl"
    if args.rank == 2:
        join(address, cfg, device, backend, ghost=args.drill == "ghost")
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=args.rank, world_size=2)  # Ray Train's group
    collectives.open_control_group(60)
    if args.drill == "pair":
        all_reduce_ones(device)
        os._exit(0)
    try:
        with collectives.failing_together(args.rank) as watch:
            member = Member.of_ray_worker(address, args.rank, 2, f"node-{args.rank}", cfg, backend, 60)
            generation = member.form()
            print("formed", generation.number, ",".join(generation.members), flush=True)
            all_reduce_ones(device)
            if args.rank == 1 and args.drill in ("dies", "joins", "ghost"):
                os._exit(0)
            if args.rank == 1 and args.drill == "hangs":
                store.set("hung", str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.rank == 1:
                error = RuntimeError("rank 1's own error")
                print("lost", member.lost_member(error, watch.failed_peer), flush=True)
                raise error
            started = time.monotonic()
            try:
                all_reduce_ones(device, 1000)
            except RuntimeError as e:
                print("lost", member.lost_member(e, watch.failed_peer), flush=True)
                print(f"waited {time.monotonic() - started:.1f} s", flush=True)
                if args.drill == "fails":
                    raise
                generation = member.form()
                print("formed", generation.number, ",".join(generation.members), flush=True)
                all_reduce_ones(device)
                print(f"stepped {time.monotonic() - started:.1f} s after the failed all-reduce began", flush=True)
                if args.drill == "hangs":
                    os.kill(int(store.get("hung")), signal.SIGKILL)
                if args.linger_s and args.drill in ("dies", "hangs"):
                    time.sleep(args.linger_s)  # alive after what its old groups' threads do meanwhile
                    all_reduce_ones(device)
                if args.drill in ("joins", "ghost"):
                    wait_until(member.joiners_waiting)
                    print("joiners waiting", flush=True)
                    try:
                        generation = member.form()
                    except Superseded as e:
                        print("superseded", e.__cause__ is not None, flush=True)
                        generation = member.form()
                    print("formed", generation.number, ",".join(generation.members), flush=True)
                    all_reduce_ones(device)
    except Exception as e:  # noqa: BLE001 - what the rank ended with is the output
        print("ended", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
    os._exit(0)  # skips the destructors of a broken group


def join(address: tuple[str, int], cfg: ElasticConfig, device: torch.device, backend: str, ghost: bool) -> None:
    """The `joins` and `ghost` drills' third process: once rank 0 trains alone (generation 2),
    join its group; a ghost dies where its groups would form."""
    rendezvous = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=60))
    wait_until(lambda: current_group(rendezvous) is not None and latest(current_group(rendezvous)).generation >= 2)
    member = Member.joining(address, current_token(rendezvous), "w1.1", 2, "node-2", cfg, backend, 60)
    member.ask()
    if ghost:
        generation = member._next_generation()  # what `form` does up to its groups
        member._arrive(generation)
        print("arrived", generation.generation, flush=True)
        os._exit(0)
    generation = member.form()
    print("formed", generation.number, ",".join(generation.members), flush=True)
    all_reduce_ones(device)
    os._exit(0)


def all_reduce_ones(device: torch.device, n: int = 1) -> None:
    """A step's all-reduce: ones summed over the default group, committed over the control
    group; says the sum."""
    ones = torch.ones(n, device=device)
    dist.all_reduce(ones)
    if not collectives.all_ranks(True):
        raise AssertionError("a rank did not commit")
    print("all-reduced", int(ones[0].item()), flush=True)


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {condition}")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
