"""Calibration: the file calibrate.py writes, its round trip through Device.from_calibration, and
predictions that follow what the file says (memwall/planner/host.py, roofline.py)."""

from __future__ import annotations

import json
import time

import pytest

from memwall.planner import plan_json
from memwall.planner.hardware import Device, HostRates
from memwall.planner.host import cpu_weights, resident
from memwall.planner.plan import make_plan
from memwall.planner.request import PlanRequest
from memwall.planner.sources import resolve_model

CALIBRATION = {
    "cpu": "Test CPU", "isa": "avx2", "cores": 2, "threads": 2, "memory_bytes": 16e9,
    "bandwidth_bytes_s": 20e9, "decode_bandwidth_share": {"q4": 0.5, "q8": 0.8},
    "decode_row_s": {"q4": 1e-8, "q8": 5e-8},
    "matmul_flops": {"int8_decode": 1e12, "int8_prefill": 80e9, "fp32": 50e9, "bf16": 10e9},
    "prefill_flops": {"q4": 100e9, "q4_large": 80e9, "q8": 100e9, "q8_large": 80e9},
    "prefill_weight_s": {"q4": 1e-9, "q4_large": 3e-9, "q8": 1e-9, "q8_large": 3e-9},
    "attention_flops": 40e9,
    "host_s": {"decode_step": 1e-3, "decode_layer": 5e-5, "prefill_step": 2e-3,
               "prefill_layer": 1e-3, "prefill_value_layer": 3e-12},
    "runtime_rss_bytes": 300 << 20, "huge_page_bytes": 2 << 20, "prefill_copy_bytes": 4,
    "measured_at": "2026-01-01T00:00:00"}

# the embedded SmolLM2-135M Q4_1 GGUF: Q4_1 layer matrices, a tied Q8_0 embedding; a layer's
# fused projections qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]
Q4_WEIGHTS, Q8_WEIGHTS, LAYERS = 106_168_320, 28_311_552, 30
LAYER_ROWS, VOCAB, HIDDEN, FFN = 960 + 576 + 3072 + 576, 49152, 576, 1536
HEAD_S = VOCAB * 5e-8 + Q8_WEIGHTS * 9 / 8 / (20e9 * 0.8)  # the LM head, one token


def write(tmp_path, **changes):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**CALIBRATION, **changes}))
    return path


@pytest.mark.usefixtures("gguf_path")
def test_quick_calibration_writes_sane_figures(tmp_path, capsys) -> None:
    from memwall.planner import calibrate

    start = time.perf_counter()
    data = calibrate.run(tmp_path / "calibration.json", quick=True)
    assert time.perf_counter() - start < 30  # ~3-5 s on 2 idle cores; leeway for a busy host
    assert json.loads((tmp_path / "calibration.json").read_text()) == data
    assert data["threads"] >= 1 and data["quick"] is True
    assert 1e9 < data["bandwidth_bytes_s"] < 1e13
    assert all(0 < v < 2 for v in data["decode_bandwidth_share"].values())
    figures = [*data["matmul_flops"].values(), *data["prefill_flops"].values(),
               data["attention_flops"]]
    assert all(1e8 < v < 1e15 for v in figures)
    assert all(v >= 0 for v in [*data["prefill_weight_s"].values(), *data["host_s"].values()])
    assert data["host_s"]["decode_step"] > 0 and data["host_s"]["prefill_step"] > 0
    assert 50 << 20 < data["runtime_rss_bytes"] < 4 << 30
    assert data["prefill_copy_bytes"] in (0, 4, 8)
    table = capsys.readouterr().out
    assert "stream read" in table and "B=1 decode, q4" in table and "runtime RSS" in table
    device = Device.from_calibration(tmp_path / "calibration.json")
    assert device.bandwidth_bytes_s == data["bandwidth_bytes_s"]
    assert device.host.decode_share == data["decode_bandwidth_share"]


def test_from_calibration_round_trips(tmp_path) -> None:
    device = Device.from_calibration(write(tmp_path))
    assert device.name == "this machine (Test CPU, 2 cores)"
    assert device.bandwidth_bytes_s == 20e9 and device.achievable_bandwidth == 20e9
    assert device.peak_flops == CALIBRATION["matmul_flops"]
    assert device.host == HostRates(
        {"q4": 0.5, "q8": 0.8}, {"q4": 1e-8, "q8": 5e-8}, CALIBRATION["prefill_flops"],
        CALIBRATION["prefill_weight_s"], 40e9, CALIBRATION["host_s"], 300 << 20, 2 << 20, 4)


