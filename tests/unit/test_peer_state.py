"""A ZeRO engine's sharded state survives a peer's death in its peers' host memory
(wildtrain.elastic.peer_state): three gloo ranks of a real DeepSpeed ZeRO-1 engine train
two steps, mirroring their partitions, rank 1 dies, and the two survivors rebuild their
engines at world size 2 from their own partitions and rank 1's mirror, with no checkpoint.
The same training uninterrupted on one rank is the reference. In fp32, and in the engine's
precision on GPUs, where DeepSpeed's ZeRO-1 optimizer is another class (BF16_Optimizer)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import mirror_gather
from tests.helpers.ranks import Ranks, start_ranks
from tests.helpers.zero_resize import STEPS_AFTER, STEPS_BEFORE, config
from wildtrain.engine import lr_at

VICTIM = 1


def run_ranks(out, world: int, victim: int = -1, *args: str) -> Ranks:
    return start_ranks("tests.helpers.zero_resize", world, "--world", world, "--victim", victim, "--out", out, *args,
                       env={"DS_ACCELERATOR": "cpu"})


# fp32: DeepSpeed's ZeRO-1 optimizer; bf16, the engine's precision on GPUs: its BF16_Optimizer.
@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_survivors_rebuild_the_zero_state_of_a_dead_peer_from_its_mirror_and_train_on_as_if_nothing_happened(
        tmp_path, precision):
    drill, reference = tmp_path / "drill", tmp_path / "reference"
    drill.mkdir()
    reference.mkdir()
    # Both at once: four processes on this machine's cores, rather than one after the other.
    held = [run_ranks(drill, 3, VICTIM, *precision), run_ranks(reference, 1, -1, *precision)]
    for ranks in held:
        for rank, (code, output, errors) in enumerate(ranks.outputs(timeout_s=600)):
            assert code == 0, f"rank {rank}:\n{output[-1000:]}\n{errors[-3000:]}"

    # The state the survivors rebuilt is the state the three ranks held when rank 1 died, bit
    # for bit: its partition came from rank 2's mirror of it, re-cut in two.
    old = [torch.load(drill / f"old{rank}.pt") for rank in range(3)]
    new = [torch.load(drill / f"new{rank}.pt") for rank in range(2)]
    for group in range(len(old[0])):
        before = torch.cat([old[rank][group] for rank in range(3)], dim=1)
        after = torch.cat([new[rank]["partition"][group] for rank in range(2)], dim=1)
        numel = min(before.shape[1], after.shape[1])  # each layout pads the group's end to its world
        assert torch.equal(before[:, :numel], after[:, :numel])
        assert not before[:, numel:].any() and not after[:, numel:].any()
        assert before[1:].abs().sum() > 0  # AdamW's moments, not zeros: the state after two steps
    for rebuilt in new:
        assert rebuilt["restored_step"] == STEPS_BEFORE and rebuilt["global_steps"] == STEPS_BEFORE
        # Old rank 1's partition from its successor (new rank 1), old rank 2's from the lowest
        # new rank holding it: old rank 0, its successor, holds its mirror.
        assert rebuilt["sources"] == (0, 1, 0)
        cfg = config(zero_stage=1)
        assert rebuilt["lr"] == pytest.approx(lr_at(STEPS_BEFORE, cfg.optim, cfg.train.steps))  # the schedule's place

    # And training on at world size 2 is training on uninterrupted: same losses, same weights.
    expected = json.loads((reference / "losses0.json").read_text())
    assert len(expected) == STEPS_BEFORE + STEPS_AFTER
    # The world sizes sum gradients in other orders, and AdamW's normalised update can turn
    # a rounding difference in a near-zero gradient into a step of up to lr (3e-3): 1e-5
    # allows that, where wrong moments or a wrong step count would be off by about lr. In
    # bf16 the world size alone moves more: an uninterrupted run at 3 ranks ended with its
    # weights 1.9e-3 off the 1-rank run's (norm of the difference over the weights' norm; a
    # third of them a bf16 rounding step apart) and its losses 3.7e-5, as this drill's did.
    reference_params = torch.load(reference / "params0.pt")
    for survivor in (0, 2):
        losses = json.loads((drill / f"losses{survivor}.json").read_text())
        assert losses == pytest.approx(expected, rel=1e-4 if precision else 1e-5, abs=1e-6)
        params = torch.load(drill / f"params{survivor}.pt")
        if precision:
            off = ((params.float() - reference_params.float()).norm() / reference_params.float().norm()).item()
            assert off < 4e-3, off
        else:
            torch.testing.assert_close(params, reference_params, rtol=1e-5, atol=1e-5)


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
