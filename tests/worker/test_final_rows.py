"""final_rows: which rows of a step's hidden states each sequence made final (what the EAGLE
drafter records, and what train_eagle.py's FeatureTap keeps)."""

import torch

from memwall.core.step import RunnerOutput, SampledToken, SchedulerOutput
from memwall.worker.runner import final_rows


def test_a_mixed_step_splits_per_sequence_and_cuts_rejected_drafts():
    # a prompt chunk of 3 (positions 0-2), a decode (position 7), a verify of 1 + 3 drafts at
    # positions 20-23 of which one was accepted, and a verify whose drafts were all rejected
    sched = SchedulerOutput(num_scheduled_tokens={"chunk": 3, "decode": 1, "verify": 4, "none": 3},
                            spec_token_ids={"verify": [5, 6, 7], "none": [8, 9]})
    positions = torch.tensor([0, 1, 2, 7, 20, 21, 22, 23, 40, 41, 42])
    hidden = torch.arange(11, dtype=torch.float32)[:, None].repeat(1, 4)
    out = RunnerOutput(accepted_drafts={"verify": [SampledToken(5, None)]})

    got = [(rid, first, rows[:, 0].tolist()) for rid, first, rows in
           final_rows(sched, positions, hidden, out)]

    assert got == [("chunk", 0, [0.0, 1.0, 2.0]),
                   ("decode", 7, [3.0]),
                   ("verify", 20, [4.0, 5.0]),  # its token and the accepted draft, not 22-23
                   ("none", 40, [8.0])]  # every draft rejected: its token's row only


def test_an_empty_step_yields_nothing():
    assert list(final_rows(SchedulerOutput(), torch.empty(0, dtype=torch.long),
                           torch.empty(0, 4), RunnerOutput())) == []
