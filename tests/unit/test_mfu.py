from pathlib import Path

import pytest
from omegaconf import OmegaConf

from wildtrain.config import ModelConfig
from wildtrain.model import flops_per_token
from wildtrain.tracking.worker.mfu import CONFIG, MEASURED_CPU, Peak, measure_cpu_peak, mfu, peak_flops

PRESETS = Path(__file__).resolve().parents[2] / "conf" / "model"


def preset(name: str) -> ModelConfig:
    return OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(PRESETS / f"{name}.yaml"))
    )


def test_mfu_of_the_125m_preset_by_hand():
    d, layers, vocab, ffn, seq_len = 768, 12, 50304, 1024, 2048
    n_matmul = layers * (4 * d * d + 3 * d * ffn) + d * vocab  # attention, SwiGLU MLP, output head
    per_token = 6 * n_matmul + 12 * layers * d * seq_len
    tokens_per_s, devices, peak = 1.2e6, 8, Peak(989.4e12, "table")
    assert per_token == flops_per_token(preset("125m"), seq_len) == 798_031_872
    # 798.0 MFLOP/token * 1.2M tokens/s = 957.6 TFLOP/s, of 8 * 989.4 = 7915.2 TFLOP/s
    assert mfu(per_token, tokens_per_s, peak, devices) == pytest.approx(0.12099, abs=1e-5)
    # twice the devices at the same throughput: half the utilization
    assert mfu(per_token, tokens_per_s, peak, 2 * devices) == pytest.approx(
        mfu(per_token, tokens_per_s, peak, devices) / 2
    )


def test_the_measured_h200_run_of_the_design_notes():
    # Measured 2026-11-30 (docs/benchmarks.md): the 1.3B model at 62.5k tokens/s on one H200 was 57.4% MFU.
    peak = peak_flops("NVIDIA H200")
    assert mfu(flops_per_token(preset("1.3b"), 2048), 62.5e3, peak, 1) == pytest.approx(0.574, abs=5e-4)


@pytest.mark.parametrize(
    "name, flops, form",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12, "H100 SXM"),
        ("NVIDIA H100 PCIe", 756.5e12, "H100 PCIE"),
        ("NVIDIA H100 NVL", 835.5e12, "H100 NVL"),
        ("NVIDIA H200", 989.4e12, "H200 SXM"),
        ("NVIDIA H200 NVL", 835.5e12, "H200 NVL"),
        ("NVIDIA GH200 480GB", 989.4e12, "GH200 SXM"),
        ("NVIDIA A100-SXM4-80GB", 312e12, "A100 SXM"),
        ("NVIDIA A100 80GB PCIe", 312e12, "A100 PCIE"),
        ("NVIDIA L40S", 362.05e12, "L40S PCIE"),
        ("NVIDIA L40", 181.05e12, "L40 PCIE"),
        ("NVIDIA L4", 121e12, "L4 PCIE"),
        ("nvidia a10", 125e12, "A10 PCIE"),
        ("AMD Instinct MI300X", 1307.4e12, "MI300X OAM"),
    ],
)
def test_table_lookup_by_the_names_devices_report(name, flops, form):
    assert peak_flops(name) == Peak(flops, f"table:{form} bf16 dense")


def test_an_unknown_accelerator_has_no_peak_unless_configured():
    assert peak_flops("NVIDIA GeForce GTX 1080") is None
    assert peak_flops("NVIDIA GeForce GTX 1080", override=8.9e12) == Peak(8.9e12, CONFIG)
    assert peak_flops("NVIDIA H100 PCIe", override=700e12) == Peak(700e12, CONFIG)


def test_cpu_peak_is_measured_once_and_labelled():
    peak = peak_flops("cpu")
    assert peak.source == MEASURED_CPU
    # some GFLOP/s, and far below any accelerator in the table
    assert 1e8 < peak.flops_per_s < 50e12
    assert measure_cpu_peak() is peak


def test_mfu_needs_a_device():
    with pytest.raises(ValueError, match="devices"):
        mfu(1.0, 1.0, Peak(1.0, CONFIG), 0)
