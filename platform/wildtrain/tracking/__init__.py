"""What a run records, split by the process it runs in (docs/architecture.md):

- `worker/`: the maths the training workers do on their own measurements (MFU, stragglers);
  no MLflow here, workers never call it.
- `controller/`: recording the run while it trains: the Ray Train controller's callbacks
  (`mlflow_run`, `progress`), the elastic timeline, the buffered `Tracker` the driver also
  uses to close the run.
- `reports/`: read-only analysis of what MLflow holds, for the CLI (`wildtrain report`,
  `wildtrain check`) and the end of a run: goodput, plots, report cards.

Beside them, what every side shares: `mlflow_client` (the one module that calls MLflow's
client), `record` (the keys and events' artifacts writers and readers agree on) and
`run_setup` (the driver opening a run's MLflow run).
"""
