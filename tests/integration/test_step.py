"""The factored training step in a plain torch.distributed group of 2 CPU processes (gloo),
no Ray: ZeRO-1 and ZeRO-3 (its model built partitioned by `build_model`, with activation
checkpointing) train the tiny model, the loss falls and is the same number on every rank,
the metrics window adds up, every collective of the helper works at world size 2, and the
validation of the engines scores what one process scores without DeepSpeed.

The processes hand their results back through a file in tmp_path.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from wildtrain import services

pytestmark = [pytest.mark.integration, pytest.mark.standalone]

WORLD = 2
STEPS = 6
SEQ_LEN = 16
GLOBAL_BATCH = 8
MICRO_BATCH = 2  # 2 micro-batches per rank and step


def _config(stage: int):
    from wildtrain.config import Config, ModelConfig

    cfg = Config()
    cfg.model = ModelConfig(
        dim=64, n_layers=2, n_heads=4, vocab_size=257, max_seq_len=32, activation_checkpointing=stage == 3
    )
    cfg.deepspeed.zero_stage = stage
    cfg.train.global_batch_size = GLOBAL_BATCH
    cfg.train.micro_batch_size = MICRO_BATCH
    cfg.train.steps = 100
    cfg.optim.warmup_steps = 1
    return cfg


def _init_process(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR=services.HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # more ranks than cores
    from wildtrain.engine import import_deepspeed

    deepspeed = import_deepspeed()

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _collectives(rank: int) -> dict:
    from wildtrain.train import collectives as c

    return {
        "all_ranks": [c.all_ranks(True), c.all_ranks(rank == 0)],
        "any_rank": [c.any_rank(rank == 1), c.any_rank(False)],
        "broadcast_flag": c.broadcast_flag(rank == 0),
        "broadcast_int": c.broadcast_int(2 if rank == 0 else 0),
        "broadcast_object": c.broadcast_object({"from": rank}),
        "all_gather_object": c.all_gather_object(f"rank{rank}"),
        "all_gather_floats": [c.all_gather_floats(float(rank)), c.all_gather_floats([rank, 10.0 + rank])],
        "mean_over_ranks": float(c.mean_over_ranks(torch.tensor(2.0 * rank))),
    }


# Validation sets of 1 and 6 rows, scored 4 rows a pass: rank 0 scores the first set's row and
# 2 of the second's (a pass each), rank 1 the other 4 (one pass), and pads with one more,
# which ZeRO-3's parameter gathers need.
VALIDATION_ROWS = {"a": 1, "b": 6}
VALIDATION_MICRO_BATCH = 4


def _validation_data(root: Path):
    """An `OpenedData` holding only validation sets, written as prepare writes shards."""
    from wildtrain.data.dataset import OpenedData
    from wildtrain.data.manifest import encode_shard
    from wildtrain.data.tokenizer import ByteTokenizer
    from wildtrain.data.validation import ValidationSet

    rng = np.random.default_rng(1)
    sets = []
    for name, rows in VALIDATION_ROWS.items():
        tokens = rng.integers(0, 257, (rows, SEQ_LEN + 1), dtype=np.int32)
        doc_ids = np.sort(rng.integers(0, 3, (rows, SEQ_LEN + 1)), axis=1).astype(np.int32)
        shard, data = encode_shard("validation-00000.parquet", tokens, doc_ids, rows_per_group=2)
        (root / name).mkdir(parents=True)
        (root / name / shard.path).write_bytes(data)
        sets.append(ValidationSet(name, str(root / name), (shard,)))
    return OpenedData([], 1, ByteTokenizer().describe(), validation=sets, token_bytes=ByteTokenizer().token_bytes())


def _validate(cfg, data, rank: int, world_size: int, engine) -> dict:
    from wildtrain.train.validation import Validator

    validator = Validator(data, SEQ_LEN, VALIDATION_MICRO_BATCH, cfg.storage, rank, world_size, torch.device("cpu"))
    return validator.evaluate(engine)


def _run(rank: int, world_size: int, port: int, root: str) -> None:
    _init_process(rank, world_size, port)
    from tests.helpers.models import engine_settings
    from wildtrain.batching import batch_plan
    from wildtrain.engine import build_engine, build_model
    from wildtrain.model import flops_per_token
    from wildtrain.tracking.worker.mfu import Peak
    from wildtrain.train.step import DeviceBatches, StepMetrics, train_step

    result = {"collectives": _collectives(rank)}
    from wildtrain.train import collectives

    validation = collectives.broadcast_object(_validation_data(Path(root, "validation")) if rank == 0 else None)
    # One global batch, trained on at every step: the loss must fall. Each rank its own rows.
    rows = np.random.default_rng(0).integers(0, 257, (GLOBAL_BATCH, SEQ_LEN + 1), dtype=np.int32)
    for stage in (1, 3):
        cfg = _config(stage)
        plan = batch_plan(GLOBAL_BATCH, MICRO_BATCH, world_size)
        torch.manual_seed(0)
        model = build_model(engine_settings(cfg), plan, torch.device("cpu"))
        # Built partitioned: each rank holds a shard of every parameter and no full one.
        partitioned = (
            all(p.numel() == 0 and 0 < p.ds_tensor.numel() < p.ds_numel for p in model.parameters())
            if stage == 3
            else None
        )
        engine = build_engine(engine_settings(cfg), plan, model, torch.device("cpu"))
        validated = _validate(cfg, validation, rank, world_size, engine)  # the initial weights
        per_rank = GLOBAL_BATCH // world_size
        mine = rows[rank * per_rank : (rank + 1) * per_rank]
        batches = DeviceBatches((mine for _ in range(STEPS)), torch.device("cpu"))
        window = StepMetrics(
            GLOBAL_BATCH * SEQ_LEN,
            flops_per_token(cfg.model, SEQ_LEN),
            Peak(1e12, "config"),
            world_size,
            torch.device("cpu"),
        )
        reports = []
        for tokens, _ in batches:
            assert tokens.dtype == torch.int64 and tokens.shape == (per_rank, SEQ_LEN + 1)
            train_step(engine, plan, tokens, window)
            reports.append(window.flush())
        result[stage] = {
            "reports": reports,
            "busy_s": window.busy_s,
            "global_steps": engine.global_steps,
            "partitioned": partitioned,
            "validated": validated,
        }
        del engine
    torch.save(result, Path(root, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("step")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DS_ACCELERATOR", "cpu")
        spawn_ranks(_run, WORLD, str(root))
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_every_collective_of_the_helper_at_world_size_2(results):
    for rank, got in enumerate(r["collectives"] for r in results):
        assert got["all_ranks"] == [True, False]
        assert got["any_rank"] == [True, False]
        assert got["broadcast_flag"] is True
        assert got["broadcast_int"] == 2
        assert got["broadcast_object"] == {"from": 0}
        assert got["all_gather_object"] == ["rank0", "rank1"]
        assert got["all_gather_floats"] == [[0.0, 1.0], [[0.0, 10.0], [1.0, 11.0]]]
        assert got["mean_over_ranks"] == 1.0, rank


@pytest.mark.parametrize("stage", [1, 3])
def test_the_step_trains_and_every_rank_reports_the_same_loss(results, stage):
    losses = [[r["loss"] for r in rank[stage]["reports"]] for rank in results]
    assert losses[0] == losses[1], "the loss is averaged over the ranks"
    assert all(math.isfinite(x) for x in losses[0])
    assert losses[0][-1] < losses[0][0] - 0.1, losses[0]
    assert all(rank[stage]["global_steps"] == STEPS for rank in results)
    if stage == 3:
        assert all(rank[3]["partitioned"] for rank in results), "zero.Init left a full parameter on a rank"


@pytest.mark.parametrize("stage", [1, 3])
def test_the_window_numbers_add_up(results, stage):
    for rank in results:
        for report in rank[stage]["reports"]:
            assert report["step_time_s"] > 0
            assert report["tokens_per_s"] == pytest.approx(GLOBAL_BATCH * SEQ_LEN / report["step_time_s"])
            phases = [report[f"time/{p}_s"] for p in ("forward", "backward", "optimizer")]
            assert all(p > 0 for p in phases) and sum(phases) <= report["step_time_s"]
            assert report["time/checkpoint_stall_s"] == 0.0 and report["time/data_wait_s"] == 0.0
            assert 0 < report["mfu"] < 1
        # busy_s: the forward time of the whole attempt, not reset by the reports.
        assert rank[stage]["busy_s"] == pytest.approx(sum(r["time/forward_s"] for r in rank[stage]["reports"]))


@pytest.mark.parametrize("stage", [1, 3])
def test_validation_at_2_ranks_scores_what_1_process_without_deepspeed_scores(results, tmp_path, stage):
    from wildtrain.model import Transformer

    cfg = _config(stage)
    torch.manual_seed(0)
    model = Transformer(cfg.model)  # the weights `build_model` draws with the same seed
    alone = _validate(cfg, _validation_data(tmp_path), 0, 1, model)
    assert set(alone) == {"val/loss", "val/bpb", "val/a/loss", "val/a/bpb", "val/b/loss", "val/b/bpb"}
    for rank in results:
        for key, value in alone.items():
            assert rank[stage]["validated"][key] == pytest.approx(value, rel=1e-5), key
