"""OutputProcessor: finished-or-growing Requests -> RequestOutputs with text.

It owns one incremental detokenizer per sample, finds stop strings (telling the engine which
requests must stop), and groups the n samples of a request into one RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memwall.outputs import CompletionOutput, Logprob, RequestOutput
from memwall.request import Request
from memwall.tokenizer.detokenizer import IncrementalDetokenizer
from memwall.tokenizer.tokenizer import Tokenizer


@dataclass
class _Sample:
    request: Request
    detok: IncrementalDetokenizer
    index: int
    num_tokens_sent: int = 0
    num_tokens_fed: int = 0
    logprobs: list = field(default_factory=list)
    """Output logprobs with decoded token strings, grown as tokens arrive."""


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.sample_of: dict[str, tuple[_Parent, _Sample]] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        parent = _Parent(request_id, prompt, children[0].prompt_token_ids)
        for index, child in enumerate(children):
            params = child.sampling_params
            detok = IncrementalDetokenizer(
                self.tokenizer, child.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            sample = _Sample(child, detok, index)
            parent.samples.append(sample)
            self.sample_of[child.request_id] = (parent, sample)
        self.parents[request_id] = parent

    def children(self, request_id: str) -> list[Request]:
        parent = self.parents.get(request_id)
        return [s.request for s in parent.samples] if parent else []

    def detokenize(self, updated: list[Request]) -> list[Request]:
        """Feeds new tokens to the detokenizers; returns requests that hit a stop string."""
        stopped = []
        for request in updated:
            _, sample = self.sample_of[request.request_id]
            new_ids = request.output_token_ids[sample.num_tokens_fed:]
            sample.num_tokens_fed = request.num_output_tokens
            stop = sample.detok.update(new_ids)
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                stopped.append(request)
            elif stop is not None:
                request.stop_reason = stop
        return stopped

    def make_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per parent with a touched sample; forgets finished parents."""
        parents: dict[str, _Parent] = {}
        for request in touched:
            entry = self.sample_of.get(request.request_id)
            if entry is not None:
                parents[entry[0].request_id] = entry[0]
        outputs = [self._output(p) for p in parents.values()]
        for parent in parents.values():
            if parent.finished:
                self._forget(parent)
        return outputs

    def _output(self, parent: _Parent) -> RequestOutput:
        completions = [self._completion(s) for s in parent.samples]
        first = parent.samples[0].request
        prompt_lp = first.prompt_logprobs if first.sampling_params.prompt_logprobs is not None else None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             finished=parent.finished, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=self._decorate_all(prompt_lp) if parent.finished else None)

    def _completion(self, sample: _Sample) -> CompletionOutput:
        request = sample.request
        finished = request.is_finished
        sent = sample.num_tokens_sent
        sample.num_tokens_sent = request.num_output_tokens
        logprobs = None
        if request.sampling_params.logprobs is not None:
            fresh = request.output_logprobs[len(sample.logprobs):]
            sample.logprobs.extend(self._decorate_all(fresh))
            logprobs = list(sample.logprobs)
        # The delta first: at finish it flushes the detokenizer's held-back tail into the text.
        delta_text = sample.detok.get_delta(finished)
        return CompletionOutput(
            index=sample.index,
            text=sample.detok.output_text,
            token_ids=list(request.output_token_ids),
            logprobs=logprobs,
            cumulative_logprob=_cumulative(request, logprobs),
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            delta_text=delta_text,
            delta_token_ids=request.output_token_ids[sent:],
            delta_logprobs=logprobs[sent:] if logprobs is not None else None,
        )

    def _decorate_all(self, entries: list | None) -> list | None:
        if entries is None:
            return None
        return [None if e is None else self._decorate(e) for e in entries]

    def _decorate(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        return {tid: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([tid], skip_special_tokens=False))
                for tid, lp in entry.items()}

    def _forget(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        for sample in parent.samples:
            self.sample_of.pop(sample.request.request_id, None)


def _cumulative(request: Request, logprobs: list | None) -> float | None:
    if logprobs is None:
        return None
    return sum(entry[token].logprob for entry, token in zip(logprobs, request.output_token_ids)
               if entry is not None and token in entry)
