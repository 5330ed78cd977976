"""One rank of tests/unit/test_peer_state.py: a real DeepSpeed ZeRO engine trained on gloo
that loses a peer and goes on at the smaller size from its peers' host copies
(wildtrain.elastic.peer_state), or takes in a joiner and goes on at the larger size, or,
with --reference, the uninterrupted reference on one rank.

    python -m tests.helpers.zero_resize --store-port P --rank R --world 3 --victim 1 --out DIR [--bf16]
        [--device cpu|cuda] [--zero 1|2|3]
    python -m tests.helpers.zero_resize --store-port P --rank R --world 2 --joiners 1 --out DIR
    python -m tests.helpers.zero_resize --store-port P --rank 0 --world 1 --reference --out DIR

Trains STEPS_BEFORE steps at --world (mirroring after each), then the victim exits; the
others re-form a group without it (and with the --joiners ranks after --world's, which held
nothing), rebuild their engines from the mirrors and train STEPS_AFTER more. Writes, per
rank, `old<rank>.pt` (its partition at the death, and how it is laid out),
`new<new rank>.pt` (its partition once rebuilt, the learning rate and DeepSpeed's step count
then) and `losses<rank>.json` / `params<rank>.pt` (every step's loss over the group and
the final weights). With --reference it trains all the steps and writes the last two.

--bf16 trains in the precision the engine has on GPUs (bf16 weights, gradients summed in
fp32: `engine.deepspeed_config`), in which DeepSpeed's optimizer at ZeRO-1 is its
BF16_Optimizer rather than the ZeRO one: an in-process GPU run's partitions are that one's.
--device cuda trains on the GPU, in that precision, over NCCL (the ranks share the machine's
one GPU, each an NCCL host of its own, as tests/helpers/member_rank.py's). Either way the
mirrors go over a gloo group beside the default one, as a worker's go over its control group.
`check_drill` is what the tests check of a drill and its reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.models import engine_settings
from tests.helpers.ranks import start_ranks
from wildtrain import engine as engines
from wildtrain.batching import BatchPlan
from wildtrain.config import Config, ModelConfig
from wildtrain.elastic.membership import Pieces
from wildtrain.elastic.peer_state import Mirrors, is_zero3, load_state, partition, partitioned_groups, sharded
from wildtrain.engine import build_engine, build_model, import_deepspeed, lr_at
from wildtrain.model.transformer import Transformer
from wildtrain.train import collectives

GLOBAL_BATCH, SEQ_LEN, SEED = 6, 8, 7
STEPS_BEFORE, STEPS_AFTER = 2, 2
VICTIM = 1


def config(zero_stage: int) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=SEQ_LEN)
    cfg.model.compile = False  # on CUDA: compiling would take longer than these few steps
    cfg.data.seq_len = SEQ_LEN
    cfg.deepspeed.zero_stage = zero_stage
    if zero_stage == 3:
        # The embedding over DeepSpeed's persistence threshold (1e5 values): ZeRO-3 gathers it
        # for each forward from the ranks' partitions, and keeps the smaller ones gathered.
        cfg.model.vocab_size = 4096
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
    engines.deepspeed_config = lambda deepspeed, optim, plan, on_cuda, load_universal=False: on_device(
        deepspeed, optim, plan, True, load_universal
    )


def engine_at(cfg: Config, world: int, device: torch.device):
    """The engine as a worker builds it: under ZeRO-3 its model partitioned from the start."""
    torch.manual_seed(SEED)
    plan = BatchPlan(world, 1, GLOBAL_BATCH // world)
    settings = engine_settings(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(settings, plan, device) if cfg.deepspeed.zero_stage == 3 else Transformer(cfg.model)
        return build_engine(settings, plan, model.to(device), device)


def layout(engine) -> dict:
    """This rank's partition and how it is laid out (`membership.Pieces`), for the checks."""
    held = sharded(engine)
    return {"partition": partition(engine), "pieces": held.pieces.sizes, "numels": held.numels}


