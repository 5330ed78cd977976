"""The one place that reaches into Ray's private or developer-only APIs (Ray 2.60).

Each use here has no public equivalent; `tests/unit/test_ray_compat.py` imports every
symbol and checks the attributes used, so a Ray upgrade that moves them fails in
seconds rather than in the middle of a run.
"""

from __future__ import annotations

import logging

from ray.train.v2._internal.execution import context as _train_context


def reports_collected() -> bool:
    """On a worker: whether the controller has taken every report this worker handed to
    `ray.train.report`. Ray's result queue holds one report, and the controller empties it
    when it polls the worker (every couple of seconds), so a report is at the controller
    long before the next one is due when reports are rare."""
    context = _train_context.get_train_context()
    return context.current_report_index == context.report_call_index and context.get_result_queue().empty()


def quiet_report_log() -> None:
    """Ray Train logs every report's whole metrics dict at INFO, under a logger named by its
    file path, which RunConfig's LoggingConfig does not reach; our progress lines say it."""
    logging.getLogger(_train_context.__file__).setLevel(logging.WARNING)
