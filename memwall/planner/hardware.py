"""Devices the planner plans for: a table of GPUs from their vendors' datasheets, or this
machine (memory from /proc/meminfo, speed from a calibration file).

GPU figures are per GPU, as the vendor states them: memory in decimal GB (an "80GB" H100 is
counted as 80e9 bytes, a little under what nvidia-smi shows: conservative), bandwidth in
bytes/s, and DENSE peak tensor FLOP/s (the datasheets' headline figures assume 2:4 sparsity and
are twice these). Achievable is less: ``bandwidth_efficiency`` (0.8: what decode kernels
reach of peak HBM bandwidth) and ``compute_efficiency`` (0.7: large GEMMs in cuBLAS) scale them.

A calibration file (``~/.cache/memwall/calibration.json``, written by ``memwall plan --device
this --calibrate``: memwall/planner/calibrate.py) holds this machine's measured figures:

    {"cpu": "...", "cores": 2, "threads": 2, "bandwidth_bytes_s": 1.9e10,
     "matmul_flops": {"int8_decode": 6e10, "fp32": 9e10, "bf16": 2e11},
     "memory_bytes": 8.3e9, "measured_at": "2025-06-01T12:00:00"}

and, from memwall's own kernels and engine (all optional: a file without them plans with the
plain roofline; ``HostRates`` below says why each exists):

     "decode_bandwidth_share": {"q4": 0.1, "q8": 0.12}, "decode_row_s": {"q4": 2e-8, ...},
     "prefill_flops": {"q4": 1.3e11, "q4_large": 1e11, ...},
     "prefill_weight_s": {"q4": 6e-10, "q4_large": 3e-9, ...},
     "attention_flops": 3e10,
     "host_s": {"decode_step": 1e-3, "decode_layer": 2e-5, "prefill_step": 3e-3,
                "prefill_layer": 2e-4, "prefill_value_layer": 3e-12},
     "runtime_rss_bytes": 3.2e8, "huge_page_bytes": 2097152, "prefill_copy_bytes": 4

Measured figures are what memwall reached, so their efficiencies are 1.0. The contract with
the measuring module: ``memwall.planner.calibrate.run(path)`` writes that file (it alone in
memwall/planner/ may import torch; the CLI imports it only for --calibrate).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_CALIBRATION = Path("~/.cache/memwall/calibration.json")
BANDWIDTH_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.7


@dataclass(frozen=True)
class GpuSpec:
    """One row of a vendor datasheet (per GPU, dense peaks)."""

    name: str
    memory_gb: float
    bandwidth_tb_s: float
    bf16_tflops: float
    fp8_tflops: float | None = None


GPUS: dict[str, GpuSpec] = {s.name: s for s in (
    GpuSpec("A100-40GB", 40, 1.555, 312),           # SXM4, HBM2
    GpuSpec("A100-80GB", 80, 2.039, 312),           # SXM4, HBM2e
    GpuSpec("H100-SXM", 80, 3.35, 989.4, 1978.9),   # HBM3
    GpuSpec("H100-PCIe", 80, 2.0, 756.5, 1513),     # HBM2e
    GpuSpec("H200", 141, 4.8, 989.4, 1978.9),       # SXM, HBM3e
    GpuSpec("L40S", 48, 0.864, 362.05, 733),        # GDDR6
    GpuSpec("L4", 24, 0.300, 121, 242.5),           # GDDR6
    GpuSpec("A10G", 24, 0.600, 70),                 # AWS g5; NVIDIA's A10 is 125 (no AWS sheet)
    GpuSpec("RTX-4090", 24, 1.008, 165.2, 330.3),   # GDDR6X; fp32 accumulate (Ada whitepaper)
    GpuSpec("MI300X", 192, 5.3, 1307.4, 2614.9),    # AMD, HBM3
)}
GPU_ALIASES = {"h100": "H100-SXM", "a100": "A100-80GB", "4090": "RTX-4090", "h100sxm5": "H100-SXM"}


@dataclass(frozen=True)
class HostRates:
    """What a calibration measured of memwall's CPU engine beyond bandwidth and peak FLOP/s.
    Each figure exists because the plain roofline missed this machine's measured decode or
    prefill speed or peak RSS by more than the 15% the planner aims at (benchmarks/
    plan_validate.py); memwall/planner/host.py turns them into roofline terms."""

    decode_share: dict[str, float] = field(default_factory=dict)
    """Weight layout (q4, q8) -> the share of the stream bandwidth at which memwall's B=1
    kernels read it: a decode step's weights stream at this rate, not at the raw bandwidth
    (the integer-activation GEMV unpacks codes as it reads them: on 2 AVX2 cores it reaches a
    tenth of what a plain sum reads) ..."""
    decode_row_s: dict[str, float] = field(default_factory=dict)
    """... plus this many seconds per output row: short rows stream slower (SmolLM2's LM head,
    49,152 rows of 576 weights, took twice its bytes' time)."""
    prefill_flops: dict[str, float] = field(default_factory=dict)
    """Layout -> FLOP/s per prompt token of memwall's quantized matmul at prefill sizes (on a
    CPU without its fp32 tiles, BLAS on the dequantized weight); ``<layout>_large``: for a
    weight of more than host.LARGE_WEIGHTS values ..."""
    prefill_weight_s: dict[str, float] = field(default_factory=dict)
    """... and the seconds per weight a prefill chunk pays once, whatever its size
    (dequantizing the weight for BLAS: 40% of a 1B model's 176-token chunk on 2 AVX2 cores,
    its large copies coming from fresh pages each time)."""
    attention_flops: float | None = None
    """FLOP/s of prefill attention (torch's SDPA), which is slower than the matmuls."""
    host: dict[str, float] = field(default_factory=dict)
    """Seconds the engine spends beyond bytes and FLOPs, measured on tiny models whose steps
    are nearly all overhead: decode_step + L x decode_layer a decode step (scheduling,
    sampling, detokenizing, decode.c's per-layer launches: a millisecond of SmolLM2's 18),
    prefill_step + L x (prefill_layer + n (H + I) prefill_value_layer) a prefill chunk of n
    tokens (the torch path's per-op costs and elementwise work: 8% of SmolLM2's prefill)."""
    runtime_bytes: int | None = None
    """Resident bytes of an engine process serving a tiny model: Python, torch, memwall and
    its kernels, before any weights (the part of peak RSS that no model shape predicts)."""
    huge_page_bytes: int = 0
    """Transparent huge page size where the kernel backs madvised memory with them (numpy's
    large arrays, e.g. the KV cache): a touched KV tensor is resident in such units."""
    prefill_copy_bytes: int = 0
    """Bytes per weight of the copy a prefill matmul makes of its weight while it runs (4: the
    float32 weight BLAS multiplies by): the largest matrix's copy is part of peak RSS."""


@dataclass(frozen=True)
class Device:
    """One device a rank runs on: its memory, bandwidth and peak FLOP/s by number format
    (bf16, fp8, fp32, int8_decode: the kinds a calibration measures)."""

    name: str
    memory_bytes: int
    bandwidth_bytes_s: float | None
    """None: unknown (this machine, not calibrated): speeds are not estimated."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    compute_efficiency: float = COMPUTE_EFFICIENCY
    is_gpu: bool = True
    source: str = "vendor datasheet"
    host: HostRates | None = None
    """A calibrated CPU's measurements of memwall's own kernels and engine (None: a GPU, or a
    calibration file without them)."""
    elsewhere: str | None = None
    """Where a calibration file was measured on another CPU than this one: what it names."""

    @property
    def achievable_bandwidth(self) -> float | None:
        if self.bandwidth_bytes_s is None:
            return None
        return self.bandwidth_bytes_s * self.bandwidth_efficiency

    def achievable_flops(self, kinds: list[str]) -> tuple[float, str] | None:
        """FLOP/s of the first of ``kinds`` this device lists (else its fastest), and which."""
        if not self.peak_flops:
            return None
        kind = next((k for k in kinds if k in self.peak_flops), None)
        if kind is None:
            kind = max(self.peak_flops, key=self.peak_flops.get)
        return self.peak_flops[kind] * self.compute_efficiency, kind

    def shared_by(self, ranks: int) -> "Device":
        """One rank's share when ``ranks`` ranks run on this one host (CPU ranks share its
        memory and bandwidth; GPUs are one device a rank)."""
        if self.is_gpu or ranks == 1:
            return self
        bw = None if self.bandwidth_bytes_s is None else self.bandwidth_bytes_s / ranks
        return replace(self, memory_bytes=self.memory_bytes // ranks, bandwidth_bytes_s=bw,
                       peak_flops={k: v / ranks for k, v in self.peak_flops.items()})

    @classmethod
    def from_gpu(cls, spec: GpuSpec) -> "Device":
        flops = {"bf16": spec.bf16_tflops * 1e12}
        if spec.fp8_tflops:
            flops["fp8"] = spec.fp8_tflops * 1e12
        return cls(spec.name, int(spec.memory_gb * 1e9), spec.bandwidth_tb_s * 1e12, flops)

    @classmethod
    def from_calibration(cls, path: str | os.PathLike) -> "Device":
        """This machine as a calibration file measured it (format: module docstring)."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration file {str(path)!r} is not valid JSON ({e.msg}); "
                             "rerun memwall plan --device this --calibrate") from None
        flops = data.get("matmul_flops") or {}
        if not isinstance(flops, dict) or not all(_positive(v) for v in flops.values()):
            raise ValueError(f"calibration file {str(path)!r}: matmul_flops must map kinds to "
                             f"positive FLOP/s, got {flops!r}")
        bandwidth = data.get("bandwidth_bytes_s")
        if bandwidth is not None and not _positive(bandwidth):
            raise ValueError(f"calibration file {str(path)!r}: bandwidth_bytes_s must be a "
                             f"positive number, got {bandwidth!r}")
        memory = data.get("memory_bytes")
        memory = int(memory) if _positive(memory) else total_ram_bytes()
        cpu = data.get("cpu") or "CPU"
        cores = f", {data['cores']} cores" if data.get("cores") else ""
        return cls(f"this machine ({cpu}{cores})", memory, bandwidth,
                   {str(k): float(v) for k, v in flops.items()}, 1.0, 1.0, False,
                   f"calibration {path} ({data.get('measured_at', 'date unknown')})",
                   _host_rates(data, path), calibration_mismatch(data))

    @classmethod
    def this_machine(cls, calibration: str | os.PathLike | None = None) -> "Device":
        """Calibrated when the file exists; else memory only (bandwidth unknown)."""
        path = Path(calibration or DEFAULT_CALIBRATION).expanduser()
        if path.is_file():
            return cls.from_calibration(path)
        return cls("this machine (not calibrated)", total_ram_bytes(), None, {}, 1.0, 1.0,
                   False, f"/proc/meminfo; no calibration at {path}")