def train(engine, step: int, device: torch.device) -> float:
    """One optimizer step on this rank's rows of the global batch, one row a micro-batch (every
    world size here divides the global batch); the loss over the group."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    rows = batch(step).to(device)
    share = GLOBAL_BATCH // world
    total = 0.0
    for row in range(rank * share, (rank + 1) * share):
        x = rows[row : row + 1]
        loss = engine(x[:, :-1], targets=x[:, 1:])
        engine.backward(loss)
        engine.step()
        total += loss.item() / GLOBAL_BATCH
    summed = torch.tensor([total], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(summed)
    return summed.item()


def join(
    store, generation: int, rank: int, world: int, device: torch.device = torch.device("cpu")
) -> dist.ProcessGroup:
    """Form generation `generation`'s default group (NCCL's on CUDA); the group the mirrors
    go over: a gloo group beside it, as a worker's control group."""
    os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"g{generation}/", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    return dist.new_group(backend="gloo")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--joiners", type=int, default=0, help="ranks after --world's that join at the re-form")
    parser.add_argument("--reference", action="store_true", help="train uninterrupted at --world")
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bf16", action="store_true", help="the engine's precision on GPUs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ["NCCL_HOSTID"] = f"wildtrain-test-{args.rank}"
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    elif args.bf16:
        train_in_gpu_precision()
    cfg = config(args.zero)
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    mirrors = Mirrors()
    losses = []
    if args.reference:
        mirrors.group = join(store, 1, args.rank, args.world, device)
        engine = engine_at(cfg, args.world, device)
        losses = [train(engine, step, device) for step in range(STEPS_BEFORE + STEPS_AFTER)]
    else:
        if args.rank < args.world:
            mirrors.group = join(store, 1, args.rank, args.world, device)
            engine = engine_at(cfg, args.world, device)
            mirrors.use_layout(1, args.world)
            for step in range(STEPS_BEFORE):
                mirrors.settle()  # before the step's reductions: see peer_state's docstring
                losses.append(train(engine, step, device))
                mirrors.exchange(engine, step + 1)
            mirrors.settle()
            torch.save(layout(engine), args.out / f"old{args.rank}.pt")
            dist.barrier()  # every mirror of the last step is in place: then the victim dies
            if args.rank == args.victim:
                os._exit(0)
            collectives.abort_groups()  # as a survivor frees its waits on the lost member (elastic.in_process)
            import_deepspeed().comm.destroy_process_group()
            del engine
            gc.collect()
        members = [r for r in range(args.world + args.joiners) if r != args.victim]
        rank, world = members.index(args.rank), len(members)
        mirrors.group = join(store, 2, rank, world, device)
        reform = mirrors.agree(fresh=False)
        engine = engine_at(cfg, world, device)
        load_state(engine, mirrors, reform, GLOBAL_BATCH)
        mirrors.use_layout(2, world)
        torch.save(
            {
                **layout(engine),
                "weights": [flat.cpu() for flat in partitioned_flats(engine)],
                "lr": engine.get_lr()[0],
                "global_steps": engine.global_steps,
                "restored_step": reform.step,
                "holders": reform.repartition.holders,
            },
            args.out / f"new{rank}.pt",
        )
        for step in range(reform.step, STEPS_BEFORE + STEPS_AFTER):
            mirrors.settle()
            losses.append(train(engine, step, device))
            mirrors.exchange(engine, step + 1)
        mirrors.settle()
    (args.out / f"losses{args.rank}.json").write_text(json.dumps(losses))
    params = list(engine.module.parameters())
    # Under ZeRO-3 each rank holds its partition of a parameter: gathered whole to be saved.
    with import_deepspeed().zero.GatheredParameters(params, enabled=args.zero == 3):
        torch.save(torch.cat([p.detach().reshape(-1).cpu() for p in params]), args.out / f"params{args.rank}.pt")
    os._exit(0)  # skips the destructors of groups whose peers have gone


def partitioned_flats(engine) -> list[torch.Tensor]:
    """The low-precision weights, per parameter group, as the engine keeps them: every rank's
    at ZeRO-1/2, this rank's partition (laid out as the fp32 one) at ZeRO-3."""
    if is_zero3(engine):
        return list(engine.optimizer.fp16_partitioned_groups_flat)
    return [group.flat for group in partitioned_groups(engine)]


def whole(partitions: list[list[torch.Tensor]], pieces: Pieces) -> list[torch.Tensor]:
    """Per piece of a layout (`membership.Pieces`), every rank's share of it end to end, from
    the ranks' partitions (per parameter group, [rows, n]; by rank): its values, then its padding."""
    cut = pieces.cut(len(partitions))
    return [
        torch.cat([groups[group][:, offset : offset + size] for groups in partitions], dim=1)
        for (group, offset), size in zip(pieces.places(), cut.sizes)
    ]


@dataclass(frozen=True)
class Resize:
    """A drill's re-form: `world` ranks train, `victim` (if any) dies, `joiners` come."""

    world: int
    victim: int = -1
    joiners: int = 0
    # By old rank, the new ranks that hold its partition at the re-form (ring 0 -> 1 -> ... -> 0).
    holders: tuple[tuple[int, ...], ...] = ()

    @property
    def survivors(self) -> list[int]:
        """The ranks that train before and after, by their first rank."""
        return [rank for rank in range(self.world) if rank != self.victim]

    @property
    def new_world(self) -> int:
        return len(self.survivors) + self.joiners


# Rank 1 of three dies: old rank 1's partition is on its successor (new rank 1), old rank 2's
# on both survivors. Or a third rank joins two, each of which holds both partitions. Or rank 1
# of two dies, its partition on rank 0; or a rank joins one, which holds the only partition.
SHRINK = Resize(3, victim=VICTIM, holders=((0,), (1,), (0, 1)))
GROW = Resize(2, joiners=1, holders=((0, 1), (0, 1)))
HALVE = Resize(2, victim=VICTIM, holders=((0,), (0,)))
DOUBLE = Resize(1, joiners=1, holders=((0,),))


