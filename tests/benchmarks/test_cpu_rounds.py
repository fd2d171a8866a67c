"""benchmarks/cpu.py's rounds: each figure's median, and memwall / baseline per round."""

from __future__ import annotations

from benchmarks.cpu import median_result, round_ratios


def test_medians_skip_failed_rounds_and_ratios_pair_rounds() -> None:
    rounds = [
        {"memwall": {"decode_tok_s": 100.0, "prefill_tok_s": 900.0}, "llama.cpp": {"decode_tok_s": 80.0, "prefill_tok_s": 300.0}},
        {"memwall": {"decode_tok_s": 150.0, "prefill_tok_s": 1000.0}, "llama.cpp": {"decode_tok_s": 100.0, "prefill_tok_s": 310.0}},
        {"memwall": {"error": "crashed"}, "llama.cpp": {"decode_tok_s": 90.0, "prefill_tok_s": 290.0}},
    ]
    ours = median_result([r["memwall"] for r in rounds])
    assert ours["decode_tok_s"] == 125.0 and ours["prefill_tok_s"] == 950.0
    assert median_result([{"error": "x"}]) == {"error": "x"}
    ratios = round_ratios(rounds)["llama.cpp"]
    # rounds 1 and 2 only (round 3 has no memwall figure), each against its own baseline
    assert ratios["decode_tok_s"]["per_round"] == [1.25, 1.5]
    assert ratios["decode_tok_s"]["median"] == 1.375
    assert "batch_tok_s" not in ratios
