"""In-process, a step's mirrors go on beside the next step and the step commits with the next
one's commit (`generations.PeerCommits`): a death mid-way costs at most the step in flight and
the one whose mirrors were on their way, and never a committed step. Three member processes
commit steps as an attempt does; member 2 dies before or right after its commit of step 3;
the survivors gather the state in the next generation (tests/helpers/commit_drill.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import commit_drill, mirror_gather
from tests.helpers.ranks import start_ranks


@pytest.mark.parametrize(
    "dies, trained",
    [
        # Dead in step 3: the survivors' commits of steps 1 and 2 had committed steps 0 and 1, and
        # step 2's mirrors were on their successors, received beside step 3.
        ("before-commit", (1, 2)),
        # Dead in step 4, its step-3 mirrors out.
        ("after-commit", (1, 2, 3)),
    ],
)
def test_a_death_beside_an_exchange_costs_only_the_step_in_flight(tmp_path, dies, trained):
    ranks = start_ranks("tests.helpers.commit_drill", commit_drill.WORLD, "--dies", dies, "--out", tmp_path)
    for rank, (code, output, errors) in enumerate(ranks.outputs(timeout_s=180)):
        assert code == 0, f"rank {rank}:\n{output[-1000:]}\n{errors[-3000:]}"
    survivors = [torch.load(tmp_path / f"survivor{rank}.pt") for rank in (0, 1)]
    for survivor in survivors:
        # Each commit commits the step before it, not its own.
        assert survivor["seen"] == [(step, step - 1) for step in trained]
        # The last step trained comes back whole, though no commit said its mirrors were in
        # place: a mirror received before the failure is kept (`Mirrors.drop_in_flight`).
        assert survivor["step"] == trained[-1] and survivor["tokens_seen"] == 100 * trained[-1]
    moved = commit_drill.MOVED_BY_A_STEP * trained[-1]
    for group in range(len(mirror_gather.GROUP_SIZES)):
        want = torch.cat([mirror_gather.partition_values(old, group) for old in range(commit_drill.WORLD)], dim=1)
        got = torch.cat([survivor["partition"][group] for survivor in survivors], dim=1)
        assert torch.equal(got[:, : want.shape[1]], want + moved) and not got[:, want.shape[1] :].any()
