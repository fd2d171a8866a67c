"""The EAGLE head: the published checkpoint layout loads (safetensors and pytorch_model.bin,
with or without the "model." prefix), a wrong directory is refused in one line, and its forward
over the paged cache equals Hugging Face's Llama decoder layer (input norm and final norm
removed) fed fc(cat(embedding, feature)), in a prefill chunk and a decode step after it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from memwall.attention.backend import get_backend
from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig
from memwall.spec_decode.eagle import EagleHeadError, load_eagle_head

HIDDEN = 64
CONFIG = dict(model_type="llama", vocab_size=300, hidden_size=HIDDEN, intermediate_size=128,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, bias=True)


@pytest.fixture(scope="module")
def reference():
    """A 1-layer HF Llama with random weights and a random fc: the oracle and the checkpoint."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaModel(transformers.LlamaConfig(**{**CONFIG, "initializer_range": 0.2}))
    hf.layers[0].input_layernorm = torch.nn.Identity()
    hf.norm = torch.nn.Identity()
    fc = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=True)
    weights = {f"layers.0.{k}": v.clone() for k, v in hf.layers[0].state_dict().items()}
    weights["layers.0.input_layernorm.weight"] = torch.ones(HIDDEN)  # shipped, not applied
    weights["embed_tokens.weight"] = torch.randn(CONFIG["vocab_size"], HIDDEN)
    weights["fc.weight"], weights["fc.bias"] = fc.weight.detach().clone(), fc.bias.detach().clone()
    return hf.eval(), fc, weights


def write_head(directory, weights, fmt="safetensors", prefix=""):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    named = {prefix + k: v.contiguous() for k, v in weights.items()}
    if fmt == "safetensors":
        save_file(named, str(directory / "model.safetensors"))
    else:
        torch.save(named, directory / "pytorch_model.bin")
    return directory


def target_arch() -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict({**CONFIG, "num_hidden_layers": 30})


@torch.inference_mode()
@pytest.mark.parametrize("fmt, prefix", [("safetensors", ""), ("bin", "model.")])
def test_forward_equals_the_hf_decoder_layer(tmp_path, reference, fmt, prefix):
    hf, fc, weights = reference
    head = load_eagle_head(write_head(tmp_path / fmt, weights, fmt, prefix), target_arch())
    g = torch.Generator().manual_seed(1)
    T = 11
    embeds, features = torch.randn(T + 1, HIDDEN, generator=g), torch.randn(T + 1, HIDDEN, generator=g)
    want = hf(inputs_embeds=fc(torch.cat([embeds, features], -1))[None]).last_hidden_state[0]

    block_size, table = 4, [5, 2, 7, 0]
    shape = (8, block_size, CONFIG["num_key_value_heads"], HIDDEN // CONFIG["num_attention_heads"])
    caches = [(torch.zeros(shape), torch.zeros(shape))]
    backend = get_backend("torch")
    meta = AttentionMetadata.build([T], [T], [table], block_size, backend="torch")
    for module in head.modules():
        if hasattr(module, "attn_backend"):
            module.attn_backend = backend
    prefill = head(embeds[:T], features[:T], torch.arange(T), caches, meta)
    torch.testing.assert_close(prefill, want[:T], atol=1e-4, rtol=1e-4)
    meta = AttentionMetadata.build([1], [T + 1], [table], block_size, backend="torch")
    step = head(embeds[T:], features[T:], torch.tensor([T]), caches, meta)
    torch.testing.assert_close(step, want[T:], atol=1e-4, rtol=1e-4)


def test_wrong_directories_are_refused(tmp_path, reference):
    _, _, weights = reference
    with pytest.raises(EagleHeadError, match="no config.json"):
        load_eagle_head(tmp_path, target_arch())
    bad = dict(weights)
    del bad["fc.weight"]
    with pytest.raises(EagleHeadError, match="missing.*fc.weight"):
        load_eagle_head(write_head(tmp_path / "missing", bad), target_arch())
    other = ModelArchConfig.from_hf_dict({**CONFIG, "hidden_size": 128, "intermediate_size": 256})
    with pytest.raises(EagleHeadError, match="hidden size 64, the target's is 128"):
        load_eagle_head(write_head(tmp_path / "ok", weights), other)
    two = tmp_path / "two"
    write_head(two, weights)
    (two / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 2}))
    with pytest.raises(EagleHeadError, match="one decoder layer"):
        load_eagle_head(two, target_arch())
    for wrong in (0, 301, 12.5, True):
        (two / "config.json").write_text(json.dumps({**CONFIG, "draft_vocab_size": wrong}))
        with pytest.raises(EagleHeadError, match="draft_vocab_size must be an integer in 1..300"):
            load_eagle_head(two, target_arch())


