"""LoRA adapters made locally with peft on the tiny random models (no hub): random, non-trivial
A and B, saved as PEFT writes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int, r: int = 8, alpha: int = 16,
                      targets=ALL_TARGETS, rslora: bool = False, scale: float = 0.3) -> Path:
    """A PEFT LoRA of the saved HF model ``base_dir`` with random A and B (B is zero after PEFT's
    own init, which would make the adapter a no-op)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                             use_rslora=rslora, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    wrapped.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int],
                max_tokens: int) -> list[int]:
    """HF + PEFT greedy continuation (the oracle)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def peft_adapters(tiny_model_dir, tmp_path_factory):
    """Factory: peft_adapters("llama") -> {name: adapter dir}: 4 adapters of different ranks and
    targets (built once per base kind)."""
    cache: dict[str, dict[str, Path]] = {}

    def make(kind: str = "llama") -> dict[str, Path]:
        if kind not in cache:
            base = tiny_model_dir(kind)
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            cache[kind] = {
                "all8": make_peft_adapter(base, root / "all8", seed=1, r=8),
                "qv4": make_peft_adapter(base, root / "qv4", seed=2, r=4, alpha=8,
                                         targets=["q_proj", "v_proj"]),
                "mlp16": make_peft_adapter(base, root / "mlp16", seed=3, r=16, alpha=16,
                                           targets=["gate_proj", "up_proj", "down_proj"]),
                "rs2": make_peft_adapter(base, root / "rs2", seed=4, r=2, alpha=4, rslora=True),
            }
        return cache[kind]

    return make
