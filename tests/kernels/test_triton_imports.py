"""The Triton modules import on any machine: without CUDA, and even without triton installed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["memwall.kernels", "memwall.kernels.triton", "memwall.kernels.triton.paged_attention",
           "memwall.attention.triton_backend"]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", **env}, timeout=120)


def test_modules_import_and_fail_helpfully_without_triton():
    code = f"""
import sys
sys.modules["triton"] = None  # as if triton were not installed: `import triton` raises ImportError
import importlib
for name in {MODULES!r}:
    importlib.import_module(name)
from memwall.kernels.triton import TRITON_AVAILABLE
from memwall.attention import triton_backend
from memwall.kernels.triton import paged_attention
import torch
assert not TRITON_AVAILABLE and not triton_backend.available()
try:
    k = torch.ones(2, 1, 16)
    cache = torch.zeros(1, 4, 1, 16)
    paged_attention.reshape_and_cache(k, k, cache, cache, torch.tensor([0, 1]))
except RuntimeError as e:
    assert "triton" in str(e), e
    print("ok")
"""
    result = run_python(code, PYTHONPATH=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_gpu_benchmark_imports_without_cuda_or_triton():
    for hide_triton in ("", "sys.modules['triton'] = None; "):
        code = f"import sys; {hide_triton}from benchmarks import gpu; sys.exit(gpu.main([]))"
        result = run_python(code, PYTHONPATH=str(ROOT))
        assert result.returncode == 2, result.stderr  # the "needs a CUDA device" exit, not a crash
        assert "needs a CUDA device" in result.stderr