def test_an_older_file_without_engine_figures_plans_the_plain_roofline(tmp_path) -> None:
    old = {k: CALIBRATION[k] for k in ("cpu", "bandwidth_bytes_s", "matmul_flops")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert Device.from_calibration(path).host is None
    doc = plan_json({"device": "this", "calibration": str(path), "max_model_len": 2048})
    one = doc["decode"]["batch_1"]
    step_bytes = doc["memory"]["weights_bytes"] + 2048 * doc["memory"]["kv_bytes_per_token"]
    assert one["tokens_per_s"] == pytest.approx(20e9 / step_bytes)


def test_bad_engine_figures_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="decode_bandwidth_share must map names to numbers"):
        Device.from_calibration(write(tmp_path, decode_bandwidth_share={"q4": -1}))
    with pytest.raises(ValueError, match="runtime_rss_bytes must be a number >= 0"):
        Device.from_calibration(write(tmp_path, runtime_rss_bytes="lots"))


def _decode_s(path, context: int = 64) -> float:
    doc = plan_json({"device": "this", "calibration": str(path), "max_model_len": context})
    return doc["decode"]["batch_1"]["step_s"]


def test_b1_decode_by_hand(tmp_path, gguf_path) -> None:
    """Each matrix at its layout's share of the bandwidth (memwall's CPU layouts: Q4_1 5 bits,
    Q8_0 9) plus a cost per output row, KV at the bandwidth, plus the engine's step and
    per-layer time."""
    kv = 64 * 2 * LAYERS * 3 * 64 * 2  # 64 tokens of fp16 K and V, 3 KV heads of 64
    layers_s = LAYERS * LAYER_ROWS * 1e-8 + Q4_WEIGHTS * 5 / 8 / (20e9 * 0.5)
    host_s = 1e-3 + LAYERS * 5e-5
    assert _decode_s(write(tmp_path)) == pytest.approx(layers_s + HEAD_S + kv / 20e9 + host_s)


def test_decode_follows_the_bandwidth_where_memory_bound(tmp_path, gguf_path) -> None:
    no_host = {k: 0 for k in CALIBRATION["host_s"]}
    no_rows = {"q4": 0, "q8": 0}
    fast = _decode_s(write(tmp_path, host_s=no_host, decode_row_s=no_rows))
    slow = _decode_s(write(tmp_path, host_s=no_host, decode_row_s=no_rows,
                           bandwidth_bytes_s=10e9))
    assert slow == pytest.approx(2 * fast)  # half the bandwidth, half the tokens/s
    shared = _decode_s(write(tmp_path, host_s=no_host, decode_row_s=no_rows,
                             decode_bandwidth_share={"q4": 0.25, "q8": 0.4}))
    assert shared > 1.9 * fast  # the kernels' share matters as much
    rows = _decode_s(write(tmp_path, host_s=no_host))
    assert rows == pytest.approx(fast + LAYERS * LAYER_ROWS * 1e-8 + VOCAB * 5e-8)
    host = _decode_s(write(tmp_path))
    assert host == pytest.approx(rows + 1e-3 + LAYERS * 5e-5)  # the engine's time adds


def _prefill_s(tmp_path, prompt: int, **changes) -> float:
    path = write(tmp_path, **changes)
    plan = make_plan(PlanRequest(device="this", calibration=str(path), max_model_len=2048,
                                 prompt_len=prompt))
    return plan.prefill.stage_s


def test_prefill_by_hand(tmp_path, gguf_path) -> None:
    """One 512-token chunk: each matrix's per-weight cost and FLOPs at its layout and size
    class (SmolLM2's are all small), the LM head for the last token only (a decode step's),
    attention at its own rate, the engine's per-chunk, per-layer and per-value time."""
    matmul = Q4_WEIGHTS * 1e-9 + 512 * 2 * Q4_WEIGHTS / 100e9 + HEAD_S
    attention = 4 * 9 * 64 * LAYERS * (512 * 513 / 2) / 40e9
    host = 2e-3 + LAYERS * (1e-3 + 512 * (HIDDEN + FFN) * 3e-12)
    assert _prefill_s(tmp_path, 512) == pytest.approx(matmul + attention + host)


