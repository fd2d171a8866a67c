"""The weight-only FP8 kernel (memwall/kernels/triton/fp8_linear.py) and its routing in
memwall/quant/fp8.py.

Without a GPU the kernel runs in Triton's interpreter on the CPU (small shapes: it is slow).
The reference is the same FP8 numbers dequantized (``dequantize_fp8_rows``) times x in float64,
so only the order of the fp32 summation differs: relative-norm error < 1e-5 for fp32 x (seen
~2e-7), < 1e-2 for bf16 output (seen ~3e-3: the output's own rounding). Shapes sit on and off
the tiles (GEMV 16 x 512, dot 64 x 128): N = 16, 48, 1040 and K = 16, 80, 8208.
Both ways of reading the bytes run here: float8e4nv (``native``, what >= 8.9 GPUs use) and the
integer decode of the uint8 bytes (older GPUs).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_support import DEVICE, gpu, require_triton

triton = require_triton()

from memwall.kernels.triton import fp8_linear as fl  # noqa: E402
from memwall.kernels.triton.fp8_linear import Fp8LinearConfig, fp8_linear, pick_config  # noqa: E402
from memwall.quant import fp8 as fp8_mod  # noqa: E402
from memwall.quant.base import QuantLinear  # noqa: E402
from memwall.quant.fp8 import (FP8, SMALL_M_MAX, Fp8Linear, dequantize_fp8_rows,  # noqa: E402
                               quantize_fp8_rows, use_small_m_kernel)

ROOT = Path(__file__).resolve().parents[2]
CAP = SMALL_M_MAX


def make_weight(n, k, seed=0, device=DEVICE):
    """Rows of very different scale, some elements tiny (E4M3 subnormals after quantizing)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    w[:, ::7] *= 1e-3
    q, scale = quantize_fp8_rows(w)
    return q.to(device), scale.to(device)


def make_x(m, k, dtype, seed=1, device=DEVICE):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def reference(x, q, scale):
    """float64 [.., N] on the CPU: x times the dequantized weight."""
    w = dequantize_fp8_rows(q.cpu(), scale.cpu(), torch.float64)
    return x.cpu().double() @ w.T


