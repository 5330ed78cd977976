"""A mirror's copy from the GPU goes beside the next step (issue 24): `Mirrors.exchange` queues
the partition's copy on a stream of its own into pinned memory and returns, and the next
optimizer step waits for it on the device. The snapshot must hold the state of its own step,
not one the next step has half overwritten: the model is large enough that its copy (~1 GB)
takes longer than the next step's forward and backward here, so without that wait AdamW
would change the values under it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import zero_resize
from wildtrain.config import ModelConfig
from wildtrain.elastic.peer_state import Mirrors, partition

pytestmark = pytest.mark.gpu


def test_a_snapshot_copied_beside_the_next_step_holds_its_own_step_s_state(cuda_group):
    cfg = zero_resize.config(1)
    cfg.model = ModelConfig(dim=1024, n_layers=6, n_heads=8, vocab_size=64, max_seq_len=zero_resize.SEQ_LEN)
    engine = zero_resize.engine_at(cfg, 1, cuda_group)
    mirrors = Mirrors(keep_steps=3)
    mirrors.use_layout(1, 1)
    wanted = {}
    for step in range(1, 5):
        zero_resize.train(engine, step, cuda_group)
        wanted[step] = partition(engine)  # a synchronous copy: the state at this step
        mirrors.exchange(engine, step)  # queued, not done
    mirrors.settle()
    kept = mirrors.snapshots[(1, 1, 0)]
    assert sorted(kept) == [2, 3, 4]
    for step, groups in kept.items():
        for group, (got, want) in enumerate(zip(groups, wanted[step], strict=True)):
            assert got.is_pinned(), "the copy from the device goes into pinned memory"
            assert torch.equal(got, want), f"step {step}, parameter group {group}"
    assert not torch.equal(kept[4][0], wanted[3][0]), "the steps changed the state: the test can tell them apart"