# --------------------------------------------------------------------------- the proposer

@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tiny_head(tiny_target, tmp_path_factory):
    """A random EAGLE head shaped for the tiny target, in the published layout."""
    from memwall.config import ModelArchConfig as Arch

    config = json.loads((tiny_target / "config.json").read_text())
    torch.manual_seed(3)
    arch = Arch.from_hf_dict({**config, "num_hidden_layers": 1})
    from memwall.spec_decode.eagle import EagleHead

    head = EagleHead(arch, fc_bias=True)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    weights = {k: v.detach().clone() for k, v in head.state_dict().items()}
    out = tmp_path_factory.mktemp("eagle")
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    save_file(weights, str(out / "model.safetensors"))
    return out


def eagle(head_dir, k=4):
    return {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k, "adaptive": False}


def test_greedy_equals_plain_with_an_eagle_head(tiny_target, tiny_head):
    from memwall import LLM, SamplingParams

    rng = __import__("random").Random(5)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randrange(1, 60))] for _ in range(12)]
    prompts += [prompts[0] + [7, 8, 9]]  # a cached prefix: the head starts after it
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    plain = LLM(str(tiny_target), num_kv_blocks=256, block_size=4).generate(prompts, params)
    for mode in ("recompute", "swap"):
        llm = LLM(str(tiny_target), speculative_config=eagle(tiny_head), num_kv_blocks=40,
                  block_size=4, max_num_batched_tokens=24, max_num_seqs=6, preemption_mode=mode)
        out = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0
        assert core.scheduler.stats.spec_num_verify_steps > 50
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def _proposers(tiny_target, tiny_head, num_blocks=256):
    """A function making proposers with caches of their own over one loaded target and head
    (weights only: a proposer's state is its cache and bookkeeping)."""
    from memwall.attention.backend import choose as choose_backend
    from memwall.loader.model_loader import load_model
    from memwall.spec_decode.eagle import EagleProposer
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

    target = load_model(str(tiny_target))
    head = load_eagle_head(tiny_head, target.arch)

    def make():
        caches = allocate_kv_cache(head.config, KVCachePlan(num_blocks, 4, 0), torch.float32)
        return EagleProposer(head, target.model, caches, 4, get_backend(choose_backend("cpu")))

    return make


