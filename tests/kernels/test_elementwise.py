"""elementwise.c: RMSNorm (with the residual add), gated activations and rotary embeddings
against torch's own ops, on every instruction-set build (AVX-512, AVX2, plain C): row counts
1, 3 and 513, widths off the vector lengths (7, 17, 576 and 1,536), strided q/k views of one
qkv buffer, and positions outside the tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memwall.kernels.cpu import build, elementwise
from memwall.layers.norm import RMSNorm
from memwall.layers.rotary import RotaryEmbedding, _rotate

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler: native kernels not built")


def _torch_norm(x, w, eps):
    return w * F.rms_norm(x, (x.shape[-1],), eps=eps)


@pytest.mark.parametrize("rows", [1, 3, 513])
@pytest.mark.parametrize("n", [7, 17, 576])
def test_rms_norm_and_the_residual_add(isa_library, rows, n) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x, res = torch.randn(rows, n, generator=g) * 3, torch.randn(rows, n, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    x0, res0 = x.clone(), res.clone()
    out, summed = elementwise.rms_norm(x, w, 1e-5)
    assert summed is x
    torch.testing.assert_close(out, _torch_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    out, summed = elementwise.rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(summed, x0 + res0, atol=0, rtol=0)
    torch.testing.assert_close(out, _torch_norm(x0 + res0, w, 1e-5), atol=1e-5, rtol=1e-5)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # the inputs are left as they were
    # each row alone gives the same bits as in the batch
    one, _ = elementwise.rms_norm(x[-1:].clone(), w, 1e-5)
    assert torch.equal(one[0], elementwise.rms_norm(x, w, 1e-5)[0][-1])


def test_the_norm_module_takes_both_paths_alike() -> None:
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    x, res = torch.randn(9, 64), torch.randn(9, 64)
    normed, summed = norm.add_and_norm(x, res)
    torch.testing.assert_close(normed, _torch_norm(x + res, norm.weight, 1e-6), atol=1e-5, rtol=1e-5)
    xb, rb = x.bfloat16(), res.bfloat16()  # not float32: the torch path, as before
    want = norm.weight * F.rms_norm((xb + rb).float(), (64,), eps=1e-6).to(torch.bfloat16)
    assert torch.equal(norm.add_and_norm(xb, rb)[0], want)
    strided = torch.randn(9, 128)[:, :64]  # not contiguous: torch
    torch.testing.assert_close(norm(strided), _torch_norm(strided, norm.weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows, inter", [(1, 1), (3, 17), (513, 1536)])
def test_gated_activations(isa_library, act, rows, inter) -> None:
    gu = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    gu[0, 0] = -100.0  # far into the tails: silu -> -0, not NaN
    gate, up = gu.chunk(2, dim=-1)
    fn = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    torch.testing.assert_close(elementwise.gated_act(gu, act), fn(gate) * up, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [2, 64, 80])
def test_rope_in_place_on_qkv_views(isa_library, head_dim) -> None:
    heads, kv_heads, t = 3, 1, 37
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, :heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(head_dim))
    cos, sin = rope.cos_full[positions].unsqueeze(1), rope.sin_signed[positions].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    assert elementwise.rope_((q, k), positions, rope.cos, rope.sin)
    # the torch path's arithmetic, rounding for rounding
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched
    with pytest.raises(ValueError, match="position"):
        elementwise.rope_((q,), torch.full((t,), 64), rope.cos, rope.sin)
    # all or none: a tensor whose layout does not fit leaves the others unrotated too
    before = qkv.clone()
    fits = torch.randn(t, 2, head_dim)
    bad = torch.randn(t, head_dim, 2).transpose(1, 2)  # head_dim not contiguous
    assert not elementwise.rope_((q, fits, bad), positions, rope.cos, rope.sin)
    assert torch.equal(qkv, before)


def test_rotary_apply_uses_either_path_with_the_same_result() -> None:
    rope = RotaryEmbedding(16, 32, 10000.0)
    positions = torch.arange(5, 10)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    rows = rope.lookup(positions, torch.float32)
    ref = RotaryEmbedding.apply(tuple(rows), q.clone(), k.clone())  # the tuple form: torch
    got = RotaryEmbedding.apply(rows, q.clone(), k.clone())
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    qg = q.clone().requires_grad_()  # autograd: never in place
    out = RotaryEmbedding.apply(rows, qg, k)[0]
    assert out is not qg and torch.equal(out.detach(), ref[0])
