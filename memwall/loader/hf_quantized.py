"""Quantized Hugging Face checkpoints (config.json has a ``quantization_config``) -> the
layouts memwall's kernels read, one Linear at a time, with no float copy of a kept weight.

    quant_method   tensors of one Linear (``<module>.<name>``)                 memwall keeps
    awq  (GEMM)    qweight int32 [in, out/8]   8 codes along out (AWQ_ORDER)     NativeQ4
                   qzeros  int32 [in/g, out/8] zeros, packed like qweight
                   scales  fp16  [in/g, out]
    gptq           qweight int32 [in/8, out]   8 codes along in, code i at       NativeQ4; act-order
                   qzeros  int32 [G, out/8]    bits 4i; zeros along out, the     (a shuffled g_idx)
                   scales  fp16  [G, out]      same way; "gptq" (v1) stores      wrapped in
                   g_idx   int32 [in]          zero - 1, "gptq_v2" the zero      PermutedInput
    fp8 /          weight  float8_e4m3fn [out, in]                              float weights, or
    fbgemm_fp8     weight_scale fp32 [] / [out] / [out, 1], or (blocks)          Fp8Linear on a CUDA
                   weight_scale_inv [out/bn, in/bk]; input_scale (unused: our    machine with FP8
                   FP8 matmul scales activations per token)                      tensor cores

Both int4 formats mean w[n, i] = (q[n, i] - z[n, g(i)]) * s[n, g(i)], g(i) the group of input
i. NativeQ4 holds w = s * q + c per 32 inputs, so each 32-block takes its group's s and
c = -z * s; both products are exact in fp32 (an fp16 scale times a 4-bit integer), so the
kernels see bit for bit the checkpoint's dequantized weights. Groups of 64 or 128 repeat their
scale over 2 or 4 blocks (0.25 B/weight of scales instead of 0.06: the q4 layout's block is 32).

AWQ packs the 8 output columns 8j..8j+7 of one input row into one int32 as

    bits    31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
    column  8j+7    8j+5    8j+3    8j+1    8j+6    8j+4    8j+2    8j+0

(AutoAWQ's pack order 0,2,4,6,1,3,5,7). Which Linears are quantized is read from the tensors
(a ``qweight`` or a ``weight_scale``), so ``modules_to_not_convert`` / ``ignored_layers`` (and
the float lm_head and embeddings) load as float without reading those lists.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from memwall.config import ModelArchConfig
from memwall.loader.errors import ModelLoadError
from memwall.loader.hf_loader import iter_hf_tensors, safetensors_files
from memwall.quant.base import QuantWeights

logger = logging.getLogger("memwall")

SUPPORTED = ("awq (bits 4, version gemm, zero_point true), gptq (bits 4, checkpoint_format "
             "gptq or gptq_v2), fp8, fbgemm_fp8")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column (of 8) held by nibble slot i
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble slot holding column k
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")
FP8_PARTS = ("weight", "weight_scale", "weight_scale_inv", "input_scale")
_BIASED = ("q_proj", "k_proj", "v_proj")  # the Linears with a bias when attention_bias


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's ``quantization_config``, checked."""

    method: str  # "awq", "gptq" or "fp8" (fbgemm_fp8 stores the same tensors)
    group_size: int = 0  # int4: inputs per scale group; -1: one group per row
    zero_offset: int = 0  # gptq v1 stores zero - 1: the real zero is stored + zero_offset
    block: tuple[int, int] | None = None  # fp8 weight_block_size (out, in): weight_scale_inv

    @property
    def parts(self) -> tuple[str, ...]:
        return FP8_PARTS if self.method == "fp8" else INT4_PARTS

    def describe(self) -> str:
        if self.method == "fp8":
            return "fp8" + (f" blocks {self.block[0]}x{self.block[1]}" if self.block else "")
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method} {group}"


