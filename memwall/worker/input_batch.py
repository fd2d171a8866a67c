"""The worker's persistent view of the running requests, and one step's inputs built from it.

``RequestRows`` keeps one numpy row per request the worker holds, updated from the deltas of
each ``SchedulerOutput`` (memwall/core/step.py): a decode step writes one token and at most one
block id per sequence. ``StepInputs`` is then a handful of vectorized gathers over those rows
and one upload, instead of flattening Python lists every step:

    rows (persistent)          token_ids [rows, len]   block_table [rows, blocks]   num_tokens
    step (per call)            input_ids [T]  positions [T]  slot_mapping [T]  seq_lens [S]
                               block_tables [S, max blocks of this step]

Draft tokens to verify (speculative decoding) are written into a row past its known tokens
(``num_tokens`` does not count them) and run like any other tokens; attention, though, sees a
verified sequence as one single-token row per token, each as long as the sequence up to it and
sharing its block table, so the one-token kernels (the fused CPU decode step) verify them:

    sequence a: t5 d1 d2 d3 at positions 5..8     ->   attention rows  a@6  a@7  a@8  a@9
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from memwall.attention.metadata import one_token_rows
from memwall.core.step import CachedRequestData, NewRequestData, SchedulerOutput
from memwall.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the worker keeps of a request besides its row of tokens and blocks."""

    request_id: str
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    num_prompt_tokens: int
    num_prompt_logprobs_done: int = 0
    lora_id: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.sampling_params.prompt_logprobs is not None
                and self.num_prompt_logprobs_done < self.num_prompt_tokens)


