"""The save process's host buffers on CUDA: shared memory, page-locked in place, filled by an
asynchronous device copy and read by the child process as the capture left them."""

from __future__ import annotations

import pytest
import torch

from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
from wildtrain.checkpoint.host_copy import HostBuffers
from wildtrain.checkpoint.restore import restore

pytestmark = pytest.mark.gpu


def test_buffers_for_a_save_process_are_shared_and_pinned():
    buffers = HostBuffers(pin=True, share=True)
    host = buffers.take("w", torch.empty(1024, device="cuda"))
    assert host.is_shared() and host.is_pinned()
    buffers.give_back({"w": host})
    assert buffers.take("w", torch.empty(1024, device="cuda")) is host


def test_a_cuda_capture_reaches_the_store_through_the_save_process(tmp_path):
    weights = torch.randn(256, 256, device="cuda")
    captured = weights.cpu()  # (weights + 1) - 1 is not weights in floating point
    saver = AsyncSaver(
        [str(tmp_path / "store")], str(tmp_path / "staging"), rank=0, world_size=1, attempt="g2", device=weights.device
    )
    try:
        saver.save_state(CheckpointMeta(1, "step_1", 1, 0), {"state.pt": {"w": weights}})
        weights.add_(1.0)  # after the capture: the save holds the values it captured
        assert saver.flush(120)
        [outcome] = saver.drain()
        assert outcome.status == "saved", outcome.reason
    finally:
        saver.close(120)
    restored = restore([str(tmp_path / "store")], str(tmp_path / "local"), rank=0, world_size=1)
    assert torch.equal(torch.load(f"{restored.folder}/state.pt")["w"], captured)


def test_a_capture_copies_what_the_training_stream_wrote_not_what_was_there_before():
    # DeepSpeed builds some of what it saves during the save (flattened, converted
    # partitions): kernels on the training stream that the copy stream must wait for.
    # `_sleep` holds the training stream, so a copy that did not wait would read the zeros.
    from wildtrain.checkpoint.host_copy import to_host

    copy_stream = torch.cuda.Stream()
    built = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of the training stream
    built.fill_(1.0)
    taken: dict = {}
    host = to_host({"w": built}, "state", HostBuffers(pin=True), taken, copy_stream)
    copy_stream.synchronize()
    assert torch.equal(host["w"], torch.ones(1 << 20)), "the copy ran before the training stream wrote the tensor"