def _real_keys(proposer) -> torch.Tensor:
    blocks = proposer.cache.blocks["s"]
    slots = [blocks[i // 4] * 4 + i % 4 for i in range(proposer.real["s"])]
    return proposer.cache.kv_caches[0][0].flatten(0, 1)[slots].float()


@torch.inference_mode()
def test_the_heads_cache_follows_accepts_rejects_and_rewinds(tiny_target, tiny_head):
    """A long-lived proposer, fed features step by step as the runner does (final positions
    only, rewinds after preemption), drafts what a fresh one fed the whole history drafts."""
    import numpy as np

    from memwall.spec_decode.proposer import DraftRequest

    proposer = _proposers(tiny_target, tiny_head)
    lived = proposer()
    rng = __import__("random").Random(9)
    g = torch.Generator().manual_seed(9)
    tokens = [rng.randrange(4, 380) for _ in range(9)]
    feats = torch.randn(8, 64, generator=g)  # positions 0..7 final; token 8 just sampled
    lived.record("s", 0, feats)
    for step in range(30):
        k = rng.randrange(1, 5)
        req = DraftRequest("s", np.array(tokens), k)
        drafts = lived.propose([req])["s"]
        fresh = proposer()
        fresh.record("s", 0, feats)
        assert drafts == fresh.propose([req])["s"] and len(drafts) == k
        # every entry the target's features made is what a fresh head computes for them
        assert lived.real["s"] == fresh.real["s"] == len(tokens) - 1
        torch.testing.assert_close(_real_keys(lived), _real_keys(fresh), rtol=0, atol=1e-5)
        if rng.random() < 0.15:  # preempted and recomputed from an earlier position
            cut, redone = rng.randrange(1, len(tokens) - 1), rng.randrange(1, 5)
            tokens = tokens[:cut + 1] + [rng.randrange(4, 380) for _ in range(redone)]
            feats = torch.cat([feats[:cut], torch.randn(redone, 64, generator=g)])
            lived.record("s", cut, feats[cut:])
            continue
        accepted = rng.randrange(0, k + 1)
        new = torch.randn(1 + accepted, 64, generator=g)  # the verify rows' final features
        lived.record("s", len(tokens) - 1, new)
        feats = torch.cat([feats, new])
        tokens = tokens + drafts[:accepted] + [rng.randrange(4, 380)]
    lived.forget(["s"])
    assert lived.num_free_blocks == 256


@torch.inference_mode()
def test_on_cpu_the_head_drafts_from_int8_panels_close_to_its_float_weights(tiny_target, tiny_head):
    """The runner quantizes the head's matmuls (int8 codes, q/k/v and gate/up joined): its
    predicted features stay within int8's rounding of the float head's, and it still drafts
    with greedy output unchanged (the target verifies every draft)."""
    from memwall import LLM, SamplingParams
    from memwall.loader.model_loader import load_model
    from memwall.quant.base import QuantLinear

    target = load_model(str(tiny_target))
    float_head = load_eagle_head(tiny_head, target.arch)
    int8_head = load_eagle_head(tiny_head, target.arch)
    summary = int8_head.quantize_for_cpu()
    assert "quantized" in summary and "0 Linear(s) kept float" in summary
    layer = int8_head.layers[0]
    assert isinstance(int8_head.fc, QuantLinear)
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert not hasattr(layer.self_attn, "q_proj")
    from memwall.kernels.cpu import panels
    if panels.available():  # a scale a 32 values: the packed panels, not the row layout
        from memwall.quant.packing import PanelMethod
        linears = [m for m in int8_head.modules() if isinstance(m, QuantLinear)]
        assert linears and all(isinstance(m.method, PanelMethod) for m in linears)
        assert all(m.source == "int8 g32" for m in linears)
    g = torch.Generator().manual_seed(2)
    T, H = 9, target.arch.hidden_size
    embeds, feats = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    block_size = 4
    shape = (4, block_size, int8_head.config.num_key_value_heads, int8_head.config.head_dim)
    outs = []
    for head in (float_head, int8_head):
        for module in head.modules():
            if hasattr(module, "attn_backend"):
                module.attn_backend = get_backend("torch")
        meta = AttentionMetadata.build([T], [T], [[2, 0, 3]], block_size, backend="torch")
        outs.append(head(embeds, feats, torch.arange(T), [(torch.zeros(shape), torch.zeros(shape))], meta))
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0 < err < 0.03, err  # quantized (not the float weights), within int8's rounding

    config = {**eagle(tiny_head, k=3), "lookup_first": False}  # the head's own drafts
    llm = LLM(str(tiny_target), speculative_config=config, num_kv_blocks=128, block_size=4)
    proposer = llm.engine.core.executor.worker.runner.proposer
    assert isinstance(proposer.head.fc, QuantLinear) and proposer.fast_path is not None
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5 + i, 17, 33, 2 * i + 40] * 5 for i in range(3)]
    plain = LLM(str(tiny_target), num_kv_blocks=128, block_size=4).generate(prompts, params)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.core.scheduler.stats.spec_num_verify_steps > 3


