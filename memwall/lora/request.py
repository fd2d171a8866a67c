"""LoRARequest: which adapter a request runs with (vLLM's name and fields).

Plain data: it crosses from the API side to the engine core, which loads the adapter on the
workers the first time it is asked for (memwall/lora/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    """Unique per loaded adapter (>= 1); a reload under the same name gets a new id."""
    lora_path: str
    """A PEFT directory or a GGUF LoRA file."""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
