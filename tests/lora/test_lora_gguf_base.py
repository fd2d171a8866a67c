"""LoRA over the embedded GGUF (Q4_1, kept quantized): memwall's greedy output equals transformers
+ PEFT on the same file (dequantized) with the same adapter, given as a PEFT directory and as a
GGUF LoRA file written as llama.cpp's convert_lora_to_gguf.py writes it (q/k B rows permuted)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from memwall import LLM, SamplingParams
from memwall.lora import LoRARequest
from tests.lora.test_gguf_lora import converter_permute, gguf_name

pytestmark = [pytest.mark.usefixtures("exact_kernels"), pytest.mark.slow]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = 16


@pytest.fixture(scope="module")
def peft_on_gguf(hf_gguf_model, tmp_path_factory):
    """(HF + PEFT model over the GGUF, the saved PEFT directory)."""
    import copy

    import peft

    base = copy.deepcopy(hf_gguf_model)  # PEFT wraps its layers in place
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0,
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.04)
    folder = tmp_path_factory.mktemp("smollm2-lora")
    model.save_pretrained(folder)
    return model.eval(), folder


def write_gguf_lora(path, peft_model, heads: int, kv_heads: int, alpha: float = 16.0):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, module in peft_model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        hf = name.removeprefix("base_model.model.")
        a = module.lora_A["default"].weight.detach().numpy().astype(np.float32)
        b = module.lora_B["default"].weight.detach().numpy().astype(np.float32)
        if hf.endswith(("q_proj", "k_proj")):
            b = converter_permute(b, heads, heads if hf.endswith("q_proj") else kv_heads)
        writer.add_tensor(f"{gguf_name(hf)}.lora_a", a)
        writer.add_tensor(f"{gguf_name(hf)}.lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@torch.no_grad()
def test_gguf_base_with_peft_and_gguf_adapters_equals_hf_peft(gguf_path, peft_on_gguf, tmp_path):
    model, folder = peft_on_gguf
    llm = LLM(str(gguf_path), num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = llm.render_chat([{"role": "user", "content": "Name three primary colors."}])
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    arch = llm.engine.core.executor.worker.loaded.arch
    gguf_file = write_gguf_lora(tmp_path / "lora.gguf", model, arch.num_attention_heads,
                                arch.num_key_value_heads)
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    base = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    runner = llm.engine.core.executor.worker.runner
    assert getattr(runner.fast_path, "runs_lora", False)  # decodes run fused in C, with LoRA
    for i, path in enumerate((folder, gguf_file), start=1):
        out = llm.generate([prompt], greedy, lora_request=LoRARequest(f"a{i}", i, str(path)))[0]
        assert out.outputs[0].token_ids == expected, path
    assert expected != base
