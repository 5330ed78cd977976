"""Ray's private symbols that wildtrain relies on still exist with the attributes it reads."""

import dataclasses

from ray.train.v2._internal.execution import context as train_context

from wildtrain import ray_compat


def test_the_train_context_still_exposes_the_report_queue_and_indexes():
    fields = {f.name for f in dataclasses.fields(train_context.TrainContext)}
    assert {"current_report_index", "report_call_index"} <= fields
    assert callable(train_context.TrainContext.get_result_queue)
    assert callable(train_context.get_train_context)
    assert train_context.__file__.endswith("context.py")


def test_the_compat_functions_are_importable():
    assert callable(ray_compat.reports_collected) and callable(ray_compat.quiet_report_log)
