"""Two ranks on one GPU (tests/gpu/two_ranks.py; why gloo carries their CUDA tensors is said
there): every collective of the helper reaches both ranks, and the factored step at ZeRO-1
and ZeRO-3 trains as the same global batch does on one rank: the loss each rank reports is
the mean over ranks, equal on both, and the gradient norm and loss follow the one-rank
reference step by step (a group that did not reduce gradients would drift from it)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.ranks import checkout_env

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("two_ranks.py")
STAGES = (1, 3)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket is held until all are bound."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The two ranks and the one-rank reference, started together; their JSON results."""
    out = tmp_path_factory.mktemp("two_ranks")
    stages = ",".join(map(str, STAGES)) if HAS_DEEPSPEED else ""
    jobs = {}
    pair_port, reference_port = _free_ports(2)
    for name, rank, world, port in (
        ("rank0", 0, 2, pair_port),
        ("rank1", 1, 2, pair_port),
        ("reference", 0, 1, reference_port),
    ):
        if name == "reference" and not stages:
            continue
        log = open(out / f"{name}.log", "w")
        command = [
            sys.executable,
            str(WORKER),
            str(rank),
            str(world),
            str(port),
            str(out / f"{name}.json"),
            "--stages",
            stages,
        ]
        jobs[name] = (
            subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=checkout_env()),
            log,
        )
    failed, deadline = [], time.monotonic() + 300
    for name, (process, log) in jobs.items():
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        if process.returncode != 0:
            failed.append(f"{name} exited {process.returncode}:\n{(out / f'{name}.log').read_text()[-4000:]}")
    assert not failed, "\n".join(failed)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in jobs}


def test_every_collective_reaches_both_ranks(runs):
    seen = [runs["rank0"]["collectives"], runs["rank1"]["collectives"]]
    for c in seen:
        assert c["small_tensor_device"] == "cpu", "flags go over the group's CPU backend"
        assert c["all_ranks_rank0"] is False and c["any_rank_rank0"] is True
        assert c["broadcast_flag_from_1"] is True and c["broadcast_object_from_1"] == {"rank": 1}
        assert c["all_gather_object"] == ["node-0", "node-1"]
        assert c["all_gather_float"] == [0.0, 1.0] and c["all_gather_floats"] == [[0.0, 0.0], [1.0, 10.0]]
        assert c["mean"] == 1.5 and c["mean_device"] == "cuda:0", "the loss is averaged where it is, on the GPU"
        assert c["sum"] == [3.0] * 4 and c["sum_device"] == "cuda:0"
        # Both ranks' buffers crossed the group: a bandwidth above zero, and below what a
        # copy through host memory could reach.
        assert 0 < c["allreduce_gb_per_s"] < 1000


@pytest.mark.parametrize("stage", STAGES)
def test_the_step_at_world_2_follows_the_one_rank_reference(runs, stage):
    if not HAS_DEEPSPEED:
        pytest.skip("needs deepspeed")
    key = f"zero{stage}"
    rank0, rank1, reference = runs["rank0"][key], runs["rank1"][key], runs["reference"][key]
    assert rank0["backend"] == "cpu:gloo,cuda:gloo"
    assert rank0["plan"] == [4, 1] and reference["plan"] == [4, 2], "one micro-batch per rank; the reference two"
    assert rank0["loss"] == rank1["loss"], "every rank reports the same loss"
    assert rank0["own_loss"] != rank1["own_loss"], "the ranks trained on different rows"
    for step, (mean, a, b) in enumerate(zip(rank0["loss"], rank0["own_loss"], rank1["own_loss"])):
        assert mean == pytest.approx((a + b) / 2, rel=1e-5), f"step {step + 1}: the loss is the mean over ranks"
    assert rank0["loss"][-1] < rank0["loss"][0] - 0.3, "the optimizer steps took effect"
    # bf16 forward and backward in micro-batches of the same rows either way; only the sum
    # of the two micro-batches' gradients differs (a reduction across ranks, or accumulation).
    assert rank0["loss"] == pytest.approx(reference["loss"], rel=2e-2)
    # Step 1's norm here is ~1.05; a rank left with its own rows' gradients would see ~1.45,
    # a sum over ranks instead of the mean ~2.1 (measured on the CPU).
    assert rank0["grad_norm"] == pytest.approx(reference["grad_norm"], rel=5e-2)
    assert rank0["grad_norm"] == rank1["grad_norm"]
    assert rank0["weights_abs_sum"] == rank1["weights_abs_sum"], "the ranks hold the same weights"
    assert rank0["weights_abs_sum"] == pytest.approx(reference["weights_abs_sum"], rel=1e-3)
