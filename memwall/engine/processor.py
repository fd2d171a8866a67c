"""Processor: user input -> validated, tokenized EngineCoreRequests (one per sample when n > 1).

It runs on the API side: chat templates and tokenization happen here, never in the engine core.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memwall.engine.protocol import EngineCoreRequest
from memwall.lora.request import LoRARequest
from memwall.sampling_params import SamplingParams
from memwall.structured.backend import DEFAULT_BACKEND
from memwall.structured.backend import check as check_constraint
from memwall.tokenizer.tokenizer import Tokenizer

PromptType = str | list[int]


class InvalidRequestError(ValueError):
    """Bad input from a user: the message says what and how to fix it (server: HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class Processor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int,
                 max_num_seqs: int, structured_outputs_backend: str = DEFAULT_BACKEND) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.structured_outputs_backend = structured_outputs_backend

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
        """A conversation as token ids: the chat template applied, then encoded without adding
        special tokens (the template places them). The one place every entry point renders chats."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: give at least one character", "prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})", "prompt")
        return ids

    def make_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
        """One request per sample; samples 2..n are named ``{request_id}/{index}``."""
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids {bad_stop} are outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})", "stop_token_ids")
        max_tokens = self._resolve_max_tokens(prompt_ids, params)
        self.check_structured_outputs(params)
        if params.n > self.max_num_seqs:
            # The n samples run side by side; more than the engine runs at once would never start.
            raise InvalidRequestError(f"n={params.n} is more than this server runs at once "
                                      f"(max_num_seqs={self.max_num_seqs})", "n")
        eos = frozenset(self.tokenizer.eos_token_ids)
        children = [params] if params.n == 1 else [params.clone_for_child(i) for i in range(params.n)]
        requests = []
        for index, child_params in enumerate(children):
            child_id = request_id if params.n == 1 else f"{request_id}/{index}"
            if child_params.prompt_logprobs is not None and index > 0:
                # Only the first sample computes prompt logprobs; the others would repeat them.
                child_params = replace(child_params, prompt_logprobs=None)
            requests.append(EngineCoreRequest(child_id, list(prompt_ids), child_params, max_tokens,
                                              eos, lora_request=lora_request))
        return requests

    def check_structured_outputs(self, params: SamplingParams, param: str = "structured_outputs") -> None:
        """A schema, regex or grammar the backend will not compile is the user's error, found
        before the request is queued (the engine core compiles it again, off its step loop)."""
        if params.structured_outputs is None:
            return
        try:
            check_constraint(params.structured_outputs, self.structured_outputs_backend)
        except ValueError as e:  # GrammarError, or a backend that is not installed
            raise InvalidRequestError(str(e), param) from None

    def _resolve_max_tokens(self, prompt_ids: list[int], params: SamplingParams) -> int:
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {len(prompt_ids)} tokens: shorten the prompt", "prompt", "context_length_exceeded")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} = "
                f"{len(prompt_ids) + params.max_tokens}: reduce max_tokens or the prompt",
                "max_tokens", "context_length_exceeded")
        return params.max_tokens