def _host_rates(data: dict, path: Path) -> HostRates | None:
    """The optional engine figures of a calibration file (HostRates); None when it has none."""
    tables = {}
    for key in ("decode_bandwidth_share", "decode_row_s", "prefill_flops", "prefill_weight_s",
                "host_s"):
        table = data.get(key) or {}
        if not isinstance(table, dict) or not all(_positive(v) or v == 0 for v in table.values()):
            raise ValueError(f"calibration file {str(path)!r}: {key} must map names to "
                             f"numbers >= 0, got {table!r}")
        tables[key] = {str(k): float(v) for k, v in table.items()}
    scalars = {k: data.get(k) for k in ("attention_flops", "runtime_rss_bytes", "huge_page_bytes",
                                        "prefill_copy_bytes")}
    for key, value in scalars.items():
        if value is not None and not (_positive(value) or value == 0):
            raise ValueError(f"calibration file {str(path)!r}: {key} must be a number >= 0, "
                             f"got {value!r}")
    if not any(tables.values()) and all(v is None for v in scalars.values()):
        return None
    runtime = scalars["runtime_rss_bytes"]
    return HostRates(tables["decode_bandwidth_share"], tables["decode_row_s"],
                     tables["prefill_flops"], tables["prefill_weight_s"],
                     scalars["attention_flops"] or None,
                     tables["host_s"], int(runtime) if runtime else None,
                     int(scalars["huge_page_bytes"] or 0), int(scalars["prefill_copy_bytes"] or 0))


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# The /proc/cpuinfo flags that pick memwall's CPU kernels (kernels/cpu/build.py's builds, AMX)
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_features() -> list[str]:
    """Which of KERNEL_FLAGS this CPU lists (two VMs both called "AMD EPYC" may differ here)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    listed = set(line.split(":", 1)[1].split())
                    return [flag for flag in KERNEL_FLAGS if flag in listed]
    except OSError:
        pass
    return []


def calibration_mismatch(data: dict, threads: int | None = None) -> str | None:
    """Why a calibration file's figures are not this machine's (another CPU model or kernel
    instruction sets, or another thread count than ``threads``), or None. A VM moved to
    another host keeps its files."""
    measured_on, here = data.get("cpu"), cpu_name()
    if measured_on and measured_on != here:
        return f"it was measured on {measured_on!r}, this machine is {here!r}"
    flags, ours = data.get("cpu_flags"), cpu_features()
    if isinstance(flags, list) and flags != ours:
        return (f"it was measured on a CPU with {' '.join(flags) or 'none'} of the kernels' "
                f"instruction sets, this one has {' '.join(ours) or 'none'}")
    if threads is not None and data.get("threads") not in (None, threads):
        return f"it was measured with {data['threads']} threads, the engine runs {threads}"
    return None


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def total_ram_bytes() -> int:
    """MemTotal from /proc/meminfo (Linux), else the page count times the page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_spec(name: str) -> GpuSpec:
    """A GPU by name, in any casing and with or without dashes (``h100``, ``H100-SXM``)."""
    found = _lookup(name)
    if found is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or --device this)")
    return found


