"""LLMEngine: the synchronous API-side engine shared by the offline API, the CLI and the server.

    add_request -> Processor (tokenize, validate, fan out n) -> core.add_request
    step():  core.step() -> EngineCoreOutputs (token ids) -> OutputProcessor (detokenize, stop
             strings, logprob text, metrics) -> RequestOutputs; stop-string hits -> core.abort

``core`` is an ``EngineCore`` in this process (offline ``LLM``, the CLI) or a client of one in
a process of its own (``memwall serve``: memwall/engine/core_client.py); both answer the same
calls with the same plain data.
"""

from __future__ import annotations

import logging
from typing import Protocol

from memwall.config import EngineArgs
from memwall.engine.output_processor import OutputProcessor
from memwall.engine.processor import InvalidRequestError, Processor, PromptType
from memwall.engine.protocol import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, EngineStats
from memwall.outputs import RequestOutput
from memwall.lora.request import LoRARequest
from memwall.sampling_params import SamplingParams
from memwall.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("memwall")


class CoreClient(Protocol):
    """What LLMEngine needs of an engine core (EngineCore itself, or a client of one)."""

    info: EngineCoreInfo

    def add_request(self, first: EngineCoreRequest, forks: list[EngineCoreRequest] = ()) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def remove_lora(self, lora_int_id: int) -> None: ...
    def step(self) -> EngineCoreOutputs: ...
    def has_unfinished_requests(self) -> bool: ...
    def shutdown(self) -> None: ...


class LLMEngine:
    def __init__(self, core: CoreClient, tokenizer: Tokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        info = core.info
        self.processor = Processor(tokenizer, info.max_model_len, info.vocab_size, info.max_num_seqs,
                                   info.structured_outputs_backend)
        self.outputs = OutputProcessor(tokenizer)
        self.stats = core.stats() if hasattr(core, "stats") else EngineStats()
        logger.info("%s: %s", self.model_name, self.describe())

    @classmethod
    def from_args(cls, args: EngineArgs, loaded=None) -> "LLMEngine":
        """An engine core in this process (with data_parallel_size > 1: a core process per
        replica, memwall/engine/dp_client.py). ``loaded``: a LoadedModel already in memory
        (tests, benchmarks); by default ``args.model`` is loaded."""
        if args.data_parallel_size > 1:
            if loaded is not None:
                raise ValueError("data_parallel_size > 1 loads the model in each replica's "
                                 "process: pass the model's path, not a loaded model")
            from memwall.engine.dp_client import DPCoreClient
            from memwall.loader.model_loader import load_tokenizer
            return cls(DPCoreClient(args), load_tokenizer(args.model, args.tokenizer))
        from memwall.engine.core import EngineCore
        from memwall.executor.uniproc import UniProcExecutor

        if loaded is None and args.parallel_config().world_size > 1:
            from memwall.executor import make_executor
            from memwall.loader.model_loader import load_tokenizer
            return cls(EngineCore(args, make_executor(args)),
                       load_tokenizer(args.model, args.tokenizer))
        executor = UniProcExecutor(args, loaded)
        core = EngineCore(args, executor)
        return cls(core, executor.worker.loaded.tokenizer)

    @property
    def model_name(self) -> str:
        return self.core.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.info.vocab_size

    def describe(self) -> str:
        return self.core.info.description

    @property
    def num_free_blocks(self) -> int:
        """KV blocks free after the last step (from the core's stats)."""
        return self.stats.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.stats.num_total_blocks

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> list[int]:
        """Queues a request (through ``lora_request``'s adapter, if given); returns its prompt
        token ids. Raises InvalidRequestError on bad input."""
        if request_id in self.outputs.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.processor.tokenize(prompt)
        requests = self.processor.make_requests(request_id, prompt_ids, params, lora_request)
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, requests)
        # Samples 2..n fork the first one's KV once its prompt is done (no second prefill).
        self.core.add_request(requests[0], requests[1:])
        return prompt_ids

    def abort_request(self, request_id: str) -> None:
        """Stops a request (all of its samples) wherever it is; its blocks are freed at once.
        Its final output (finish_reason "abort") comes with the next step."""
        ids = self.outputs.abort(request_id)
        if ids:
            self.core.abort_requests(ids)

    def remove_lora(self, lora_int_id: int) -> None:
        """The adapter takes no new requests (the API side forgot its name); the workers drop
        it once its running requests end."""
        self.core.remove_lora(lora_int_id)

    def set_watched(self, watched: bool) -> None:
        """A dashboard page is open (or none is any more): the core builds its block map
        only meanwhile (memwall/core/live_trace.py)."""
        if hasattr(self.core, "set_watched"):
            self.core.set_watched(watched)

    def has_unfinished_requests(self) -> bool:
        """Requests the API side waits on, or work the core still owes (an abort's freeing)."""
        return self.outputs.has_unfinished or self.core.has_unfinished_requests()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step() if self.core.has_unfinished_requests() else None
        if core_outputs is not None:
            self.stats = core_outputs.stats
        elif hasattr(self.core, "stats"):  # nothing ran: an abort may still have freed blocks
            self.stats = self.core.stats()
        outputs, stopped = self.outputs.process(core_outputs.outputs if core_outputs else [])
        if stopped:  # a stop string, found here in the text: the core must stop them too
            self.core.abort_requests(stopped)
            if hasattr(self.core, "stats"):  # its blocks are free now, not after the next step
                self.stats = self.core.stats()
        return outputs

    def shutdown(self) -> None:
        self.core.shutdown()
