"""`wildtrain export`: a committed checkpoint of a run in Hugging Face Transformers' format
(config.json, model.safetensors, sharded when large, and the tokenizer), in a local folder or
an object store, optionally registered in MLflow's model registry.

A run is found by its name, as `wildtrain train` and `move` find it: the config assembled
from conf/ and the command line's overrides with `run.name=RUN` says where its folder and
checkpoint stores are (`layout.RunLayout`). What the run trained is read from its record
(`<run.storage>/<run.name>/wildtrain_run.json`, written by the driver at every submission),
never from that config, which could differ (a forgotten `experiment=`, a muP multiplier):
its model section, the tokenizer of its data, and the dataset it came from. A record from
before the model was recorded falls back to the model of the config logged to its MLflow run.

The weights are the fp32 master weights. A checkpoint of ZeRO stage 0 (fp32, CPU) holds
them whole in its model states; one of stage 1-3 partitions them per rank, and is read
through DeepSpeed's universal format (one fp32 file per parameter): the weights of a
committed universal copy in the store when there is one (`checkpoint.reshard`, made ahead
of a resize), else the checkpoint converted here. Not DeepSpeed's `zero_to_fp32`: it reads
ZeRO optimizers' files only, and in bf16 at stage 1 (the GPU default) DeepSpeed runs its
BF16_Optimizer, whose files it refuses ("is not a zero checkpoint", DeepSpeed 0.19.8).

Transformers is imported only here and in what calls it: never on a training worker's path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import torch

from wildtrain import storage
from wildtrain.checkpoint import reshard, universal
from wildtrain.checkpoint.format import CheckpointManifest
from wildtrain.checkpoint.restore import Candidate, NoGoodCheckpoint, Restored, Skipped, list_candidates, restore
from wildtrain.checkpoint.store import CommitError, Store, upload
from wildtrain.config import Config, ModelConfig, load_config
from wildtrain.data.manifest import MANIFEST, DataError, Manifest
from wildtrain.data.tokenizer import Tokenizer, dataset_tokenizer, hf_files
from wildtrain.layout import RunLayout, checkpoint_stores
from wildtrain.model import Transformer
from wildtrain.model.hf import hf_architecture, hf_state_dict

PROVENANCE = "wildtrain_export.json"  # beside the model: which run, step and checkpoint it is
# Transformers' own default shard size is larger; 5 GB is what the Hub's tools write.
MAX_SHARD_SIZE = "5GB"


class ExportError(RuntimeError):
    """A run, checkpoint or output that cannot be exported; one line naming it."""


@dataclass(frozen=True)
class RunInfo:
    name: str
    cfg: Config  # where the run is: run.storage, checkpoint.*, storage.*, tracking.* (the caller's overrides)
    model: ModelConfig  # what it trained (its record)
    tokenizer: Optional[dict]  # its data's tokenizer as the dataset manifest describes it; None: not recorded
    dataset: str  # the root of its first dataset, whose tokenizer is the run's
    mlflow_run_id: Optional[str]


def open_run(name: str, overrides: Sequence[str] = ()) -> RunInfo:
    """The run `name` where the config of `overrides` puts it (see the module docstring)."""
    return run_info(load_config([*overrides, f"run.name={name}"]))


def run_info(cfg: Config) -> RunInfo:
    """The run `cfg` names (run.name), where it puts it: what it trained, from its record."""
    name = cfg.run.name
    layout = RunLayout.of(cfg.run, cfg.checkpoint)
    text = storage.read_text(layout.record, cfg.storage)
    if text is None:
        raise ExportError(
            f"no run {name!r} at {layout.root} (no {layout.record}); give the overrides it was "
            "trained with (experiment=..., run.storage=...)"
        )
    record = json.loads(text)
    if "data_order" not in record:
        raise ExportError(f"{layout.record}: no data_order: the run's dataset (and so its tokenizer) is unknown")
    if "model" in record:
        model = _model_config(record["model"], layout.record)
    else:
        model = _logged_model(cfg.tracking.uri, record["mlflow_run_id"], layout.record)
    return RunInfo(
        name, cfg, model, record.get("tokenizer"), record["data_order"]["datasets"][0][0], record.get("mlflow_run_id")
    )


def _model_config(raw: dict, where: str) -> ModelConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    except OmegaConfBaseException as e:
        raise ExportError(f"{where}: model: {str(e).splitlines()[0]}") from None


def _logged_model(uri: str, run_id: str, record: str) -> ModelConfig:
    """The model section of the config.yaml that the run's MLflow run was created with."""
    from omegaconf import OmegaConf

    from wildtrain.tracking.mlflow_client import Client, Refused, check_reachable

    check_reachable(uri)
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = Client(uri).download(run_id, "config.yaml", folder)
        except Refused as e:
            raise ExportError(
                f"{record} records no model, and MLflow run {run_id} at {uri} has no config.yaml: "
                f"{str(e).splitlines()[0]}"
            ) from None
        raw = OmegaConf.to_container(OmegaConf.load(path))
    return _model_config(raw["model"], f"MLflow run {run_id}, config.yaml")


