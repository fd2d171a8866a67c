"""Speculative decoding: draft k tokens cheaply, verify them in one forward pass, keep the
longest prefix the target model agrees with (exactly: memwall/spec_decode/rejection.py).

    runner, after sampling:   proposer.propose(contexts, k per sequence) -> draft token ids
                              (RunnerOutput.draft_token_ids; DraftLengths picks each k)
    scheduler, next step:     the drafts join the sequence's chunk after its last token
                              (SchedulerOutput.spec_token_ids)
    runner:                   the 1 + k tokens run as k + 1 one-token attention rows
                              (worker/input_batch.py) -> logits [k + 1, vocab]
                              rejection.verify() -> accepted drafts + one sampled token
    scheduler.update:         appends them, frees blocks only rejected drafts filled

Proposers sit behind one small ABC (proposer.py):

    ngram         ngram.py        prompt lookup: the sequence's own earlier tokens
    draft_model   draft_model.py  a smaller model with the target's tokenizer, k greedy steps
                                  over its own paged KV cache (the worker loads the model and
                                  allocates that cache, then builds it)
    eagle         eagle.py        an EAGLE-1/2 head (published checkpoint layout) over the
                                  target's hidden states, which the runner hands it each step
    lookup_first  lookup_first.py prompt lookup where it matches and pays more, draft_model's
                                  or eagle's drafter elsewhere (on for those methods unless
                                  "lookup_first": false)
"""

from __future__ import annotations

from memwall.config import SpeculativeConfig
from memwall.spec_decode.proposer import DraftRequest, Proposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposers that need no model of their own (the worker builds a draft model's)."""
    if config.method == "ngram":
        from memwall.spec_decode.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"a {config.method} proposer is built by the worker, which loads its model")


__all__ = ["DraftRequest", "Proposer", "make_proposer"]
