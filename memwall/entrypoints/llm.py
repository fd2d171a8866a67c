"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any, Sequence

from memwall.config import EngineArgs
from memwall.engine.llm_engine import LLMEngine
from memwall.engine.processor import PromptType
from memwall.outputs import RequestOutput
from memwall.lora.request import LoRARequest
from memwall.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """Runs a model in-process. ``model=None`` loads the embedded SmolLM2-135M-Instruct GGUF.

    Engine options are keyword arguments named as in ``EngineArgs`` (``max_num_seqs=...``,
    ``num_kv_blocks=...``, ``dtype=...``).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the engine's worker processes now (they also stop when the LLM is collected
        or the interpreter exits)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; outputs come back in the same order.
        ``lora_request``: one adapter for all prompts, or one (or None) per prompt (needs
        ``LLM(enable_lora=True)``)."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        loras = _as_lora_list(lora_request, len(prompt_list))
        ids = [str(next(self._ids)) for _ in prompt_list]
        try:
            for request_id, prompt, p, lora in zip(ids, prompt_list, params, loras):
                self.engine.add_request(request_id, prompt, p, lora)
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no half-queued batch
                self.engine.abort_request(request_id)
            self._drain()
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them. ``tools`` (OpenAI
        function definitions) and ``chat_template_kwargs`` go to the chat template, as in vLLM;
        the output is not parsed for calls here (the server's tool_choice does that)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c, add_generation_prompt, tools, chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The chat template applied and tokenized (special tokens come from the template)."""
        return self.engine.processor.render_chat(messages, add_generation_prompt, tools=tools,
                                                 **(chat_template_kwargs or {}))

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _as_lora_list(lora, count: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    loras = list(lora)
    if len(loras) != count:
        raise ValueError(f"{len(loras)} lora requests for {count} prompts")
    return loras


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
