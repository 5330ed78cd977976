"""The save process's room in /dev/shm: the estimate of each rank's host copies, the choice
between the process and the thread mode, and how a worker says it chose the thread."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tests.helpers.models import engine_settings
from tests.helpers.ranks import spawned_pair
from wildtrain.checkpoint.shm import capture_bytes, choose_mode, shm_free, shm_needed
from wildtrain.config import load_config
from wildtrain.events import ShmTooSmall, from_dict
from wildtrain.model import param_count
from wildtrain.train.checkpointing import save_mode


def _engine(cfg) -> tuple:
    """What `save_mode` reads of `cfg`: the engine's settings, checkpoint.background, cluster.use_gpu."""
    return engine_settings(cfg), cfg.checkpoint.background, bool(cfg.cluster.use_gpu)


GiB = 2**30


def test_enough_room_keeps_the_process():
    mode = choose_mode("process", free=10 * GiB, needed=10 * GiB)
    assert (mode.mode, mode.reason) == ("process", "")


def test_too_little_room_saves_in_a_thread_and_says_why_and_how_to_fix_it():
    mode = choose_mode("process", free=64 * 2**20, needed=600 * GiB)
    assert mode.mode == "thread"
    assert "644,245,094,400 bytes" in mode.reason and "67,108,864 bytes" in mode.reason
    assert "/dev/shm" in mode.reason and "emptyDir with medium: Memory" in mode.reason
    assert (mode.free, mode.needed) == (64 * 2**20, 600 * GiB)


def test_a_thread_asked_for_or_no_shm_to_measure_is_taken_as_it_is():
    assert choose_mode("thread", free=0, needed=GiB).mode == "thread"
    assert choose_mode("thread", free=0, needed=GiB).reason == ""
    assert choose_mode("process", free=None, needed=GiB).mode == "process"


def test_free_bytes_are_read_from_the_filesystem(tmp_path):
    stats = os.statvfs(tmp_path)
    assert shm_free(str(tmp_path)) == pytest.approx(stats.f_bavail * stats.f_frsize, rel=0.01)
    assert shm_free(str(tmp_path / "missing")) is None


