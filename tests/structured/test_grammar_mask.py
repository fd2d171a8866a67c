"""The sampler's grammar mask: bits to -inf, unconstrained rows untouched."""

from __future__ import annotations

import numpy as np
import torch

from memwall.sample.grammar_mask import apply_token_bitmask, stack_bitmask


def _mask(allowed: list[int], words: int) -> np.ndarray:
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_only_allowed_tokens_survive_and_other_rows_are_untouched():
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab)
    original = logits.clone()
    rows = [_mask([0, 31, 32, 63, 69], 3), None, _mask([5], 3)]
    apply_token_bitmask(logits, stack_bitmask(rows))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 32, 63, 69]
    assert torch.equal(logits[1], original[1])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [5]
    assert logits[0, 31] == original[0, 31]


def test_logits_wider_than_the_mask_disallow_the_padding():
    logits = torch.zeros(1, 40)  # the model has 8 padding rows past a 32-token tokenizer
    apply_token_bitmask(logits, stack_bitmask([np.full(1, -1, dtype=np.int32) & 0 | -1]))
    assert torch.isfinite(logits).all()  # an all-ones row means "no constraint"
    apply_token_bitmask(logits, stack_bitmask([_mask([1, 2], 1)]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 2]


def test_no_constrained_rows_means_no_mask():
    assert stack_bitmask([None, None]) is None
