"""The capture half of an asynchronous save: copies of a checkpoint's tensors in host memory.

On CUDA each copy runs on a stream of its own into pinned memory, so the wait is for the
copies alone; the host buffers are reused from one save to the next, because a fresh
multi-GB allocation costs page faults (or a slow cudaHostAlloc) that a reused one does not.
`CapturingWriter` stands in for DeepSpeed's checkpoint writer so that its `save_checkpoint`
hands over state dicts instead of serializing them.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from typing import Any, Callable, Mapping, Optional

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils


class HostBuffers:
    """Host tensors reused across saves, one spare per tensor position; with `share`, in
    shared memory, for a save process to read where they are."""

    def __init__(self, pin: bool, share: bool = False) -> None:
        self._pin = pin
        self._share = share
        self._spare: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, key: str, like: torch.Tensor) -> torch.Tensor:
        with self._lock:
            spare = self._spare.pop(key, None)
        if spare is not None and spare.shape == like.shape and spare.dtype == like.dtype:
            return spare
        if not self._share:
            return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pin)
        host = torch.empty(like.shape, dtype=like.dtype, device="cpu").share_memory_()
        if self._pin and host.numel():
            # As torch.distributed.checkpoint's staging does: CUDA cannot allocate pinned memory
            # that another process can map, so the shared memory is page-locked in place.
            pin_memory_utils.pin_memory(host.data_ptr(), host.untyped_storage().nbytes())
            weakref.finalize(host, pin_memory_utils.unpin_memory, host.data_ptr())
        return host

    def give_back(self, buffers: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self._spare.update(buffers)


class CapturingWriter:
    """Stands in for a DeepSpeed engine's checkpoint engine during one `save_checkpoint`:
    keeps host copies of what DeepSpeed would serialize, and delegates everything else."""

    def __init__(self, inner, capture: Callable[[str, Any], None]) -> None:
        self._inner = inner
        self._capture = capture

    def save(self, state_dict, path: str) -> None:
        self._capture(path, state_dict)

    def preserves_storage_sharing(self) -> bool:
        return False  # the host copies are compact already; DeepSpeed's clone would be one more copy

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@contextlib.contextmanager
def copying(stream: Optional["torch.cuda.Stream"]):
    """Capture inside: each tensor's copy queues on `stream` (`to_host`), and leaving waits
    for them, so training may change the originals afterwards. Only the copies go there:
    DeepSpeed's own work during a save stays on its streams. None: copies on the CPU, which
    are done when `to_host` returns."""
    if stream is None:
        yield
        return
    # The state as of now: DeepSpeed updates parameters on side streams too, so ordering
    # after the current stream alone could copy a half-applied optimizer step.
    torch.cuda.synchronize()
    yield
    stream.synchronize()


def to_host(obj: Any, key: str, buffers: HostBuffers, taken: dict[str, torch.Tensor], memo: dict[int, Any],
            stream: Optional["torch.cuda.Stream"] = None) -> Any:
    """A copy of `obj` whose tensors live in host buffers taken from `buffers` (and recorded
    in `taken` by key, to be given back), so training may change the originals at once.
    Containers keep their type (and a state dict its `_metadata`)."""
    if torch.is_tensor(obj):
        if id(obj) not in memo:  # a tensor referenced twice (tied weights) is copied once
            host = buffers.take(key, obj)
            if stream is not None and obj.is_cuda:
                # The allocator must not hand a temporary's memory (DeepSpeed builds some state
                # dicts on the fly) to the training stream while this copy still reads it.
                obj.record_stream(stream)
                with torch.cuda.stream(stream):
                    host.copy_(obj.detach(), non_blocking=True)
            else:
                host.copy_(obj.detach())
            taken[key] = host
            memo[id(obj)] = host
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = to_host(v, f"{key}/{k}", buffers, taken, memo, stream)
        return out
    if isinstance(obj, list):
        return [to_host(v, f"{key}/{i}", buffers, taken, memo, stream) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [to_host(v, f"{key}/{i}", buffers, taken, memo, stream) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)
