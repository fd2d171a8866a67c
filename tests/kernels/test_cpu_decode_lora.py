"""The fused C decode step with per-token LoRA adapters (decode.c's lora_apply) against the
torch path (memwall/lora/layers.py's LoRAProjection): a batch whose sequences use different
adapters, or none, in one call, at every instruction-set build this CPU runs."""

from __future__ import annotations

import copy

import pytest
import torch

from memwall.attention.metadata import AttentionMetadata
from memwall.kernels.cpu import quant_ops
from memwall.kernels.cpu.decode import NativeDecoder
from memwall.loader.model_loader import load_model
from memwall.lora.adapter import TARGETS, LoRAAdapter, LoRAWeights
from memwall.lora.layers import apply_lora
from memwall.lora.slots import LoRASlots, target_shapes
from memwall.quant import quantize_model
from memwall.worker.cpu_decode import FusedCpuDecode
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

pytestmark = [pytest.mark.skipif(not quant_ops.available(), reason="no C compiler: native kernels not built"),
              pytest.mark.usefixtures("exact_kernels")]  # parity with torch: exact kernels
BLOCK = 4
ADAPTERS = [(8, TARGETS), (4, ("q_proj", "v_proj")), (2, ("down_proj",))]
"""(rank, targets) of the adapters in slots 0, 1, 2."""
MIXED = [0, -1, 1, 2, 0]


@pytest.fixture
def isa(isa_library):
    """One instruction-set build of the kernels (conftest.py), on its exact fp32 paths."""
    name, cdll = isa_library
    cdll.mw_set_int_acts(0)
    yield name
    cdll.mw_set_int_acts(1)


def _adapter(arch, rank: int, targets, seed: int) -> LoRAAdapter:
    """Random A [r, in], B [out, r] for ``targets`` of every layer; the deltas are ~10% of the
    projections' outputs, so an adapter visibly changes the hidden states."""
    g = torch.Generator().manual_seed(seed)
    shapes, modules = target_shapes(arch), {}
    for layer in range(arch.num_hidden_layers):
        for target in targets:
            k, n = shapes[target]
            owner = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            modules[f"model.layers.{layer}.{owner}.{target}"] = LoRAWeights(
                torch.randn(rank, k, generator=g) * 0.1, torch.randn(n, rank, generator=g) * 0.1)
    return LoRAAdapter(f"adapter-{seed}", "", f"hash-{seed}", rank, modules)


def _lora_model(tiny_model_dir, kind: str, quant: str | None):
    """(arch, model, slots): a tiny fused model (quantized when asked), its projections wrapped
    by apply_lora, ADAPTERS loaded in slots 0..2 of 3 slots of rank 8."""
    loaded = load_model(str(tiny_model_dir(kind)))
    model = copy.deepcopy(loaded.model)
    if quant:
        quantize_model(model, quant)
    slots = LoRASlots(loaded.arch, max_loras=3, max_rank=8)
    apply_lora(model, slots)
    for slot, (rank, targets) in enumerate(ADAPTERS):
        slots.load(slot, _adapter(loaded.arch, rank, targets, seed=slot))
    return loaded.arch, model, slots


