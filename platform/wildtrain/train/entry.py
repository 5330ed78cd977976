"""What the driver hands Ray Train: the function every worker runs (its inputs:
`wildtrain.worker_inputs`), and the function of a joiner (`elastic.joiners`). The driver
and the controller pickle them by reference, so they import this module and not
train/loop.py, whose imports (the engine, the model, torch._dynamo: 1.3 s of the driver's
start here) only a worker needs."""

from __future__ import annotations

import time
from concurrent.futures import Future

import ray

from wildtrain import storage
from wildtrain.config import Config
from wildtrain.elastic.signals import RunCannotContinue
from wildtrain.worker_inputs import LoopInputs


def worker_main(inputs: LoopInputs) -> None:
    """Every worker's training function: `train.loop.train_loop`, imported where it runs."""
    check_storage(inputs.storage_view, inputs.cfg)  # before it reads
    from wildtrain.train.loop import train_loop

    train_loop(inputs)


def joiner_main(inputs: LoopInputs, token: str, name: str, group_size: int) -> None:
    """A joiner's function: `train.loop.join_in_process`, imported where it runs. Its first read
    through Ray Data begins before that import, not after it: the read mostly waits for Ray to
    start its read tasks' processes (2-3 s here), which import beside the loop's imports (torch,
    Ray Train, the model's torch._dynamo: 3-4 s of a core), and a joiner is ready to join once
    both are done."""
    called_at = time.time()
    check_storage(inputs.storage_view, inputs.cfg)  # before it reads
    first_read = begin_first_read(inputs)
    from wildtrain.train.loop import join_in_process

    join_in_process(inputs, token, name, group_size, first_read, called_at)


def begin_first_read(inputs: LoopInputs) -> Future:
    """A process's first read through Ray Data (`data.stream.warm_up`), begun in a thread of its
    own: the future of its end."""
    # Ray Train's trainer module first, on this thread (0.3 s, no torch): it imports the 61
    # modules of Ray Data's executor that the read's thread imports too, and two threads that
    # import the same modules at once can fail on a circular import between them. Past it,
    # the read's thread and the loop's imports import none of the same modules here.
    import ray.train.v2.api.data_parallel_trainer  # noqa: F401

    from wildtrain.data import stream

    return stream.warm_up_ahead(inputs.data.datasets, inputs.cfg.data, inputs.cfg.train, inputs.cfg.storage)


def check_storage(drivers: storage.StorageView, cfg: Config) -> None:
    """Stop the run, naming what differs, unless this worker's s3:// URIs go where the
    driver's went. The driver's settings reach it in its runtime env; a worker that still
    resolves them otherwise (something on its node overrides them) would read and write
    another store, or none."""
    differs = storage.StorageView.here(cfg.storage).differences(drivers)
    if differs:
        raise RunCannotContinue(
            f"storage: a worker on {ray.util.get_node_ip_address()} resolves s3:// unlike "
            f"the driver: {'; '.join(differs)}"
        )