def test_short_chunks_run_the_integer_kernels(tmp_path, gguf_path) -> None:
    """At most 128 tokens: no per-weight cost, int8_prefill's FLOP/s."""
    matmul = 100 * 2 * Q4_WEIGHTS / 80e9 + HEAD_S
    attention = 4 * 9 * 64 * LAYERS * (100 * 101 / 2) / 40e9
    host = 2e-3 + LAYERS * (1e-3 + 100 * (HIDDEN + FFN) * 3e-12)
    assert _prefill_s(tmp_path, 100) == pytest.approx(matmul + attention + host)


def test_large_matrices_take_the_large_figures(gguf_path) -> None:
    from memwall.planner.host import LARGE_WEIGHTS, Matrix

    assert not Matrix("q4", 3072, 576, 30, 5).large  # SmolLM2's gate_up: 1.8M weights
    assert Matrix("q4", 16384, 2048, 16, 5).large  # Llama-3.2-1B's: 33.6M
    assert LARGE_WEIGHTS * 4 == 32 << 20  # a float32 copy of 32 MiB


def test_resident_size_counts_the_touched_kv_in_huge_pages(tmp_path, gguf_path) -> None:
    rates = Device.from_calibration(write(tmp_path)).host
    model = resolve_model(None)
    weights = cpu_weights(model, "auto")
    assert sum(m.bytes for m in weights.layers) == Q4_WEIGHTS * 5 / 8
    assert weights.head.bytes == Q8_WEIGHTS * 9 / 8 and weights.head.layout == "q8"
    assert weights.resident_bytes == pytest.approx(
        Q4_WEIGHTS * 5 / 8 + Q8_WEIGHTS * 9 / 8 + 35_136 * 4)  # + the F32 norms
    small = resident(rates, model.shape, weights, 128, 4096, 640, 512, 16)
    # SmolLM2's K of one layer for 4096 tokens is 1.5 MiB: no huge pages, 640 tokens each
    assert small.kv == 2 * LAYERS * 640 * 3 * 128
    big = resident(rates, model.shape, weights, 128, 65536, 640, 512, 16)
    assert big.kv == 2 * LAYERS * (2 << 20)  # 24 MiB tensors: one touched huge page each
    # the float32 copy of the fused gate/up weight a 512-token chunk multiplies by
    assert small.step == 512 * 4 * (2 * 576 + 3 * 1536) + 2 * 1536 * 576 * 4
    assert small.total == (300 << 20) + small.weights + small.kv + small.step


def test_memwall_plan_calibrate_writes_then_plans_with_the_file(tmp_path, capsys, monkeypatch,
                                                                gguf_path) -> None:
    """The CLI's --calibrate runs calibrate.run(path) (here a stand-in that writes the test
    figures) and the plan that follows reads them."""
    from memwall.entrypoints.cli import main
    from memwall.planner import calibrate

    path = tmp_path / "calibration.json"
    monkeypatch.setattr(calibrate, "run", lambda p: p.write_text(json.dumps(CALIBRATION)))
    code = main(["plan", "--device", "this", "--calibrate", "--calibration", str(path),
                 "--max-model-len", "64", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and path.is_file() and str(path) in doc["device"]["source"]
    assert doc["decode"]["batch_1"]["step_s"] == pytest.approx(_decode_s(path))


def test_prefill_fit_survives_a_larger_chunk_timed_no_slower() -> None:
    """Fast integer kernels on a quick calibration's small probe weights: the 512-token chunk can
    time no slower than the 256-token one. The fit then takes the larger chunk's mean rate,
    never a division by a zero slope."""
    from memwall.planner.calibrate.kernels import PREFILL_TOKENS, KernelProbes

    probes = KernelProbes.__new__(KernelProbes)
    probes.dequantizes = False
    probes.prefill_weights = {"q4": 1000, "q4_large": 4000, "q8": 1000}
    probes.prefill_tokens = {k: PREFILL_TOKENS for k in probes.prefill_weights}
    small, large = PREFILL_TOKENS
    probes.samples = {f"prefill {k}/{m}": [1e-3] for k in probes.prefill_weights for m in (small, large)}
    probes.samples["prefill q4_large/256"] = [2e-3]  # slower at 256 than at 512
    flops, weight_s = probes._prefill_fit()
    assert flops["q4"] == pytest.approx(2 * 1000 * large / 1e-3)
    assert flops["q4_large"] == pytest.approx(2 * 4000 * large / 1e-3)
    assert all(v >= 0 for v in weight_s.values())
