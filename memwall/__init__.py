"""memwall: an LLM inference engine that reads like a textbook.

Public surface: ``LLM`` (offline batch API), ``SamplingParams``, ``RequestOutput``.
"""

from memwall.outputs import CompletionOutput, RequestOutput
from memwall.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code: load it only when asked for, so that
    # `import memwall` stays cheap for tools that only need the data types.
    if name == "LLM":
        from memwall.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
