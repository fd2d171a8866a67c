"""Multi-LoRA serving: many fine-tuned variants of one base model in the same steps.

    request.py      LoRARequest (plain data: name, id, path), what a request names
    adapter.py      LoRAAdapter: an adapter's A/B per module, scaling folded in
    peft.py         PEFT directories -> LoRAAdapter (load_adapter picks PEFT or GGUF)
    gguf_lora.py    llama.cpp's GGUF LoRA files -> LoRAAdapter
    slots.py        LoRASlots: the resident adapters in the layout the kernels read
    layers.py       LoRAProjection / apply_lora: the torch path (decode.c has the native one)
    worker_lora.py  the worker's host cache and slots, filled per step
    registry.py     the engine core's side: loads on a thread, host-cache eviction, cache keys

Importing the package loads no torch (the engine core imports request.py and registry.py).
"""

from memwall.lora.request import LoRARequest

__all__ = ["LoRARequest"]
