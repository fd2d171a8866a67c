"""Frozen configuration, one dataclass per subsystem.

Every field carries a one-line doc; the CLI builds its flags from ``EngineArgs`` so that a
default is written once. Validation messages quote the bad value and say how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_BLOCK_SIZE = 16
DEFAULT_STEP_BUDGET = 2048  # tokens a step, where none was set or measured
DEFAULT_MAX_NUM_SEQS = 64  # sequences at once, where none was set or sized from a calibration


@dataclass(frozen=True)
class ModelArchConfig:
    """The shape of a decoder-only transformer, read from config.json or GGUF metadata."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    """The attention window of sliding layers. With ``layer_types`` (Gemma) the attention
    attends the last ``sliding_window`` keys in those layers; without (Mistral, Phi-3: every
    layer), the engine caps the context at it and attends fully."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # ---- Gemma 2 / Gemma 3 (defaults: the Llama family) ----
    layer_types: tuple[str, ...] | None = None
    """Per layer "sliding_attention" or "full_attention" (Gemma 2 alternates, Gemma 3 has 5
    sliding layers to 1 full one)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: silu, or gelu_pytorch_tanh (Gemma's GeGLU)."""
    embed_scale: float | None = None
    """Gemma multiplies the token embeddings by sqrt(hidden_size)."""
    attn_scale: float | None = None
    """Softmax scale, when not head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    rope_local_theta: float | None = None
    """Rope base of the sliding layers when it differs (Gemma 3: 10,000 vs 1,000,000)."""
    attn_logit_softcap: float | None = None
    """Gemma 2: attention scores become cap * tanh(score / cap)."""
    final_logit_softcap: float | None = None
    """Gemma 2: logits become cap * tanh(logit / cap)."""
    sandwich_norms: bool = False
    """Gemma: the attention and MLP outputs are normed too (4 norms a layer)."""
    norm_weight_offset: float = 0.0
    """Added to every RMSNorm weight at load: Gemma checkpoints store w for (1 + w) (GGUF
    files already hold 1 + w)."""

    def layer_window(self, layer: int) -> int | None:
        """The attention window of a layer, None for full attention."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def context_cap(self) -> int | None:
        """A window the engine caps the context at: a uniform one it does not attend natively."""
        return self.sliding_window if self.layer_types is None else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelArchConfig":
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "llama")
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moved rope_theta into rope_parameters.
        rope_params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        if isinstance((rope_params.get("full_attention") or {}).get("rope_type"), str):
            kind = rope_params["full_attention"]["rope_type"]  # Gemma 3: per layer type
            rope_scaling = None if kind == "default" else dict(rope_params["full_attention"])
        gemma = _gemma_fields(cfg, model_type, rope_params)
        if gemma.get("rope_theta") is not None:
            rope_theta = gemma.pop("rope_theta")
        if model_type == "phi3" and (cfg.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError("Phi models with partial rotary embeddings are not supported")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Mistral only when attention_bias says so.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3_text", "gemma3"),
            rope_scaling=rope_scaling,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            **gemma,
        )


GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3")


def is_whole_number(value: Any) -> bool:
    """An int and not a bool (JSON's ``true`` parses as one): what a count read from a config
    file or a --speculative-config must be."""
    return isinstance(value, int) and not isinstance(value, bool)


