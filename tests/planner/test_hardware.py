"""Devices: the GPU table, GPU counts, calibration files and this machine without one."""

from __future__ import annotations

import json

import pytest

from memwall.planner import plan_json
from memwall.planner.hardware import Device, parse_gpus, total_ram_bytes


@pytest.mark.parametrize("text, name, count", [
    ("H100", "H100-SXM", 1), ("H100x8", "H100-SXM", 8), ("8xH100", "H100-SXM", 8),
    ("h100:4", "H100-SXM", 4), ("MI300X", "MI300X", 1), ("mi300xx2", "MI300X", 2),
    ("rtx4090", "RTX-4090", 1), ("L4x2", "L4", 2), ("nvidia-a100-40gb", "A100-40GB", 1),
    ("H100-PCIe", "H100-PCIe", 1),
])
def test_gpu_names_and_counts(text: str, name: str, count: int) -> None:
    spec, n = parse_gpus(text)
    assert (spec.name, n) == (name, count)


def test_datasheet_figures_are_dense_peaks_per_gpu() -> None:
    h100 = Device.from_gpu(parse_gpus("H100")[0])
    assert h100.memory_bytes == 80e9 and h100.bandwidth_bytes_s == 3.35e12
    assert h100.peak_flops == {"bf16": 989.4e12, "fp8": 1978.9e12}
    assert h100.achievable_bandwidth == pytest.approx(2.68e12)
    with pytest.raises(ValueError, match="unknown GPU 'B9000'"):
        parse_gpus("B9000")


def test_calibrated_machine(tmp_path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({
        "cpu": "Test CPU", "cores": 4, "threads": 4, "bandwidth_bytes_s": 20e9,
        "matmul_flops": {"int8_decode": 500e9, "fp32": 100e9, "bf16": 200e9},
        "memory_bytes": 16e9, "measured_at": "2025-01-01T00:00:00"}))
    device = Device.from_calibration(path)
    assert device.name == "this machine (Test CPU, 4 cores)" and device.memory_bytes == 16e9
    assert device.achievable_bandwidth == 20e9  # measured: efficiency 1
    doc = plan_json({"device": "this", "calibration": str(path), "max_model_len": 2048})
    # the embedded Q4_1 model decodes on the int8 kernels; B=1 is bandwidth over bytes
    assert doc["decode"]["achievable_flops"] == 500e9
    bytes_one = doc["memory"]["weights_bytes"] + 2048 * doc["memory"]["kv_bytes_per_token"]
    assert doc["decode"]["batch_1"]["tokens_per_s"] == pytest.approx(20e9 / bytes_one)
    assert doc["prefill"]["tokens_per_s"] > 0


def test_this_machine_without_calibration_plans_memory_only(tmp_path) -> None:
    doc = plan_json({"device": "this", "calibration": str(tmp_path / "missing.json")})
    assert doc["device"]["memory_bytes"] == total_ram_bytes()
    assert doc["decode"] is None and doc["prefill"] is None
    assert any("--calibrate" in note for note in doc["notes"])
    assert doc["memory"]["max_concurrent_requests"] > 0


def test_bad_calibration_files_are_one_line_errors(tmp_path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text("{oops")
    with pytest.raises(ValueError, match="is not valid JSON"):
        Device.from_calibration(path)
    path.write_text(json.dumps({"bandwidth_bytes_s": -1}))
    with pytest.raises(ValueError, match="bandwidth_bytes_s must be a positive number"):
        Device.from_calibration(path)