def test_a_node_needs_two_copies_of_every_rank_on_it():
    # The 21b preset under ZeRO-3 at its smallest size, one pod of 8 GPUs: the pod holds
    # the whole optimizer state, 12 bytes a parameter, twice, plus the margin.
    n = param_count(load_config(["model=21b"]).model)
    per_rank = [capture_bytes(n, 2, 3, 8, r) for r in range(8)]
    assert per_rank == [12 * n // 8] * 8
    assert shm_needed(per_rank) == pytest.approx(2 * 12 * n * 1.1, rel=1e-6)
    # ZeRO-1: rank 0 also holds the module's bf16 weights.
    assert capture_bytes(n, 2, 1, 8, 0) - capture_bytes(n, 2, 1, 8, 1) == 2 * n


def test_a_worker_with_a_small_shm_saves_in_a_thread_and_tells_the_controller(capsys):
    cfg = load_config(["model=125m"])
    assert cfg.checkpoint.background == "process"

    mode, events = save_mode(*_engine(cfg), rank=0, world_size=1, nodes=["node-a"], shm_free=lambda: 64 * 2**20)

    assert mode == "thread"
    [event] = events
    assert isinstance(event, ShmTooSmall) and from_dict(event.to_dict()) == event
    assert (event.node, event.ranks, event.free) == ("node-a", [0], 64 * 2**20)
    assert event.needed == shm_needed([capture_bytes(param_count(cfg.model), 4, 1, 1, 0)])
    assert event.needed > event.free
    assert "node node-a" in event.summary() and "emptyDir" in event.summary()
    assert "rank 0 on node node-a: checkpoint.background=process needs" in capsys.readouterr().out


def _choose(rank: int, results) -> None:
    free = 64 * 2**20 if rank == 1 else 64 * GiB  # node-b's /dev/shm is small
    results.put(
        (rank, save_mode(*_engine(load_config(["model=125m"])), rank, 2, ["node-a", "node-b"], shm_free=lambda: free))
    )


def test_every_rank_tells_the_controller_of_a_small_shm_on_any_node():
    """The controller logs rank 0's reports; where rank 0's node takes one before the
    controller collected it, rank 1's stands in, and must carry the same events."""
    with spawned_pair(_choose) as results:
        chosen = dict(results.get(timeout=60) for _ in range(2))
    (mode_0, events_0), (mode_1, events_1) = chosen[0], chosen[1]
    assert (mode_0, mode_1) == ("process", "thread")
    [event] = events_0
    assert (event.node, event.ranks, event.free) == ("node-b", [1], 64 * 2**20)
    assert [dataclasses.replace(e, at=0) for e in events_1] == [dataclasses.replace(event, at=0)]


def test_a_worker_with_room_keeps_the_process_quietly(capsys):
    cfg = load_config(["model=125m"])
    assert save_mode(*_engine(cfg), 0, 1, ["node-a"], shm_free=lambda: 64 * GiB) == ("process", [])
    assert save_mode(*_engine(cfg), 0, 1, ["node-a"], shm_free=lambda: None) == ("process", [])
    cfg.checkpoint.background = "thread"
    assert save_mode(*_engine(cfg), 0, 1, ["node-a"], shm_free=lambda: 0) == ("thread", [])
    assert capsys.readouterr().out == ""


def test_the_estimate_is_what_a_real_capture_copies(tmp_path):
    """ZeRO-1 and ZeRO-3 at 2 ranks on CPU (fp32, gloo; about 20 s here): the bytes each
    rank's capture copies to host buffers, against `capture_bytes` (exact but for
    DeepSpeed's step counters). A DeepSpeed that lays its files out otherwise fails it."""
    script = textwrap.dedent("""
        import os, sys, tempfile
        from pathlib import Path
        import torch.multiprocessing as mp
        from tests.integration.test_resharding import _config, _engine, _init_process, _train

        def run(rank, port, out):
            _init_process(rank, 2, port)
            from wildtrain import checkpoint
            from wildtrain.checkpoint.host_copy import CapturingWriter, HostBuffers, to_host
            from wildtrain.checkpoint.shm import capture_bytes
            from wildtrain.model import param_count
            for stage in (1, 3):
                cfg = _config(stage)
                engine, plan = _engine(cfg, 2)
                _train(engine, plan, rank, range(1))  # the optimizer's state exists after a step
                taken = {}
                buffers = HostBuffers(pin=False)
                engine.checkpoint_engine = CapturingWriter(
                    engine.checkpoint_engine, lambda path, state: to_host(state, path, buffers, taken, {}))
                checkpoint.save(engine, tempfile.mkdtemp(), "t", "{}", rank)
                copied = sum(t.numel() * t.element_size() for t in taken.values())
                estimate = capture_bytes(param_count(cfg.model), 4, stage, 2, rank)
                Path(out, f"stage{stage}-rank{rank}").write_text(f"{copied} {estimate}")
            # torch's teardown of the gloo groups at exit aborts a rank now and then
            # ("terminate called without an active exception"): what counts is written.
            os._exit(0)

        if __name__ == "__main__":
            mp.spawn(run, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
    """)
    (tmp_path / "capture.py").write_text(script)
    out = tmp_path / "out"
    out.mkdir()
    from wildtrain import services

    env = os.environ | {"PYTHONPATH": f"{REPO}:{REPO / 'platform'}"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "capture.py"), str(services.free_port()), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = {f.name: [int(n) for n in f.read_text().split()] for f in out.iterdir()}
    assert sorted(results) == ["stage1-rank0", "stage1-rank1", "stage3-rank0", "stage3-rank1"]
    for name, (copied, estimate) in results.items():
        assert 0 <= copied - estimate <= 64, f"{name}: {copied} bytes copied, {estimate} estimated"