def quant_spec(cfg: dict, where: Path) -> QuantSpec:
    """The checked ``quantization_config`` of config.json ``cfg``; ModelLoadError (one line,
    naming the method and the supported ones) for anything memwall cannot load."""
    qc = cfg["quantization_config"]
    method = str(qc.get("quant_method", "")).lower()
    bits = qc.get("bits", qc.get("w_bit"))
    if method == "awq" and bits == 4 and str(qc.get("version", "gemm")).lower() == "gemm" \
            and qc.get("zero_point", True):
        return QuantSpec("awq", _group_size(qc.get("group_size", qc.get("q_group_size")), where))
    fmt = qc.get("checkpoint_format", "gptq")
    if method == "gptq" and bits == 4 and fmt in ("gptq", "gptq_v2") \
            and not qc.get("is_marlin_format"):
        return QuantSpec("gptq", _group_size(qc.get("group_size", -1), where),
                         zero_offset=1 if fmt == "gptq" else 0)
    if method in ("fp8", "fbgemm_fp8"):
        block = qc.get("weight_block_size")
        return QuantSpec("fp8", block=tuple(int(b) for b in block) if block else None)
    details = ", ".join(f"{key} {qc[key]!r}" for key in ("bits", "version", "zero_point",
                                                            "checkpoint_format") if key in qc)
    raise ModelLoadError(f"{where}: quantization_config quant_method {method!r}"
                         f"{' (' + details + ')' if details else ''} is not supported; "
                         f"supported: {SUPPORTED}")


def _group_size(value, where: Path) -> int:
    group = int(value if value is not None else 128)
    if group != -1 and (group <= 0 or group % 32):
        raise ModelLoadError(f"{where}: int4 group_size {group} is not supported; memwall's "
                             "int4 kernels need -1 (per channel) or a multiple of 32")
    return group


# --------------------------------------------------------------------------- unpacking

def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> [..., C, 8] uint8, entry i = bits 4i..4i+3."""
    return ((packed.to(torch.int32)[..., None] >> _SHIFTS) & 15).to(torch.uint8)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C/8] (8 values along C, interleaved) -> uint8 [R, C]."""
    return _nibbles(packed)[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ's int32 [R, C/8] (value i of a word at bits 4i, along C) -> uint8 [R, C]."""
    return _nibbles(packed).reshape(packed.shape[0], -1)


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int) -> tuple[torch.Tensor, ...]:
    """An AWQ Linear -> (q uint8 [out, in], z, s float32 [out, G], g_idx int64 [in])."""
    k = qweight.shape[0]
    q = unpack_awq(qweight).t()  # [out, in]
    z = unpack_awq(qzeros).t().float()  # [out, G]
    return q, z, scales.float().t(), torch.arange(k) // group_size


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None, group_size: int,
               zero_offset: int) -> tuple[torch.Tensor, ...]:
    """A GPTQ Linear -> (q uint8 [out, in], z, s float32 [out, G], g_idx int64 [in])."""
    k = qweight.shape[0] * 8
    q = _nibbles(qweight).permute(0, 2, 1).reshape(k, -1).t()  # [in/8, 8, out] -> [out, in]
    z = unpack_rows(qzeros).t().float() + zero_offset  # [out, G]
    if g_idx is None:  # old checkpoints without act-order stored none
        g_idx = torch.arange(k) // (k if group_size == -1 else group_size)
    return q, z, scales.float().t(), g_idx.long()


def dequantize_codes(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                     g_idx: torch.Tensor) -> torch.Tensor:
    """w[n, i] = (q[n, i] - z[n, g_idx[i]]) * s[n, g_idx[i]], float32 [out, in]."""
    return (q.float() - z[:, g_idx]) * s[:, g_idx]


# --------------------------------------------------------------------------- int4 -> kernels

def int4_weights(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor,
                 source: str, backend: str = "auto") -> QuantWeights:
    """Codes, zeros and scales (as ``awq_codes``/``gptq_codes`` give them) -> NativeQ4, or
    torch's Int4WeightOnly (groups of 32) when the native kernels are not built; inputs are
    permuted (``PermutedInput``) when g_idx does not already keep each group contiguous.

    Every 32-input block must lie in one group (any group size that is a multiple of 32)."""
    from memwall.quant.act_order import PermutedInput
    from memwall.quant.gguf_repack import use_native
    from memwall.quant.int4_cpu import Int4WeightOnly, NativeQ4

    n, k = q.shape
    if k % 32:
        raise ModelLoadError(f"{source}: in_features {k} is not a multiple of 32, which the "
                             "int4 kernels need; load with quantization 'none'")
    perm = torch.argsort(g_idx, stable=True)  # [in]: groups become contiguous
    permuted = not torch.equal(perm, torch.arange(k))
    if permuted:
        q, g_idx = q[:, perm], g_idx[perm]
    blocks = g_idx.view(k // 32, 32)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        raise ModelLoadError(f"{source}: a scale group does not cover whole blocks of 32 "
                             "inputs; load with quantization 'none'")
    g = blocks[:, 0]  # [in/32] the group of each 32-input block
    s32, z32 = s[:, g].contiguous(), z[:, g].contiguous()  # [out, in/32]
    if use_native(backend):
        weights = NativeQ4().from_codes(q, s32, -z32 * s32, source)  # w = s*q + c, exact
    else:  # torch's plane: w = (q - 8) * scale + zero
        weights = Int4WeightOnly(32).from_planes(q[None], s32[None], ((8 - z32) * s32)[None],
                                                 source)
    return PermutedInput.wrap(weights, perm) if permuted else weights


