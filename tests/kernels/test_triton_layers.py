"""The Triton norm, rotary and activation kernels against the torch layers they replace.

Without a GPU the kernels run in Triton's interpreter on the CPU. Tolerances: float32
atol 1e-6, rtol 1e-5 (rsqrt/exp differ in the last bits); float16 exact in practice, checked at
one half-precision ulp (rtol 1e-3); bfloat16 one ulp (rtol 1.6e-2): the interpreter rounds
float32 -> bfloat16 by truncation, not to nearest as the GPU and torch do (seen with triton 3.9).
"""


import pytest
import torch
from triton_support import CUDA, DEVICE, gpu, require_triton

triton = require_triton()

from memwall.kernels.triton import activation, norm, rotary  # noqa: E402
from memwall.layers.norm import RMSNorm  # noqa: E402
from memwall.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def rand(*shape, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype)


# --------------------------------------------------------------------------------- RMSNorm

def check_norm(tokens, hidden, dtype, device, seed=0):
    layer = RMSNorm(hidden, 1e-6).to(device, dtype)
    layer.weight.data = rand(hidden, dtype=dtype, device=device, seed=seed + 1)
    x = rand(tokens, hidden, dtype=dtype, device=device, seed=seed + 2)
    residual = rand(tokens, hidden, dtype=dtype, device=device, seed=seed + 3)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = norm.fused_add_rms_norm(x, residual, layer.weight, 1e-6)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # out of place
    torch.testing.assert_close(new_residual, x + residual, **TOL[dtype])
    torch.testing.assert_close(normed, layer(x + residual), **TOL[dtype])
    torch.testing.assert_close(norm.rms_norm(x, layer.weight, 1e-6), layer(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype):
    check_norm(5, 48, dtype, DEVICE)  # hidden not a power of two: masked columns


def test_rms_norm_keeps_leading_dims_like_qk_norm():
    """Qwen3's q/k norm: [tokens, heads, head_dim] normalized per head."""
    layer = RMSNorm(32, 1e-6).to(DEVICE)
    q = rand(3, 4, 32)
    out = norm.rms_norm(q, layer.weight, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, layer(q), **TOL[torch.float32])


# ---------------------------------------------------------------------------------- rotary

def check_rotary(tokens, heads, kv_heads, head_dim, dtype, device, scaling=None):
    rope = RotaryEmbedding(head_dim, 128, 10000.0, scaling).to(device)
    positions = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(4)).to(device)
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided views, as in the model
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    ref_q, ref_k = RotaryEmbedding.apply(rope.lookup(positions, q.dtype), q.clone(), k.clone())
    out_q, out_k = rotary.apply_rotary_(q, k, rope.cos, rope.sin, positions)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_fused_qkv_views(dtype):
    check_rotary(6, 4, 2, 32, dtype, DEVICE)


def test_rotary_llama3_scaled_table_and_odd_half():
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    check_rotary(3, 2, 1, 24, torch.float32, DEVICE, scaling)  # half = 12: masked columns


# ------------------------------------------------------------------------------ activation

@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gate_up = rand(4, 2 * 40, dtype=dtype) * 4  # wide range: silu's tails
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(activation.silu_and_mul(gate_up), ref, **TOL[dtype])


def test_silu_and_mul_several_column_blocks():
    gate_up = rand(2, 3, 2 * 100)  # leading dims kept; block 32 -> 4 column blocks
    gate, up = gate_up.chunk(2, dim=-1)
    out = activation.silu_and_mul(gate_up, block=32)
    assert out.shape == (2, 3, 100)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, **TOL[torch.float32])


# ------------------------------------------------------------------------------- real GPU

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_layers_at_llama3_8b_sizes(dtype):
    check_norm(300, 4096, dtype, "cuda")
    check_rotary(300, 32, 8, 128, dtype, "cuda")
    gate_up = rand(300, 2 * 14336, dtype=dtype, device="cuda")
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(activation.silu_and_mul(gate_up),
                               torch.nn.functional.silu(gate) * up, **TOL[dtype])
