"""train_eagle.py trains what the engine runs: its dense training forward equals the head's
paged forward, a few optimizer steps lower the loss on a tiny target, and the head it saves
loads and drafts in the engine with greedy output unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `benchmarks`

from benchmarks.train_eagle import (layer_forward, lm_head_matrix, save_head,  # noqa: E402
                                    sequence_loss, target_features)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from memwall.loader.model_loader import load_model

    path = tiny_model_dir("llama")
    return path, load_model(str(path))


def _head(arch):
    from memwall.spec_decode.eagle import EagleHead

    torch.manual_seed(4)
    head_arch = type(arch).from_hf_dict({**_hf(arch), "num_hidden_layers": 1})
    head = EagleHead(head_arch, fc_bias=True)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    return head


def _training_sequence(loaded, seed: int):
    """A random 40-token sequence's ids, embeddings, target features and the LM head matrix,
    as main() prepares them (clones outside inference mode: autograd reads them)."""
    model = loaded.model
    ids = [int(t) for t in torch.randint(4, 380, (40,), generator=torch.Generator().manual_seed(seed))]
    feats = target_features(model, 4, ids).clone()
    with torch.inference_mode():
        embeds = model.model.embed_tokens(torch.tensor(ids)).float()
    return ids, embeds.clone(), feats, lm_head_matrix(model, loaded.arch.hidden_size).clone()


def _hf(arch) -> dict:
    return {"model_type": "llama", "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size, "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
            "max_position_embeddings": arch.max_position_embeddings, "rms_norm_eps": arch.rms_norm_eps,
            "rope_theta": arch.rope_theta, "rope_scaling": arch.rope_scaling}


@torch.inference_mode()
def test_the_training_forward_is_the_paged_forward(tiny):
    from memwall.attention.backend import get_backend
    from memwall.attention.metadata import AttentionMetadata

    _, loaded = tiny
    head = _head(loaded.arch)
    g = torch.Generator().manual_seed(0)
    T, H = 19, loaded.arch.hidden_size
    x = torch.randn(T, H, generator=g)
    dense = layer_forward(head, x, torch.arange(T))
    shape = (5, 4, head.config.num_key_value_heads, head.config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape))]
    meta = AttentionMetadata.build([T], [T], [[3, 0, 4, 1, 2]], 4, backend="torch")
    for module in head.modules():
        if hasattr(module, "attn_backend"):
            module.attn_backend = get_backend("torch")
    rope = head.rotary.lookup(torch.arange(T), x.dtype)
    paged = head.layers[0](x, rope, caches[0], meta)
    torch.testing.assert_close(dense, paged, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_the_second_step_forward_is_a_drafted_entry_over_the_paged_cache(tiny):
    """layer_forward with ``prior``: row i is the entry a second draft step writes at position
    i + 1, over a cache holding the first-step entries before it (and not the ones after)."""
    from memwall.attention.backend import get_backend
    from memwall.attention.metadata import AttentionMetadata

    _, loaded = tiny
    head = _head(loaded.arch)
    g = torch.Generator().manual_seed(3)
    T, H = 13, loaded.arch.hidden_size
    x, x2 = torch.randn(T, H, generator=g), torch.randn(T - 1, H, generator=g)
    keys: list = []
    layer_forward(head, x, torch.arange(T), keep=keys)
    dense = layer_forward(head, x2, torch.arange(1, T), prior=keys[0])
    for module in head.modules():
        if hasattr(module, "attn_backend"):
            module.attn_backend = get_backend("torch")
    shape = (5, 4, head.config.num_key_value_heads, head.config.head_dim)
    table = [3, 0, 4, 1, 2]
    layer = head.layers[0]
    for q in (1, 4, 7, T - 1):  # the real entries 0 .. q - 1, then the drafted one at q
        caches = (torch.zeros(shape), torch.zeros(shape))
        layer(x[:q], head.rotary.lookup(torch.arange(q), x.dtype), caches,
              AttentionMetadata.build([q], [q], [table], 4, backend="torch"))
        drafted = layer(x2[q - 1:q], head.rotary.lookup(torch.tensor([q]), x.dtype), caches,
                        AttentionMetadata.build([1], [q + 1], [table], 4, backend="torch"))
        torch.testing.assert_close(dense[q - 1:q], drafted, atol=1e-5, rtol=1e-5)


def test_training_lowers_the_loss_and_the_saved_head_drafts(tiny, tmp_path):
    from memwall import LLM, SamplingParams

    path, loaded = tiny
    ids, embeds, feats, lm_head = _training_sequence(loaded, seed=1)
    head = _head(loaded.arch)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = last = None
    greedy = torch.tensor(ids[1:] + [ids[0]])  # any labels: the loss must fall on them
    second: dict = {}
    for _ in range(15):
        loss, _, _ = sequence_loss(head, lm_head, embeds, feats, torch.tensor(ids), 10, greedy, second)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < 0.8 * first
    assert second["positions"] == 15 * (40 - 2 - 7)  # the second step's rows over the reply
    save_head(head, _hf(loaded.arch), tmp_path / "head")
    spec = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
            "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(str(path), num_kv_blocks=128, block_size=4).generate([ids], params)
    llm = LLM(str(path), speculative_config=spec, num_kv_blocks=128, block_size=4)
    out = llm.generate([ids], params)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.core.scheduler.stats.spec_num_verify_steps > 3


def test_training_chats_leave_out_the_benchmarks_prompts(monkeypatch):
    """The chats a head trains on never include the prompts spec_decode.py measures it with."""
    import benchmarks.datasets as datasets
    from benchmarks import spec_decode, train_eagle

    records = tuple({"conversations": [{"from": "human", "value": f"Question number {i} here?"},
                                       {"from": "gpt", "value": f"Answer {i}."}]} for i in range(60))
    monkeypatch.setattr(datasets, "sharegpt_path", lambda: "unused")
    monkeypatch.setattr(datasets, "read_records", lambda path: records)
    measured = spec_decode.chat_prompts(train_eagle.EVALUATION_CHATS)
    assert len(measured) == 60  # every record is a chat prompt the benchmark could take
    assert train_eagle.conversations(10, exclude=set()) != []
    assert train_eagle.conversations(10, exclude=set(measured[:30])) == [
        c for c in train_eagle.conversations(60, exclude=set()) if c not in measured[:30]][:10]
    assert train_eagle.conversations(10) == []  # by default: all 60 are the benchmark's


def test_bf16_autocast_training_lowers_the_loss_and_keeps_float32_weights(tiny):
    """--bf16: the forward under bfloat16 autocast, the head's weights and optimizer float32."""
    _, loaded = tiny
    ids, embeds, feats, lm_head = _training_sequence(loaded, seed=2)
    head = _head(loaded.arch)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    greedy = torch.tensor(ids[1:] + [ids[0]])
    losses = []
    for _ in range(15):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = sequence_loss(head, lm_head, embeds, feats, torch.tensor(ids), 10,
                                       greedy, {})
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.dtype == torch.float32 for p in head.parameters())