def run_drill(out: Path, *args: str, env: dict[str, str], resize: Resize = SHRINK) -> tuple[Path, Path]:
    """The drill (`resize` after STEPS_BEFORE) and its reference (one rank, uninterrupted),
    both at once: four processes on the machine's cores. Their folders."""
    drill, reference = out / "drill", out / "reference"
    held = []
    for folder, processes, flags in (
        (drill, resize.world + resize.joiners, ("--world", resize.world, "--victim", resize.victim)),
        (reference, 1, ("--world", 1, "--reference")),
    ):
        folder.mkdir()
        flags += ("--joiners", resize.joiners) if folder == drill else ()
        held.append(start_ranks("tests.helpers.zero_resize", processes, *flags, "--out", folder, *args, env=env))
    for ranks in held:
        for rank, (code, output, errors) in enumerate(ranks.outputs(timeout_s=600)):
            assert code == 0, f"rank {rank}:\n{output[-1000:]}\n{errors[-3000:]}"
    return drill, reference


def check_drill(drill: Path, reference: Path, bf16: bool, resize: Resize = SHRINK, zero: int = 1) -> None:
    """The ranks of the re-formed group rebuilt the state the old ranks held at the re-form,
    and trained on as the uninterrupted reference did."""
    # The state rebuilt is the state the old ranks held, bit for bit, re-cut at the new size:
    # a dead rank's partition from its mirror; each new partition from the slices of the old
    # ones that overlap it, piece by piece (a group at ZeRO-1/2, a parameter at ZeRO-3); the
    # low-precision weights those of the fp32 ones.
    old = [torch.load(drill / f"old{rank}.pt") for rank in range(resize.world)]
    new = [torch.load(drill / f"new{rank}.pt") for rank in range(resize.new_world)]
    numels = new[0]["numels"]
    assert old[0]["numels"] == numels and len(numels) > (len(new[0]["partition"]) if zero == 3 else 0)
    before = whole([rank["partition"] for rank in old], Pieces(old[0]["pieces"]))
    after = whole([rank["partition"] for rank in new], Pieces(new[0]["pieces"]))
    if zero == 3:  # each rank's own share of each parameter, laid out as its fp32 partition
        weights = whole([[w.unsqueeze(0) for w in rank["weights"]] for rank in new], Pieces(new[0]["pieces"]))
        held_by_rank = [weights] * len(new)
    else:  # every rank's weights of each group, flat
        held_by_rank = [[w.unsqueeze(0) for w in rank["weights"]] for rank in new]
    for piece, numel in enumerate(numels):
        # Each layout pads the piece's end to its world; the new padding is zeros.
        assert torch.equal(before[piece][:, :numel], after[piece][:, :numel])
        assert not after[piece][:, numel:].any()
        for weights in held_by_rank:
            lp = weights[piece]
            assert torch.equal(lp[0, :numel], before[piece][0, :numel].to(lp.dtype)) and not lp[:, numel:].any()
    assert sum(values[1:].abs().sum() for values in before) > 0  # AdamW's moments, not zeros: after two steps
    for rebuilt in new:
        assert rebuilt["restored_step"] == STEPS_BEFORE and rebuilt["global_steps"] == STEPS_BEFORE
        assert rebuilt["holders"] == resize.holders
        cfg = config(zero_stage=1)
        assert rebuilt["lr"] == pytest.approx(lr_at(STEPS_BEFORE, cfg.optim, cfg.train.steps))  # the schedule's place

    # And training on at the new size is training on uninterrupted: same losses, same weights.
    # The world sizes sum gradients in other orders, and AdamW's normalised update can turn
    # a rounding difference in a near-zero gradient into a step of up to lr (3e-3): 1e-5
    # allows that, where wrong moments or a wrong step count would be off by about lr. In
    # bf16 the world size alone moves more: on the CPU an uninterrupted run at 3 ranks ended
    # with its weights 1.9e-3 off the 1-rank run's (norm of the difference over the weights'
    # norm; a third of them a bf16 rounding step apart) and its losses 3.7e-5, as the drill's.
    expected = json.loads((reference / "losses0.json").read_text())
    assert len(expected) == STEPS_BEFORE + STEPS_AFTER
    reference_params = torch.load(reference / "params0.pt")
    joiners = range(resize.world, resize.world + resize.joiners)
    for rank in [*resize.survivors, *joiners]:
        losses = json.loads((drill / f"losses{rank}.json").read_text())
        trained = expected if rank < resize.world else expected[STEPS_BEFORE:]  # a joiner: from the re-form
        assert losses == pytest.approx(trained, rel=1e-4 if bf16 else 1e-5, abs=1e-6)
        params = torch.load(drill / f"params{rank}.pt")
        if bf16:
            off = ((params.float() - reference_params.float()).norm() / reference_params.float().norm()).item()
            assert off < 4e-3, off
        else:
            torch.testing.assert_close(params, reference_params, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    main()
