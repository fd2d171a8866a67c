"""Weight-only quantization for CPU: weights stay int4/int8 in memory, matmuls read them as is.

    base.py         QuantMethod (per-layer strategy) and QuantLinear (the drop-in module)
    int4_cpu.py     group-wise int4 planes on torch's tinygemm op (GGUF Q4_0/Q4_1/Q4_K/Q5_K/Q8_0)
    int8_cpu.py     per-channel int8 on torch's int8 op (--quantization int8, GGUF Q6_K)
    gguf_repack.py  raw GGUF blocks -> those layouts, no float copy
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
