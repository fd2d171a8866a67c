"""This machine measured for the planner, in about fifteen seconds: ``memwall plan --device this
--calibrate`` calls ``run(path)``, which writes the calibration file that
hardware.Device.from_calibration reads. The one part of memwall/planner that imports torch
(.importlinter exempts it); the CLI imports it only for --calibrate.

Every figure is memwall's own code on this machine, with the engine's thread count (the cores
this process may use, memwall/worker/worker.py ``default_threads``), the median of ROUNDS rounds
spread over the run (kernels.py). Why each exists: hardware.HostRates; how the roofline uses
it: memwall/planner/host.py.

    bandwidth_bytes_s       a streaming read (torch sum) of a float32 buffer 8x the L3 cache
    decode_bandwidth_share  q4, q8: memwall's B=1 quantized matmul (the integer-activation
    decode_row_s            kernels decode.c runs) over weights 2x the L3 cache with rows of
                            512 to 4096 weights: t = rows x row_s + bytes / (share x
                            bandwidth_bytes_s), least squares
    matmul_flops            int8_decode: the same kernels on 16 tokens of a 4096 x 2048 weight (a
                            batched decode step); int8_prefill: on 96 (a prefill chunk of at most
                            128 tokens); fp32, bf16: torch.matmul
    prefill_flops           q4, q8: memwall's quantized matmul, whatever path this CPU takes (BLAS
    prefill_weight_s        on the dequantized weight, fp32 tiles, AMX), at 512 (and 256) tokens:
                            t(n) = P x weight_s + 2 n P / flops, on a 2048 x 2048 weight and
                            (q4_large) a 4096 x 4096 one, whose float32 copy no longer fits the
                            allocator's heap (host.LARGE_WEIGHTS); q8_large adds q4's difference
    attention_flops         torch's SDPA, causal, grouped heads, over a 512-token prompt
    layer_value_s           memwall's decoder layer without its matmuls and attention (norms,
                            rotary, KV write, activation, residuals), per token and H + I value
                            (layer.py)
    host_s                  the engine's own time per step and per layer, from tiny models
                            served by it (engine.py); prefill_value_layer is layer_value_s
    cpu, cpu_flags, threads the CPU's model name, which of the kernels' instruction sets it
                            lists, the thread count: a file measured elsewhere is not used to
                            size an engine (hardware.calibration_mismatch)
    runtime_rss_bytes       this process's resident size after serving the tiny models, before
                            any large buffer: Python, torch and memwall without weights
    prefill_copy_bytes      bytes per weight of the copy a prefill matmul makes of its weight: 4
                            where it dequantizes for BLAS, 8 on AMX (split bf16), 0 fp32 tiles
    huge_page_bytes         2 MiB when transparent huge pages back madvised memory, else 0

``quick=True`` measures smaller buffers fewer times (tests: a few seconds, noisier figures).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from memwall.planner.calibrate.engine import host_figures, tiny_timings
from memwall.planner.calibrate.kernels import (DECODE_ROWS, INT_PREFILL_ROWS, QUICK_ROUNDS, ROUNDS,
                                               KernelProbes)
from memwall.planner.hardware import cpu_features, cpu_name, total_ram_bytes

MIB = 1 << 20


def run(path: str | os.PathLike, quick: bool = False) -> dict:
    """Measures this machine, writes the calibration JSON to ``path``, prints one table of what
    was measured, and returns the figures."""
    data = measure(quick)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(describe(data))
    print(f"memwall: wrote {path}")
    return data


def measure(quick: bool = False) -> dict:
    from memwall.kernels.cpu import quant_ops
    from memwall.worker.worker import default_threads

    threads = default_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    tiny = tiny_timings(threads, quick)  # first: the resident size before large buffers
    data = {"cpu": cpu_name(), "cpu_flags": cpu_features(), "isa": _isa(quant_ops),
            "cores": os.cpu_count(),
            "threads": threads, "memory_bytes": total_ram_bytes(), "runtime_rss_bytes": _rss()}
    probes = KernelProbes(quick, _l3_bytes())
    for _ in range(QUICK_ROUNDS if quick else ROUNDS):
        probes.sample()
    data.update(probes.figures())
    data["host_s"] = host_figures(tiny, data)
    data["huge_page_bytes"] = _huge_page_bytes()
    data.update(measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), quick=quick,
                seconds=round(time.perf_counter() - start, 2), torch=torch.__version__)
    return data


# ---- this machine ------------------------------------------------------------------------
def _rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _l3_bytes() -> int:
    """The largest cache's size (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text.rstrip("KM")) * {"K": 1 << 10, "M": MIB}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * MIB)


def _huge_page_bytes() -> int:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return 0
    return 2 * MIB if "[never]" not in mode else 0


def _isa(quant_ops) -> str:
    """The integer kernels' code path (vnni, avx2 or c), and AVX-512 and AMX where listed."""
    flags = cpu_features()
    isa = quant_ops.int_gemm_isa() if quant_ops.available() else "torch"
    return isa + (", avx512" if "avx512f" in flags else "") + (", amx" if "amx_bf16" in flags
                                                              else "")


# ---- the table ---------------------------------------------------------------------------
def describe(data: dict) -> str:
    """What was measured, one row per figure."""
    bw, flops, host = data["bandwidth_bytes_s"], data["matmul_flops"], data["host_s"]
    g = 1e9
    rows = [("CPU", f"{data['cpu']} ({data['isa']}), {data['threads']} threads"),
            ("stream read", f"{bw / g:.1f} GB/s")]
    for kind, share in data["decode_bandwidth_share"].items():
        rows.append((f"B=1 decode, {kind}", f"{share * bw / g:.1f} GB/s ({share:.0%} of the "
                     f"stream) + {data['decode_row_s'][kind] * g:.0f} ns/row"))
    rows.append((f"int8 kernels, {DECODE_ROWS} / {INT_PREFILL_ROWS} rows",
                 f"{flops['int8_decode'] / g:.0f} / {flops['int8_prefill'] / g:.0f} GFLOP/s"))
    for key in data["prefill_flops"]:
        rows.append((f"prefill matmul, {key}", f"{data['prefill_flops'][key] / g:.0f} GFLOP/s + "
                     f"{data['prefill_weight_s'][key] * g:.2f} ns/weight a chunk"))
    rows += [("torch fp32 / bf16 matmul", f"{flops['fp32'] / g:.0f} / {flops['bf16'] / g:.1f} "
                                          "GFLOP/s"),
             ("prefill attention (SDPA)", f"{data['attention_flops'] / g:.0f} GFLOP/s"),
             ("layer without matmuls", f"{data['layer_value_s'] * 1e12:.0f} ps/token/value"),
             ("engine, decode step", f"{host['decode_step'] * 1e3:.2f} ms + "
                                     f"{host['decode_layer'] * 1e6:.0f} us/layer"),
             ("engine, prefill chunk", f"{host['prefill_step'] * 1e3:.2f} ms + "
                                       f"{host['prefill_layer'] * 1e6:.0f} us/layer"),
             ("runtime RSS", f"{data['runtime_rss_bytes'] / MIB:.0f} MiB"),
             ("prefill weight copy", f"{data['prefill_copy_bytes']} bytes/weight"),
             ("huge pages", f"{data['huge_page_bytes'] // MIB} MiB" if data["huge_page_bytes"]
              else "off"),
             ("took", f"{data['seconds']:.1f} s{' (quick)' if data['quick'] else ''}")]
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(label.ljust(width) + value for label, value in rows)
