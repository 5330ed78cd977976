"""A ZeRO engine's sharded state survives a peer's death in its peers' host memory
(wildtrain.elastic.peer_state): three gloo ranks of a real DeepSpeed ZeRO-1 engine train
two steps, mirroring their partitions, rank 1 dies, and the two survivors rebuild their
engines at world size 2 from their own partitions and rank 1's mirror, with no checkpoint.
The same training uninterrupted on one rank is the reference. In fp32, and in the engine's
precision on GPUs, where DeepSpeed's ZeRO-1 optimizer is another class (BF16_Optimizer)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import mirror_gather
from tests.helpers.ranks import start_ranks
from tests.helpers.zero_resize import check_drill, run_drill

# fp32: DeepSpeed's ZeRO-1 optimizer; bf16, the engine's precision on GPUs: its BF16_Optimizer.
@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_survivors_rebuild_the_zero_state_of_a_dead_peer_from_its_mirror_and_train_on_as_if_nothing_happened(
        tmp_path, precision):
    drill, reference = run_drill(tmp_path, *precision, env={"DS_ACCELERATOR": "cpu"})
    check_drill(drill, reference, bf16=bool(precision))


def test_a_rank_that_holds_nothing_receives_the_whole_state_from_the_partitions_sources(tmp_path):
    # Three members mirror their partitions, member 0 dies, and the two others gather with a
    # joiner (a spare in the dead member's place): old partitions 0 and 1 come from new rank 0
    # (old 1: its own, and its mirror of old 0), partition 2 from new rank 1.
    ranks = start_ranks("tests.helpers.mirror_gather", mirror_gather.OLD_WORLD + 1, "--out", tmp_path)
    for rank, (code, output, errors) in enumerate(ranks.outputs(timeout_s=300)):
        assert code == 0, f"rank {rank}:\n{output[-1000:]}\n{errors[-3000:]}"
    expected = [torch.cat([mirror_gather.partition_values(old, group) for old in range(mirror_gather.OLD_WORLD)], dim=1)
                for group in range(len(mirror_gather.GROUP_SIZES))]
    for rank in range(3):
        gathered = torch.load(tmp_path / f"gathered{rank}.pt")
        assert gathered["sources"] == (0, 0, 1) and gathered["step"] == mirror_gather.STEP
        assert len(gathered["full"]) == len(expected)
        for got, want in zip(gathered["full"], expected):
            assert torch.equal(got, want)
