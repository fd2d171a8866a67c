"""What every Triton kernel test starts with: triton in its CPU interpreter when there is no
GPU (TRITON_INTERPRET=1 must be set before triton's first import; tests/conftest.py sets it),
or a skip of the whole module when that cannot work."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")


def require_triton():
    """The triton module, or a module-level skip with the reason."""
    if not CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")
    if not CUDA and type(triton.language.standard.max).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot "
                    "run on the CPU: set it in the environment or in tests/conftest.py",
                    allow_module_level=True)
    return triton
