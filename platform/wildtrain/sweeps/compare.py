"""Which trial of a sweep won, and why: smoothed loss curves against tokens, a ranking by
the final smoothed loss, and the effect of each swept key. Pure, over `TrialRecord`s that
`report.fetch_sweep` reads from MLflow."""

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


@dataclass(frozen=True)
class Ranked:
    place: Optional[int]  # 1 = best; None: not ranked (see `note`)
    trial: TrialRecord
    final_loss: Optional[float]  # the smoothed loss at the trial's last logged step
    note: str  # "tie with X", "stopped early: ...", "running"; "" otherwise


def smooth(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled to 0."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * value + (1 - weight) * average
        out.append(average / (1 - (1 - weight) ** i))
    return out


def rank(trials: Sequence[TrialRecord]) -> list[Ranked]:
    """Finished trials with a finite loss first, best final smoothed loss first; then the
    rest (stopped early, failed, still running) by name, unranked with the reason."""
    finals = {t.name: smooth(t.loss)[-1] if t.loss else None for t in trials}

    def rankable(t: TrialRecord) -> bool:
        final = finals[t.name]
        return t.status == "FINISHED" and not t.stopped_early and final is not None and math.isfinite(final)

    ranked_trials = sorted((t for t in trials if rankable(t)), key=lambda t: (round(finals[t.name], LOSS_DECIMALS), t.name))
    out, place = [], 0
    for i, t in enumerate(ranked_trials):
        shown = round(finals[t.name], LOSS_DECIMALS)
        ties = [o.name for o in ranked_trials if o is not t and round(finals[o.name], LOSS_DECIMALS) == shown]
        if i == 0 or round(finals[ranked_trials[i - 1].name], LOSS_DECIMALS) != shown:
            place = i + 1
        out.append(Ranked(place, t, finals[t.name], f"tie with {', '.join(ties)}" if ties else ""))
    for t in sorted((t for t in trials if not rankable(t)), key=lambda t: t.name):
        note = (f"stopped early: {t.stopped_early}" if t.stopped_early
                else t.status.lower() if t.status != "FINISHED" else "no finite loss")
        out.append(Ranked(None, t, finals[t.name], note))
    return out


@dataclass(frozen=True)
class Effect:
    key: str
    value: str
    mean_loss: Optional[float]  # over the ranked trials with this value; None: none ranked
    trials: int  # ranked trials with this value


def effects(ranked: Sequence[Ranked], keys: Sequence[str]) -> list[Effect]:
    """Mean final smoothed loss per value of each swept key, over the ranked trials: a
    trial stopped early has no final loss worth averaging, and says so in the ranking."""
    out = []
    for key in keys:
        values = list(dict.fromkeys(dict(r.trial.values)[key] for r in ranked))
        for value in values:
            losses = [r.final_loss for r in ranked if r.place is not None and dict(r.trial.values)[key] == value]
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

    header = ("rank", "trial", *keys, "loss", "tokens/s", "MFU", "goodput", "peak GB", "note")
    rows = [header] + [
        (str(r.place) if r.place is not None else "-", r.trial.name, *(dict(r.trial.values)[k] for k in keys),
         show(r.final_loss, f".{LOSS_DECIMALS}f"), show(r.trial.tokens_per_s, ".0f"), show(r.trial.mfu, ".2%"),
         show(r.trial.goodput, ".1%"), show(r.trial.peak_memory_gb, ".2f"), r.note)
        for r in ranked
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"sweep {sweep}: {len(ranked)} trials, ranked by final smoothed loss (EMA {SMOOTHING:g})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    winner = next((r for r in ranked if r.place == 1), None)
    if winner is not None:
        values = " ".join(f"{k}={v}" for k, v in winner.trial.values)
        lines.append(f"best: {winner.trial.name} ({values})" + (f", {winner.note}" if winner.note else ""))
    lines.append("effect of each swept key (mean final loss of the ranked trials with that value):")
    lines += [f"  {e.key}={e.value}: {show(e.mean_loss, f'.{LOSS_DECIMALS}f')} (n={e.trials})"
              for e in effects(ranked, keys)]
    odd = differing_data([r.trial for r in ranked])
    if odd:
        lines.append(f"warning: trained on other data than {ranked[0].trial.name}: {', '.join(odd)}")
    return "\n".join(lines) + "\n"
