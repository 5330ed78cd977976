"""Resharding: a ZeRO checkpoint saved by 2 ranks, converted to the universal format, loads
at 1 and 3 ranks with the exact fp32 weights, Adam moments, step counts, LR and per-group
hyperparameters it was saved with, and the next two steps match those of the run that saved it.

Each world size is a group of processes started with torch.multiprocessing (gloo, CPU);
they hand their results back through files in tmp_path.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from wildtrain import services
from wildtrain.checkpoint import universal
from wildtrain.checkpoint.universal import MARKER, convert, is_converted, universal_tag

pytestmark = [pytest.mark.integration, pytest.mark.standalone]

TAG = "step_3"
STAGES = [1, 2, 3]
STEPS = 3
GLOBAL_BATCH = 6  # splits evenly over 1, 2 and 3 ranks
SEQ_LEN = 16


def _config(stage: int):
    from wildtrain.config import Config, ModelConfig

    cfg = Config()
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=257, max_seq_len=32)
    cfg.deepspeed.zero_stage = stage
    cfg.train.global_batch_size = GLOBAL_BATCH
    cfg.train.micro_batch_size = GLOBAL_BATCH
    cfg.train.steps = 10  # inside the warm-up (5 steps), so every step has its own LR
    return cfg


def _engine(cfg, world_size: int, load_universal: bool = False):
    from tests.helpers.models import engine_settings
    from wildtrain.batching import batch_plan
    from wildtrain.engine import build_engine
    from wildtrain.model import Transformer

    plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    torch.manual_seed(1234)  # the untrained init: a load that restores nothing shows
    return build_engine(
        engine_settings(cfg), plan, Transformer(cfg.model), torch.device("cpu"), load_universal=load_universal
    ), plan


def _init_process(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",  # before deepspeed is imported
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


def _probe_tokens() -> torch.Tensor:
    return torch.randint(0, 257, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(7))


def _snapshot(engine) -> dict:
    """The full training state, gathered on every rank (a collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if getattr(optimizer, "_hp_optimizer_states_linked", False):
        # DeepSpeed 0.19.8, ZeRO-1/2: after the first param group's first step the optimizer
        # links every group's parameters to its Adam state, while the later groups have none
        # yet, and never links again; re-linking now that all groups have state fixes that.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    snap = {"params": _full_params(engine), "exp_avg": {}, "exp_avg_sq": {}}
    for name, param in engine.module.named_parameters():
        snap["exp_avg"][name] = safe_get_full_optimizer_state(param, "exp_avg").clone()
        snap["exp_avg_sq"][name] = safe_get_full_optimizer_state(param, "exp_avg_sq").clone()
    snap["global_steps"] = engine.global_steps
    snap["scheduler_step"] = engine.lr_scheduler.last_epoch
    snap["lr"] = engine.get_lr()
    snap["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    # The weights the forward pass actually uses (the copy the optimizer writes back to).
    tokens = _probe_tokens()
    with torch.no_grad():
        snap["probe_loss"] = engine(tokens[:, :-1], tokens[:, 1:]).item()
    return snap


def _train(engine, plan, rank: int, steps: range) -> None:
    """Optimizer steps `steps` on a fixed global batch per step, split over the ranks."""
    data = torch.randint(0, 257, (STEPS + 2, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    for step in steps:
        per_rank = data[step].view(plan.world_size, plan.grad_accum_steps, plan.micro_batch_size, SEQ_LEN + 1)
        for micro in per_rank[rank]:
            loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(loss)
            engine.step()


def _full_params(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}


def _after_next_steps(engine) -> dict:
    adam_steps = {float(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state}
    return {"params_after_next_steps": _full_params(engine), "adam_steps_after_next_steps": adam_steps}


def _train_and_save(rank: int, world_size: int, port: int, root: str) -> None:
    _init_process(rank, world_size, port)
    from wildtrain import checkpoint

    for stage in STAGES:
        engine, plan = _engine(_config(stage), world_size)
        _train(engine, plan, rank, range(STEPS))
        snap = _snapshot(engine)
        checkpoint.save(engine, _folder(root, stage), TAG, client_state="{}", rank=rank)
        _train(engine, plan, rank, range(STEPS, STEPS + 2))  # what a resumed run must do next
        snap.update(_after_next_steps(engine))
        if rank == 0:
            torch.save(snap, Path(root, f"saved_{stage}.pt"))


def _load(rank: int, world_size: int, port: int, root: str) -> None:
    _init_process(rank, world_size, port)
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    for stage in STAGES:
        cfg = _config(stage)
        folder = _folder(root, stage)
        result = {}
        if world_size == 1:  # without conversion, DeepSpeed refuses the other world size
            plain, _ = _engine(cfg, world_size)
            try:
                plain.load_checkpoint(folder, tag=TAG)
            except ZeRORuntimeException as e:
                result["plain_error"] = str(e)
            del plain
        engine, plan = _engine(cfg, world_size, load_universal=True)
        universal.load(engine, folder, TAG)
        result.update(_snapshot(engine))
        _train(engine, plan, rank, range(STEPS, STEPS + 2))
        result.update(_after_next_steps(engine))
        if rank == 0:
            torch.save(result, Path(root, f"loaded_{stage}_{world_size}.pt"))


def _folder(root: str, stage: int) -> str:
    return str(Path(root, f"zero{stage}"))


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> Path:
    """Every stage trained and saved at 2 ranks, converted, then loaded at 1 and at 3 ranks.

    One group of processes per world size serves all stages (an engine each): starting the
    processes, not the engines, is what costs the time."""
    root = tmp_path_factory.mktemp("resharding")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DS_ACCELERATOR", "cpu")  # the children and the converter inherit it
        spawn_ranks(_train_and_save, 2, str(root))
        # Three conversions at once, as they may happen; ZeRO-1's (the default) in this
        # process, as a restarting worker converts.
        with ThreadPoolExecutor(len(STAGES)) as pool:
            list(pool.map(_convert, [_folder(str(root), stage) for stage in STAGES], [stage == 1 for stage in STAGES]))
        for world_size in (1, 3):
            spawn_ranks(_load, world_size, str(root))
    return root


def _convert(folder: str, in_process: bool) -> None:
    before = _listing(Path(folder, TAG))
    assert convert(folder, TAG, in_process=in_process) == universal_tag(TAG)
    assert _listing(Path(folder, TAG)) == before, "the original checkpoint was modified"


def _listing(folder: Path) -> list:
    return sorted((p.relative_to(folder), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_saved_at_2_ranks_loads_exactly_at_another_world_size(resharded, stage, world_size):
    saved = torch.load(resharded / f"saved_{stage}.pt", weights_only=False)
    loaded = torch.load(resharded / f"loaded_{stage}_{world_size}.pt", weights_only=False)
    assert loaded["global_steps"] == saved["global_steps"] == STEPS
    assert loaded["scheduler_step"] == saved["scheduler_step"] == STEPS
    assert loaded["lr"] == saved["lr"]
    assert loaded["param_groups"] == saved["param_groups"]  # weight decay: 0.1, then 0.0
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        assert loaded[kind].keys() == saved[kind].keys()
        for name, tensor in saved[kind].items():
            assert loaded[kind][name].dtype == tensor.dtype == torch.float32, (kind, name)
            assert torch.equal(loaded[kind][name], tensor), (kind, name)
    assert loaded["probe_loss"] == pytest.approx(saved["probe_loss"], rel=1e-6, abs=0)
    # Two more steps continue the run: same updates (Adam's step count included), up to the
    # order in which a different number of ranks sums the gradients.
    assert loaded["adam_steps_after_next_steps"] == saved["adam_steps_after_next_steps"] == {STEPS + 2}
    for name, tensor in saved["params_after_next_steps"].items():
        torch.testing.assert_close(loaded["params_after_next_steps"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", STAGES)
def test_unconverted_checkpoint_does_not_load_at_another_world_size(resharded, stage):
    loaded = torch.load(resharded / f"loaded_{stage}_1.pt", weights_only=False)
    assert "Automatic adjustment of ZeRO's optimizer state partitioning" in loaded.get("plain_error", "")


def test_second_convert_does_nothing(resharded, monkeypatch):
    folder = Path(_folder(str(resharded), 1))
    before = _listing(folder)  # the marker's mtime included

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(universal.subprocess, "run", no_conversion)
    assert convert(str(folder), TAG) == universal_tag(TAG)
    assert _listing(folder) == before


def test_interrupted_conversion_does_not_count_as_converted(resharded, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(Path(_folder(str(resharded), 1), TAG), folder / TAG)
    utag = universal_tag(TAG)
    # What a crash can leave: a staging folder, even one with the marker in it...
    stale = folder / f".{utag}.partial-crashed"
    (stale / utag).mkdir(parents=True)
    (stale / utag / MARKER).write_text("")
    # ...and what a conversion that is not this module's could: the target without the marker.
    (folder / utag).mkdir()
    (folder / utag / "half_written.pt").write_text("")
    assert not is_converted(str(folder), TAG)

    assert convert(str(folder), TAG) == utag
    assert is_converted(str(folder), TAG)
    assert not (folder / utag / "half_written.pt").exists()
    assert (folder / utag / "zero" / "optimizer_state.pt").is_file()
    assert sorted(os.listdir(folder)) == sorted([TAG, utag, stale.name])  # its own staging folder is gone


@pytest.mark.parametrize("in_process", [False, True])
def test_convert_handles_regex_characters_in_the_path(resharded, tmp_path, in_process):
    # ds_to_universal turns its output path into a regex unescaped; staging folders may hold `+`.
    folder = tmp_path / "run+1 (copy)" / "ckpt"
    shutil.copytree(Path(_folder(str(resharded), 1), TAG), folder / TAG)
    assert convert(str(folder), TAG, in_process=in_process) == universal_tag(TAG)
    assert is_converted(str(folder), TAG)


@pytest.mark.parametrize("in_process", [False, True])
def test_convert_failure_names_the_checkpoint_and_leaves_nothing_converted(tmp_path, monkeypatch, in_process):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    folder = tmp_path / "ckpt"
    (folder / TAG).mkdir(parents=True)
    (folder / TAG / "mp_rank_00_model_states.pt").write_text("not a checkpoint")
    with pytest.raises(RuntimeError, match=re.escape(str(folder / TAG))):
        convert(str(folder), TAG, in_process=in_process)
    assert os.listdir(folder) == [TAG]