def run_tokenizer(run: RunInfo) -> Tokenizer:
    """The tokenizer the run's data was tokenized with, read from its dataset; checked
    against the record, so a dataset prepared again with another tokenizer is refused."""
    where = storage.join(run.dataset, MANIFEST)
    text = storage.read_text(where, run.cfg.storage)
    if text is None:
        raise ExportError(f"{where}: missing; the tokenizer of run {run.name!r} is its dataset's")
    described = Manifest.from_json(text, where).tokenizer
    if run.tokenizer is not None and described != run.tokenizer:
        changed = [
            f"{key} {_short(run.tokenizer.get(key))} -> {_short(described.get(key))}"
            for key in sorted(described.keys() | run.tokenizer.keys())
            if described.get(key) != run.tokenizer.get(key)
        ]
        raise ExportError(f"{where}: its tokenizer is not the one run {run.name!r} trained with: {'; '.join(changed)}")
    try:
        return dataset_tokenizer(run.dataset, described, run.cfg.storage)
    except DataError as e:
        raise ExportError(str(e)) from None


def _short(value) -> str:
    return f"{len(value)} entries" if isinstance(value, (list, dict)) else repr(value)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint's weights, fp32 on the CPU, under wildtrain's parameter names."""

    step: int
    where: str  # <store>/<name>
    manifest: CheckpointManifest
    weights: dict[str, torch.Tensor]
    skipped: tuple[Skipped, ...]  # newer checkpoints passed over: their files did not verify
    bytes_read: int


def read_checkpoint(run: RunInfo, step: Optional[int] = None) -> Checkpoint:
    """The newest committed checkpoint of the run whose files verify (at `step`, if given),
    downloaded into checkpoint.staging_dir and read (see the module docstring)."""
    stores = checkpoint_stores(RunLayout.of(run.cfg.run, run.cfg.checkpoint), run.cfg.storage)
    Path(run.cfg.checkpoint.staging_dir).mkdir(parents=True, exist_ok=True)
    local = tempfile.mkdtemp(prefix=f"export-{run.name}-", dir=run.cfg.checkpoint.staging_dir)
    try:
        try:
            with storage.errors(stores[0].uri, run.cfg.storage):
                # world_size 0, a size no checkpoint was saved at: every file is read (of a
                # ZeRO checkpoint, through `_universal_weights`), not one rank's part.
                restored = restore(
                    stores,
                    local,
                    rank=0,
                    world_size=0,
                    universal_copy=_universal_weights,
                    listing=lambda list_them: [c for c in list_them() if step in (None, c.step)],
                )
        except NoGoodCheckpoint as e:
            raise ExportError(f"run {run.name!r}: {e}") from None
        if restored is None:
            raise ExportError(_nothing_committed(run, stores, step))
        where = storage.join(restored.candidate.store, restored.candidate.name)
        try:
            weights = _fp32_weights(restored, parameter_shapes(run.model))
        except ValueError as e:
            raise ExportError(f"{where}: does not fit model {run.model.name!r}: {e}") from None
        return Checkpoint(
            restored.manifest.step, where, restored.manifest, weights, restored.skipped, restored.bytes_read
        )
    finally:
        shutil.rmtree(local, ignore_errors=True)


def committed_step(run: RunInfo, step: Optional[int] = None) -> int:
    """The step of the run's newest committed checkpoint (or `step`, if one is committed
    there), from the stores' listing: for a check before the work, which `read_checkpoint`
    (verifying the files) does."""
    stores = checkpoint_stores(RunLayout.of(run.cfg.run, run.cfg.checkpoint), run.cfg.storage)
    with storage.errors(stores[0].uri, run.cfg.storage):
        steps = [c.step for c in list_candidates(stores) if c.manifest is not None and step in (None, c.step)]
    if not steps:
        raise ExportError(_nothing_committed(run, stores, step))
    return max(steps)


def _nothing_committed(run: RunInfo, stores: list[Store], step: Optional[int]) -> str:
    where = ", ".join(s.uri for s in stores)
    if step is None:
        return f"run {run.name!r} has no committed checkpoint in {where}"
    steps = sorted({c.step for c in list_candidates(stores) if c.manifest is not None})
    return (
        f"run {run.name!r} has no committed checkpoint at step {step} in {where} "
        f"(committed: {', '.join(map(str, steps)) or 'none'})"
    )


def _universal_weights(store: Store, candidate: Candidate) -> tuple[str, CheckpointManifest]:
    """What `restore` downloads of a ZeRO checkpoint: the fp32 weights of its committed
    universal copy, or else the whole checkpoint, to be converted here."""
    found = reshard.find_universal(store, candidate.name)
    if found is None:
        return candidate.name, candidate.manifest
    name, copy = found
    return name, replace(copy, files=tuple(f for f in copy.files if f.path.endswith("/fp32.pt")))


def _fp32_weights(restored: Restored, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    folder, tag = Path(restored.folder), restored.manifest.tag
    if restored.manifest.zero_stage == 0:
        # Unpartitioned: the model states hold the fp32 weights (DeepSpeed refuses bf16
        # with fp32 gradient accumulation, how wildtrain trains on GPU, at stage 0).
        # DeepSpeed's own objects are pickled in it; its sha256 was checked against the manifest.
        states = torch.load(folder / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        saved = states["module"]
    else:
        params = folder / universal.universal_tag(tag) / "zero"
        if not params.is_dir():
            universal.convert(str(folder), tag, in_process=True)
        saved = {}
        for path in sorted(p for p in params.iterdir() if p.is_dir()):
            fp32 = torch.load(path / "fp32.pt", map_location="cpu", weights_only=True)
            saved[path.name] = fp32["param"] if isinstance(fp32, dict) else fp32  # ZeRO-3's: the tensor alone
    return {name: _shaped(name, tensor.float(), shapes.get(name)) for name, tensor in saved.items()}


def _shaped(name: str, tensor: torch.Tensor, shape: Optional[torch.Size]) -> torch.Tensor:
    if shape is None:
        return tensor  # not the model's: `hf_state_dict` names it
    if tensor.dim() == 1 and tensor.numel() == shape.numel():
        tensor = tensor.view(shape)  # ZeRO-3's universal files hold each parameter flat
    if tensor.shape != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the model's {tuple(shape)}")
    return tensor


def parameter_shapes(model: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):  # shapes only: nothing allocated, nothing drawn
        return {name: param.shape for name, param in Transformer(model).named_parameters()}


@dataclass(frozen=True)
class Exported:
    location: str  # where the files were written: a local folder, or an object-store URI
    architecture: str  # Transformers' model class
    step: int
    checkpoint: str  # <store>/<name> it was read from
    skipped: tuple[Skipped, ...]
    bytes_read: int
    version: Optional[str] = None  # of the registered model, with `register`


def write_hf(
    folder: Path,
    model: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    provenance: dict,
    max_shard_size: str = MAX_SHARD_SIZE,
) -> str:
    """Write `weights` (a `Transformer(model)`'s, fp32) as a Transformers model with
    `tokenizer` into the existing `folder`; the architecture's name."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig

    architecture = hf_architecture(model, tokenizer.eos_id)
    AutoConfig.for_model(architecture.model_type, **architecture.config).save_pretrained(folder)
    save_torch_state_dict(hf_state_dict(model, weights), folder, max_shard_size=max_shard_size)
    for name, text in hf_files(tokenizer, model.max_seq_len).items():
        (folder / name).write_text(text)
    (folder / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    return architecture.name


def export_checkpoint(
    run: RunInfo, folder: str, step: Optional[int] = None, max_shard_size: str = MAX_SHARD_SIZE
) -> Exported:
    """Export the run's newest committed checkpoint (or that of `step`) into the local
    `folder`, which must not exist or be empty; it appears complete or not at all."""
    target = Path(folder).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"{target}: exists and is not an empty folder")
    tokenizer = run_tokenizer(run)
    hf_architecture(run.model, tokenizer.eos_id)  # refused before anything is downloaded
    checkpoint = read_checkpoint(run, step)
    provenance = {
        "run": run.name,
        "step": checkpoint.step,
        "checkpoint": checkpoint.where,
        "mlflow_run_id": run.mlflow_run_id,
        "zero_stage": checkpoint.manifest.zero_stage,
        "world_size": checkpoint.manifest.world_size,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        try:
            architecture = write_hf(partial, run.model, checkpoint.weights, tokenizer, provenance, max_shard_size)
        except ValueError as e:  # the weights do not fit the recorded model
            raise ExportError(f"{checkpoint.where}: {e}") from None
        os.rename(partial, target)  # replaces an empty folder
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Exported(
        str(target), architecture, checkpoint.step, checkpoint.where, checkpoint.skipped, checkpoint.bytes_read
    )


def export(run: RunInfo, out: str, step: Optional[int] = None, register_as: Optional[str] = None) -> Exported:
    """`wildtrain export`: into the local folder or object-store URI `out`, and with
    `register_as`, registered as a new version of that model in MLflow."""
    if register_as is not None:
        from wildtrain.tracking.mlflow_client import check_reachable

        check_reachable(run.cfg.tracking.uri)  # before the export's work, not after
    if "://" not in out:
        exported = export_checkpoint(run, out, step)
    else:
        exported = _export_to_store(run, out, step)
    if register_as is not None:
        exported = replace(exported, version=register(run, exported, register_as))
    return exported


def _export_to_store(run: RunInfo, uri: str, step: Optional[int]) -> Exported:
    parent, _, name = uri.rstrip("/").rpartition("/")
    if "://" not in parent:
        raise ExportError(f"--out {uri}: give a folder below the bucket, e.g. {uri.rstrip('/')}/{run.name}")
    if storage.list_files(uri, run.cfg.storage)[1]:
        raise ExportError(f"--out {uri}: not empty")
    Path(run.cfg.checkpoint.staging_dir).mkdir(parents=True, exist_ok=True)
    local = tempfile.mkdtemp(prefix=f"export-{run.name}-", dir=run.cfg.checkpoint.staging_dir)
    try:
        exported = export_checkpoint(run, str(Path(local, name)), step)
        with storage.errors(uri, run.cfg.storage):
            upload(exported.location, Store.from_uri(parent, run.cfg.storage), name)
    except CommitError as e:  # an upload that does not read back as written
        raise ExportError(str(e)) from None
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return replace(exported, location=uri)


def register(run: RunInfo, exported: Exported, name: str) -> str:
    """A new version of the registered model `name` whose source is the export, linked to
    the run's MLflow run and tagged with its step and checkpoint; its version number."""
    from wildtrain.tracking.mlflow_client import Client, Refused

    try:
        return Client(run.cfg.tracking.uri).register_version(
            name,
            exported.location,
            run.mlflow_run_id,
            tags={
                "wildtrain.run": run.name,
                "wildtrain.step": str(exported.step),
                "wildtrain.checkpoint": exported.checkpoint,
                "wildtrain.architecture": exported.architecture,
            },
            description=f"run {run.name}, step {exported.step}, from checkpoint {exported.checkpoint}",
        )
    except Refused as e:
        raise ExportError(
            f"{exported.location} is written, but registering it as {name!r} at "
            f"{run.cfg.tracking.uri} failed: {str(e).splitlines()[0]}"
        ) from None
