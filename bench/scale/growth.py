"""How a cost grows with N, for the scale benches' tables: the slope of log(cost) against
log(N) by least squares, and its name."""

from __future__ import annotations

import math
from typing import Sequence


def slope(ns: Sequence[float], costs: Sequence[float]) -> float:
    """The least-squares slope of log(cost) on log(N) (costs at or below zero are left out)."""
    points = [(math.log(n), math.log(c)) for n, c in zip(ns, costs) if c > 0]
    if len(points) < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def kind(s: float) -> str:
    """The growth a log-log slope stands for (N log N over these ranges fits a slope of about 1.2)."""
    if math.isnan(s):
        return "-"
    for bound, name in ((0.3, "constant"), (0.8, "sublinear"), (1.15, "linear"), (1.5, "N log N"), (2.5, "quadratic")):
        if s < bound:
            return name
    return "worse than quadratic"


def growth_line(label: str, ns: Sequence[float], costs: Sequence[float]) -> str:
    s = slope(ns, costs)
    return f"{label}: log-log slope {s:.2f} ({kind(s)})"


def markdown(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