# --------------------------------------------------------------------------- fp8

def fp8_weight(weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """FP8 weight [out, in] and its scale (one, one per row, or one per block) -> float32."""
    n, k = weight.shape
    scale = scale.float()
    if block is not None:  # [ceil(n/bn), ceil(k/bk)]
        scale = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    elif scale.numel() == n:
        scale = scale.reshape(n, 1)
    elif scale.numel() != 1:
        raise ModelLoadError(f"fp8 weight_scale of shape {list(scale.shape)} fits neither a "
                             f"tensor nor the {n} rows of a [{n}, {k}] weight")
    return weight.float() * scale


def fp8_gpu() -> bool:
    """True where Fp8Linear multiplies FP8 on tensor cores (a CUDA device of capability 8.9+)."""
    from memwall.quant.fp8 import scaled_mm_supported
    return torch.cuda.is_available() and scaled_mm_supported(torch.device("cuda"))


def fp8_kept(weight: torch.Tensor, scale: torch.Tensor, source: str) -> QuantWeights | None:
    """An FP8 weight with a tensor or row scale as Fp8Linear holds it; None when it cannot."""
    from memwall.quant.fp8 import FP8, Fp8Linear

    n, k = weight.shape
    method = Fp8Linear()
    if weight.dtype != FP8 or scale.numel() not in (1, n) or not method.supports(n, k):
        return None
    wscale = scale.float().reshape(-1).expand(n).contiguous()  # [out]
    return QuantWeights(method, {"qweight": weight.contiguous(), "wscale": wscale}, n, k, source)


# --------------------------------------------------------------------------- a checkpoint

class _Tensors:
    """The checkpoint's tensors by name, each read on demand (every shard stays open)."""

    def __init__(self, model_dir: Path) -> None:
        self.files: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        for path in safetensors_files(model_dir):
            for name in self._handle(path).keys():
                self.files[name] = path

    def _handle(self, path: Path):
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except (OSError, RuntimeError, ValueError) as e:
                raise ModelLoadError(f"cannot read {path}: {e}") from None
        return self._open[path]

    def get(self, name: str) -> torch.Tensor | None:
        path = self.files.get(name)
        return None if path is None else self._handle(path).get_tensor(name)

    def modules_with(self, suffix: str) -> list[str]:
        return sorted(n.removesuffix(suffix) for n in self.files if n.endswith(suffix))


def open_quantized(model_dir: Path, cfg: dict, arch: ModelArchConfig, dtype: torch.dtype,
                   quantization: str = "auto", backend: str = "auto"
                   ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, QuantWeights]]:
    """A quantized checkpoint as ``(float tensors, {module: QuantWeights})`` for the model
    loader: the int4 Linears become QuantWeights (all read now, one at a time), unless
    ``quantization`` is "none": then they, like FP8 weights off a CUDA machine, are yielded
    dequantized to ``dtype`` as ``<module>.weight``, one at a time as the model loads."""
    spec = quant_spec(cfg, model_dir / "config.json")
    tensors = _Tensors(model_dir)
    marker = (".qweight" if spec.method != "fp8" else
              ".weight_scale_inv" if spec.block else ".weight_scale")
    modules = tensors.modules_with(marker)
    if not modules:
        raise ModelLoadError(f"{model_dir}: config.json declares {spec.describe()} quantization "
                             f"but no tensor is stored that way (no *{marker})")
    skip = {f"{m}.{part}" for m in modules for part in spec.parts}
    skip |= _extra_zero_biases(tensors, modules, arch)
    packed = _kept(tensors, modules, spec, quantization, backend)
    floats = [m for m in modules if m not in packed]
    if floats:  # what stays quantized, the model loader's summary line reports
        logger.info("weights: %s checkpoint: %d of %d Linear(s) dequantized to %s (%s)",
                    spec.describe(), len(floats), len(modules), str(dtype).removeprefix("torch."),
                    _why_float(spec, quantization))
    return itertools.chain(iter_hf_tensors(model_dir, dtype, skip),
                           _dequantized(tensors, floats, spec, dtype)), packed


