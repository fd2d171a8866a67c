"""quantize_model on whole models: a tiny random Llama from a float checkpoint, and the
embedded SmolLM2 Q4_1 GGUF kept quantized in memory, both against the float model. GGUF
weights name the checkpoint's layers, so those models are quantized before fuse_projections()
joins q/k/v and gate/up (as the loader does)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig
from memwall.loader.gguf_loader import gguf_hf_config, iter_gguf_tensors, open_gguf
from memwall.loader.hf_loader import iter_hf_tensors, read_hf_config
from memwall.loader.model_loader import LoadedModel, load_model
from memwall.kernels.cpu import quant_ops
from memwall.quant import QuantLinear, gguf_quantized_linears, quantize_model
from memwall.quant.gguf_repack import repack
from memwall.models.registry import build_model
from memwall.quant.transform import ConcatLinear
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

BLOCK = 16


def _cache(arch, tokens: int):
    blocks = tokens // BLOCK + 1
    return allocate_kv_cache(arch, KVCachePlan(blocks, BLOCK, 0), torch.float32), list(range(blocks))


def run(model: nn.Module, arch, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of one prefill over ids."""
    caches, table = _cache(arch, len(ids))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [table], BLOCK)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), caches, meta))


@torch.no_grad()
def greedy(model: nn.Module, arch, ids: list[int], n: int) -> list[int]:
    """n greedy tokens: one prefill, then one-token decode steps on the paged cache."""
    caches, table = _cache(arch, len(ids) + n)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [table], BLOCK)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    out = [int(model.compute_logits(hidden[-1:]).argmax())]
    for pos in range(len(ids), len(ids) + n - 1):
        meta = AttentionMetadata.build([1], [pos + 1], [table], BLOCK)
        hidden = model(torch.tensor([out[-1]]), torch.tensor([pos]), caches, meta)
        out.append(int(model.compute_logits(hidden).argmax()))
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")))


def unfused(config: dict, tensors) -> nn.Module:
    """A float model as the checkpoint lays it out (q_proj, k_proj, ... not yet fused)."""
    model = build_model(ModelArchConfig.from_hf_dict(config))
    model.load_weights(tensors)
    return model.eval()


# This random model amplifies weight noise ~5x into its logits (0.6% random noise on every
# weight gives 2.7%); int8 adds 0.6% a layer, int4 (4 bits of Gaussian weights) ~8%.
@pytest.mark.parametrize("method, tol", [("int8", 0.06), ("int4", 0.5)])
def test_tiny_llama_quantized_stays_close_to_float(tiny, method, tol):
    model = copy.deepcopy(tiny.model)
    report = quantize_model(model, method)
    assert not report.kept_float and report.quant_bytes < report.float_bytes / 2.5
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    ref, got = run(tiny.model, tiny.arch, ids), run(model, tiny.arch, ids)
    assert ((got - ref).norm() / ref.norm()).item() < tol
    if method == "int8":
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_unjoinable_fused_parts_become_a_concat_linear(tiny_model_dir, tiny):
    """q/k/v whose parts come in types one kernel cannot share (e.g. Q4_K q, Q6_K v) fuse into
    a ConcatLinear."""
    path = tiny_model_dir("llama")
    model = unfused(read_hf_config(path), iter_hf_tensors(path, torch.float32))
    attn = model.model.layers[0].self_attn
    q, k, v = (attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach())
    qkv = torch.cat([q, k, v])
    from memwall.quant.int4_cpu import Int4WeightOnly
    from memwall.quant.int8_cpu import Int8WeightOnly
    raw = {"model.layers.0.self_attn.q_proj": Int8WeightOnly().create_weights(q),
           "model.layers.0.self_attn.k_proj": Int4WeightOnly(32).create_weights(k),
           "model.layers.0.self_attn.v_proj": Int8WeightOnly().create_weights(v)}
    quantize_model(model, None, raw)
    model.fuse_projections()
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, ConcatLinear)
    assert type(model.model.layers[1].self_attn.qkv_proj) is nn.Linear  # method None: float
    x = torch.randn(3, qkv.shape[1])
    ref = nn.functional.linear(x, qkv, tiny.model.model.layers[0].self_attn.qkv_proj.bias)
    got = model.model.layers[0].self_attn.qkv_proj(x)
    assert ((got - ref).norm() / ref.norm()).item() < 0.15


