"""One rank of tests/gpu/test_two_ranks_cuda.py: the collectives helper, then the factored
step (`train_step` on a DeepSpeed engine) at each ZeRO stage given, written as JSON for the
test to judge. No Ray: the rank joins a torch.distributed group by itself.

    python two_ranks.py RANK WORLD_SIZE PORT OUT_JSON [--stages 1,3] [--device cuda|cpu]

Two ranks share the one GPU of a test machine. NCCL refuses that ("Duplicate GPU detected":
it tells ranks apart by the GPU's bus id and only NCCL_HOSTID, which makes the two look like
two hosts talking over sockets, gets around it), so the group is `cpu:gloo,cuda:gloo`:
gloo carries CUDA tensors through pinned host copies (ProcessGroupGloo's CUDA works for
allreduce, broadcast, allgather and reduce; its reduce-scatter is an allreduce) with the
same algorithms as on the CPU. Named per device type, the backend is one `collectives`
reads as Ray Train's `cpu:gloo,cuda:nccl`: flags and objects on the CPU, the loss and the
bandwidth probe on the GPU. `--device cpu` (plain gloo) runs the same on a machine without
one, for working on this script.

Every rank trains on its own rows of one global batch; WORLD_SIZE 1 trains on all of them
in as many micro-batches, the reference a data-parallel step must reproduce.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os

import numpy as np
import torch
import torch.distributed as dist

SEQ_LEN = 64
ROWS_PER_RANK = 4  # one micro-batch per rank at world size 2; two at world size 1
RANKS = 2
STEPS = 4


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rank", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("out")
    parser.add_argument("--stages", default="", help="ZeRO stages to train, comma-separated (none: collectives only)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return parser.parse_args()


def collectives_seen(rank: int, device: torch.device) -> dict:
    """What each collective of the helper returned on this rank; the bandwidth probe too."""
    from wildtrain.train import collectives as c
    from wildtrain.train import health

    mean = c.mean_over_ranks(torch.tensor(rank + 1.0, device=device))
    summed = c.sum_(torch.full((4,), rank + 1.0, device=device))
    return {
        "small_tensor_device": str(c.small_tensor_device(str(dist.get_backend()))),
        "all_ranks_rank0": c.all_ranks(rank == 0),
        "any_rank_rank0": c.any_rank(rank == 0),
        "broadcast_flag_from_1": c.broadcast_flag(rank == 1, src=1),
        "broadcast_object_from_1": c.broadcast_object({"rank": rank}, src=1),
        "all_gather_object": c.all_gather_object(f"node-{rank}"),
        "all_gather_float": c.all_gather_floats(float(rank)),
        "all_gather_floats": c.all_gather_floats([float(rank), 10.0 * rank]),
        "mean": mean.item(),
        "mean_device": str(mean.device),
        "sum": summed.tolist(),
        "sum_device": str(summed.device),
        "allreduce_gb_per_s": health.measure_allreduce(device),
    }


def train(stage: int, rank: int, world_size: int, device: torch.device) -> dict:
    """Loss and gradient norm per step of `STEPS` steps on one fixed global batch, this rank's
    own loss beside the mean over ranks, and a checksum of the trained fp32 weights."""
    from deepspeed.utils import safe_get_full_fp32_param

    from wildtrain.batching import batch_plan
    from wildtrain.config import Config, ModelConfig
    from wildtrain.engine import EngineSettings, build_engine, build_model
    from wildtrain.train.step import DeviceBatches, StepMetrics, train_step

    cfg = Config()
    # Eager: two ranks compiling the same graphs would double the test's time, and the
    # compiled step has tests of its own at world size 1.
    cfg.model = ModelConfig(dim=128, n_layers=2, n_heads=4, max_seq_len=SEQ_LEN, compile=False)
    cfg.deepspeed.zero_stage = stage
    global_batch = RANKS * ROWS_PER_RANK
    cfg.train.global_batch_size, cfg.train.micro_batch_size = global_batch, ROWS_PER_RANK
    cfg.optim.warmup_steps = 1
    plan = batch_plan(global_batch, ROWS_PER_RANK, world_size)
    settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
    torch.manual_seed(0)
    engine = build_engine(settings, plan, build_model(settings, plan, device), device)
    tokens = np.random.default_rng(stage).integers(0, cfg.model.vocab_size, (global_batch, SEQ_LEN + 1), dtype=np.int32)
    rows = tokens if world_size == 1 else tokens[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    window = StepMetrics(len(rows) * SEQ_LEN, 1.0, None, world_size, device)
    own, loss, grad_norm = [], [], []
    for batch, _ in DeviceBatches((rows for _ in range(STEPS)), device):
        train_step(engine, plan, batch, window)
        own.append((window.loss_sum / window.micro_steps).item())
        loss.append(window.flush()["loss"])
        grad_norm.append(float(engine.get_global_grad_norm()))
    checksum = sum(safe_get_full_fp32_param(p).double().abs().sum().item() for p in engine.module.parameters())
    result = {
        "own_loss": own,
        "loss": loss,
        "grad_norm": grad_norm,
        "weights_abs_sum": checksum,
        "plan": [plan.micro_batch_size, plan.grad_accum_steps],
        "backend": str(dist.get_backend()),
    }
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    args = _args()
    cuda = args.device == "cuda"
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        RANK=str(args.rank),
        LOCAL_RANK="0" if cuda else str(args.rank),
        WORLD_SIZE=str(args.world_size),
    )
    if cuda:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
        device = torch.device("cpu")
    dist.init_process_group(
        "cpu:gloo,cuda:gloo" if cuda else "gloo",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    result: dict = {"rank": args.rank, "world_size": args.world_size}
    try:
        if args.world_size > 1:
            result["collectives"] = collectives_seen(args.rank, device)
        for stage in filter(None, args.stages.split(",")):
            result[f"zero{stage}"] = train(int(stage), args.rank, args.world_size, device)
    finally:
        with open(args.out, "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
