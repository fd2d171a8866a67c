"""OutputProcessor: the engine core's per-step news (EngineCoreOutput) -> RequestOutputs with text.

It runs on the API side and owns everything the core does not: one incremental detokenizer per
sample, stop strings (a sample that hits one is finished here and reported back so the core
aborts it), decorated logprobs, timing metrics, and the grouping of a request's n samples into
one RequestOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memwall.engine.protocol import EngineCoreOutput, EngineCoreRequest
from memwall.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from memwall.tokenizer.detokenizer import IncrementalDetokenizer
from memwall.tokenizer.tokenizer import Tokenizer


@dataclass
class _Sample:
    request_id: str
    index: int
    wants_logprobs: bool
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    """Output logprobs with decoded token strings, grown as tokens arrive."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    spec_counts: tuple[int, int, int] = (0, 0, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    wants_prompt_logprobs: bool
    metrics: RequestMetrics
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.sample_of: dict[str, tuple[_Parent, _Sample]] = {}
        self._aborted: dict[str, _Parent] = {}  # finished by abort(), reported by the next process()

    def add(self, request_id: str, prompt: str | None, requests: list[EngineCoreRequest]) -> None:
        first = requests[0]
        parent = _Parent(request_id, prompt, first.prompt_token_ids,
                         first.sampling_params.prompt_logprobs is not None,
                         RequestMetrics(arrival_time=first.arrival_time))
        for index, request in enumerate(requests):
            params = request.sampling_params
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            sample = _Sample(request.request_id, index, params.logprobs is not None, detok)
            parent.samples.append(sample)
            self.sample_of[request.request_id] = (parent, sample)
        self.parents[request_id] = parent

    @property
    def has_unfinished(self) -> bool:
        return bool(self.parents) or bool(self._aborted)

    def abort(self, request_id: str) -> list[str]:
        """Finishes the request's running samples as "abort" (their output comes with the next
        ``process``); returns the sample ids the engine core must abort."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        ids = [s.request_id for s in parent.samples if not s.finished]
        for sample in parent.samples:
            if not sample.finished:
                sample.finish_reason = "abort"
        if ids:
            self._aborted[request_id] = parent
        return ids

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step's news; returns the RequestOutputs of the touched requests (aborted
        ones first) and the sample ids that hit a stop string, which the core must abort."""
        touched, self._aborted = dict(self._aborted), {}
        stopped: list[str] = []
        now = time.monotonic()
        for out in core_outputs:
            entry = self.sample_of.get(out.request_id)
            if entry is None or entry[1].finished:
                continue  # finished here already (abort, stop string): the core's news is stale
            parent, sample = entry
            if self._apply(parent, sample, out, now):
                stopped.append(sample.request_id)
            touched[parent.request_id] = parent
        outputs = [self._output(p, now) for p in touched.values()]
        for parent in touched.values():
            if parent.finished:
                self._forget(parent)
        return outputs, stopped

    def _apply(self, parent: _Parent, sample: _Sample, out: EngineCoreOutput, now: float) -> bool:
        """True when the sample just hit a stop string (the core does not know it finished)."""
        metrics = parent.metrics
        if out.first_scheduled_time is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        if out.new_token_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.spec_counts != sample.spec_counts:
            sample.spec_counts = out.spec_counts
            totals = [sum(s.spec_counts[i] for s in parent.samples) for i in range(3)]
            metrics.num_draft_tokens, metrics.num_accepted_tokens, metrics.num_verify_steps = totals
        if out.new_prompt_logprobs:
            parent.prompt_logprobs.extend(self._decorate_all(out.new_prompt_logprobs))
        sample.token_ids.extend(out.new_token_ids)
        if sample.wants_logprobs and out.new_logprobs is not None:
            sample.logprobs.extend(self._decorate_all(out.new_logprobs))
        stop = sample.detok.update(out.new_token_ids)
        if out.finished:
            sample.finish_reason = out.finish_reason
            sample.stop_reason = stop if stop is not None else out.stop_reason
            return False
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            return True
        return False

    def _output(self, parent: _Parent, now: float) -> RequestOutput:
        completions = [self._completion(s) for s in parent.samples]
        finished = parent.finished
        if finished and parent.metrics.finished_time is None:
            parent.metrics.finished_time = now
        prompt_lp = parent.prompt_logprobs if parent.wants_prompt_logprobs and finished else None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             finished=finished, num_cached_tokens=parent.num_cached_tokens,
                             prompt_logprobs=prompt_lp, metrics=parent.metrics)

    def _completion(self, sample: _Sample) -> CompletionOutput:
        sent = sample.num_tokens_sent
        sample.num_tokens_sent = len(sample.token_ids)
        logprobs = list(sample.logprobs) if sample.wants_logprobs else None
        # The delta first: at finish it flushes the detokenizer's held-back tail into the text.
        delta_text = sample.detok.get_delta(sample.finished)
        return CompletionOutput(
            index=sample.index,
            text=sample.detok.output_text,
            token_ids=list(sample.token_ids),
            logprobs=logprobs,
            cumulative_logprob=_cumulative(sample.token_ids, logprobs),
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            delta_text=delta_text,
            delta_token_ids=sample.token_ids[sent:],
            delta_logprobs=logprobs[sent:] if logprobs is not None else None,
        )

    def _decorate_all(self, entries: list) -> list:
        return [None if e is None else self._decorate(e) for e in entries]

    def _decorate(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        return {tid: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([tid], skip_special_tokens=False))
                for tid, lp in entry.items()}

    def _forget(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        for sample in parent.samples:
            self.sample_of.pop(sample.request_id, None)


def _cumulative(token_ids: list[int], logprobs: list | None) -> float | None:
    if logprobs is None:
        return None
    return sum(entry[token].logprob for entry, token in zip(logprobs, token_ids)
               if entry is not None and token in entry)
