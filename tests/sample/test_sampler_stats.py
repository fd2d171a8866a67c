"""Goodness of fit: the sampler's empirical distribution against the analytic one.

Each case samples one fixed logits row N times in a single batched call (N identical rows), so
the draws are independent. The analytic reference follows the documented order: temperature,
then top-k, then top-p on the renormalised top-k distribution, then min-p.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from memwall.sample import Sampler
from memwall.sampling_params import SamplingParams

from sample_helpers import build_meta

LOGITS = np.array([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -1.5, -3.0])
N = 40_000
P_MIN = 1e-3


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def analytic(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> tuple[np.ndarray, list[int]]:
    """Float64 reference distribution, plus the support size after each filter."""
    probs = _softmax(logits / temperature)
    sizes = [int((probs > 0).sum())]
    if top_k:
        probs[np.argsort(-probs)[top_k:]] = 0.0
        probs /= probs.sum()
    sizes.append(int((probs > 0).sum()))
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p)) + 1  # smallest prefix reaching top_p
    probs[order[keep:]] = 0.0
    probs /= probs.sum()
    sizes.append(int((probs > 0).sum()))
    probs[probs < min_p * probs.max()] = 0.0
    probs /= probs.sum()
    sizes.append(int((probs > 0).sum()))
    return probs, sizes


def sample_counts(params: SamplingParams, n: int = N, seed: int = 0) -> np.ndarray:
    torch.manual_seed(seed)  # unseeded rows share the default generator
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(n, 1)  # [N, V]
    out = Sampler()(logits, build_meta([params] * n))
    return torch.bincount(out.sampled_token_ids, minlength=len(LOGITS)).numpy()


def assert_fits(counts: np.ndarray, expected: np.ndarray) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"masked tokens were sampled: {counts} vs {expected}"
    result = chisquare(counts[support], expected[support] * counts.sum())
    assert result.pvalue > P_MIN, f"counts {counts} do not fit {np.round(expected, 4)}: {result}"


CASES = {
    "temperature_0.7": dict(temperature=0.7),
    "temperature_1.5": dict(temperature=1.5),
    "top_k_3": dict(top_k=3),
    "top_p_0.8": dict(top_p=0.8),
    "min_p_0.2": dict(min_p=0.2),
    "combined": dict(temperature=1.5, top_k=7, top_p=0.8, min_p=0.35),
}


@pytest.mark.parametrize("kwargs", CASES.values(), ids=CASES.keys())
def test_distribution_matches_analytic(kwargs: dict) -> None:
    expected, _ = analytic(LOGITS, **kwargs)
    assert_fits(sample_counts(SamplingParams(**kwargs)), expected)


def test_cases_are_not_trivial() -> None:
    """Each filter in each case really removes tokens, or the test would not check it. In the
    combined case min-p applied before top-p would leave 3 tokens, so the order is checked too."""
    assert analytic(LOGITS, top_k=3)[1][1] == 3
    assert analytic(LOGITS, top_p=0.8)[1][2] == 4
    assert analytic(LOGITS, min_p=0.2)[1][3] == 4
    assert analytic(LOGITS, **CASES["combined"])[1] == [10, 7, 5, 4]


def test_chi_square_rejects_a_neighbouring_distribution() -> None:
    """Power check: T=0.7 samples must not pass as T=0.8, nor top_p=0.8 as plain T=1."""
    counts = sample_counts(SamplingParams(temperature=0.7))
    with pytest.raises(AssertionError):
        assert_fits(counts, analytic(LOGITS, temperature=0.8)[0])
    with pytest.raises(AssertionError):
        assert_fits(sample_counts(SamplingParams(top_p=0.8)), analytic(LOGITS)[0])


def test_per_row_params_apply_to_their_own_row() -> None:
    """A mixed batch: top_k=2 rows only ever give tokens 0/1, min_p rows stay in their support,
    plain rows reach the whole vocabulary."""
    n = 6_000
    params = [SamplingParams(top_k=2), SamplingParams(min_p=0.2), SamplingParams(temperature=2.0)] * n
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(len(params), 1)  # [3n, V]
    torch.manual_seed(1)
    tokens = Sampler()(logits, build_meta(params)).sampled_token_ids.view(n, 3)  # [n, 3]
    assert set(tokens[:, 0].tolist()) == {0, 1}
    assert set(tokens[:, 1].tolist()) == {0, 1, 2, 3}
    assert set(tokens[:, 2].tolist()) == set(range(len(LOGITS)))
