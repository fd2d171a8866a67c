"""pack_model on the embedded SmolLM2 (Q4_1 Linears, a Q8_0 LM head tied to the embedding):
every Linear is packed in place (no memory added), the tied embedding still returns the same
rows bit for bit, the projections give what the row layout gave (within the integer
activations' error), a second call changes nothing, cutting a packed layer gives the row
layout's cut, and the engine decodes a batch as it decodes each sequence alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memwall import LLM, SamplingParams
from memwall.kernels.cpu import panels
from memwall.loader.model_loader import load_model
from memwall.quant.base import QuantLinear
from memwall.quant.packing import PanelMethod, pack_model

pytestmark = pytest.mark.skipif(not panels.available(),
                                reason="needs the AVX-512 VNNI kernels (this CPU or build lacks them)")


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def test_pack_model_on_the_embedded_gguf():
    net = load_model(None).model
    linears = {name: m for name, m in net.named_modules() if isinstance(m, QuantLinear)}
    before_bytes = sum(t.nbytes for t in net.buffers())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=g)
    down = net.model.layers[3].mlp.down_proj
    xd = torch.randn(3, down.in_features, generator=g)
    ids = torch.tensor([[0, 1, 49151], [17, 2048, 300]])
    rows_before = net.model.embed_tokens(ids)
    head_before, down_before = net.lm_head(x), down(xd)
    plain_down = dataclasses.replace(down.method.native_weight(down, None))
    plain_codes = plain_down.codes.clone()

    report = pack_model(net)
    assert report.layers == len(linears) and report.embedding
    assert all(isinstance(m.method, PanelMethod) for m in linears.values())
    assert sum(t.nbytes for t in net.buffers()) == before_bytes  # permuted in place
    assert not torch.equal(down.codes, plain_codes)
    assert torch.equal(net.model.embed_tokens(ids), rows_before)
    assert _rel_err(net.lm_head(x), head_before) < 1e-4
    assert _rel_err(down(xd), down_before) < 1e-4

    again = pack_model(net)  # idempotent: already packed layers are left alone
    assert again.layers == 0
    assert torch.equal(net.model.embed_tokens(ids), rows_before)

    index = torch.tensor([0, 5, 575, 100])
    cut = down.method.take_rows(down, index)
    assert torch.equal(cut.tensors["codes"], plain_codes[index])


def test_batched_decode_equals_one_sequence_at_a_time():
    """Up to 16 tokens a matmul compute each row as that token alone gets it, so a sequence's
    greedy tokens do not depend on what else is in the batch (5 prompts of 3 tokens: every
    step of the batched run, its prefill too, has at most 16 tokens)."""
    llm = LLM(None, threads=2, max_num_seqs=8)
    prompts = [[504, 3575, 282], [1409, 8516, 30], [9246, 2329, 253], [5250, 1743, 3858],
               [33, 28, 216]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
    model = llm.engine.core.executor.worker.model  # the worker packed its model at load
    assert isinstance(model.lm_head.method, PanelMethod)
