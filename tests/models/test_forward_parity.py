"""Model forward passes against HF transformers on tiny random checkpoints (float32).

Logits must match at atol 1e-4 / rtol 1e-4 whether the prompt runs in one pass, in chunks, or
token by token through the paged KV cache.
"""

from __future__ import annotations

import pytest
import torch

from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig
from memwall.loader.hf_loader import iter_hf_tensors, read_hf_config
from memwall.models.registry import build_model
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

ATOL = RTOL = 1e-4
KINDS = ["llama", "llama3", "llama_tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


def load_ours(path):
    arch = ModelArchConfig.from_hf_dict(read_hf_config(path))
    model = build_model(arch)
    model.load_weights(iter_hf_tensors(path, torch.float32))
    return model.eval(), arch


def hf_logits(path, ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def run_chunks(model, arch, ids, chunk_sizes, block_size=4):
    """Feeds ``ids`` in chunks of the given sizes through the paged cache; returns all logits."""
    plan = KVCachePlan(num_blocks=64, block_size=block_size, bytes_per_block=0)
    caches = allocate_kv_cache(arch, plan, torch.float32)
    # Deliberately scattered blocks: a paged cache must not care where blocks are.
    table = list(range(63, 63 - (len(ids) // block_size + 1), -1))
    logits, start = [], 0
    for size in chunk_sizes:
        end = start + size
        meta = AttentionMetadata.build([size], [end], [table], block_size)
        hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), caches, meta)
        logits.append(model.compute_logits(hidden))
        start = end
    return torch.cat(logits)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf_full_chunked_and_decode(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    ids = [(i * 37 + 11) % 300 + 4 for i in range(40)]
    reference = hf_logits(path, ids)
    model, arch = load_ours(path)
    for chunks in ([40], [13, 7, 20], [25] + [1] * 15):
        ours = run_chunks(model, arch, ids, chunks)
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_mixed_batch_of_prefill_and_decodes_matches_separate_runs(tiny_model_dir):
    """Two decodes and a prefill chunk in one forward pass == each sequence alone."""
    model, arch = load_ours(tiny_model_dir("qwen3"))
    block_size = 4
    plan = KVCachePlan(num_blocks=64, block_size=block_size, bytes_per_block=0)
    caches = allocate_kv_cache(arch, plan, torch.float32)
    seqs = {"a": [5, 9, 13, 17, 21, 25, 29], "b": [7, 8, 9, 10, 11], "c": [40, 41, 42, 43, 44, 45]}
    tables = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    # Prefill a and b except their last token.
    for name in ("a", "b"):
        ids = seqs[name][:-1]
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [tables[name]], block_size)
        model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    # One mixed step: decode a, decode b, prefill c (whole).
    ids = [seqs["a"][-1], seqs["b"][-1]] + seqs["c"]
    pos = [len(seqs["a"]) - 1, len(seqs["b"]) - 1] + list(range(len(seqs["c"])))
    meta = AttentionMetadata.build([1, 1, len(seqs["c"])], [len(seqs["a"]), len(seqs["b"]), len(seqs["c"])],
                                   [tables["a"], tables["b"], tables["c"]], block_size)
    mixed = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), caches, meta))
    for row, (name, index) in enumerate([("a", -1), ("b", -1)]):
        alone = run_chunks(model, arch, seqs[name], [len(seqs[name])])[index]
        torch.testing.assert_close(mixed[row], alone, atol=ATOL, rtol=RTOL)
    alone_c = run_chunks(model, arch, seqs["c"], [len(seqs["c"])])
    torch.testing.assert_close(mixed[2:], alone_c, atol=ATOL, rtol=RTOL)


def test_sharded_checkpoint_loads_the_same(tiny_model_dir):
    single, _ = load_ours(tiny_model_dir("llama"))
    sharded, _ = load_ours(tiny_model_dir("llama", shards=True))
    assert (tiny_model_dir("llama", shards=True) / "model.safetensors.index.json").exists()
    for (n1, p1), (n2, p2) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
