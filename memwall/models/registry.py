"""Which architectures memwall runs, by HF ``architectures`` name and ``model_type``."""

from __future__ import annotations

from torch import nn

from memwall.config import ModelArchConfig
from memwall.models.gemma import GemmaForCausalLM
from memwall.models.llama import LlamaForCausalLM

# HF architecture name -> the class that computes it (one class covers a family's flags)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}
MODEL_TYPES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
               "qwen3": LlamaForCausalLM, "phi3": LlamaForCausalLM, "gemma2": GemmaForCausalLM,
               "gemma3_text": GemmaForCausalLM, "gemma3": GemmaForCausalLM}
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)


def build_model(cfg: ModelArchConfig) -> nn.Module:
    if cfg.model_type not in MODEL_TYPES:
        raise ValueError(f"model type {cfg.model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return MODEL_TYPES[cfg.model_type](cfg)
