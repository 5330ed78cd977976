"""Read-only reports over what MLflow recorded, for the CLI and the end of a run."""
