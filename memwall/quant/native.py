"""Compatibility re-export: the quantized CPU matmuls moved to memwall/kernels/cpu/quant_ops.py
(C sources beside it, built by memwall/kernels/cpu/build.py). Import from there; this module
goes once its last importers outside memwall/quant have moved."""

from memwall.kernels.cpu.build import lib as _lib
from memwall.kernels.cpu.quant_ops import (MAX_TOKENS, available, int8_dot_available,
                                           q4_dequantize, q4_matmul, q8_dequantize, q8_matmul,
                                           set_int8_dot)

__all__ = ["MAX_TOKENS", "available", "int8_dot_available", "q4_dequantize", "q4_matmul",
           "q8_dequantize", "q8_matmul", "set_int8_dot", "_lib"]
