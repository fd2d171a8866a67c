"""A drafter's LM head over the first N token ids only (speculative_config
``"draft_vocab_size": N``), after FR-Spec (Zhao et al., 2025) and EAGLE-3's reduced draft
vocabulary: a drafted token costs its head's N rows instead of the whole vocabulary's.

Why it pays: drafting is one small forward per token, and the LM head is most of it. Qwen2.5-
Coder-0.5B's output matrix (151,936 x 896, Q8_0) is 145 MB of the 390 MB a token reads; an
EAGLE head's one layer is a few MB against SmolLM2's 49,152-row head. Why the first N ids:
byte-level BPE vocabularies (Llama 3, Qwen, SmolLM2) number their tokens in merge order, and
merges are learned most frequent first, so the first N ids are a frequency-ranked subset with
no corpus to count. Measured: the first 32,768 Qwen ids hold 96.2% of the tokens of HumanEval's
prompts and solutions; the first 16,384 SmolLM2 ids 91.7% of ShareGPT replies (32,768: 97.2%).

A draft outside the subset is impossible, so those positions are rejected, never wrong: the
target verifies every draft, and its distribution is untouched (rejection.py).
"""

from __future__ import annotations

import torch
from torch import nn


class DraftVocabError(ValueError):
    """A head that cannot be cut to N rows (one line, for users)."""


class DraftVocabHead(nn.Module):
    """Logits of token ids 0 .. N-1 from a model's LM head (its first N output rows, copied;
    q4/q8 rows packed into panels like the model's own weights). Greedy drafting needs only
    their argmax, which is the full head's argmax whenever that lies below N.

    ``four_bit``: the copy is rounded to 4-bit codes (int4, a scale and an offset per 32
    values) whatever the head's own type; N may then be the whole vocabulary. An EAGLE head
    drafts from the target's LM head (SmolLM2's is Q8_0): its 8,192 first rows are 5.0 MB as
    Q8_0 and 3.4 MB as int4, read once a drafted token."""

    def __init__(self, lm_head: nn.Module, size: int, four_bit: bool = False) -> None:
        super().__init__()
        from memwall.distributed.tensor_parallel import ShardError, take_rows

        vocab = lm_head.out_features
        if not 1 <= size <= vocab - (not four_bit):
            raise DraftVocabError(f"draft_vocab_size must be in 1..{vocab - 1} for this model's "
                                  f"{vocab}-token head, got {size}")
        rows = torch.arange(size, device=_device_of(lm_head))
        try:
            self.rows = take_rows(lm_head, rows)
        except ShardError as e:
            raise DraftVocabError(f"draft_vocab_size: the LM head cannot be cut ({e})") from None
        if four_bit:
            self.rows = _as_int4(self.rows)
        if rows.device.type == "cpu":
            from memwall.quant.packing import pack_model
            pack_model(self)

    @property
    def out_features(self) -> int:
        return self.rows.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rows(hidden).float()  # [n, size]: ids 0 .. size - 1


@torch.no_grad()  # not inference_mode: packing the result rewrites its codes in place
def _as_int4(layer: nn.Module) -> nn.Module:
    """``layer`` (any Linear or QuantLinear, bias-free) rounded to int4 codes. Its float weight
    is read back through its own forward on the identity: each output is one weight times
    1.0, so whatever its kernel and layout (packed panels permute codes in place), this is its
    weight as it computes it."""
    from memwall.quant.transform import quantize_model

    eye = torch.eye(layer.in_features, device=_device_of(layer))
    holder = nn.Module()
    holder.rows = nn.Linear(layer.in_features, layer.out_features, bias=False,
                            device=eye.device).requires_grad_(False)
    holder.rows.weight.copy_(layer(eye).float().t())
    quantize_model(holder, "int4")
    return holder.rows


def _device_of(module: nn.Module) -> torch.device:
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(module.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def draft_head(model: nn.Module, size: int | None, four_bit: bool = False):
    """What turns a drafter's hidden states into logits whose argmax is the draft:
    ``model.compute_logits`` (every id), or a DraftVocabHead over the first ``size`` ids (all
    of them when ``four_bit`` asks for a 4-bit copy)."""
    vocab = model.lm_head.out_features
    if four_bit:
        return DraftVocabHead(model.lm_head, min(size or vocab, vocab), four_bit=True)
    if size is None or size >= vocab:
        return model.compute_logits
    return DraftVocabHead(model.lm_head, size)