class RequestRows:
    """Rows of token ids and block ids, one per held request; freed rows are reused."""

    def __init__(self, num_rows: int, max_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.token_ids = np.zeros((num_rows, min(max_len, 1024)), dtype=np.int64)
        self.block_table = np.zeros((num_rows, -(-self.token_ids.shape[1] // block_size)),
                                    dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.num_computed = np.zeros(num_rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.states: dict[str, RequestState] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    # ---- deltas ----------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_ids:
            self.remove(request_id)
        for request_id in sched.preempted_ids:
            self.remove(request_id)
        for new in sched.new_requests:
            self.add(new)
        if sched.cached_requests:
            self.apply_all(sched.cached_requests)
        for request_id, drafts in sched.spec_token_ids.items():
            self.stage_drafts(request_id, drafts)

    def stage_drafts(self, request_id: str, drafts: list[int]) -> None:
        """Writes draft tokens after the row's known tokens without counting them: the next
        step's delta overwrites them with what was accepted."""
        row = self.row_of[request_id]
        count = int(self.num_tokens[row])
        if count + len(drafts) > self.token_ids.shape[1]:
            self._fit(count + len(drafts), 0)
        self.token_ids[row, count:count + len(drafts)] = drafts

    def apply_all(self, cached: list[CachedRequestData]) -> None:
        """Deltas of held requests. The usual decode case (one new token each) is a few
        vectorized writes for the whole batch; new block ids and longer deltas go one by one."""
        single = [c for c in cached if len(c.new_token_ids) == 1]
        if len(single) != len(cached):
            for c in cached:
                if len(c.new_token_ids) != 1:
                    self.apply(c)
        if not single:
            return
        rows = np.fromiter((self.row_of[c.request_id] for c in single), np.int64, len(single))
        counts = self.num_tokens[rows]
        if int(counts.max()) + 1 > self.token_ids.shape[1]:
            self._fit(int(counts.max()) + 1, 0)
        self.token_ids[rows, counts] = [c.new_token_ids[0] for c in single]
        self.num_tokens[rows] = counts + 1
        self.num_computed[rows] = [c.num_computed_tokens for c in single]
        for c, row in zip(single, rows.tolist()):
            if c.new_block_ids or 0 <= c.num_blocks != self.num_blocks[row]:
                self._append_blocks(row, c.new_block_ids, c.num_blocks)

    def _append_blocks(self, row: int, new_blocks: list[int], total: int = -1) -> None:
        """``total`` >= 0: the table's length after the append (it may have shrunk first)."""
        blocks = int(self.num_blocks[row]) if total < 0 else total - len(new_blocks)
        if blocks + len(new_blocks) > self.block_table.shape[1]:
            self._fit(0, blocks + len(new_blocks))
        self.block_table[row, blocks:blocks + len(new_blocks)] = new_blocks
        self.num_blocks[row] = blocks + len(new_blocks)

    def add(self, new: NewRequestData) -> None:
        """A request the worker does not hold yet (or holds stale: it is replaced)."""
        self.remove(new.request_id)
        tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
        self._fit(tokens, len(new.block_ids))
        row = self._take_row()
        self.row_of[new.request_id] = row
        prompt_len = len(new.prompt_token_ids)
        self.token_ids[row, :prompt_len] = new.prompt_token_ids
        self.token_ids[row, prompt_len:tokens] = new.output_token_ids
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_tokens[row], self.num_blocks[row] = tokens, len(new.block_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.states[new.request_id] = RequestState(new.request_id, new.sampling_params,
                                                   new.eos_token_ids, prompt_len,
                                                   new.num_prompt_logprobs_done, new.lora_id)

    def apply(self, cached: CachedRequestData) -> None:
        row = self.row_of[cached.request_id]
        count, new_tokens = int(self.num_tokens[row]), cached.new_token_ids
        if count + len(new_tokens) > self.token_ids.shape[1]:
            self._fit(count + len(new_tokens), 0)
        self.token_ids[row, count:count + len(new_tokens)] = new_tokens
        if cached.new_block_ids or cached.num_blocks >= 0:
            self._append_blocks(row, cached.new_block_ids, cached.num_blocks)
        self.num_tokens[row] = count + len(new_tokens)
        self.num_computed[row] = cached.num_computed_tokens

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
            self.states.pop(request_id, None)

    def output_ids(self, request_id: str) -> np.ndarray:
        row, state = self.row_of[request_id], self.states[request_id]
        return self.token_ids[row, state.num_prompt_tokens:self.num_tokens[row]]

    def prompt_ids(self, request_id: str) -> np.ndarray:
        return self.token_ids[self.row_of[request_id], :self.states[request_id].num_prompt_tokens]

    # ---- growth ----------------------------------------------------------------------------
    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.token_ids.shape[0]
            self._grow_rows(2 * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow_rows(self, rows: int) -> None:
        for name in ("token_ids", "block_table", "num_tokens", "num_blocks", "num_computed"):
            old = getattr(self, name)
            new = np.zeros((rows, *old.shape[1:]), dtype=old.dtype)
            new[:old.shape[0]] = old
            setattr(self, name, new)

    def _fit(self, tokens: int, blocks: int) -> None:
        """Widens the rows (doubling) so a request can hold ``tokens`` tokens and ``blocks`` blocks."""
        for name, need in (("token_ids", tokens), ("block_table", blocks)):
            old = getattr(self, name)
            if need > old.shape[1]:
                new = np.zeros((old.shape[0], max(need, 2 * old.shape[1])), dtype=old.dtype)
                new[:, :old.shape[1]] = old
                setattr(self, name, new)


@dataclass
class PromptLogprobRows:
    """Rows of the logits that score prompt tokens for one request."""

    request_id: str
    rows: list[int]  # indexes into the logits rows
    targets: list[int]  # the prompt token each row predicts
    top_k: int  # how many top candidates the request asked for


@dataclass
class VerifyRows:
    """The logits rows of one sequence's verified drafts: row i predicts the token after
    draft i - 1 (row 0: after the last known token), so there is one row more than drafts."""

    request_id: str
    rows: list[int]  # indexes into the logits rows
    draft_token_ids: list[int]


@dataclass
class StepInputs:
    """One step's flat token axis and where every token sits in the paged KV cache.

    ``query_lens``, ``seq_lens`` and ``block_tables`` are attention's view of the step: a
    sequence verifying drafts appears there as one single-token row per token (module doc).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: np.ndarray  # [S] tokens of each scheduled sequence this step
    seq_lens: np.ndarray  # [S] KV length of each sequence after this step
    block_tables: torch.Tensor  # [S, max_blocks] int64 (padded with 0)
    logit_token_index: list[int]
    """Flat token index of every row of logits to compute (sampling rows first)."""
    sampling_ids: list[str]
    """Requests that sample this step, in the order of the first logits rows (a fork child
    shares its parent's row: both are predicted by the same last prompt token)."""
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    verify: list[VerifyRows] = field(default_factory=list)
    """Sequences verifying drafts; their logits rows follow the sampling rows."""

    @classmethod
    def build(cls, rows: RequestRows, sched: SchedulerOutput,
              device: torch.device | str = "cpu") -> "StepInputs":
        ids = list(sched.num_scheduled_tokens)
        row_index = np.fromiter((rows.row_of[i] for i in ids), dtype=np.int64, count=len(ids))
        query_lens = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(ids))
        start = rows.num_computed[row_index]
        seq_lens = start + query_lens
        ends = np.cumsum(query_lens)
        total = int(ends[-1])
        if total == len(ids):  # every sequence runs one token: no repeat needed
            tok_rows, positions = row_index, start
        else:
            tok_rows = np.repeat(row_index, query_lens)
            positions = np.arange(total) - np.repeat(ends - query_lens - start, query_lens)
        bs = rows.block_size
        input_ids = rows.token_ids[tok_rows, positions]
        slots = rows.block_table[tok_rows, positions // bs] * bs + positions % bs
        width = -(-int(seq_lens.max()) // bs)
        tables = rows.block_table[row_index, :width]
        spec = _num_drafts(sched, ids)
        samples = seq_lens - spec == rows.num_tokens[row_index] if spec is not None else (
            seq_lens == rows.num_tokens[row_index])
        plain = samples if spec is None else samples & (spec == 0)
        sample_index = (ends - 1)[plain].tolist()
        sampling_ids = [i for i, s in zip(ids, plain.tolist()) if s]
        logit_index, sampling = _with_forks(sched, sampling_ids, sample_index)
        verify = []
        if spec is not None:
            for i in np.flatnonzero(spec).tolist():
                first = len(logit_index)
                logit_index.extend(range(int(ends[i]) - int(spec[i]) - 1, int(ends[i])))
                verify.append(VerifyRows(ids[i], list(range(first, len(logit_index))),
                                         sched.spec_token_ids[ids[i]]))
        attn_query, attn_seq, attn_tables = (query_lens, seq_lens, tables) if spec is None else (
            one_token_rows(spec > 0, query_lens, start, seq_lens, tables))
        inputs = cls(_upload(input_ids, device), _upload(positions, device), _upload(slots, device),
                     attn_query, attn_seq, _upload(attn_tables, device), logit_index, sampling,
                     verify=verify)
        inputs._add_prompt_logprobs(rows, ids, start, ends - query_lens, query_lens)
        return inputs

    def _add_prompt_logprobs(self, rows: RequestRows, ids: list[str], start: np.ndarray,
                             offsets: np.ndarray, query_lens: np.ndarray) -> None:
        """Positions p of a chunk whose next token p + 1 is a prompt token not yet scored."""
        for i, request_id in enumerate(ids):
            state = rows.states[request_id]
            if not state.wants_prompt_logprobs:
                continue
            first = state.num_prompt_logprobs_done  # entries collected (position 0 counts as one)
            row = rows.row_of[request_id]
            flat, targets = [], []
            for pos in range(int(start[i]), int(start[i] + query_lens[i])):
                if first <= pos + 1 < state.num_prompt_tokens:
                    flat.append(int(offsets[i]) + pos - int(start[i]))
                    targets.append(int(rows.token_ids[row, pos + 1]))
            rows_at = list(range(len(self.logit_token_index), len(self.logit_token_index) + len(flat)))
            self.logit_token_index.extend(flat)
            state.num_prompt_logprobs_done += len(flat)
            self.prompt_rows.append(PromptLogprobRows(request_id, rows_at, targets,
                                                      state.sampling_params.prompt_logprobs or 0))


def _num_drafts(sched: SchedulerOutput, ids: list[str]) -> np.ndarray | None:
    """[S] drafts each scheduled sequence verifies, or None in a step without any."""
    if not sched.spec_token_ids:
        return None
    return np.fromiter((len(sched.spec_token_ids.get(i, ())) for i in ids), np.int64, len(ids))


def _with_forks(sched: SchedulerOutput, sampling_ids: list[str],
                sample_index: list[int]) -> tuple[list[int], list[str]]:
    """Fork children sample from their parent's logits row, right after it."""
    if not sched.forks:
        return sample_index, sampling_ids
    children: dict[str, list[str]] = {}
    for fork in sched.forks:
        children.setdefault(fork.parent_id, []).append(fork.request_id)
    index, ids = [], []
    for request_id, flat in zip(sampling_ids, sample_index):
        for rid in (request_id, *children.get(request_id, ())):
            index.append(flat)
            ids.append(rid)
    return index, ids


def _upload(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if torch.device(device).type == "cpu" else tensor.to(device, non_blocking=True)