def test_bf16_is_the_default_only_where_the_cpu_multiplies_it(monkeypatch):
    import memwall.planner.hardware as hardware
    from benchmarks.train_eagle import native_bf16

    for flags, expected in ((["avx512f", "avx512_bf16"], True), (["amx_tile", "amx_bf16"], True),
                            (["avx2", "avx512f", "avx512_vnni"], False), ([], False)):
        monkeypatch.setattr(hardware, "cpu_features", lambda flags=flags: flags)
        assert native_bf16() is expected, flags


def test_the_tap_keeps_the_features_the_engine_computed_while_generating(tiny):
    """FeatureTap's features of a generated request equal the target's reference forward over
    the same tokens, every position from the prompt's first to the reply's second to last,
    across chunked prefill (a 6-token budget) and a batch of 3; the greedy labels are the
    reply's own next tokens and the LM head's argmax over the prompt."""
    from memwall import LLM, SamplingParams
    from benchmarks.train_eagle import FeatureTap, greedy_tokens, tapped_sequence

    path, loaded = tiny
    llm = LLM(str(path), num_kv_blocks=128, block_size=4, prefix_caching=False,
              max_num_batched_tokens=6, max_num_seqs=3)
    runner = llm.engine.core.executor.worker.runner
    tap = FeatureTap(runner)
    prompts = [[int(t) for t in torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 11, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    for prompt, output in zip(prompts, outs):
        ids, feats, greedy, reply_from = tapped_sequence(runner.model, tap, output)
        assert reply_from == len(prompt)
        assert ids == prompt + list(output.outputs[0].token_ids)[:-1]
        reference = target_features(loaded.model, 4, ids)
        # the engine's fp16 KV cache against the reference's float32 one: ~4e-3 apart at most
        torch.testing.assert_close(feats, reference, atol=1e-2, rtol=1e-2)
        assert greedy[reply_from - 1:].tolist() == list(output.outputs[0].token_ids)
        assert greedy.tolist() == greedy_tokens(loaded.model, reference).tolist()
    assert tap.pieces == {}  # each request's pieces handed over once


def test_the_tap_leaves_out_a_sequence_with_a_position_never_computed(tiny):
    from benchmarks.train_eagle import FeatureTap

    _, loaded = tiny

    class Runner:
        model, fast_path = torch.nn.Identity(), None

        def execute(self, sched):
            return None

    tap = FeatureTap(Runner())
    H = loaded.arch.hidden_size
    tap.pieces["a"] = [(0, torch.ones(3, H)), (4, torch.ones(2, H))]  # position 3 missing
    tap.pieces["b"] = [(0, torch.ones(3, H)), (3, 2 * torch.ones(3, H)), (2, 3 * torch.ones(1, H))]
    assert tap.features("a", 6) is None
    b = tap.features("b", 5)  # the rows past 5 dropped, position 2 computed again
    assert b[:, 0].tolist() == [1, 1, 3, 2, 2]
