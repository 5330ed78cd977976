"""Downstream evaluations of a run's committed checkpoints with EleutherAI's
lm-evaluation-harness: `harness` is what wildtrain asks of lm-eval, `remote` an evaluation
as a Ray task on resources of its own, which the controller's `EvalEvery`
(elastic/controller.py) submits beside training and `on_demand` for `wildtrain eval`.
None imports lm-eval or Transformers when imported itself."""
