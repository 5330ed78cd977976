"""What elastic.in_process costs a step when nothing fails, against the restart path's steps.

Each step's commit (`generations.PeerCommits.commit`: the rank's ZeRO partition copied to
host memory and sent to its ring successor, `elastic.peer_state.Mirrors`, then the
all-reduce of the step's loss) against the same steps without it, as the restart path
trains. The commit as it was, waiting for the step's own exchange before that all-reduce,
and as it is, waiting only for the step before's (the exchange goes on beside the next
step). Side by side in one run: two gloo ranks, each a real DeepSpeed ZeRO-1 engine
(wildtrain's `build_engine`), blocks of steps of each variant in turn; every step timed on
both ranks from a barrier, the slower rank's time kept. Prints a row per model shape: the
parameters, what a rank mirrors a step, and each variant's median step time, the in-process
ones also as a ratio to the restart path's (the reference).

On this CPU the exchange's transfer competes with the step for the same two cores, so it
costs the step about as much beside it as after it; `--idle-step-s S` sleeps S seconds in
place of each training step, the host idle as beside a GPU's step, to see what the overlap
saves there.

`--device cuda` trains both ranks on the machine's one GPU (NCCL, each rank a host of its
own, as tests/gpu's ranks), in the engine's GPU precision: the partition's copy from the
device goes beside the next step (`peer_state.host_copy` on a stream of its own, into pinned
memory). Two ranks share that GPU's compute and its link to the host, so each step copies
half the model's state (12 bytes a parameter over 2) where a rank of a real cluster of W
GPUs copies 12/W over its own link: a harder case than a cluster's. The model is not
compiled (a compile per shape would take most of a GPU call), so its steps are slower than a
compiled run's and the mirrors' share smaller. bench/gpu_all.sh's `mirror` part runs it there.

Usage: PYTHONPATH=platform:bench .venv/bin/python bench/mirror_cost.py [--shapes 128x2 512x8] [--steps 6] [--rounds 3]
       [--idle-step-s S] [--device cpu|cuda] [--batch B]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wildtrain.batching import BatchPlan
from wildtrain.config import load_config
from wildtrain.elastic.peer_state import Mirrors
from wildtrain.engine import EngineSettings, build_engine, clone_world_group, import_deepspeed
from wildtrain.model.transformer import Transformer

WORLD, SEQ_LEN = 2, 128
VARIANTS = (
    "restart path: no commit",
    "in-process: commit waits for its step's mirrors",
    "in-process: commit waits for the step before's",
)


# Two ranks on one GPU over NCCL: each a host of its own that talks over sockets (tests/helpers/ranks.py says why).
NCCL_ON_ONE_GPU = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
}


def engine_of(dim: int, layers: int, batch: int, device: torch.device):
    cfg = load_config(
        [
            "experiment=tiny",
            f"model.dim={dim}",
            f"model.n_layers={layers}",
            f"model.max_seq_len={SEQ_LEN}",
            f"data.seq_len={SEQ_LEN}",
            "deepspeed.zero_stage=1",
            "model.compile=false",
        ]
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = build_engine(
            EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s),
            BatchPlan(WORLD, 1, batch),
            model,
            device,
        )
    return engine, cfg.model.vocab_size, sum(p.numel() for p in model.parameters())


def rank_main(rank: int, store_path: str, args, results) -> None:
    os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(WORLD))  # DeepSpeed asserts them
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ.update(NCCL_ON_ONE_GPU, NCCL_HOSTID=f"wildtrain-mirror-cost-{rank}")
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=600),
    )
    deepspeed = import_deepspeed()
    clone_world_group(deepspeed, timedelta(seconds=600))
    for shape in args.shapes:
        dim, layers = (int(v) for v in shape.split("x"))
        engine, vocab, params = engine_of(dim, layers, args.batch, device)
        # A group of their own, as in-process members form one: the step's collectives never
        # queue behind an exchange's bytes on a connection.
        mirrors = Mirrors(keep_steps=3, group=dist.new_group(backend="gloo"))
        mirrors.use_layout(1, WORLD)
        step = 0
        for round_ in range(args.rounds + 1):  # the first round warms up, not counted
            for variant in VARIANTS:
                mirrors.settle()  # a block starts with no exchange on its way
                for _ in range(args.steps):
                    generator = torch.Generator().manual_seed(step * WORLD + rank)
                    tokens = torch.randint(vocab, (args.batch, SEQ_LEN + 1), generator=generator).to(device)
                    dist.barrier()
                    started = time.perf_counter()
                    if args.idle_step_s:
                        time.sleep(args.idle_step_s)  # the host idle through the step, as beside a GPU's
                        loss = torch.zeros((), device=device)
                    else:
                        loss = engine(tokens[:, :-1], targets=tokens[:, 1:])
                        engine.backward(loss)
                        engine.step()
                    step += 1
                    if variant != VARIANTS[0]:
                        mirrors.exchange(engine, step)  # waits for the last exchange first
                        if variant == VARIANTS[1]:
                            mirrors.settle()
                        dist.all_reduce(loss.detach().reshape(1))
                    if device.type == "cuda":
                        # The training stream's work, not the copy's stream: what the copy costs
                        # the step is its wait at the next optimizer step.
                        torch.cuda.current_stream(device).synchronize()
                    took = torch.tensor([time.perf_counter() - started], device=device)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    if rank == 0 and round_:
                        results.append((shape, params, variant, took.item()))
        del engine
    dist.destroy_process_group()
    # torch's teardown at a normal exit aborts a gloo rank now and then ("terminate called
    # without an active exception"), which fails the spawn: the results are handed over.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["128x2", "512x8"], help="model dim x layers")
    parser.add_argument("--steps", type=int, default=6, help="steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks of each variant counted, in turn")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=1, help="sequences a rank trains a step")
    parser.add_argument(
        "--idle-step-s",
        type=float,
        default=0.0,
        help="instead of training, sleep this long a step: the host idle, as it is while a GPU "
        "trains (the state copied and sent is still the engine's)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.list()
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), args, results), nprocs=WORLD)
        rows = list(results)
    print(f"\n| model (dim x layers) | parameters | mirrored a step, per rank | {' | '.join(VARIANTS)} |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    for shape in args.shapes:
        params = next(p for s, p, _, _ in rows if s == shape)
        medians = [statistics.median(t for s, _, v, t in rows if s == shape and v == variant) for variant in VARIANTS]
        cells = [f"{medians[0]:.3f} s"] + [f"{m:.3f} s ({m / medians[0]:.2f}x)" for m in medians[1:]]
        print(f"| {shape} | {params / 1e6:.2f} M | {12 * params / WORLD / 2**20:,.1f} MiB | {' | '.join(cells)} |")
    trains = (
        f"each step a {args.idle_step_s:g} s sleep (the host idle)"
        if args.idle_step_s
        else f"{args.batch} sequence(s) of {SEQ_LEN} tokens a rank"
    )
    ranks = "NCCL ranks on one GPU (mirrors over gloo)" if args.device == "cuda" else "gloo ranks of one thread each"
    print(
        f"\nmedian step time (the slower rank's, from a barrier), {WORLD} {ranks}, ZeRO-1, "
        f"{trains}; {args.rounds} blocks of {args.steps} steps per variant in turn, after a round of each not counted"
    )


if __name__ == "__main__":
    main()
