"""How fast: the roofline by construction, the ridge batch, and the README's TP/PP example."""

from __future__ import annotations

import json

import pytest

from memwall.entrypoints.cli import main
from memwall.planner import plan_json
from memwall.planner.layout import Layout
from memwall.planner.roofline import StepModel, decode_step, prefill, ridge_batch
from memwall.planner.shapes import BUILTIN

H100_BW = 3.35e12 * 0.8
H100_FLOPS = 989.4e12 * 0.7


def test_batch_one_decode_is_bandwidth_over_bytes() -> None:
    doc = plan_json({"model": "llama-3-8b", "gpu": "H100", "max_model_len": 4096})
    step_bytes = 8_030_261_248 * 2 + 4096 * 131_072  # weights + one sequence's KV
    one = doc["decode"]["batch_1"]
    assert one["bound"] == "memory"
    assert one["tokens_per_s"] == pytest.approx(H100_BW / step_bytes, rel=1e-12)


def test_ridge_batch_llama3_8b_on_h100() -> None:
    """Weights only (context 0): B* = (W / BW) / (2 P / F), P the matmul weights (the layers'
    and the LM head's, not the embedding lookup). By hand: 16.06 GB / 2.68 TB/s = 5.99 ms;
    2 x 7.50e9 / 692.6 TFLOP/s = 21.7 us a sequence -> ~277; the raw peak ratio 989.4 / 3.35 =
    295 FLOP/byte bounds it from above."""
    doc = plan_json({"model": "llama-3-8b", "gpu": "H100", "max_model_len": 4096})
    s = BUILTIN["llama-3-8b"]
    by_hand = (s.params * 2 / H100_BW) / (2 * s.matmul_params / H100_FLOPS)
    assert doc["decode"]["ridge_batch_weights_only"] == pytest.approx(by_hand, rel=1e-9)
    assert 250 < by_hand < 295
    # at 4096 tokens a sequence's KV (537 MB) costs more time than its math: no ridge
    assert doc["decode"]["ridge_batch"] is None


def test_at_the_ridge_compute_time_equals_memory_time() -> None:
    m = StepModel(16e9, 131_072, 7.5e9, 4 * 32 * 128 * 32, H100_BW, H100_FLOPS, Layout(), 32)
    b = ridge_batch(m, 128)
    step = decode_step(m, round(b), 128)
    assert step.compute_s == pytest.approx(step.memory_s, rel=0.01)
    assert decode_step(m, round(b * 2), 128).bound == "compute"


def test_prefill_chunks_and_ttft() -> None:
    m = StepModel(16e9, 131_072, 7.5e9, 4 * 32 * 128 * 32, H100_BW, H100_FLOPS, Layout(), 32)
    one = prefill(m, 1000, 2048)  # one chunk, compute-bound
    flops = 1000 * 2 * 7.5e9 + 4 * 32 * 128 * 32 * (1000 * 1001 / 2)
    assert one.ttft_s == pytest.approx(flops / H100_FLOPS)
    assert prefill(m, 4096, 2048).stage_s > 2 * prefill(m, 2048, 2048).stage_s  # attention grows


EXAMPLE = ["plan", "--model", "llama-3-70b", "--gpu", "H100x8", "--tensor-parallel-size", "8",
           "--max-model-len", "2048", "--batch", "64", "--what-if", "tp=4,pp=2", "--json"]


def test_readme_tp_pp_example_from_the_cli(capsys) -> None:
    """memwall plan --model llama-3-70b --gpu H100x8 --tensor-parallel-size 8
    --max-model-len 2048 --batch 64 --what-if tp=4,pp=2 --json
    (defaults: 3.35 TB/s x 0.8, 12 us per all-reduce and per p2p send)."""
    assert main(EXAMPLE) == 0
    doc = json.loads(capsys.readouterr().out)
    tp8, tp4pp2 = doc["decode"], doc["what_ifs"][0]["decode"]
    for d in (tp8, tp4pp2):
        assert round(d["weights_read_per_rank_bytes"] / 1e9, 1) == 17.6
        assert d["kv_bytes_per_token_per_rank"] == 40 * 1024
    assert round(tp8["step_s"] * 1e3, 1) == 10.5
    assert tp8["tokens_per_s"] == pytest.approx(6090, rel=0.002)
    assert round(tp8["tokens_per_s_per_sequence"]) == 95
    assert round(tp8["batch_1"]["tokens_per_s_per_sequence"]) == 117
    assert round(tp4pp2["step_s"] * 1e3, 1) == 8.6
    assert tp4pp2["tokens_per_s"] == pytest.approx(3740, rel=0.002)
    assert round(tp4pp2["tokens_per_s_per_sequence"]) == 58
    assert round(tp4pp2["batch_1"]["tokens_per_s_per_sequence"]) == 66
    # the formula: t = (W_r + KV_read) / BW + 2 (L / PP) t_AR + t_p2p, throughput (B / PP) / t
    w_r = 70_553_706_496 * 2 / 8
    t = (w_r + 32 * 2048 * 40960) / H100_BW + 2 * 40 * 12e-6 + 12e-6
    assert tp4pp2["step_s"] == pytest.approx(t, rel=1e-12)
    assert tp4pp2["tokens_per_s"] == pytest.approx(32 / t, rel=1e-12)
    assert tp4pp2["tokens_per_s_per_sequence"] == pytest.approx(1 / (2 * t), rel=1e-12)


def test_the_table_shows_the_step_intensity_and_the_ridge(capsys) -> None:
    """Arithmetic intensity = the step's FLOPs / the bytes it reads; the ridge = usable FLOP/s /
    usable bandwidth (H100: 989.4 TFLOP/s x 0.7 over 3.35 TB/s x 0.8 = 258 FLOP/B)."""
    argv = [a for a in EXAMPLE if a != "--json"]
    assert main(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("arithmetic intensity"))
    w_r = 70_553_706_496 * 2 / 8
    flops = 64 * 2 * (w_r / 2)  # 64 sequences x 2 FLOPs a bf16 weight (attention adds a little)
    intensity = flops / (w_r + 64 * 2048 * 40960)
    shown = float(row.split()[2])
    assert shown == pytest.approx(intensity, rel=0.03)
    assert "(ridge 258)" in row
