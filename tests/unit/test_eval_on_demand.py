"""`wildtrain eval RUN` without `--step`: the step it announces is the step its task evaluates,
however many checkpoints commit in between."""

from __future__ import annotations

import types

import pytest

import wildtrain.services
from wildtrain.evals import on_demand


class Submitted(Exception):
    pass


def test_eval_without_a_step_submits_the_step_it_announces(monkeypatch):
    said, submitted = [], []
    monkeypatch.setattr(on_demand, "run_info", lambda cfg: types.SimpleNamespace(mlflow_run_id="r"))
    monkeypatch.setattr(on_demand, "committed_step", lambda info, step: 40 if step is None else step)
    monkeypatch.setattr(on_demand, "plan_evaluation", lambda *_: types.SimpleNamespace(tasks=("hellaswag",)))
    monkeypatch.setattr(on_demand, "check_reachable", lambda uri: None)
    monkeypatch.setattr(wildtrain.services, "connect_ray", lambda address: None)

    def submit(info, step, plan):
        submitted.append(step)
        raise Submitted

    monkeypatch.setattr(on_demand, "submit", submit)
    cfg = types.SimpleNamespace(
        run=types.SimpleNamespace(name="tiny"),
        eval=types.SimpleNamespace(tasks=("hellaswag",)),
        tracking=types.SimpleNamespace(uri="http://mlflow"),
        cluster=types.SimpleNamespace(ray_address=None),
    )
    with pytest.raises(Submitted):
        on_demand.evaluate_checkpoint(cfg, None, None, said.append)
    assert said == ["evaluating tiny step 40 on hellaswag"]
    assert submitted == [40]  # not None: the task must not pick whatever is newest when it runs
