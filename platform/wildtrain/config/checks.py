"""Checks of a whole config: every value against its declaration (config/allowed.py), then
each section's relations between its fields, then the relations across sections."""

from __future__ import annotations

from dataclasses import fields

from wildtrain.batching import unservable_world_sizes
from wildtrain.config.allowed import check_declared
from wildtrain.config.errors import ConfigError
from wildtrain.config.schema import Config


def validate(cfg: Config) -> None:
    """What the types alone cannot express. The declared values come first, so that the
    relations only ever see values in range (`dim % n_heads` a positive n_heads)."""
    check_declared(cfg)
    for section in (getattr(cfg, f.name) for f in fields(cfg)):
        if hasattr(section, "validate"):  # sections without relations between their fields have none
            section.validate()
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds model.max_seq_len ({cfg.model.max_seq_len})")
    if cfg.model.attention == "prefix_lm" and cfg.train.objective == "causal":
        raise ConfigError(
            "model.attention: prefix_lm needs train.objective prefix_lm or ul2 "
            "(a causal objective has no inputs to attend to bidirectionally)"
        )
    if cfg.train.objective == "ul2" and not cfg.objective.denoisers:
        raise ConfigError("objective.denoisers: train.objective=ul2 needs at least one denoiser")
    if cfg.elastic.in_process and cfg.deepspeed.zero_stage not in (1, 2, 3):
        raise ConfigError(
            f"elastic.in_process: survivors keep ZeRO-1, 2 and 3 partitions only (elastic.peer_state); "
            f"deepspeed.zero_stage is {cfg.deepspeed.zero_stage}"
        )
    if cfg.elastic.max_workers > cfg.train.global_batch_size:
        # Also what keeps the search below short: it tries every world size up to max_workers.
        raise ConfigError(
            f"elastic.max_workers: {cfg.elastic.max_workers} workers need at least one sequence each, "
            f"more than train.global_batch_size ({cfg.train.global_batch_size})"
        )
    bad = unservable_world_sizes(
        cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.elastic.min_workers, cfg.elastic.max_workers
    )
    if bad:
        raise ConfigError(
            f"train.global_batch_size: {cfg.train.global_batch_size} sequences cannot be split evenly "
            f"at world size {_listed(bad)} with micro-batches of at most "
            f"{cfg.train.micro_batch_size} (elastic.min_workers..max_workers = "
            f"{cfg.elastic.min_workers}..{cfg.elastic.max_workers})"
        )


def _listed(numbers: list[int], shown: int = 8) -> str:
    """The first `shown` of `numbers` and how many more: a wide range of world sizes would
    otherwise make the error one line of thousands."""
    more = f" and {len(numbers) - shown} more" if len(numbers) > shown else ""
    return ", ".join(map(str, numbers[:shown])) + more
