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
import shutil
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils

from wildtrain import checkpoint


class HostBuffers:
    """Host tensors reused across saves, one spare per tensor position; with `share`, in
    shared memory, for a save process to read where they are. `reserve` allocates them
    ahead of the first save, in the background."""

    def __init__(self, pin: bool, share: bool = False) -> None:
        self._pin = pin
        self._share = share
        self._spare: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._reserving: Optional[threading.Thread] = None
        self.allocated = 0  # buffers allocated so far: reused ones are the point

    def emptied(self) -> HostBuffers:
        """Buffers like these, none allocated yet: for another layout of the state."""
        return HostBuffers(self._pin, self._share)

    def reserve(self, specs: Mapping[str, tuple[torch.Size, torch.dtype]]) -> None:
        """Allocate (and pin) a spare for each (key, shape, dtype) in a background thread:
        page-locking a rank's whole state takes seconds (about 18 GB for the 1.3b preset
        on one GPU) that the first save would otherwise stall training for. A `take`
        before it is done waits for the rest."""

        def allocate() -> None:
            for key, (shape, dtype) in specs.items():
                host = self._new(shape, dtype)
                with self._lock:
                    self._spare.setdefault(key, host)

        self._reserving = threading.Thread(target=allocate, name="wildtrain-host-buffers", daemon=True)
        self._reserving.start()

    def take(self, key: str, like: torch.Tensor) -> torch.Tensor:
        reserving = self._reserving
        if reserving is not None:
            reserving.join()
            self._reserving = None
        with self._lock:
            spare = self._spare.pop(key, None)
        if spare is not None and spare.shape == like.shape and spare.dtype == like.dtype:
            return spare
        return self._new(like.shape, like.dtype)

    def _new(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        self.allocated += 1
        if not self._share:
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self._pin)
        host = torch.empty(shape, dtype=dtype, device="cpu").share_memory_()
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


def map_tensors(obj: Any, key: str, fn: Callable[[str, torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    """`obj` with each tensor replaced by `fn(its key, it)`: `key` extended by the path of
    container keys and indices to it. A tensor referenced twice (tied weights) is mapped
    once. Containers keep their type (and a state dict its `_metadata`); anything else is
    deep-copied."""
    if torch.is_tensor(obj):
        if id(obj) not in memo:
            memo[id(obj)] = fn(key, obj)
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = map_tensors(v, f"{key}/{k}", fn, memo)
        return out
    if isinstance(obj, list):
        return [map_tensors(v, f"{key}/{i}", fn, memo) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [map_tensors(v, f"{key}/{i}", fn, memo) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def to_host(
    obj: Any,
    key: str,
    buffers: HostBuffers,
    taken: dict[str, torch.Tensor],
    stream: Optional["torch.cuda.Stream"] = None,
) -> Any:
    """A copy of `obj` whose tensors live in host buffers taken from `buffers` (and recorded
    in `taken` by key, to be given back), so training may change the originals at once."""

    def copy_to_host(key: str, tensor: torch.Tensor) -> torch.Tensor:
        host = buffers.take(key, tensor)
        if stream is not None and tensor.is_cuda:
            # DeepSpeed builds some of what it saves on the fly (flattened or converted
            # partitions): kernels queued on the training stream, which the copy must
            # follow; and the allocator must not hand such a temporary's memory to the
            # training stream while this copy still reads it.
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            tensor.record_stream(stream)
            with torch.cuda.stream(stream):
                host.copy_(tensor.detach(), non_blocking=True)
        else:
            host.copy_(tensor.detach())
        taken[key] = host
        return host

    return map_tensors(obj, key, copy_to_host, {})


def tensor_specs(obj: Any, key: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The key, shape and dtype of each tensor `to_host` would copy out of `obj`."""
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def note(key: str, tensor: torch.Tensor) -> None:
        specs[key] = (tensor.shape, tensor.dtype)

    map_tensors(obj, key, note, {})
    return specs


def buffer_key(folder: Path, tag: str, path: str) -> str:
    """Buffers are matched by position in the file, not by the tag folder, which changes every save."""
    return Path(path).relative_to(folder).as_posix().removeprefix(f"{tag}/")


def reserve(buffers: HostBuffers, engine, scratch: Path, rank: int) -> None:
    """Have `buffers` allocate, in the background, a spare for each tensor of this rank's
    part of `engine`'s checkpoints (a collective, as a save is: every rank calls it). What
    the checkpoint holds is learned from a capture that copies nothing: DeepSpeed's
    `save_checkpoint` into the `scratch` folder, its tensors noted."""
    tag = "reserve"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def note(path: str, state: Any) -> None:
        if not isinstance(state, bytes):
            specs.update(tensor_specs(state, buffer_key(scratch, tag, path)))

    original = engine.checkpoint_engine
    engine.checkpoint_engine = CapturingWriter(original, note)
    try:
        checkpoint.save(engine, str(scratch), tag, "{}", rank)
    finally:
        engine.checkpoint_engine = original
        shutil.rmtree(scratch, ignore_errors=True)
    buffers.reserve(specs)
