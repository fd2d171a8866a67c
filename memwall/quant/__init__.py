"""Weight-only quantization for CPU: weights stay int4/int8 in memory, matmuls read them as is.

    base.py         QuantMethod (per-layer strategy) and QuantLinear (the drop-in module)
    native.py       the old import path of memwall/kernels/cpu/quant_ops.py (fp32 C kernels)
    int4_cpu.py     NativeQ4 (native), Int4WeightOnly (torch's bf16 tinygemm op, the fallback)
    int8_cpu.py     NativeQ8 (native), Int8WeightOnly (torch's bf16 int8 op, the fallback)
    gguf_repack.py  raw GGUF blocks -> those layouts, no float copy
    act_order.py    PermutedInput: GPTQ act-order weights (inputs gathered by a permutation)
    transform.py    quantize_model(model, method, gguf_raw): swap nn.Linear in place

Use after the model is built and loaded:

    quantize_model(model, None, gguf_quantized_linears(reader, hf_config))   # a GGUF file
    quantize_model(model, "int8")                                             # a float checkpoint
"""

from memwall.quant.base import QuantLinear, QuantMethod, QuantWeights
from memwall.quant.gguf_repack import gguf_quantized_linears
from memwall.quant.transform import QuantizeReport, get_quant_method, quantize_model


__all__ = ["QuantLinear", "QuantMethod", "QuantWeights", "QuantizeReport", "get_quant_method",
           "quantize_model", "gguf_quantized_linears"]
