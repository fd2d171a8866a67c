"""benchmarks/quality.py's teacher-forced measures (llama-perplexity --kl-divergence's "Same top p"
and KL): the same greedy token given the same history, KL(reference || tested)."""

from __future__ import annotations

import math

import torch

from benchmarks.quality import forced_agreement


def test_identical_paths_agree_everywhere_with_zero_kl() -> None:
    logp = torch.log_softmax(torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)), -1)
    f = forced_agreement(list(logp), list(logp))
    assert f["same_top"] == 1.0 and abs(f["kl_mean"]) < 1e-12 and f["positions"] == 10


def test_one_flipped_position_of_four_and_its_kl() -> None:
    ref = torch.log(torch.tensor([[0.7, 0.2, 0.1]] * 4))
    tested = ref.clone()
    tested[2] = torch.log(torch.tensor([0.2, 0.7, 0.1]))  # another greedy token at position 2
    f = forced_agreement([tested[:3], tested[3:]], [ref[:3], ref[3:]])  # windows of any length
    assert f["same_top"] == 0.75 and f["positions"] == 4
    kl_flip = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert math.isclose(f["kl_mean"], kl_flip / 4, rel_tol=1e-5)  # float32 logs
