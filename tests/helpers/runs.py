"""A run's folder as the driver leaves it, for tests of what reads it (`wildtrain export`,
`sample`) without training: its record, and a small byte-level dataset it names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from tests.helpers.datasets import write_dataset
from wildtrain.checkpoint.store import commit, upload
from wildtrain.config import Config, ModelConfig, flatten, load_config, to_yaml
from wildtrain.data.pins import OrderPins
from wildtrain.data.tokenizer import ByteTokenizer
from wildtrain.layout import RunLayout, run_record


def make_run(
    data: Path,
    overrides: list[str],
    model: ModelConfig,
    *,
    record_model: bool = True,
    mlflow_run_id: Optional[str] = None,
    tokenizer: Optional[dict] = None,
) -> Config:
    """The record of the run the config of `overrides` names, trained on the dataset at
    `data` (written unless there); the run's config."""
    cfg = load_config(overrides)
    if not (data / "manifest.json").exists():
        write_dataset(data, [np.zeros((4, model.max_seq_len + 1), dtype=np.int32)], rows_per_group=4)
    sha = hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest()
    record = {
        "mlflow_run_id": mlflow_run_id,
        "config_hash": "test",
        "data_order": OrderPins(0, 4, model.max_seq_len, ((str(data), 1.0, sha),), ()).to_dict(),
    }
    if record_model:
        record |= run_record(model, tokenizer or ByteTokenizer().describe())
    path = Path(RunLayout.of(cfg.run, cfg.checkpoint).record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return cfg


def mlflow_run(cfg: Config, artifacts: Path) -> str:
    """The id of the MLflow run the driver opens for `cfg` (its config logged), with the
    experiment's artifacts in `artifacts`: not MLflow's default, ./mlruns of the checkout."""
    from mlflow.tracking import MlflowClient

    MlflowClient(cfg.tracking.uri).create_experiment(cfg.tracking.experiment, artifact_location=str(artifacts))
    return open_mlflow_run(cfg, None)[1]


def open_mlflow_run(cfg: Config, run_id: Optional[str]) -> tuple[str, str]:
    """`run_setup.open_run` as the driver calls it for `cfg`: (experiment id, run id)."""
    from wildtrain.tracking.run_setup import open_run

    return open_run(cfg.tracking, cfg.run, cfg.cluster.name, run_id, params=flatten(cfg), config_yaml=to_yaml(cfg))


def commit_checkpoint(cfg: Config, tmp_path: Path, step: int, committed: bool = True) -> None:
    """A checkpoint folder of `step` in the run's store, with a manifest unless not
    `committed`; its files are no checkpoint's (for tests that never read them)."""
    local = tmp_path / f"ckpt{step}"
    (local / f"step_{step}").mkdir(parents=True)
    (local / f"step_{step}" / "mp_rank_00_model_states.pt").write_bytes(b"not read by these tests")
    store, name = RunLayout.of(cfg.run, cfg.checkpoint).checkpoint_uris[0], f"step_{step:09d}-ab"
    files = upload(str(local), store, name)
    if committed:
        commit(
            store,
            name,
            step=step,
            tag=f"step_{step}",
            world_size=1,
            zero_stage=0,
            files=files,
            data_position={},
            config_hash="test",
        )