class Step:
    """One decode step of ``batch`` sequences over a random KV cache (as a prefill would have
    left it), run by the fused C step or the model's torch forward, each from the same cache."""

    def __init__(self, arch, model, batch: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.model, self.batch = model, batch
        self.caches = allocate_kv_cache(arch, KVCachePlan(2 * batch + 1, BLOCK, 0), torch.float32)
        for k, v in self.caches:
            k.normal_(generator=g)
            v.normal_(generator=g)
        self.saved = [(k.clone(), v.clone()) for k, v in self.caches]
        # lengths 1..8: inside Gemma 3's window of 8, across a block boundary
        self.lens = [1 + (5 * b + seed) % 8 for b in range(batch)]
        self.tables = [[2 * b + 1, 2 * b + 2][:-(-n // BLOCK)] for b, n in enumerate(self.lens)]
        self.ids = torch.randint(0, arch.vocab_size, (batch,), generator=g)
        self.decoder = NativeDecoder.build(model, self.caches)
        assert self.decoder is not None, "the native decoder did not accept this model"

    def meta(self, rows: list[int]) -> AttentionMetadata:
        return AttentionMetadata.build([1] * len(rows), [self.lens[b] for b in rows],
                                       [self.tables[b] for b in rows], BLOCK)

    def restore(self) -> None:
        for (k, v), (sk, sv) in zip(self.caches, self.saved):
            k.copy_(sk)
            v.copy_(sv)

    def fused(self, token_slots: list[int] | None, rows: list[int] | None = None,
              runner: bool = False) -> torch.Tensor:
        """The C step for sequences ``rows`` (all by default). runner: through FusedCpuDecode,
        which reads the slots the runner set (set_step); else token_slots go to step as they
        are (all -1 included)."""
        rows = list(range(self.batch)) if rows is None else rows
        self.restore()
        meta, ids = self.meta(rows), self.ids[rows]
        positions = torch.tensor([self.lens[b] - 1 for b in rows])
        if runner:
            self.model.lora_slots.set_step(token_slots)
            try:
                return FusedCpuDecode(self.model, self.decoder).run(ids, positions, meta)
            finally:
                self.model.lora_slots.set_step(None)
        slots = None if token_slots is None else torch.tensor(token_slots, dtype=torch.int32)
        embeddings = self.model.model.embed_tokens(ids)
        if getattr(self.model.model, "embed_scale", None) is not None:  # Gemma
            embeddings = embeddings * torch.tensor(self.model.model.embed_scale)
        return self.decoder.step(embeddings, positions, meta.slot_mapping, meta.decode.seq_lens,
                                 meta.decode.block_tables, slots)

    def torch(self, token_slots: list[int] | None) -> torch.Tensor:
        """The model's forward (LoRAProjection modules, torch reference attention)."""
        caches = [(k.clone(), v.clone()) for k, v in self.saved]
        self.model.lora_slots.set_step(token_slots)
        try:
            return self.model(self.ids, torch.tensor([n - 1 for n in self.lens]), caches,
                              self.meta(list(range(self.batch))))
        finally:
            self.model.lora_slots.set_step(None)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The rows differ by far more than rounding: an adapter's delta is really there."""
    return ((a - b).norm() / b.norm()).item() > 1e-2


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_mixed_adapters_match_torch(isa, tiny_model_dir, kind, quant):
    """Slots [0, -1, 1, 2, 0] in one step: each row as the torch path computes it (qwen2: q/k/v
    biases before the delta; gemma3: the delta before the attention output's norm)."""
    arch, model, _ = _lora_model(tiny_model_dir, kind, quant)
    step = Step(arch, model, len(MIXED))
    got = step.fused(MIXED)
    _close(got, step.torch(MIXED))
    base = step.fused(None)
    _close(base, step.torch(None))
    for b, slot in enumerate(MIXED):  # the adapters change their rows, and only theirs
        if slot >= 0:
            assert _changed(got[b], base[b]), f"row {b} (slot {slot}) did not change"
        else:
            _close(got[b], base[b])


@torch.inference_mode()
def test_the_runner_passes_the_steps_slots(tiny_model_dir):
    """FusedCpuDecode.run reads model.lora_slots.token_slots (set_step), in batch order."""
    arch, model, _ = _lora_model(tiny_model_dir, "llama", "int4")
    step = Step(arch, model, len(MIXED), seed=1)
    _close(step.fused(MIXED, runner=True), step.torch(MIXED))
    torch.testing.assert_close(step.fused(MIXED, runner=True), step.fused(MIXED), rtol=0, atol=0)
    assert model.lora_slots.token_slots is None
    _close(step.fused(None, runner=True), step.torch(None))


@torch.inference_mode()
def test_no_adapter_is_the_base_model(tiny_model_dir):
    """Every slot -1 (passed to C as such) or None: the base model, bit for bit."""
    arch, model, _ = _lora_model(tiny_model_dir, "qwen2", "int8")
    step = Step(arch, model, 4)
    base = step.fused(None)
    torch.testing.assert_close(step.fused([-1] * 4), base, rtol=0, atol=0)
    _close(base, step.torch([-1] * 4))


@torch.inference_mode()
@pytest.mark.parametrize("quant", [None, "int4"])
def test_each_row_is_its_sequence_alone(tiny_model_dir, quant):
    """Every row of the mixed batch equals that sequence run alone (B = 1) with its adapter."""
    arch, model, _ = _lora_model(tiny_model_dir, "llama", quant)
    step = Step(arch, model, len(MIXED), seed=2)
    batch = step.fused(MIXED)
    for b, slot in enumerate(MIXED):
        alone = step.fused([slot], rows=[b])
        assert alone.shape == (1, arch.hidden_size)
        _close(alone[0], batch[b])


@torch.inference_mode()
def test_a_batch_past_the_row_tile(isa, tiny_model_dir):
    """19 sequences (the q4 kernels take 16 rows at a time), every adapter several times, in
    parallel work items: the torch result, and the same bits with one thread or two."""
    arch, model, _ = _lora_model(tiny_model_dir, "llama", "int4")
    step = Step(arch, model, 19, seed=3)
    token_slots = [(b % 4) - 1 for b in range(19)]  # -1, 0, 1, 2, -1, ...
    got = step.fused(token_slots)
    _close(got, step.torch(token_slots))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = step.fused(token_slots)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, got, rtol=0, atol=0)


@torch.inference_mode()
def test_widths_off_the_vector_blocks(isa):
    """Projections of 40, 80 and 88 outputs (64 + 16 + 8: every vector block and the scalar
    tail of each build) and 80 or 88 inputs, with ranks 5 and 3 in slots of rank 5."""
    from memwall.config import ModelArchConfig
    from memwall.models.registry import build_model

    torch.manual_seed(0)
    arch = ModelArchConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=128, hidden_size=80, intermediate_size=88,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64))
    model = build_model(arch).eval()
    model.fuse_projections()
    slots = LoRASlots(arch, max_loras=2, max_rank=5)
    apply_lora(model, slots)
    slots.load(0, _adapter(arch, 5, TARGETS, seed=7))
    slots.load(1, _adapter(arch, 3, ("k_proj", "o_proj", "up_proj"), seed=8))
    step = Step(arch, model, 4, seed=7)
    token_slots = [1, 0, -1, 0]
    got = step.fused(token_slots)
    _close(got, step.torch(token_slots))
    assert _changed(got[:2], step.fused(None)[:2])


@torch.inference_mode()
def test_rank_rows_past_the_adapter_are_never_read(isa, tiny_model_dir):
    """NaN in every slot row past its adapter's rank (and in whole segments an adapter does not
    target) changes nothing: the C step reads rank[s] rows only."""
    arch, model, slots = _lora_model(tiny_model_dir, "qwen2", "int8")
    step = Step(arch, model, len(MIXED), seed=4)
    before = step.fused(MIXED)
    for segments in slots.layers:
        for seg in segments.values():
            for s in range(slots.max_loras):
                r = int(seg.rank[s])
                seg.a[s, r:] = float("nan")
                seg.bt[s, r:] = float("nan")
    torch.testing.assert_close(step.fused(MIXED), before, rtol=0, atol=0)
    _close(step.torch(MIXED), before)


@torch.inference_mode()
def test_bad_slots_raise_and_change_nothing(tiny_model_dir):
    arch, model, _ = _lora_model(tiny_model_dir, "llama", "int4")
    step = Step(arch, model, 2, seed=5)
    meta, positions = step.meta([0, 1]), torch.tensor([n - 1 for n in step.lens])
    args = (positions, meta.slot_mapping, meta.decode.seq_lens, meta.decode.block_tables)
    x = model.model.embed_tokens(step.ids)
    for token_slots, match in ((torch.tensor([0, 3], dtype=torch.int32), "LoRA slot"),
                               (torch.tensor([-2, 0], dtype=torch.int32), "LoRA slot"),
                               (torch.tensor([0, 1]), "int32"),
                               (torch.tensor([0], dtype=torch.int32), "2 rows")):
        step.restore()
        given = x.clone()
        with pytest.raises(ValueError, match=match):
            step.decoder.step(given, *args, token_slots)
        torch.testing.assert_close(given, x, rtol=0, atol=0)  # the embeddings are untouched ...
        for (k, v), (sk, sv) in zip(step.caches, step.saved):  # ... and so is the cache
            assert torch.equal(k, sk) and torch.equal(v, sv)


@torch.inference_mode()
def test_a_model_without_lora_takes_only_minus_one(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("llama")))
    model = copy.deepcopy(loaded.model)
    model.lora_slots = LoRASlots(loaded.arch, 1, 1)  # Step.torch's set_step needs one
    step = Step(loaded.arch, model, 2, seed=6)
    assert step.decoder.model.n_slots == 0
    torch.testing.assert_close(step.fused([-1, -1]), step.fused(None), rtol=0, atol=0)
    with pytest.raises(ValueError, match="LoRA slot"):
        step.fused([0, -1])