def _gemma_fields(cfg: dict[str, Any], model_type: str, rope_params: dict) -> dict[str, Any]:
    """Gemma 2 / 3's extra shape, from their config.json (old and transformers-5 forms)."""
    if model_type not in GEMMA_TYPES:
        return {}
    layers = cfg["num_hidden_layers"]
    pattern = 2 if model_type == "gemma2" else cfg.get("sliding_window_pattern", 6)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    fields: dict[str, Any] = dict(
        layer_types=tuple(layer_types),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        sandwich_norms=True,
        norm_weight_offset=0.0 if cfg.get("memwall_norms_hold_offset") else 1.0,
    )
    if model_type != "gemma2":  # per-layer-type rope: full layers the global base
        full = rope_params.get("full_attention") or {}
        local = rope_params.get("sliding_attention") or {}
        fields["rope_theta"] = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        fields["rope_local_theta"] = float(local.get("rope_theta", cfg.get("rope_local_base_freq",
                                                                           10_000.0)))
    return fields


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: how many fixed-size blocks, and how big each is."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache, all used (the prefix cache keeps what running sequences do not
    need); None = kv_cache_fraction of available memory, trimmed to what max_num_seqs
    sequences at full context can use."""
    kv_cache_fraction: float = 0.25
    """Share of currently available RAM given to the KV cache when kv_cache_memory is unset."""
    num_blocks: int | None = None
    """Exact block count (overrides the memory budget; used by tests)."""
    enable_prefix_caching: bool = True
    """Keep and share the KV of full blocks across requests with the same prefix."""
    swap_space: int = 0
    """Bytes of host memory for swapped-out blocks (0 = no swap pool)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_batched_tokens: int = DEFAULT_STEP_BUDGET
    """Token budget per step: prefill chunks plus decodes."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Most sequences running at once."""
    max_model_len: int | None = None
    """Context window (prompt + output); None = the model's own."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps instead of refusing them."""
    scheduling_policy: str = "fcfs"
    """fcfs, or priority (lower SamplingParams.priority first, then arrival)."""
    preemption_mode: str = "recompute"
    """recompute (free the blocks, redo the prefill later) or swap (move them to host memory)."""
    max_spec_batch: int | None = None
    """Speculation: draft tokens are scheduled only while at most this many sequences run."""
    max_loras: int | None = None
    """Multi-LoRA: most adapters whose requests run at once (the workers' slots); None: off."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


SPEC_METHODS = ("ngram", "draft_model", "eagle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (memwall/spec_decode/): vLLM's ``speculative_config`` keys."""

    method: str = "ngram"
    """ngram (prompt lookup), draft_model or eagle."""
    num_speculative_tokens: int = 4
    """Most draft tokens a sequence verifies per step (k)."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix of the sequence matched against its earlier tokens."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix that may produce a draft."""
    model: str | None = None
    """draft_model / eagle: the drafter's GGUF file or Hugging Face directory."""
    disable_by_batch_size: int | None = None
    """With more running sequences than this, no sequence drafts (verification stops paying)."""
    adaptive: bool = True
    """Per sequence, shrink k while drafts are rejected and stop drafting where it does not pay."""
    draft_vocab_size: int | None = None
    """draft_model / eagle: draft only token ids below this (EAGLE-3's name): the drafter's LM
    head computes that many rows, not the whole vocabulary (memwall/spec_decode/draft_vocab.py)."""
    requantize: str | None = None
    """draft_model with a GGUF drafter: "q4_1" (or "q4_0") rounds the drafter's weights that
    memory keeps a byte a code (Q5_0, Q8_0, Q6_K...) to that 4-bit type at load, so a drafted
    token reads ~0.6x the bytes. eagle on CPU: "q4_1" keeps the head's matmuls and the LM head
    rows it drafts from (draft_vocab_size's, else the whole vocabulary's, a copy) as 4-bit
    codes with a scale and an offset per 32 values (Q4_1's form; int8 codes otherwise). Lossy
    for the drafts only: the target verifies every one."""

    lookup_first: bool | None = None
    """draft_model / eagle: a sequence whose last tokens recur earlier in it may draft what
    followed there (the ngram method's prompt lookup, prompt_lookup_min/max: free) where that
    gains more than the drafter's drafts, the drafter elsewhere
    (memwall/spec_decode/lookup_first.py). None (the default): on for those two methods,
    which ran faster with it on two CPUs (Qwen2.5-Coder 0.5B -> 1.5B on HumanEval: 1.75x
    against 1.50x end to end on a Cascade Lake Xeon, 1.91-2.09x against 1.56-1.70x on a Zen 4
    EPYC; SmolLM2's EAGLE head on chat 1.34-1.49x against 1.12-1.32x); false turns it off."""

    @property
    def uses_lookup_first(self) -> bool:
        """Whether prompt lookup drafts beside the drafter (``lookup_first``, resolved)."""
        return self.method != "ngram" if self.lookup_first is None else self.lookup_first

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got "
                             f"{self.method!r}")
        # JSON's 2.5, "3" and true reach here as they are: name them rather than draft 2.5
        # tokens or fail in a comparison far from the key
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not is_whole_number(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive is true or false, got {self.adaptive!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model is the drafter's path, a string; got {self.model!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 1..16, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None:
            if not is_whole_number(self.disable_by_batch_size):
                raise ValueError("disable_by_batch_size must be an integer, got "
                                 f"{self.disable_by_batch_size!r}")
            if self.disable_by_batch_size < 1:
                raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs \"model\": the drafter's path")
        if self.draft_vocab_size is not None:
            if self.method == "ngram":
                raise ValueError("draft_vocab_size applies to the draft_model and eagle methods "
                                 "(ngram drafts copy tokens from the sequence)")
            if not is_whole_number(self.draft_vocab_size) or self.draft_vocab_size < 1:
                raise ValueError(f"draft_vocab_size must be a positive integer, got "
                                 f"{self.draft_vocab_size!r}")

        if self.lookup_first is not None and (not isinstance(self.lookup_first, bool) or (
                self.method == "ngram" and self.lookup_first)):
            raise ValueError("lookup_first is true or false, for the draft_model and eagle "
                             "methods (ngram drafts by lookup alone)")
        if self.requantize is not None:
            if self.method not in ("draft_model", "eagle"):
                raise ValueError("requantize applies to the draft_model and eagle methods (a "
                                 "drafter's weights)")
            choices = ("q4_0", "q4_1") if self.method == "draft_model" else ("q4_1",)
            if self.requantize not in choices:
                raise ValueError(f"requantize must be {' or '.join(choices)} for the "
                                 f"{self.method} method, got {self.requantize!r}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a JSON object (the CLI's --speculative-config) or a dict (``LLM(...)``)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON ({e.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)


DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "fp8")  # memwall/attention/kv_quant.py


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and in which number formats (resolved: no ``auto`` left)."""

    device: str = "cpu"
    """cpu or cuda."""
    dtype: str = "float32"
    """Compute dtype of weights and activations: float32, bfloat16 or float16."""
    gpu_memory_utilization: float = 0.9
    """cuda: share of total GPU memory for weights + activations + KV cache."""
    kv_cache_dtype: str = "auto"
    """auto (cuda: = dtype; cpu: fp16 with float32 compute), fp32, fp16, bf16, int8 (a scale
    per 16 values of a token and KV head) or fp8 (torch.float8_e4m3fn); memwall/attention/kv_quant.py."""
    enforce_eager: bool = False
    """cuda: never capture or replay CUDA graphs."""

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"


EXECUTOR_BACKENDS = ("auto", "uni", "mp", "ray")
TP_COMMS = ("auto", "shm", "gloo")


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine's model is split over worker processes (memwall/distributed/).

    ranks = tensor_parallel_size x pipeline_parallel_size; rank = stage * tp + tp_rank, so a
    stage's tensor-parallel ranks are neighbours (vLLM's order). Data parallel replicas are
    whole engines (memwall/engine/dp_client.py), not ranks of one.
    """

    tensor_parallel_size: int = 1
    """Ranks that split every layer (heads, MLP columns, vocabulary)."""
    pipeline_parallel_size: int = 1
    """Stages of contiguous layers; hidden states pass from one to the next."""
    distributed_executor_backend: str = "auto"
    """uni (one worker in this process), mp (a process per rank on this host) or ray (an
    actor per rank, placed by a placement group); auto: uni for one rank, else ray when a Ray
    cluster is already running here, else mp (as vLLM chooses)."""
    tp_comm: str = "auto"
    """The all-reduce between tensor-parallel ranks: shm (shared memory, ranks on one host),
    gloo (torch.distributed, any hosts); auto: shm when every rank is on this host."""
    comm_timeout_s: float = 120.0
    """A collective or a step that waits longer for a rank fails (the rank died or hangs)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.tp_comm not in TP_COMMS:
            raise ValueError(f"tp_comm must be one of {', '.join(TP_COMMS)}, got {self.tp_comm!r}")
        if self.comm_timeout_s <= 0:
            raise ValueError(f"comm_timeout_s must be > 0, got {self.comm_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def backend(self) -> str:
        """The executor ``auto`` resolves to (see distributed_executor_backend)."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        if self.world_size == 1:
            return "uni"
        return "ray" if _ray_cluster_running() else "mp"


def _ray_cluster_running() -> bool:
    """A Ray cluster this process may join: RAY_ADDRESS set, or a local head's address file."""
    import os
    import tempfile
    if os.environ.get("RAY_ADDRESS"):
        return True
    return os.path.exists(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster"))


# memwall/structured/backend.py's BACKENDS (config imports nothing from the engine)
STRUCTURED_OUTPUTS_BACKENDS = ("llguidance", "xgrammar")


def _arg(default: Any, help: str) -> Any:
    """A dataclass field whose help text becomes the CLI flag's help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user can set when building an engine (offline LLM, CLI and server alike).

    The CLI turns each field into a flag (``max_num_seqs`` -> ``--max-num-seqs``).
    """

    model: str | None = _arg(None, "GGUF file or Hugging Face directory (default: the embedded "
                                   "SmolLM2-135M-Instruct Q4_1)")
    tokenizer: str | None = _arg(None, "tokenizer directory when it differs from the model's")
    dtype: str = _arg("auto", "compute dtype: auto (float32 on cpu, bfloat16 on cuda), float32, "
                              "bfloat16 or float16")
    quantization: str = _arg("auto", "weights in memory: auto (a GGUF's quantized weights stay "
                                     "quantized, float checkpoints stay float), none (dequantize "
                                     "all to --dtype), int8 or int4 (quantize float weights at load), "
                                     "fp8 (float8 e4m3 weights, a scale per output channel; "
                                     "torch._scaled_mm on cuda, dequantized matmul elsewhere)")
    block_size: int = _arg(DEFAULT_BLOCK_SIZE, "tokens per KV-cache block")
    kv_cache_memory: int | None = _arg(None, "bytes for the KV cache, all of them used (blocks past "
                                             "what the running sequences need keep cached "
                                             "prefixes); default: a fraction of free RAM, trimmed "
                                             "to max-num-seqs sequences at full context")
    kv_cache_fraction: float = _arg(0.25, "share of available RAM for the KV cache when "
                                          "--kv-cache-memory is not given")
    num_kv_blocks: int | None = _arg(None, "exact number of KV blocks (overrides the budgets)")
    max_num_batched_tokens: int | None = _arg(None, "token budget per engine step (prefill chunks + "
                                                    "decodes); default: chosen at start-up from the "
                                                    "measured speed of this CPU's kernels "
                                                    "(memwall/worker/step_shape.py) or predicted "
                                                    "from --calibration, 2048 on cuda or without "
                                                    "chunked prefill")
    max_num_seqs: int | None = _arg(None, "most sequences running at once (default 64; on the "
                                          "CPU with --calibration: the requests at full context "
                                          "the KV cache holds, at most 64)")
    calibration: str | None = _arg(None, "calibration file (memwall plan --device this "
                                         "--calibrate) from whose measured speeds the planner "
                                         "sizes the CPU step budget and max sequences where "
                                         "those flags are not given; auto: "
                                         "~/.cache/memwall/calibration.json if it exists (the "
                                         "command line's default); none: measure at start-up")
    max_model_len: int | None = _arg(None, "context window in tokens (default: the model's)")
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps")
    prefix_caching: bool = _arg(True, "reuse the KV cache of shared prompt prefixes")
    preemption_mode: str = _arg("recompute", "when KV blocks run out: recompute (free and redo "
                                             "the prefill later) or swap (park blocks in host memory)")
    swap_space: int = _arg(1 << 30, "bytes of host memory for swapped-out KV blocks "
                                    "(used with --preemption-mode swap)")
    scheduling_policy: str = _arg("fcfs", "fcfs, or priority (lower request priority runs first)")
    threads: int | None = _arg(None, "CPU threads (default: the cores this process may use)")
    seed: int = _arg(0, "seed of the generator shared by requests without their own seed")
    show_progress: bool = _arg(False, "show a progress bar while the model loads")
    # ---- device (GPU backend; see DeviceConfig) ----
    device: str = _arg("auto", "where the model runs: auto (cuda when a GPU is visible, else cpu), "
                               "cpu or cuda")
    gpu_memory_utilization: float = _arg(0.9, "share of the GPU's memory this engine may use; the "
                                               "KV cache gets what weights and a profiled forward "
                                               "pass leave of it (cuda only)")
    kv_cache_dtype: str = _arg("auto", "KV cache elements: auto (cpu: fp16; cuda: the compute "
                                       "dtype), fp32, fp16, bf16, int8 (one byte, a float scale "
                                       "per 16 values of a token and KV head; cpu only), or "
                                       "fp8 (float8 e4m3, one byte; values clamped to +-448, "
                                       "no scale)")
    enforce_eager: bool = _arg(False, "cuda: run decode steps eagerly instead of replaying "
                                      "captured CUDA graphs")
    speculative_config: str | dict | None = _arg(
        None, "speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4}' (keys: method, num_speculative_tokens, "
              "prompt_lookup_max, prompt_lookup_min, model, disable_by_batch_size, adaptive, "
              "draft_vocab_size, requantize, lookup_first)")
    structured_outputs_backend: str = _arg(
        "llguidance", "grammar backend for structured outputs (JSON schema, regex, choice, "
                      "grammar): llguidance, or xgrammar (pip install xgrammar)")
    enable_lora: bool = _arg(False, "serve LoRA adapters (requests name one; see --lora-modules)")
    max_loras: int = _arg(1, "adapters whose requests run in one step (compute slots)")
    max_lora_rank: int = _arg(16, "largest adapter rank accepted (slots are sized for it)")
    max_cpu_loras: int | None = _arg(None, "adapters kept loaded in host memory (default: "
                                           "max(max_loras, 8)); more are read from disk on demand")
    lora_cache_policy: str = _arg(
        "adapter-aware", "prefix cache and adapter cache: adapter-aware (blocks keyed by the "
                         "adapter's content hash, eviction weighs how often each adapter is "
                         "used) or vllm (keyed by adapter name, independent LRU evictions)")
    structured_outputs_warmup: bool = _arg(
        False, "build the grammar backend's token table at start-up, in the background, so the "
               "first constrained request does not wait for it (0.2 s and ~25 MB for a 49k "
               "vocabulary, 3 s and ~300 MB for 262k); memwall serve does by default")

    # ---- parallelism (ParallelConfig; memwall/distributed/) ----
    tensor_parallel_size: int = _arg(1, "ranks that split every layer (heads, MLP, vocabulary)")
    pipeline_parallel_size: int = _arg(1, "stages of contiguous layers, a batch in flight per stage")
    data_parallel_size: int = _arg(1, "engine replicas behind one server, requests routed by "
                                      "prefix-cache affinity and load")
    distributed_executor_backend: str = _arg("auto", "uni, mp (a process per rank) or ray (an "
                                                     "actor per rank); auto: uni for one rank, "
                                                     "ray when a Ray cluster runs, else mp")
    tp_comm: str = _arg("auto", "tensor-parallel all-reduce: shm (shared memory, one host), gloo "
                                "(torch.distributed); auto: shm when the ranks share this host")
    comm_timeout_s: float = _arg(120.0, "seconds a collective or a step may wait for a rank "
                                        "before the engine declares it dead")

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        self.speculative()  # a bad speculative config fails here, before a model loads
        self._check_parallel()
        if self.enable_lora:
            self._check_lora()
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError("structured_outputs_backend must be one of "
                             f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got "
                             f"{self.structured_outputs_backend!r}")

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                              self.distributed_executor_backend, self.tp_comm, self.comm_timeout_s)

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras ({self.max_loras}) and max_lora_rank "
                             f"({self.max_lora_rank}) must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.lora_cache_policy not in ("adapter-aware", "vllm"):
            raise ValueError(f"lora_cache_policy must be adapter-aware or vllm, got "
                             f"{self.lora_cache_policy!r}")
        spec = self.speculative()
        if spec is not None and spec.method != "ngram":
            raise ValueError(f"LoRA with {spec.method!r} speculation is not supported (the drafter "
                             f"does not run the adapters); ngram drafts work")

    def _check_parallel(self) -> None:
        parallel = self.parallel_config()  # validates the sizes and names
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if parallel.world_size > 1 and self.enable_lora:
            raise ValueError("LoRA adapters with tensor or pipeline parallel are not supported "
                             "yet (the adapters' slots are not sharded); run one rank per engine, "
                             "or --data-parallel-size for more engines")
        if parallel.world_size > 1 and parallel.backend() == "uni":
            raise ValueError(f"{parallel.world_size} ranks need a process each: use "
                             f"--distributed-executor-backend mp or ray, not uni")

    @property
    def host_loras(self) -> int:
        """Adapters the host caches hold (--max-cpu-loras, by default max(max_loras, 8))."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, 8)

    def cache_config(self) -> CacheConfig:
        swap = self.swap_space if self.preemption_mode == "swap" else 0
        return CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                           kv_cache_fraction=self.kv_cache_fraction, num_blocks=self.num_kv_blocks,
                           enable_prefix_caching=self.prefix_caching, swap_space=swap)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_len = min(self.max_model_len or model_max_len, model_max_len)
        budget = self.max_num_batched_tokens or DEFAULT_STEP_BUDGET  # measured later if None
        seqs = self.max_num_seqs or DEFAULT_MAX_NUM_SEQS  # sized from a calibration if None
        return SchedulerConfig(max_num_batched_tokens=budget,
                               max_num_seqs=seqs, max_model_len=max_len,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               scheduling_policy=self.scheduling_policy,
                               preemption_mode=self.preemption_mode,
                               max_spec_batch=self._max_spec_batch(),
                               max_loras=self.max_loras if self.enable_lora else None)

    def _max_spec_batch(self) -> int | None:
        spec = self.speculative()
        if spec is None:
            return 0  # no drafts are ever scheduled
        return spec.disable_by_batch_size

    def device_config(self, cuda_available: bool) -> "DeviceConfig":
        """Resolves ``auto`` for this machine (``cuda_available``: torch.cuda.is_available())."""
        device = self.device if self.device != "auto" else ("cuda" if cuda_available else "cpu")
        if device == "cuda" and not cuda_available:
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device: install a "
                             "CUDA build of torch, or use --device cpu")
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        return DeviceConfig(device=device, dtype=dtype,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            kv_cache_dtype=self.kv_cache_dtype, enforce_eager=self.enforce_eager)

    @classmethod
    def cli_fields(cls):
        """(name, default, help) for every field, for building command-line flags."""
        return [(f.name, f.default, f.metadata.get("help", "")) for f in fields(cls)]


__all__ = ["ModelArchConfig", "CacheConfig", "SchedulerConfig", "DeviceConfig", "EngineArgs",
           "SpeculativeConfig", "ParallelConfig"]
