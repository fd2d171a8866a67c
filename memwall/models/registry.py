"""Which architectures memwall runs, by HF ``architectures`` name and ``model_type``."""

from __future__ import annotations

from torch import nn

from memwall.config import ModelArchConfig
from memwall.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def build_model(cfg: ModelArchConfig) -> nn.Module:
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {cfg.model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return LlamaForCausalLM(cfg)
