"""memwall: an LLM inference engine that reads like a textbook.

Public surface: ``LLM`` (offline batch API), ``SamplingParams`` (with
``StructuredOutputsParams``), ``RequestOutput``.
"""

import logging

from memwall.outputs import CompletionOutput, RequestOutput
from memwall.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

# Start-up facts (KV blocks, context window) go to stderr unless the application configures
# logging itself, as vLLM does.
_logger = logging.getLogger("memwall")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("memwall: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False


def __getattr__(name: str):
    # LLM pulls in torch and the model code: load it only when asked for, so that
    # `import memwall` stays cheap for tools that only need the data types.
    if name == "LLM":
        from memwall.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]
