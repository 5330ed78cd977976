"""Every rank of a group restores the checkpoint rank 0 chose, even when another rank's
listing of the store lags behind (an eventually consistent object store): two processes
on gloo, as a worker group is, restoring from one store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist

from tests.helpers.ranks import spawn_ranks
from wildtrain import services
from wildtrain.checkpoint.format import checkpoint_name
from wildtrain.checkpoint.restore import restore
from wildtrain.checkpoint.store import Store, commit, upload, write_part

pytestmark = [pytest.mark.integration, pytest.mark.standalone]


def _commit(root: Path, step: int) -> None:
    local = root / f"local{step}"
    local.mkdir()
    (local / "latest").write_text(f"step_{step}")
    store, name = Store.from_uri(str(root / "store")), checkpoint_name(step, "a1")
    files = upload(str(local), store, name)
    write_part(store, name, 0, files)
    commit(
        store,
        name,
        step=step,
        tag=f"step_{step}",
        world_size=2,
        zero_stage=1,
        files=files,
        data_position={"step": step},
        config_hash="c0ffee",
    )


def _restore(rank: int, world_size: int, port: int, root: str) -> None:
    from tests.helpers.faulty_fs import Faults, faulty_filesystem

    os.environ.update(MASTER_ADDR=services.HOST, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    store_root = str(Path(root, "store"))
    # Rank 1's listing has not caught up with the newest commit; reading it works.
    lagging = Faults(hidden=lambda path: checkpoint_name(20, "a1") in path)
    fs = faulty_filesystem(pafs.LocalFileSystem(), lagging) if rank == 1 else pafs.LocalFileSystem()

    def agree(ok: bool) -> bool:
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def from_rank_zero(list_them):
        box = [list_them() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    restored = restore(
        [Store(fs, store_root, store_root)],
        str(Path(root, f"local_rank{rank}")),
        rank=rank,
        world_size=world_size,
        agree=agree,
        listing=from_rank_zero,
    )
    Path(root, f"rank{rank}.json").write_text(json.dumps({"step": restored.manifest.step if restored else None}))
    dist.destroy_process_group()


def test_every_rank_restores_the_checkpoint_rank_0_chose_when_a_listing_lags(tmp_path):
    for step in (10, 20):
        _commit(tmp_path, step)
    spawn_ranks(_restore, 2, str(tmp_path))
    steps = [json.loads(Path(tmp_path, f"rank{r}.json").read_text())["step"] for r in (0, 1)]
    assert steps == [20, 20]
