"""Asynchronous checkpoints of real DeepSpeed engines: ZeRO-1/2/3 saved by 2 ranks through
`AsyncSaver` into a store, then restored from the committed manifest at 2 ranks (each
downloading only its own partition) and at 1 rank through the universal conversion.

Each engine saves twice; the first save's upload waits at a gate, so the second save waits
in the queue while the engine takes another step, and is written only after that step has
changed the live tensors: a save that wrote them instead of its captured copies would
restore the later weights.

Each world size is a group of processes started with torch.multiprocessing (gloo, CPU);
they hand their results back through files in the test's folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.ranks import spawn_ranks
from tests.integration.test_resharding import STAGES, _config, _engine, _full_params, _init_process, _train

pytestmark = [pytest.mark.integration, pytest.mark.standalone]

SAVE_AT = 2
WAIT_S = 120


def _store(root: str, stage: int) -> str:
    return str(Path(root, f"store{stage}"))


def _agree(ok: bool) -> bool:
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _train_and_save(rank: int, world_size: int, port: int, root: str) -> None:
    _init_process(rank, world_size, port)
    import threading

    import pyarrow.fs as pafs

    from tests.helpers.faulty_fs import Faults, faulty_filesystem
    from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
    from wildtrain.checkpoint.format import new_attempt_token
    from wildtrain.checkpoint.store import Store

    token = [new_attempt_token()]
    dist.broadcast_object_list(token, src=0)
    for stage in STAGES:
        engine, plan = _engine(_config(stage), world_size)
        faults = Faults(gate=threading.Event())
        store = Store(faulty_filesystem(pafs.LocalFileSystem(), faults), _store(root, stage), _store(root, stage))
        saver = AsyncSaver(
            [store],
            str(Path(root, f"staging{rank}")),
            rank=rank,
            world_size=world_size,
            attempt=token[0],
            policy="queue",
            background="thread",
        )  # the gate is this process's
        admissions = []
        for step in range(1, SAVE_AT + 1):
            _train(engine, plan, rank, range(step - 1, step))
            if step == 1:
                # As the loop does after an attempt's first step (the optimizer's state exists
                # from then on): the first save takes host buffers allocated ahead of it.
                saver.reserve_buffers(engine)
                saver._buffers._reserving.join()
                reserved = saver._buffers.allocated
                assert reserved > 0, f"rank {rank}: nothing reserved for stage {stage}"
            if step == SAVE_AT:
                saved = _full_params(engine)
            skip = torch.tensor([int(saver.admission().action == "skip")])
            dist.all_reduce(skip, op=dist.ReduceOp.MAX)
            meta = CheckpointMeta(
                step=step,
                tag=f"step_{step}",
                world_size=world_size,
                zero_stage=stage,
                data_position={"step": step},
                config_hash="test",
            )
            admissions.append(
                saver.save_engine(engine, meta, f'{{"step": {step}}}', blocked_elsewhere=bool(skip.item())).action
            )
            if step == 1:
                assert saver._buffers.allocated == reserved, (
                    f"rank {rank}, stage {stage}: the first save allocated "
                    f"{saver._buffers.allocated - reserved} buffers of its own"
                )
            # The first save's upload waits at the gate, so the second is written only after
            # the step below has changed the live tensors.
            assert faults.write_blocked.wait(WAIT_S), f"rank {rank}: the first upload never started"
        _train(engine, plan, rank, range(SAVE_AT, SAVE_AT + 1))
        faults.gate.set()
        assert saver.close(WAIT_S), f"rank {rank}: the saves of stage {stage} did not finish"
        outcomes = saver.drain()
        if rank == 0:
            torch.save(
                {
                    "admissions": admissions,
                    "outcomes": [(o.step, o.status, o.reason) for o in outcomes],
                    "params": saved,
                },
                Path(root, f"saved_{stage}.pt"),
            )
        dist.barrier()


def _restore(rank: int, world_size: int, port: int, root: str) -> None:
    _init_process(rank, world_size, port)
    from wildtrain import checkpoint
    from wildtrain.checkpoint import universal
    from wildtrain.checkpoint.restore import restore

    for stage in STAGES:
        local = Path(root, f"restore{stage}_{world_size}_{rank}")
        restored = restore([_store(root, stage)], str(local), rank=rank, world_size=world_size, agree=_agree)
        folder = Path(restored.folder)
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        reshard = restored.manifest.world_size != world_size
        engine, _ = _engine(_config(stage), world_size, load_universal=reshard)
        if reshard:
            universal.convert(restored.folder, restored.manifest.tag)
            universal.load(engine, restored.folder, restored.manifest.tag)
        else:
            checkpoint.load(engine, restored.folder, restored.manifest.tag)
        result = {
            "files": files,
            "params": _full_params(engine),
            "global_steps": engine.global_steps,
            "client_state": checkpoint.read_client_state(restored.folder),
        }
        torch.save(result, Path(root, f"restored_{stage}_{world_size}_{rank}.pt"))
        dist.barrier()


@pytest.fixture(scope="module")
def saved_and_restored(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("async_checkpoint")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DS_ACCELERATOR", "cpu")
        spawn_ranks(_train_and_save, 2, str(root))
        spawn_ranks(_restore, 2, str(root))
        spawn_ranks(_restore, 1, str(root))
    return root


@pytest.mark.parametrize("stage", STAGES)
def test_a_committed_async_save_restores_the_captured_weights_at_the_same_world_size(saved_and_restored, stage):
    saved = torch.load(saved_and_restored / f"saved_{stage}.pt", weights_only=False)
    assert saved["admissions"] == ["start", "queue"]
    assert saved["outcomes"] == [(1, "saved", ""), (SAVE_AT, "saved", "")]
    for rank in (0, 1):
        restored = torch.load(saved_and_restored / f"restored_{stage}_2_{rank}.pt", weights_only=False)
        assert restored["global_steps"] == SAVE_AT and restored["client_state"] == f'{{"step": {SAVE_AT}}}'
        for name, tensor in saved["params"].items():
            assert torch.equal(restored["params"][name], tensor), (rank, name)
        partitions = {int(m[1]) for f in restored["files"] if (m := re.search(r"zero_pp_rank_(\d+)_", f))}
        assert partitions == {rank}, f"rank {rank} downloaded the partitions of ranks {partitions}"


@pytest.mark.parametrize("stage", STAGES)
def test_a_committed_async_save_restores_at_another_world_size_through_the_universal_format(saved_and_restored, stage):
    saved = torch.load(saved_and_restored / f"saved_{stage}.pt", weights_only=False)
    restored = torch.load(saved_and_restored / f"restored_{stage}_1_0.pt", weights_only=False)
    assert restored["global_steps"] == SAVE_AT
    for name, tensor in saved["params"].items():
        assert torch.equal(restored["params"][name], tensor), name
    partitions = {int(m[1]) for f in restored["files"] if (m := re.search(r"zero_pp_rank_(\d+)_", f))}
    assert partitions == {0, 1}
