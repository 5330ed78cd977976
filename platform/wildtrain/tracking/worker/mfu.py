"""Model FLOPs utilization: the FLOPs the model needs per token (`model.flops`), times
tokens per second, over what the devices could do at their peak.

Peaks are the vendors' dense bf16 tensor figures (not the 2:4-sparsity ones, which are
twice as large), so MFU compares with published numbers. A CPU has no such figure that
means anything for PyTorch, so its peak is measured: a short fp32 matmul.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Optional

import torch

CONFIG = "config"
MEASURED_CPU = "measured-cpu-matmul"

# Per device, by form factor: SXM boards run at higher clocks and power than PCIe cards
# of the same chip, and NVL cards sit between the two. The first form factor listed is
# the one a name that states none has (the SXM parts report e.g. "NVIDIA H100 80GB HBM3").
_PEAKS: dict[str, dict[str, float]] = {
    "B200": {"SXM": 2250e12},
    "GB200": {"SXM": 2500e12},
    "H200": {"SXM": 989.4e12, "NVL": 835.5e12},
    "GH200": {"SXM": 989.4e12},
    "H100": {"SXM": 989.4e12, "NVL": 835.5e12, "PCIE": 756.5e12},
    "A100": {"SXM": 312e12, "PCIE": 312e12},
    "L40S": {"PCIE": 362.05e12},
    "L40": {"PCIE": 181.05e12},
    "L4": {"PCIE": 121e12},
    "A10": {"PCIE": 125e12},
    "MI300X": {"OAM": 1307.4e12},
    "MI325X": {"OAM": 1307.4e12},
    "MI250X": {"OAM": 383e12},
}


@dataclass(frozen=True)
class Peak:
    flops_per_s: float  # per device
    source: str  # "table:<device> <form factor> bf16 dense", "config" or "measured-cpu-matmul"


def peak_flops(device_name: str, override: Optional[float] = None) -> Optional[Peak]:
    """The peak FLOP/s of one device named as `torch.cuda.get_device_name()` names it, or
    "cpu": the configured `override` if any, else the table's figure, else (on CPU) the
    measured one; None for an accelerator the table does not know."""
    if override is not None:
        return Peak(override, CONFIG)
    # "NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe", "AMD Instinct MI300X": the chip and
    # the form factor are words of the name.
    words = re.findall(r"[A-Z0-9]+", device_name.upper())
    for chip, forms in _PEAKS.items():
        if chip in words:
            form = next((f for f in forms if any(w.startswith(f) for w in words)), next(iter(forms)))
            return Peak(forms[form], f"table:{chip} {form} bf16 dense")
    return measure_cpu_peak() if words == ["CPU"] else None


def device_peak(device: torch.device, override: Optional[float] = None) -> Optional[Peak]:
    """`peak_flops` of the training device `device` (its name, or "cpu")."""
    return peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", override)


@functools.cache
def measure_cpu_peak(size: int = 512, seconds: float = 0.2) -> Peak:
    """The best fp32 rate of `size`² matmuls over `seconds`, with this process's threads;
    measured once per process, since it costs `seconds` and the cores do not change."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # the first call pays for allocation and thread start-up
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return Peak(2.0 * size**3 / best, MEASURED_CPU)


def mfu(flops_per_token: float, tokens_per_s: float, peak: Peak, devices: int) -> float:
    """The share of `devices` devices' peak that training `tokens_per_s` tokens a second uses."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    return flops_per_token * tokens_per_s / (peak.flops_per_s * devices)