@pytest.mark.parametrize("vocab", [None, 200])
def test_a_requantized_head_drafts_from_4_bit_weights_with_greedy_output_unchanged(
        tiny_target, tiny_head, vocab):
    """``"requantize": "q4_1"``: the head's matmuls and the LM head rows it drafts from (the
    draft vocabulary's, or a copy of the whole head) are int4 codes; the target's own head is
    untouched, its drafts still get accepted, and the output is the plain output."""
    from memwall import LLM, SamplingParams
    from memwall.spec_decode.draft_vocab import DraftVocabHead

    config = {**eagle(tiny_head, k=3), "requantize": "q4_1", "draft_vocab_size": vocab,
              "lookup_first": False}  # the head's own drafts
    llm = LLM(str(tiny_target), speculative_config=config, num_kv_blocks=128, block_size=4)
    proposer = llm.engine.core.executor.worker.runner.proposer
    layer = proposer.head.layers[0]
    parts = (proposer.head.fc, layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    for part in parts:
        assert part.source == "int4 g32"
    assert isinstance(proposer.logits, DraftVocabHead) and proposer.logits.rows.source == "int4 g32"
    target = llm.engine.core.executor.worker.runner.model
    assert proposer.logits.out_features == (vocab or target.lm_head.out_features)
    assert type(target.lm_head) is torch.nn.Linear  # the verifier keeps its float head
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5 + i, 17, 33, 2 * i + 40] * 5 for i in range(3)]
    plain = LLM(str(tiny_target), num_kv_blocks=128, block_size=4).generate(prompts, params)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.core.scheduler.stats
    assert stats.spec_num_draft_tokens > 0
    if vocab is None:  # the random head's drafts of the whole vocabulary: some hit
        assert stats.spec_num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_a_head_trained_on_the_first_ids_drafts_among_them_by_default(tiny_target, tiny_head,
                                                                      tmp_path):
    """A head whose config.json says ``"draft_vocab_size": N`` (train_eagle.py writes it)
    drafts from the LM head's first N rows without the speculative config naming them (the
    start-up line says so); the config's own size wins; output stays the plain output."""
    import shutil

    from memwall import LLM, SamplingParams
    from memwall.spec_decode.draft_vocab import DraftVocabHead

    head = tmp_path / "head"
    shutil.copytree(tiny_head, head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 150}))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5 + i, 17, 33, 2 * i + 40] * 5 for i in range(3)]
    plain = LLM(str(tiny_target), num_kv_blocks=128, block_size=4).generate(prompts, params)
    for named, rows in ((None, 150), (100, 100)):
        spec = {**eagle(head, k=3), "lookup_first": False, "draft_vocab_size": named}
        llm = LLM(str(tiny_target), speculative_config=spec, num_kv_blocks=128, block_size=4)
        runner = llm.engine.core.executor.worker.runner
        assert isinstance(runner.proposer.logits, DraftVocabHead)
        assert runner.proposer.logits.out_features == rows == runner.draft_vocab_size
        assert f"among the first {rows} token ids" in llm.engine.core.info.description
        out = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
        assert llm.engine.core.scheduler.stats.spec_num_draft_tokens > 0