def test_gguf_weights_for_unknown_layers_are_an_error(tiny):
    w = repack(torch.zeros(64, 18 * 2, dtype=torch.uint8), 2, (64, 64))  # Q4_0
    with pytest.raises(ValueError, match="match no Linear"):
        quantize_model(copy.deepcopy(tiny.model), None, {"model.nope": w})
    # a fused model has no q_proj any more: the error says to quantize first
    w = repack(torch.zeros(64, 18 * 2, dtype=torch.uint8), 2, (64, 64))
    with pytest.raises(ValueError, match="before fuse_projections"):
        quantize_model(copy.deepcopy(tiny.model), None, {"model.layers.0.self_attn.q_proj": w})


@pytest.fixture(scope="module")
def smollm(gguf_path):
    ref = load_model(str(gguf_path), quantization="none")
    reader = open_gguf(gguf_path)
    config = gguf_hf_config(reader)
    model = unfused(config, iter_gguf_tensors(reader, config))
    report = quantize_model(model, None, gguf_quantized_linears(reader, config))
    model.fuse_projections()
    return ref, LoadedModel(model, ref.arch, ref.tokenizer, "quantize_model"), report


PROMPTS = ["Name three primary colors.", "What is the capital of France?",
           "Write one sentence about the sea."]


def _chat(loaded, text: str) -> list[int]:
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True)
    return loaded.tokenizer.encode(prompt, add_special_tokens=False)


def test_smollm2_gguf_is_quantized_in_memory(smollm):
    _, quant, report = smollm
    assert len(report.quantized) == 7 * 30 + 1 and not report.kept_float  # q, k, v, o, gate, up, down
    assert report.quant_bytes < report.float_bytes / 4
    linears = [m for m in quant.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * 30 + 1 and not any(type(m) is nn.Linear for m in quant.model.modules())


def test_smollm2_gguf_quantized_agrees_with_float(smollm):
    """Teacher-forced: the quantized model's argmax on the float model's greedy continuation.
    With the native kernels (fp32 throughout) free-running greedy tokens are checked too."""
    ref, quant, _ = smollm
    agree = total = 0
    for text in PROMPTS:
        ids = _chat(ref, text)
        tokens = greedy(ref.model, ref.arch, ids, 16)
        seq = ids + tokens
        a = run(ref.model, ref.arch, seq)[len(ids) - 1:-1].argmax(-1)
        b = run(quant.model, quant.arch, seq)[len(ids) - 1:-1].argmax(-1)
        agree += int((a == b).sum())
        total += len(tokens)
        if quant_ops.available():
            assert greedy(quant.model, quant.arch, ids, 16) == tokens
    assert agree / total >= 0.9


def test_load_model_keeps_gguf_weights_quantized(smollm, gguf_path):
    """The loader's default path equals quantize_model on a float load, module for module,
    and gives the same logits."""
    _, quant, _ = smollm
    loaded = load_model(str(gguf_path))  # quantization="auto"
    mods = dict(quant.model.named_modules())
    for name, module in loaded.model.named_modules():
        if isinstance(module, QuantLinear):
            other = mods[name]
            assert isinstance(other, QuantLinear) and other.source == module.source
            for (bname, buf), (_, obuf) in zip(module.named_buffers(), other.named_buffers()):
                assert torch.equal(buf, obuf), (name, bname)
    assert not any(type(m) is nn.Linear for m in loaded.model.modules())
    ids = _chat(loaded, PROMPTS[0])
    assert greedy(loaded.model, loaded.arch, ids, 8) == greedy(quant.model, quant.arch, ids, 8)
