"""memwall's kernels (and torch's) timed for the calibration; calibrate/__init__.py lists the
figures and what each is. ``KernelProbes`` allocates every probe's buffers once and times each
probe once per round; a figure is the median over ROUNDS rounds, so that a burst from a
neighbour on a shared machine moves one round's sample, not the figure.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable

import torch

DECODE_COLS = (512, 1024, 2048, 4096)  # row lengths of the B=1 probes (models: 576 .. 8192)
DECODE_ROWS = 16  # rows of the batched decode probe (memwall/worker/step_shape.py's too)
INT_PREFILL_ROWS = 96  # a prefill chunk the integer kernels take (<= 128)
PREFILL_TOKENS = (256, 512)  # chunk sizes above the integer kernels' 128 (quant_ops)
PREFILL_SHAPES = {"": (2048, 2048), "_large": (4096, 4096)}  # 16 and 64 MiB float32 copies
ROUNDS = 5  # ~15 s on a 2-core EPYC; with 3 rounds, repeated calibrations' prefill rates
           # spread 74-107 GFLOP/s on a shared VM (plan_validate-20261126-091727.json)
QUICK_ROUNDS = 2
MIB = 1 << 20


def median_s(fn: Callable[[], object], repeats: int, warm_up: bool = True) -> float:
    """Median seconds of ``repeats`` calls (after one warm-up call)."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def two_point(x: tuple[float, float], t: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of t = a + b x through two timings (x ascending). Noise must not
    make either negative: a slope <= 0 becomes 0 (the intercept the mean), a negative
    intercept 0 (the slope through the larger point)."""
    slope = (t[1] - t[0]) / (x[1] - x[0])
    if slope <= 0:
        return statistics.fmean(t), 0.0
    intercept = t[1] - slope * x[1]
    if intercept < 0:
        return 0.0, t[1] / x[1]
    return intercept, slope


def q_weight(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A q4/q8 weight [n, k] in memwall's layout (kernels/cpu/layout.py), float16 scales and
    offsets per 32 weights as GGUF's Q4_1 and Q8_0 load; the codes' values do not matter to
    the kernels' speed."""
    codes = torch.full((n, k // 2) if kind == "q4" else (n, k), 0x5A,
                       dtype=torch.uint8 if kind == "q4" else torch.int8)
    s = torch.full((n, k // 32), 0.01, dtype=torch.float16)
    return codes, s, torch.full((n, k // 32), -0.08, dtype=torch.float16)


def matmul(kind: str) -> Callable:
    from memwall.kernels.cpu import quant_ops

    return quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul


def prefill_copy_bytes() -> int:
    """What quant_ops does with a prefill chunk's weight: AMX rebuilds it as split bf16 (8 bytes a
    weight), the fp32 tiles read it in place, else it is dequantized to float32 for BLAS."""
    from memwall.kernels.cpu import amx, quant_ops

    if not quant_ops.available():
        return 4
    if quant_ops.int_acts_enabled() and amx.use_for(PREFILL_TOKENS[-1]):
        return 8
    return 0 if quant_ops.tiles_from() > 0 else 4


class KernelProbes:
    def __init__(self, quick: bool, l3_bytes: int) -> None:
        self.quick, self.shrink = quick, 4 if quick else 1
        self.repeats = 3 if quick else 5
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.probes: dict[str, tuple[Callable[[], object], int]] = {}
        self.stream_bytes = max(8 * l3_bytes, 256 * MIB) // self.shrink
        stream = torch.ones(self.stream_bytes // 4)
        self.probes["stream"] = (stream.sum, self.repeats)
        self.decode_sizes: dict[str, tuple[int, int]] = {}
        for kind in ("q4", "q8"):
            for k in DECODE_COLS:
                self._decode_probe(kind, k, max(2 * l3_bytes, 64 * MIB) // self.shrink)
        for rows in (DECODE_ROWS, INT_PREFILL_ROWS):
            self._int_probe(rows)
        self.dequantizes = prefill_copy_bytes() == 4
        for kind, suffix in (("q4", ""), ("q4", "_large"), ("q8", "")):
            self._prefill_probe(kind, suffix)
        self._torch_probe("fp32", torch.float32, 512, 2048)
        self._torch_probe("bf16", torch.bfloat16, 64, 512)
        self._attention_probe()
        from memwall.planner.calibrate.layer import value_probe

        self.layer_values, layer = value_probe(128 if quick else 256)
        self.probes["layer"] = (layer, self.repeats)

    # ---- the probes --------------------------------------------------------------------
    def _decode_probe(self, kind: str, k: int, nbytes: int) -> None:
        per_row = (k // 2 if kind == "q4" else k) + k // 8  # codes + float16 s and c per 32
        w, x = q_weight(kind, max(32, nbytes // per_row), k), torch.randn(1, k)
        self.decode_sizes[f"{kind}/{k}"] = (w[0].shape[0], sum(t.nbytes for t in w))
        self.probes[f"decode {kind}/{k}"] = (lambda: matmul(kind)(x, *w), 2 * self.repeats)

    def _int_probe(self, rows: int) -> None:
        n, k = (2048, 1024) if self.quick else (4096, 2048)
        w, x = q_weight("q4", n, k), torch.randn(rows, k)
        self.probes[f"int {rows}"] = (lambda: matmul("q4")(x, *w), self.repeats)
        self.int_flops = 2 * n * k  # per row

    def _prefill_probe(self, kind: str, suffix: str) -> None:
        from memwall.kernels.cpu import quant_ops

        n, k = PREFILL_SHAPES[suffix]
        n, k = n // (2 if self.quick else 1), k // (2 if self.quick else 1)
        w, key = q_weight(kind, n, k), kind + suffix
        # where the weight is dequantized, that is timed alone and one chunk size does (the
        # large weight's smaller one: half the seconds)
        tokens = PREFILL_TOKENS if not self.dequantizes else PREFILL_TOKENS[-1:] if not suffix \
            else PREFILL_TOKENS[:1]
        self.prefill_tokens = {**getattr(self, "prefill_tokens", {}), key: tokens}
        for m in tokens:
            x = torch.randn(m, k)
            self.probes[f"prefill {key}/{m}"] = (lambda: matmul(kind)(x, *w), 2)
        if self.dequantizes:
            self.probes[f"dequantize {key}"] = ((lambda: quant_ops.q4_dequantize(*w, k))
                                                if kind == "q4" else
                                                (lambda: quant_ops.q8_dequantize(*w)), 3)
        self.prefill_weights = {**getattr(self, "prefill_weights", {}), key: n * k}

    def _torch_probe(self, name: str, dtype: torch.dtype, m: int, n: int) -> None:
        a, b = torch.randn(m, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        self.probes[f"torch {name}"] = (lambda: a @ b, 2)
        self.torch_flops = {**getattr(self, "torch_flops", {}), name: 2 * m * n * n}

    def _attention_probe(self) -> None:
        """Causal SDPA over a prompt, 8 query heads of 64 over 2 KV heads, as
        memwall/attention/paged_torch.py calls it: 4 h D n^2 / 2 FLOPs."""
        heads, kv_heads, dim, n = 8, 2, 64, 256 if self.quick else 512
        q = torch.randn(1, heads, n, dim)
        k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        self.probes["attention"] = (lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True),
                                    self.repeats)
        self.attention_flops = 4 * heads * dim * n * n / 2

    # ---- rounds and figures ------------------------------------------------------------
    def sample(self) -> None:
        """One round: every probe timed once more (the median of its repeats; the first round
        warms each up)."""
        with torch.inference_mode():
            for key, (fn, repeats) in self.probes.items():
                self.samples[key].append(median_s(fn, repeats, not self.samples[key]))

    def s(self, key: str) -> float:
        return statistics.median(self.samples[key])

    def figures(self) -> dict:
        bandwidth = self.stream_bytes / self.s("stream")
        decode = {kind: self._decode_fit(kind) for kind in ("q4", "q8")}
        flops, weight_s = self._prefill_fit()
        return {"bandwidth_bytes_s": bandwidth,
                "decode_bandwidth_share": {k: rate / bandwidth for k, (rate, _) in decode.items()},
                "decode_row_s": {k: row_s for k, (_, row_s) in decode.items()},
                "matmul_flops": {"int8_decode": DECODE_ROWS * self.int_flops
                                 / self.s(f"int {DECODE_ROWS}"),
                                 "int8_prefill": INT_PREFILL_ROWS * self.int_flops
                                 / self.s(f"int {INT_PREFILL_ROWS}"),
                                 **{k: f / self.s(f"torch {k}") for k, f in self.torch_flops.items()}},
                "prefill_flops": flops, "prefill_weight_s": weight_s,
                "attention_flops": self.attention_flops / self.s("attention"),
                "layer_value_s": self.s("layer") / self.layer_values,
                "prefill_copy_bytes": prefill_copy_bytes()}

    def _decode_fit(self, kind: str) -> tuple[float, float]:
        """(bytes/s, seconds per row): per byte, t / bytes = 1 / rate + row_s x rows / bytes, a
        least-squares line through the DECODE_COLS points (a negative row cost is noise: 0)."""
        xs, ys = [], []
        for k in DECODE_COLS:
            rows, size = self.decode_sizes[f"{kind}/{k}"]
            xs.append(rows / size)
            ys.append(self.s(f"decode {kind}/{k}") / size)
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        row_s = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if row_s < 0:
            return 1 / my, 0.0
        return 1 / max(my - row_s * mx, 1e-13), row_s

    def _prefill_fit(self) -> tuple[dict[str, float], dict[str, float]]:
        """t(n) = P x weight_s + 2 n P / flops per probe weight: where the matmul dequantizes
        for BLAS, weight_s is the dequantizer's own time (a difference of two timings would be
        noisier); elsewhere the line through the two chunk sizes."""
        flops, weight_s = {}, {}
        for key, params in self.prefill_weights.items():
            m1, m2 = PREFILL_TOKENS if len(self.prefill_tokens[key]) > 1 else (
                0, self.prefill_tokens[key][0])
            t2 = self.s(f"prefill {key}/{m2}")
            if self.dequantizes:
                fixed = min(self.s(f"dequantize {key}"), t2 / 2)
                per_token = (t2 - fixed) / m2
            else:
                fixed, per_token = two_point((m1, m2), (self.s(f"prefill {key}/{m1}"), t2))
            if per_token <= 0:  # the larger chunk timed no slower (noise, or a kernel whose
                fixed, per_token = 0.0, t2 / m2  # fixed cost hides the tokens'): its mean
            flops[key], weight_s[key] = 2 * params / per_token, fixed / params
        # a large weight's extra cost is its float32 copy's fresh pages, whatever its layout
        flops["q8_large"] = flops["q4_large"]
        weight_s["q8_large"] = weight_s["q8"] + max(0.0, weight_s["q4_large"] - weight_s["q4"])
        return flops, weight_s
