"""What a plan is asked for: the CLI's flags and plan_json's keys, one frozen dataclass.

Every field is a key of ``plan_json`` and a ``memwall plan`` flag (``max_model_len`` ->
``--max-model-len``, built from the field and its help in memwall/entrypoints/cli.py); the
names are the engine's (memwall/config.py EngineArgs) where the engine has the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from memwall.planner.memory import DEFAULT_RESERVE, DEFAULT_STEP_TOKENS
from memwall.planner.roofline import DEFAULT_COMM_US

HOST_NAMES = ("this", "cpu", "host")


def _arg(default: Any, help: str) -> Any:
    """A field whose help text is also its ``memwall plan`` flag's (memwall/config.py's way)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PlanRequest:
    model: str | None = _arg(None, "GGUF file, Hugging Face directory or built-in name "
                                   "(llama-3-8b, qwen2.5-7b, ...); default: the embedded "
                                   "SmolLM2-135M GGUF")
    dtype: str = _arg("auto", "compute dtype, float weights kept in it: auto (bfloat16 on a "
                              "GPU, float32 on the CPU), float32, bfloat16, float16")
    quantization: str = _arg("auto", "weights: auto (a GGUF file's own types, else --dtype), "
                                     "none (all in --dtype), or the layers' matrices in fp8, "
                                     "int8, int4 or a GGUF type (q4_k, q8_0, ...)")
    kv_cache_dtype: str = _arg("auto", "KV cache elements: auto (the compute dtype; fp16 on the "
                                       "CPU with float32 compute), fp32, fp16, bf16, int8, fp8")
    max_model_len: int | None = _arg(None, "context every request is planned at (default: the "
                                           "model's)")
    tensor_parallel_size: int = _arg(1, "ranks that split every layer")
    pipeline_parallel_size: int = _arg(1, "stages of contiguous layers")
    batch: int | None = _arg(None, "sequences in flight per replica (default: as many as fit at "
                                   "--max-model-len)")
    device: str | None = _arg(None, "this (this machine, the default; also cpu) or a GPU name")
    gpu: str | None = _arg(None, "GPU kind and count: H100, H100x8 or 8xH100; kinds: "
                                 "memwall/planner/hardware.py")
    price_per_hour: float | None = _arg(None, "dollars per GPU-hour (per machine-hour for "
                                              "--device this): adds $ per 1M output tokens")
    prompt_len: int | None = _arg(None, "prompt tokens for TTFT and prefill speed (default: "
                                        "min(1024, --max-model-len))")
    max_num_batched_tokens: int = _arg(DEFAULT_STEP_TOKENS, "tokens a step (the engine's step "
                                                            "budget): prefill chunk, activations")
    reserve: float = _arg(DEFAULT_RESERVE, "share of device memory held back for the runtime")
    allreduce_us: float = _arg(DEFAULT_COMM_US, "latency of one tensor-parallel all-reduce, us")
    p2p_us: float = _arg(DEFAULT_COMM_US, "latency of one pipeline stage-to-stage send, us")
    bandwidth_efficiency: float | None = _arg(None, "achievable share of peak memory bandwidth "
                                                    "(default 0.8 on GPUs, 1.0 when measured)")
    compute_efficiency: float | None = _arg(None, "achievable share of peak FLOP/s (default 0.7 "
                                                  "on GPUs, 1.0 when measured)")
    calibration: str | None = _arg(None, "calibration file for --device this (default "
                                         "~/.cache/memwall/calibration.json)")
    what_if: tuple[str, ...] = field(default=(), metadata={
        "help": "a variant shown as another column (repeatable): kv=int8, gpus=2, "
                "kv=int8,tp=2 (keys: memwall/planner/cost.py)"})

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_batched_tokens"):
            _at_least(name, getattr(self, name), 1)
        for name in ("max_model_len", "batch", "prompt_len"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        for name in ("price_per_hour", "allreduce_us", "p2p_us"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.reserve < 1:
            raise ValueError(f"reserve must be in [0, 1), got {self.reserve}")
        for name in ("bandwidth_efficiency", "compute_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.gpu and self.device and self.device.lower() != self.gpu.lower():
            raise ValueError(f"give --gpu {self.gpu!r} or --device {self.device!r}, not both")

    @property
    def on_host(self) -> bool:
        return self.gpu is None and (self.device is None or self.device.lower() in HOST_NAMES)

    @property
    def gpu_text(self) -> str | None:
        return self.gpu or (None if self.on_host else self.device)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "PlanRequest":
        """Keys as the fields; numbers may come as strings (a web form); None means default."""
        if not isinstance(values, dict):
            raise ValueError(f"a plan request is a JSON object, got {type(values).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown plan key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return cls(**{k: _coerce(k, v) for k, v in values.items() if v is not None})

    @classmethod
    def cli_fields(cls) -> list[tuple[str, Any, str]]:
        """(name, default, help) of every field, for building the command line's flags."""
        return [(f.name, f.default, f.metadata.get("help", "")) for f in fields(cls)]


_INTS = {"max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "batch",
         "prompt_len", "max_num_batched_tokens"}
_FLOATS = {"price_per_hour", "reserve", "allreduce_us", "p2p_us", "bandwidth_efficiency",
           "compute_efficiency"}


def _coerce(name: str, value: Any) -> Any:
    try:
        if name in _INTS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if name in _FLOATS:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
    except (TypeError, ValueError):
        kind = "an integer" if name in _INTS else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}") from None
    if name == "what_if":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"what_if must be a string or a list of strings, got {value!r}")
        return tuple(items)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
