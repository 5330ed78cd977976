"""A ZeRO engine's sharded state survives a peer's death in its peers' host memory
(wildtrain.elastic.peer_state): three gloo ranks of a real DeepSpeed ZeRO-1 engine train
two steps, mirroring their partitions, rank 1 dies, and the two survivors rebuild their
engines at world size 2 from their own partitions and rank 1's mirror, with no checkpoint;
or two ranks take in a third. Each new partition is assembled from the slices of the old
ones that overlap it.
The same training uninterrupted on one rank is the reference. In fp32, and in the engine's
precision on GPUs, where DeepSpeed's ZeRO-1 optimizer is another class (BF16_Optimizer)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import mirror_gather, mirror_send
from tests.helpers.ranks import start_ranks
from tests.helpers.zero_resize import DOUBLE, GROW, HALVE, SHRINK, check_drill, run_drill
from wildtrain.elastic.peer_state import Mirrors


# fp32: DeepSpeed's ZeRO-1 optimizer; bf16, the engine's precision on GPUs: its BF16_Optimizer.
@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_survivors_rebuild_the_zero_state_of_a_dead_peer_from_its_mirror_and_train_on_as_if_nothing_happened(
    tmp_path, precision
):
    drill, reference = run_drill(tmp_path, *precision, env={"DS_ACCELERATOR": "cpu"})
    check_drill(drill, reference, bf16=bool(precision))


def test_a_joiner_takes_its_partition_of_the_zero_state_from_the_members_and_all_train_on(tmp_path):
    # 2 -> 3: the new partitions are cut from the two old ones, the joiner's from both.
    drill, reference = run_drill(tmp_path, env={"DS_ACCELERATOR": "cpu"}, resize=GROW)
    check_drill(drill, reference, bf16=False, resize=GROW)


# ZeRO-3 cuts each parameter on its own (DeepSpeed's ds_tensor), not a group flattened: every
# new partition is assembled parameter by parameter, and the low-precision partitions DeepSpeed
# gathers each forward from (and its persistent parameters, kept gathered) are made anew.
@pytest.mark.parametrize("resize", [HALVE, SHRINK, DOUBLE], ids=["2 to 1", "3 to 2", "1 to 2"])
def test_a_zero3_group_resized_in_process_rebuilds_each_parameter_s_partitions_and_trains_on(tmp_path, resize):
    drill, reference = run_drill(tmp_path, "--zero", "3", env={"DS_ACCELERATOR": "cpu"}, resize=resize)
    check_drill(drill, reference, bf16=False, resize=resize, zero=3)


def gather_drill(out, nodes: str, dead: str) -> list:
    """tests/helpers/mirror_gather.py's drill: what each rank of generation 2 assembled (a
    dict) or why it could not (a str)."""
    processes = len(nodes.split(",")) + 1  # the members and the joiner
    ranks = start_ranks("tests.helpers.mirror_gather", processes, "--nodes", nodes, "--dead", dead, "--out", out)
    for rank, (code, output, errors) in enumerate(ranks.outputs(timeout_s=300)):
        assert code == 0, f"rank {rank}:\n{output[-1000:]}\n{errors[-3000:]}"
    lost = [out / f"lost{rank}.txt" for rank in range(processes - len(dead.split(",")))]
    return [
        why.read_text() if why.exists() else torch.load(out / f"gathered{rank}.pt") for rank, why in enumerate(lost)
    ]


def the_state_of(world: int) -> list[torch.Tensor]:
    return [
        torch.cat([mirror_gather.partition_values(old, group) for old in range(world)], dim=1)
        for group in range(len(mirror_gather.GROUP_SIZES))
    ]


@pytest.mark.parametrize(
    "nodes, dead, holders",
    [
        # Member 0 of three dies; the two others re-form with a joiner (a spare in its place): old
        # partition 0 is on new rank 0 (old 1's mirror of it), 1 on new ranks 0 (its own) and 1
        # (old 2's mirror of it), 2 on new rank 1.
        ("a,b,c", "0", ((0,), (0, 1), (1,))),
        # Two nodes of two workers each, and one node dies, taking two ranks: each partition was
        # mirrored on the other node (membership.mirror_ring: 0 -> 2 -> 1 -> 3 -> 0), so old 2's
        # is on old 1 (new rank 1) and old 3's on old 0 (new rank 0).
        ("a,a,b,b", "2,3", ((0,), (1,), (1,), (0,))),
    ],
    ids=["one of three", "a node of two workers"],
)
def test_each_rank_assembles_its_new_partition_from_the_slices_its_holders_send(tmp_path, nodes, dead, holders):
    world = len(nodes.split(","))
    assembled = gather_drill(tmp_path, nodes, dead)
    for group, whole in enumerate(the_state_of(world)):
        # The new partitions laid end to end are the old ones laid end to end, bit for bit, and
        # zeros after (the new layout's padding); every rank holds every weight.
        after = torch.cat([rank["partition"][group] for rank in assembled], dim=1)
        assert torch.equal(after[:, : whole.shape[1]], whole)
        assert not after[:, whole.shape[1] :].any()
        for rank in assembled:
            assert rank["holders"] == holders and rank["step"] == mirror_gather.STEP
            weights = rank["weights"][group]
            assert torch.equal(weights[: whole.shape[1]], whole[0]) and not weights[whole.shape[1] :].any()


def test_ring_neighbours_lost_together_take_a_partition_with_its_mirror(tmp_path):
    # The same deaths with each rank on a node of its own: ranks 2 and 3 are ring neighbours,
    # so old 2's partition and its mirror (on old 3) are both gone, and every rank says so.
    for lost in gather_drill(tmp_path, "a,b,c,d", "2,3"):
        assert "partitions [2] of generation 1's 4 ranks are held nowhere alive" in lost


def test_each_step_s_copy_reuses_the_buffer_of_a_snapshot_dropped_and_keeps_its_own_values():
    """A rank's copies go into the buffers of the snapshots dropped as old (keep_steps=2: three
    buffers in turn), and no reuse overwrites a snapshot still kept."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = mirror_gather.engine_of(0, 1)
        mirrors = Mirrors(keep_steps=2)
        mirrors.use_layout(1, 1)
        buffers = []
        for step in range(1, 7):
            for fp32 in engine.optimizer.single_partition_of_fp32_groups:
                fp32.fill_(step)  # the optimizer step moved the weights
            mirrors.exchange(engine, step)
            mirrors.settle()
            buffers.append(mirrors.snapshots[(1, 1, 0)][step][0].data_ptr())
    finally:
        dist.destroy_process_group()
    assert buffers[3:] == buffers[:3] and len(set(buffers)) == 3
    kept = mirrors.snapshots[(1, 1, 0)]
    assert sorted(kept) == [5, 6]
    for step, groups in kept.items():
        for group, values in enumerate(groups):
            assert (values[0] == step).all()
            assert torch.equal(values[1:], mirror_gather.partition_values(0, group)[1:]), "AdamW's moments"


def test_a_mirror_is_sent_once_its_copy_from_the_device_has_landed():
    # On a GPU `Mirrors.exchange` returns with the copy queued; the send is posted only once it is done.
    [(code0, out0, err0), (code1, out1, err1)] = start_ranks("tests.helpers.mirror_send", 2).outputs(60)
    assert code0 == 0 and code1 == 0, err0 + err1
    assert "posted before the copy landed: False" in out0
    assert f"received: [{mirror_send.FILLED}]" in out1, (
        "the send went out with the copy's bytes, not the buffer's old ones"
    )


def test_a_mirror_whose_copy_lands_after_a_re_form_is_not_sent_into_the_new_generation():
    [(code0, out0, err0), (code1, out1, err1)] = start_ranks("tests.helpers.mirror_send", 2, "--re-formed").outputs(60)
    assert f"received: [{mirror_send.MARKER}]" in out1, f"generation 1's mirror went to generation 2's group: {out1}"
    assert code0 == 0 and code1 == 0, err0 + err1