def _lookup(name: str) -> GpuSpec | None:
    key = re.sub(r"[\s_-]", "", name.lower()).removeprefix("nvidia").removeprefix("amd")
    table = {re.sub(r"-", "", n.lower()): n for n in GPUS} | GPU_ALIASES
    return GPUS[table[key]] if key in table else None


def parse_gpus(text: str) -> tuple[GpuSpec, int]:
    """``H100`` -> (H100-SXM, 1); ``H100x8``, ``8xH100``, ``H100:8`` -> (H100-SXM, 8). A name
    that itself ends in x and digits (RTX4090) is read as a name first."""
    text = text.strip()
    readings = [(text, 1)]
    if m := re.fullmatch(r"(\d+)\s*[x*]\s*(.+)", text, re.IGNORECASE):
        readings.append((m.group(2), int(m.group(1))))
    if m := re.fullmatch(r"(.+)\s*[x*:]\s*(\d+)", text, re.IGNORECASE):
        readings.append((m.group(1), int(m.group(2))))
    for name, count in readings:
        spec = _lookup(name)
        if spec is not None:
            if count < 1:
                raise ValueError(f"GPU count must be >= 1, got {text!r}")
            return spec, count
    raise ValueError(f"unknown GPU {text!r}: write NAME or NAMExCOUNT (e.g. H100x8); known: "
                     f"{', '.join(GPUS)} (or --device this)")
