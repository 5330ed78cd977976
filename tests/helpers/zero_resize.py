"""One rank of tests/unit/test_peer_state.py: a real DeepSpeed ZeRO engine trained on gloo
that loses a peer and goes on at the smaller size from its peers' host copies
(wildtrain.elastic.peer_state), or, with --world 1, the uninterrupted reference.

    python -m tests.helpers.zero_resize --store-port P --rank R --world 3 --victim 1 --out DIR [--bf16]

Trains STEPS_BEFORE steps at --world (mirroring after each), then the victim exits; the
others re-form a group without it, rebuild their engines from the mirrors and train
STEPS_AFTER more. Writes, per rank, `old<rank>.pt` (its partition at the death),
`new<new rank>.pt` (its partition once rebuilt, the learning rate and DeepSpeed's step count
then) and `losses<rank>.json` / `params<rank>.pt` (every step's loss over the group and
the final weights). With --world 1 it trains all the steps and writes the last two.

--bf16 trains in the precision the engine has on GPUs (bf16 weights, gradients summed in
fp32: `engine.deepspeed_config`), in which DeepSpeed's optimizer at ZeRO-1 is its
BF16_Optimizer rather than the ZeRO one: an in-process GPU run's partitions are that one's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from wildtrain.batching import BatchPlan
from wildtrain.config import Config, ModelConfig
from wildtrain.elastic.membership import micro_batches
from wildtrain.elastic.peer_state import Mirrors, load_state, partition
from wildtrain import engine as engines
from wildtrain.engine import build_engine, import_deepspeed
from wildtrain.model.transformer import Transformer

GLOBAL_BATCH, SEQ_LEN, SEED = 6, 8, 7
STEPS_BEFORE, STEPS_AFTER = 2, 2


def config(zero_stage: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=SEQ_LEN)
    cfg.data.seq_len = SEQ_LEN
    cfg.deepspeed.zero_stage = zero_stage
    cfg.train.steps = STEPS_BEFORE + STEPS_AFTER
    cfg.optim.warmup_steps = 2  # the schedule's position matters: the rebuilt engine must be at it
    cfg.elastic.collective_timeout_s = 60
    return cfg


def batch(step: int) -> torch.Tensor:
    """The global batch of `step`, the same whoever draws it."""
    return torch.randint(0, 64, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(SEED + step))


def train_in_gpu_precision() -> None:
    """The engine's DeepSpeed config from here on is the one it has on GPUs, on the CPU."""
    on_device = engines.deepspeed_config
    engines.deepspeed_config = lambda cfg, plan, on_cuda, load_universal=False: on_device(cfg, plan, True,
                                                                                          load_universal)


def engine_at(cfg: Config, world: int):
    torch.manual_seed(SEED)
    plan = BatchPlan(world, 1, GLOBAL_BATCH // world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_engine(cfg, plan, Transformer(cfg.model), torch.device("cpu"))


def train(engine, step: int) -> float:
    """One optimizer step on this rank's rows of the global batch; the loss over the group."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    rows = batch(step)
    total = 0.0
    for micro in micro_batches(GLOBAL_BATCH, world, rank, 1):
        x = rows[micro.start:micro.stop]
        loss = engine(x[:, :-1], targets=x[:, 1:])
        engine.backward(loss)
        engine.step()
        total += loss.item() / GLOBAL_BATCH
    summed = torch.tensor([total], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(summed)
    return summed.item()


def join(store, generation: int, rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"g{generation}/", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bf16", action="store_true", help="the engine's precision on GPUs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.bf16:
        train_in_gpu_precision()
    cfg = config(args.zero)
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    join(store, 1, args.rank, args.world)
    engine = engine_at(cfg, args.world)
    losses = []
    if args.world == 1:
        losses = [train(engine, step) for step in range(STEPS_BEFORE + STEPS_AFTER)]
    else:
        mirrors = Mirrors()
        mirrors.use_layout(1, args.world)
        for step in range(STEPS_BEFORE):
            mirrors.settle()  # before the step's reductions: see peer_state's docstring
            losses.append(train(engine, step))
            mirrors.exchange(engine, step + 1)
        mirrors.settle()
        torch.save(partition(engine), args.out / f"old{args.rank}.pt")
        dist.barrier()  # every mirror of the last step is in place: then the victim dies
        if args.rank == args.victim:
            os._exit(0)
        import_deepspeed().comm.destroy_process_group()
        del engine
        gc.collect()
        survivors = [r for r in range(args.world) if r != args.victim]
        rank, world = survivors.index(args.rank), len(survivors)
        join(store, 2, rank, world)
        plan, full = mirrors.gather(fresh=False)
        engine = engine_at(cfg, world)
        load_state(engine, full, plan.step, GLOBAL_BATCH)
        mirrors.use_layout(2, world)
        torch.save({"partition": partition(engine), "lr": engine.get_lr()[0], "global_steps": engine.global_steps,
                    "restored_step": plan.step, "sources": plan.sources}, args.out / f"new{rank}.pt")
        for step in range(plan.step, STEPS_BEFORE + STEPS_AFTER):
            mirrors.settle()
            losses.append(train(engine, step))
            mirrors.exchange(engine, step + 1)
        mirrors.settle()
    (args.out / f"losses{args.rank}.json").write_text(json.dumps(losses))
    torch.save(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]),
               args.out / f"params{args.rank}.pt")


if __name__ == "__main__":
    main()
