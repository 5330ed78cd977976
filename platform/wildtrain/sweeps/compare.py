"""Which trial of a sweep won, and why: smoothed loss curves against tokens, a ranking by
the final validation loss (or, for trials without a validation set, the final smoothed
training loss), and the effect of each swept key. Pure, over `TrialRecord`s that
`report.fetch_sweep` reads from MLflow.

The validation loss is the default because it compares what training losses do not: trials
of different objectives (a UL2 trial's training loss is another quantity than a causal
one's) and trials that overfit."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

# Weight of the newest loss in the exponential moving average of a curve.
SMOOTHING = 0.3
# Final losses equal at the table's precision are a tie: the ranking then says so, and
# orders them by trial name only so that it is deterministic.
LOSS_DECIMALS = 4


@dataclass(frozen=True)
class TrialRecord:
    name: str  # the trial's run name: <sweep>-<hash>
    run_id: str  # its MLflow run
    values: tuple[tuple[str, str], ...]  # (swept key, value), in the order of the sweep's --grid
    status: str  # MLflow's: FINISHED, RUNNING, FAILED, KILLED
    stopped_early: Optional[str]  # the reason, for a trial the early-stop rule ended
    tokens: tuple[float, ...]  # tokens seen at each logged loss
    loss: tuple[float, ...]
    tokens_per_s: Optional[float]  # mean over the trial's reports
    mfu: Optional[float]
    goodput: Optional[float]
    peak_memory_gb: Optional[float]
    data_digests: tuple[str, ...] = ()  # the dataset manifests it trained on
    val_loss: Optional[float] = None  # at its last validation (train/validation.py)
    hash: str = ""  # the trial's (grid.trial_hash)


# What trials can be ranked by: the validation loss at their last validation, or the
# smoothed training loss at their last logged step.
METRICS = ("val/loss", "loss")


@dataclass(frozen=True)
class Ranked:
    place: Optional[int]  # 1 = best; None: not ranked (see `note`)
    trial: TrialRecord
    final_loss: Optional[float]  # the smoothed training loss at the trial's last logged step
    note: str  # "tie with X", "stopped early: ...", "running"; "" otherwise
    score: Optional[float] = None  # what it was ranked by (`ranking_metric`)


def smooth(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled to 0."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * value + (1 - weight) * average
        out.append(average / (1 - (1 - weight) ** i))
    return out


def ranking_metric(trials: Sequence[TrialRecord]) -> str:
    """ "val/loss" when every finished trial has a finite validation loss, else "loss"."""
    finished = [t for t in trials if t.status == "FINISHED" and not t.stopped_early]
    validated = all(t.val_loss is not None and math.isfinite(t.val_loss) for t in finished)
    return "val/loss" if finished and validated else "loss"


def rank(trials: Sequence[TrialRecord], metric: Optional[str] = None) -> list[Ranked]:
    """Finished trials with a finite `metric` (`ranking_metric` when None) first, best
    first; then the rest (stopped early, failed, still running) by name, unranked with the
    reason."""
    metric = metric or ranking_metric(trials)
    if metric not in METRICS:
        raise ValueError(f"a sweep's trials are ranked by {' or '.join(METRICS)}, not {metric!r}")
    finals = {t.name: smooth(t.loss)[-1] if t.loss else None for t in trials}
    scores = {t.name: t.val_loss if metric == "val/loss" else finals[t.name] for t in trials}

    def rankable(t: TrialRecord) -> bool:
        score = scores[t.name]
        return t.status == "FINISHED" and not t.stopped_early and score is not None and math.isfinite(score)

    ranked_trials = sorted(
        (t for t in trials if rankable(t)), key=lambda t: (round(scores[t.name], LOSS_DECIMALS), t.name)
    )
    out, place = [], 0
    for i, t in enumerate(ranked_trials):
        shown = round(scores[t.name], LOSS_DECIMALS)
        ties = [o.name for o in ranked_trials if o is not t and round(scores[o.name], LOSS_DECIMALS) == shown]
        if i == 0 or round(scores[ranked_trials[i - 1].name], LOSS_DECIMALS) != shown:
            place = i + 1
        out.append(Ranked(place, t, finals[t.name], f"tie with {', '.join(ties)}" if ties else "", scores[t.name]))
    for t in sorted((t for t in trials if not rankable(t)), key=lambda t: t.name):
        note = (
            f"stopped early: {t.stopped_early}"
            if t.stopped_early
            else t.status.lower()
            if t.status != "FINISHED"
            else f"no finite {metric}"
        )
        out.append(Ranked(None, t, finals[t.name], note, scores[t.name]))
    return out


@dataclass(frozen=True)
class Effect:
    key: str
    value: str
    mean_loss: Optional[float]  # over the ranked trials with this value; None: none ranked
    trials: int  # ranked trials with this value


def effects(ranked: Sequence[Ranked], keys: Sequence[str]) -> list[Effect]:
    """Mean final score (what the trials were ranked by) per value of each swept key, over
    the ranked trials: a trial stopped early has no final loss worth averaging, and says so
    in the ranking."""
    out = []
    for key in keys:
        values = list(dict.fromkeys(dict(r.trial.values)[key] for r in ranked))
        for value in values:
            losses = [r.score for r in ranked if r.place is not None and dict(r.trial.values)[key] == value]
            out.append(Effect(key, value, statistics.fmean(losses) if losses else None, len(losses)))
    return out


def differing_data(trials: Sequence[TrialRecord]) -> list[str]:
    """Trials whose dataset manifests differ from the first trial's: their losses are not
    comparable, and the report flags them."""
    if not trials:
        return []
    first = trials[0].data_digests
    return [t.name for t in trials if t.data_digests != first]


def table_text(sweep: str, ranked: Sequence[Ranked], keys: Sequence[str]) -> str:
    def show(value: Optional[float], spec: str) -> str:
        return "-" if value is None or not math.isfinite(value) else format(value, spec)

    by_validation = ranking_metric([r.trial for r in ranked]) == "val/loss"
    header = ("rank", "trial", *keys, "val loss", "loss", "tokens/s", "MFU", "goodput", "peak GB", "note")
    rows = [header] + [
        (
            str(r.place) if r.place is not None else "-",
            r.trial.name,
            *(dict(r.trial.values)[k] for k in keys),
            show(r.trial.val_loss, f".{LOSS_DECIMALS}f"),
            show(r.final_loss, f".{LOSS_DECIMALS}f"),
            show(r.trial.tokens_per_s, ".0f"),
            show(r.trial.mfu, ".2%"),
            show(r.trial.goodput, ".1%"),
            show(r.trial.peak_memory_gb, ".2f"),
            r.note,
        )
        for r in ranked
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    by = "final validation loss" if by_validation else f"final smoothed training loss (EMA {SMOOTHING:g})"
    lines = [f"sweep {sweep}: {len(ranked)} trials, ranked by {by}"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    winner = next((r for r in ranked if r.place == 1), None)
    if winner is not None:
        values = " ".join(f"{k}={v}" for k, v in winner.trial.values)
        lines.append(f"best: {winner.trial.name} ({values})" + (f", {winner.note}" if winner.note else ""))
    lines.append(f"effect of each swept key (mean {by} of the ranked trials with that value):")
    lines += [
        f"  {e.key}={e.value}: {show(e.mean_loss, f'.{LOSS_DECIMALS}f')} (n={e.trials})" for e in effects(ranked, keys)
    ]
    odd = differing_data([r.trial for r in ranked])
    if odd:
        lines.append(f"warning: trained on other data than {ranked[0].trial.name}: {', '.join(odd)}")
    return "\n".join(lines) + "\n"