def test_with_lookup_first_the_head_catches_up_over_the_steps_it_skipped(
        tiny_target, tiny_head, draft_sources):
    """``"lookup_first": true``: steps drafted by prompt lookup leave the head's cache behind
    (its features are still recorded); when the sequence next drafts with the head, the cache
    catches up over the entries it skipped. Sequences move between the two sources, and the
    output is the plain output."""
    from memwall import LLM, SamplingParams

    rng = __import__("random").Random(8)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randrange(2, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(tiny_target), num_kv_blocks=256, block_size=4).generate(prompts, params)
    config = {**eagle(tiny_head), "lookup_first": True, "prompt_lookup_min": 1,
              "prompt_lookup_max": 2}
    llm = LLM(str(tiny_target), speculative_config=config, num_kv_blocks=256, block_size=4)
    proposer = llm.engine.core.executor.worker.runner.proposer
    seen = draft_sources(proposer)  # (request id, "lookup" or "drafter", tokens), in order
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    moved = set()  # sequences the head drafted for after lookup had
    for rid in {r for r, _, _ in seen}:
        sources = [src for r, src, _ in seen if r == rid]
        if "lookup" in sources and "drafter" in sources[sources.index("lookup"):]:
            moved.add(rid)
    assert len(moved) >= 2, seen
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@torch.inference_mode()
def test_the_fused_c_step_drafts_what_the_heads_torch_forward_drafts(tiny_target, tiny_head):
    """A quantized head's draft steps (and its catch-ups of a few entries) take the fused C
    decode step, as one-token rows without an input norm; they draft the tokens its torch
    forward drafts, and leave the same keys in its cache."""
    import numpy as np

    from memwall.attention.backend import choose as choose_backend
    from memwall.loader.model_loader import load_model
    from memwall.spec_decode.eagle import EagleProposer
    from memwall.spec_decode.proposer import DraftRequest
    from memwall.worker.cpu_decode import FusedCpuDecode
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

    target = load_model(str(tiny_target))
    head = load_eagle_head(tiny_head, target.arch)
    head.quantize_for_cpu()
    backend = get_backend(choose_backend("cpu"))

    def make(fused: bool):
        caches = allocate_kv_cache(head.config, KVCachePlan(64, 4, 0), torch.float32)
        fast = FusedCpuDecode.build(head.native_view(), caches) if fused else None
        return EagleProposer(head, target.model, caches, 4, backend, fast_path=fast)

    fused, plain = make(True), make(False)
    assert fused.fast_path is not None
    steps = {"fused": 0}
    step = fused.fast_path.decoder.step

    def counted(*args):
        steps["fused"] += 1
        return step(*args)

    fused.fast_path.decoder.step = counted
    rng = __import__("random").Random(4)
    g = torch.Generator().manual_seed(4)
    tokens = [rng.randrange(4, 380) for _ in range(13)]
    feats = torch.randn(12, 64, generator=g)
    for p in (fused, plain):
        p.record("s", 0, feats)
    for _ in range(12):
        req = DraftRequest("s", np.array(tokens), rng.randrange(1, 5))
        a, b = fused.propose([req])["s"], plain.propose([req])["s"]
        assert a == b
        keep = rng.randrange(0, len(a) + 1)  # accept some drafts, then a new token and features
        new = a[:keep] + [rng.randrange(4, 380)]
        more = torch.randn(len(new), 64, generator=g)
        for p in (fused, plain):
            p.record("s", len(tokens) - 1, more)
        tokens += new
        torch.testing.assert_close(_real_keys(fused), _real_keys(plain), rtol=1e-4, atol=1e-4)
    assert steps["fused"] >= 12  # every draft step after the first prompt-long catch-up


def test_features_grow_rewind_and_refuse_gaps():
    """A sequence's features: appended step by step past the buffer's first size, rewritten
    from an earlier position after a rewind, refused when a position would be skipped."""
    from memwall.spec_decode.eagle import _Features

    g = torch.Generator().manual_seed(3)
    held, truth = _Features(base=5), torch.randn(0, 8)
    for _ in range(40):  # 5 rows a step: 200 positions, past the 64 first allocated
        new = torch.randn(5, 8, generator=g)
        assert held.append(5 + len(truth), new)
        truth = torch.cat([truth, new])
    assert held.count == 200 and torch.equal(held.slice(5, 205), truth)
    redone = torch.randn(3, 8, generator=g)
    assert held.append(5 + 150, redone)  # rewound to position 155: what follows is dropped
    assert held.count == 153 and torch.equal(held.slice(150, 158), torch.cat([truth[145:150], redone]))
    assert not held.append(5 + 154, redone)  # a gap: position 158 would be missing
    assert not held.append(4, redone)  # before the first position held
    assert torch.equal(held.slice(5, 155), truth[:150])