def assert_close(y, ref, dtype):
    assert y.dtype == dtype and torch.isfinite(y).all()
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    err = ((y.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < bound, f"relative error {err:.2e} >= {bound:.0e}"


DTYPES = [torch.float32, torch.bfloat16]


# ------------------------------------------------------------------------ against the reference

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", sorted({1, 2, 3, 7, 16, CAP}))
def test_rows_up_to_the_cap_match_the_reference(m, dtype):
    """N = 48 and K = 80 are off every tile; both byte readers."""
    q, scale = make_weight(48, 80, seed=m)
    x = make_x(m, 80, dtype, seed=m)
    ref = reference(x, q, scale)
    for native in (True, False):
        assert_close(fp8_linear(x, q, scale, native=native), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, k", [(16, 16), (1040, 80), (16, 8208), (48, 8208)])
@pytest.mark.parametrize("m", [1, 7])
def test_tile_boundaries_with_the_picked_split(m, n, k, dtype):
    """The device's own tiles: K = 8208 splits K (shares of whole steps, the last one short)."""
    q, scale = make_weight(n, k, seed=n + k)
    x = make_x(m, k, dtype, seed=m)
    y = fp8_linear(x, q, scale, native=(m == 1))
    assert_close(y, reference(x, q, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("split_k", [1, 3, 64])
def test_split_k_on_and_off(block_m, split_k, dtype):
    """Forced configs: one share, three uneven ones (K = 1040 is 16.25 steps of 64), and more
    shares asked for than there are steps (the empty ones are not launched)."""
    q, scale = make_weight(48, 1040, seed=split_k)
    x = make_x(3, 1040, dtype, seed=block_m)
    cfg = Fp8LinearConfig(block_m=block_m, block_n=16, block_k=64, split_k=split_k,
                          num_warps=4, num_stages=2)
    ref = reference(x, q, scale)
    y = fp8_linear(x, q, scale, config=cfg, native=False)
    assert_close(y, ref, dtype)
    if split_k > 1:  # the reduction sums the shares in a fixed order: same bits on a rerun
        assert torch.equal(y, fp8_linear(x, q, scale, config=cfg, native=False))


@pytest.mark.parametrize("native", [True, False], ids=["float8e4nv", "uint8-decode"])
def test_every_finite_e4m3_byte_decodes_exactly(native):
    """Row n of the weight holds byte n at column 0 (NaN bytes 0x7F/0xFF left out): with x the
    first unit vector, y[n] is that byte's value times its scale, exactly."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    q = torch.zeros(codes.numel(), 16, dtype=torch.uint8)
    q[:, 0] = codes
    q = q.view(FP8).to(DEVICE)
    scale = torch.linspace(0.5, 2.0, codes.numel()).to(DEVICE)
    x = torch.zeros(1, 16, device=DEVICE)
    x[0, 0] = 1.0
    y = fp8_linear(x, q, scale, native=native)
    assert torch.equal(y[0].cpu(), dequantize_fp8_rows(q.cpu(), scale.cpu())[:, 0])


def test_leading_dims_strides_fp16_and_rows_past_the_cap():
    q, scale = make_weight(48, 80)
    base = make_x(2 * 3 * 96, 1, torch.float32).reshape(2, 3, 96)
    x = base[..., 8:88]  # [2, 3, 80], rows 96 apart: strided, not contiguous
    y = fp8_linear(x, q, scale)
    assert y.shape == (2, 3, 48)
    assert_close(y, reference(x, q, scale), torch.float32)
    x16 = make_x(4, 80, torch.float16)
    assert_close(fp8_linear(x16, q, scale, native=False), reference(x16, q, scale), torch.float16)
    many = make_x(CAP + 9, 80, torch.float32)  # two m tiles: correct, if not the fast case
    assert_close(fp8_linear(many, q, scale), reference(many, q, scale), torch.float32)
    assert fp8_linear(many[:0], q, scale).shape == (0, 48)


def test_bad_inputs_are_refused():
    q, scale = make_weight(16, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(make_x(1, 32, torch.float32), q.view(torch.uint8), scale)
    with pytest.raises(ValueError, match=r"x \[\.\.\., 32\]"):
        fp8_linear(make_x(1, 16, torch.float32), q, scale)


# ---------------------------------------------------------------------------------- tiles

@pytest.mark.parametrize("m", [1, 2, 16, 32])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                  (1024, 4096), (16, 16)])
def test_tile_table_keeps_its_limits(m, n, k):
    cfg = pick_config(m, n, k, sms=132)
    assert cfg.block_m == (1 if m == 1 else 16 if m <= 16 else 32)
    assert cfg.split_k & (cfg.split_k - 1) == 0  # a power of two
    if cfg.split_k > 1:
        assert k >= fl.SPLIT_K_MIN_K
        tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
        assert tiles * cfg.split_k <= fl.PROGRAMS_PER_SM * 132
        assert -(-k // cfg.block_k) >= cfg.split_k * fl.MIN_K_STEPS
        assert cfg.split_k * m * 4 * 2 * fl.PARTIAL_TRAFFIC <= k  # partials vs weight bytes


def test_tile_table_for_llama3_8b_on_an_h100():
    """The numbers pick_config's docstring quotes (qkv, o, gate_up, down)."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    splits = {m: [pick_config(m, n, k, 132).split_k for n, k in shapes] for m in (1, 16, 32)}
    assert splits == {1: [1, 1, 1, 2], 16: [1, 1, 1, 8], 32: [1, 1, 1, 8]}


# -------------------------------------------------------------------------------- routing

def test_routing_decision():
    assert use_small_m_kernel("cuda", 1, True) and use_small_m_kernel("cuda", CAP, True)
    assert not use_small_m_kernel("cuda", CAP + 1, True)  # prefill: fp8 tensor cores
    assert not use_small_m_kernel("cuda", 0, True)
    assert not use_small_m_kernel("cuda", 1, False)  # no triton: _scaled_mm or F.linear
    assert not use_small_m_kernel("cpu", 1, True)  # the CPU keeps F.linear


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "",
                               "PYTHONPATH": str(ROOT)}, timeout=120)


def test_cpu_apply_never_imports_triton_and_the_kernel_imports_without_it():
    code = """
import sys
import torch
from memwall.quant.base import QuantLinear
from memwall.quant.fp8 import Fp8Linear, dequantize_fp8_rows
layer = QuantLinear(Fp8Linear().create_weights(torch.randn(32, 64)))
x = torch.randn(3, 64)
assert torch.allclose(layer(x), x @ dequantize_fp8_rows(layer.qweight, layer.wscale).T)
assert "triton" not in sys.modules, "a CPU fp8 matmul imported triton"
sys.modules["triton"] = None  # as if triton were not installed
from memwall.kernels.triton import fp8_linear
try:
    fp8_linear.fp8_linear(x, layer.qweight, layer.wscale)
except RuntimeError as e:
    assert "triton" in str(e), e
    print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ------------------------------------------------------------------------------- real GPU

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [True, False], ids=["float8e4nv", "uint8-decode"])
def test_gpu_llama_shapes_match_the_reference(dtype, native):
    if native and not fl.fp8_native(torch.device("cuda")):
        pytest.skip("float8e4nv needs compute capability >= 8.9")
    for n, k in [(4096, 4096), (1024, 4096), (4096, 14336)]:
        q, scale = make_weight(n, k, seed=n + k, device="cuda")
        for m in (1, 2, 16, CAP):
            x = make_x(m, k, dtype, seed=m, device="cuda")
            assert_close(fp8_linear(x, q, scale, native=native), reference(x, q, scale), dtype)


@pytest.mark.gpu
@gpu
def test_gpu_apply_routes_small_batches_to_the_kernel(monkeypatch):
    calls = []
    kernel = fp8_linear

    def spy(x, q, s):
        calls.append(x.shape[0])
        return kernel(x, q, s)

    monkeypatch.setattr(fp8_mod, "_small_m_kernel", lambda: spy)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear(Fp8Linear().create_weights(w)).cuda()
    for rows in (1, 7, CAP):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        assert_close(layer(x), reference(x, layer.qweight, layer.wscale), torch.bfloat16)
    assert calls == [1, 7, CAP]
    layer(torch.randn(CAP + 1, 512, device="cuda", dtype=torch.bfloat16))  # prefill-sized
    assert calls == [1, 7, CAP]


@pytest.mark.gpu
@gpu
def test_gpu_kernel_replays_in_a_cuda_graph():
    """Fixed tiles, no autotuning: a captured launch replays on new inputs (split-K included)."""
    q, scale = make_weight(4096, 14336, device="cuda")
    x = make_x(16, 14336, torch.bfloat16, device="cuda")
    assert pick_config(16, 4096, 14336, fl._device_info(x.device)[0]).split_k > 1
    fp8_linear(x, q, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, q, scale)
    x.copy_(make_x(16, 14336, torch.bfloat16, seed=9, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, reference(x, q, scale), torch.bfloat16)

