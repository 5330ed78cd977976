"""`wildtrain promote SWEEP --to model=7b`: the best trial as a frozen experiment file
(conf/experiment/<name>.yaml) for the big run, scaled by the muP/depth-muP `transfer` rule,
with where it came from as comments and as `run.tags` (so the run it starts carries them
as MLflow tags). Everything is read back from MLflow and checked against it: the trial's
config is rebuilt from the sweep's recorded overrides and must hash to the trial's hash."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from wildtrain.config import Config, ConfigError, config_hash, load_config, to_yaml
from wildtrain.model.transformer import HIDDEN
from wildtrain.sweeps import compare
from wildtrain.sweeps.execute import TRIAL_TAG, common_overrides
from wildtrain.sweeps.grid import trial_hash
from wildtrain.sweeps.report import fetch_sweep
from wildtrain.sweeps.transfer import Transfer, transfer

METRICS = compare.METRICS  # what a trial can be promoted by (compare.rank)
PROVENANCE = "wildtrain.promoted_from."  # + sweep, trial, trial_hash, config_hash, data_manifests, ...


class PromoteError(RuntimeError):
    pass


@dataclass(frozen=True)
class Promotion:
    name: str
    path: Path
    cfg: Config
    provenance: dict[str, str]
    transfer: Transfer


def promote(uri: str, sweep: str, to: Sequence[str], overrides: Sequence[str] = (), name: Optional[str] = None,
            metric: Optional[str] = None, conf_dir: Optional[Path] = None) -> Promotion:
    """`metric`: what the best trial is chosen by; None: the validation loss where every
    finished trial has one, else the training loss (`compare.ranking_metric`)."""
    if metric is not None and metric not in METRICS:
        raise PromoteError(f"--metric {metric}: a trial can be promoted by {', '.join(METRICS)}")
    from mlflow.tracking import MlflowClient

    parent, keys, trials = fetch_sweep(uri, sweep)
    if metric == "val/loss" and compare.ranking_metric(trials) != "val/loss":
        raise PromoteError(f"--metric val/loss: not every finished trial of sweep {sweep!r} has a validation loss "
                           "(its data held no documents out); promote by --metric loss")
    metric = metric or compare.ranking_metric(trials)
    ranked = compare.rank(trials, metric)
    best = next((r for r in ranked if r.place == 1), None)
    if best is None:
        raise PromoteError(f"sweep {sweep!r} has no finished trial to promote (run it, or see `wildtrain report {sweep}`)")
    client = MlflowClient(uri)
    trial_run = client.get_run(best.trial.run_id)
    # The sweep's trials ran with early stop on; the big run trains on whatever its loss does.
    common = [o for o in common_overrides(parent) if not o.startswith("early_stop.enabled=")]
    swept = [f"{key}={value}" for key, value in best.trial.values]
    trial_cfg = load_config([*common_overrides(parent), *swept], conf_dir)
    if trial_hash(trial_cfg) != trial_run.data.tags[TRIAL_TAG]:
        raise PromoteError(f"trial {best.trial.name}: its config rebuilt from conf/ hashes to {trial_hash(trial_cfg)}, "
                           "not its own hash: conf/ changed since the sweep ran")
    # The big run's own choices win over the trial's: `--to model=7b` replaces a swept
    # model.dim, which the transfer rule then scales from.
    kept = [o for o in [*common, *swept] if not overridden(o.partition("=")[0], [*to, *overrides])]
    target = load_config([*kept, *to, *overrides], conf_dir)
    rule = transfer(trial_cfg.model, trial_cfg.optim.hidden_lr_mult, target.model)
    name = name or f"{sweep}-yolo"
    provenance = {
        "sweep": sweep, "sweep_run_id": parent.info.run_id, "trial": best.trial.name,
        "trial_run_id": trial_run.info.run_id, "trial_hash": trial_run.data.tags[TRIAL_TAG],
        "config_hash": config_hash(trial_cfg), "data_manifests": ",".join(best.trial.data_digests),
        "metric": metric, "score": f"{best.score:.{compare.LOSS_DECIMALS}f}",
    }
    tags = {PROVENANCE + key: value for key, value in provenance.items()}
    cfg = load_config([*kept, *to, *overrides, *(f"{k}={v}" for k, v in rule.overrides().items()),
                       f"run.name={name}"], conf_dir)
    cfg.run.tags = {**cfg.run.tags, **tags}
    path = (conf_dir or _conf_dir()) / "experiment" / f"{name}.yaml"
    if path.exists():
        raise PromoteError(f"{path} exists: promoted experiments are frozen; choose another --name")
    path.write_text(_header(sweep, best, rule, to, overrides, provenance) + to_yaml(cfg))
    try:
        loaded = load_config([f"experiment={name}"], conf_dir)
    except ConfigError as e:
        path.unlink()
        raise PromoteError(f"the promoted experiment does not load ({e}); nothing written") from None
    if loaded != cfg:
        path.unlink()
        raise PromoteError("the promoted experiment does not load back as written; nothing written")
    return Promotion(name, path, cfg, tags, rule)


def overridden(key: str, by: Sequence[str]) -> bool:
    """Whether one of the overrides `by` sets `key`, itself or as its group or section."""
    return any(key == other or key.startswith(other + ".") for other in (o.partition("=")[0] for o in by))


def _conf_dir() -> Path:
    from wildtrain.config import default_conf_dir

    return default_conf_dir()


def _header(sweep: str, best: compare.Ranked, rule: Transfer, to: Sequence[str], overrides: Sequence[str],
            provenance: dict[str, str]) -> str:
    lines = [
        f"Promoted by `wildtrain promote {sweep} --to {' '.join(to)}{' ' + ' '.join(overrides) if overrides else ''}`:",
        f"the best trial of sweep {sweep}, {best.trial.name} "
        f"({' '.join(f'{k}={v}' for k, v in best.trial.values)}), final {provenance['metric']} {best.score:.4f}.",
        "Frozen: every value is written out, so later changes to conf/ do not change this run.",
        "Scaled by muP and depth-muP from the base model (the trial's shape, or the base it was itself promoted "
        f"from): dim {rule.base_dim}, ffn_dim {rule.base_ffn_dim}, head_dim {rule.base_head_dim}, "
        f"n_layers {rule.base_n_layers}, with the trial's multipliers:",
        *(f"  {key} = {value:.6g}" for key, value in rule.overrides().items()),
        "which this model scales by each matrix's fan-in against the base's (learning rate: a multiple of optim.lr):",
        *(f"  {matrix}: learning rate x{rule.scaled.lr_mult(matrix, rule.hidden_lr_mult):.6g}, "
          f"init std x{rule.scaled.init_std(matrix, 1.0):.6g}" for matrix in HIDDEN),
        f"  logits x{rule.scaled.output_mult:.6g}, residual branches x{rule.scaled.residual_mult:.6g}, "
        f"attention logits q.k x{rule.scaled.attention_scale:.6g}",
        "Provenance (also run.tags, so the run carries them as MLflow tags):",
        *(f"  {key}: {value}" for key, value in provenance.items()),
    ]
    return "".join(f"# {line}\n" for line in lines)