def _kept(tensors: _Tensors, modules: list[str], spec: QuantSpec, quantization: str,
          backend: str) -> dict[str, QuantWeights]:
    """The Linears that stay quantized: every int4 one unless ``quantization`` is "none";
    the FP8 ones Fp8Linear can hold, where it multiplies FP8 (``fp8_gpu``) and only for "auto"
    (the worker asks the loader for "none" when it is to quantize to FP8 itself)."""
    if quantization == "none":
        return {}
    if spec.method != "fp8":
        return {m: _int4_module(tensors, m, spec, backend) for m in modules}
    if spec.block is not None or quantization != "auto" or not fp8_gpu():
        return {}
    kept = {m: fp8_kept(tensors.get(f"{m}.weight"), tensors.get(f"{m}.weight_scale"),
                        spec.describe()) for m in modules}
    return {m: w for m, w in kept.items() if w is not None}


def _why_float(spec: QuantSpec, quantization: str) -> str:
    if quantization == "none" or spec.method != "fp8":
        return "quantization 'none'"
    if spec.block is not None:
        return "block scales: memwall's FP8 matmul takes a scale per row"
    if quantization != "auto" or not fp8_gpu():
        return "FP8 matmuls need quantization 'auto' and a CUDA device of compute capability 8.9+"
    return "shapes torch._scaled_mm cannot take"


def _int4_module(tensors: _Tensors, module: str, spec: QuantSpec, backend: str) -> QuantWeights:
    q, z, s, g_idx = _codes(tensors, module, spec)
    return int4_weights(q, z, s, g_idx, f"{spec.describe()} -> int4", backend)


def _codes(tensors: _Tensors, module: str, spec: QuantSpec) -> tuple[torch.Tensor, ...]:
    qweight, qzeros, scales, g_idx = (tensors.get(f"{module}.{p}") for p in INT4_PARTS)
    if qzeros is None or scales is None:
        raise ModelLoadError(f"{module}: a {spec.method} checkpoint stores qweight, qzeros and "
                             f"scales for each quantized Linear; qzeros or scales is missing")
    try:
        if spec.method == "awq":
            group = spec.group_size if spec.group_size != -1 else qweight.shape[0]
            q, z, s, g = awq_codes(qweight, qzeros, scales, group)
        else:
            q, z, s, g = gptq_codes(qweight, qzeros, scales, g_idx, spec.group_size,
                                    spec.zero_offset)
        fits = (z.shape == s.shape and s.shape[0] == q.shape[0] and g.shape == q.shape[1:]
                and 0 <= int(g.min()) and int(g.max()) < s.shape[1])
    except RuntimeError:
        fits = False
    if not fits:
        raise ModelLoadError(f"{module}: {spec.method} tensors qweight {list(qweight.shape)}, "
                             f"qzeros {list(qzeros.shape)}, scales {list(scales.shape)}"
                             f"{'' if g_idx is None else f', g_idx {list(g_idx.shape)}'} do not "
                             f"fit together (group_size {spec.group_size})")
    return q, z, s, g


def _dequantized(tensors: _Tensors, modules: list[str], spec: QuantSpec,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for m in modules:
        if spec.method == "fp8":
            scale = tensors.get(f"{m}.weight_scale_inv" if spec.block else f"{m}.weight_scale")
            w = fp8_weight(tensors.get(f"{m}.weight"), scale, spec.block)
        else:
            w = dequantize_codes(*_codes(tensors, m, spec))
        yield f"{m}.weight", w.to(dtype)


def _extra_zero_biases(tensors: _Tensors, modules: list[str], arch: ModelArchConfig) -> set[str]:
    """Biases of quantized Linears the model has none for, when they are all zero: some GPTQ
    exporters write one for every Linear (a no-op we skip, as vLLM does). A nonzero one is
    loaded, so the model loader names it as a tensor that does not belong."""
    extra = set()
    for m in modules:
        name = f"{m}.bias"
        has_bias = arch.attention_bias and m.rsplit(".", 1)[-1] in _BIASED
        if name in tensors.files and not has_bias and not tensors.get(name).any():
            extra.add(name)
    return extra
