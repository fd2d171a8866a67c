"""SamplingParams: how one request turns logits into tokens and when it stops.

The field names and defaults follow vLLM's (and so the OpenAI API's) so that users can
move code over unchanged. Validation happens in ``__post_init__`` and raises ``ValueError``
with a message that quotes the bad value: the server turns it into a 400, the CLI into one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

# A temperature below this is treated as greedy: dividing logits by ~0 only makes NaNs.
GREEDY_EPSILON = 1e-5

# vLLM arguments memwall refuses by name (rather than "unexpected keyword"), with the reason.
UNSUPPORTED = {
    "spaces_between_special_tokens":
        "memwall decodes with the `tokenizers` library, which has no such option: special tokens "
        "are always joined to the text around them without spaces (as with False); remove the "
        "argument",
}


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM names it: exactly one of ``json`` (a JSON schema, as a
    dict or its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (Lark or GBNF text; EBNF with the xgrammar backend).

    Grammar-guided decoding (memwall/structured/): each step the sampler masks every token the
    grammar does not allow, so the output always matches. Checked here for shape only; whether
    the schema or grammar compiles is the backend's call (a 400 naming the problem).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact output; fewer tokens, no whitespace loops)."""
    backend: str | None = None
    """The grammar backend that must compile it (memwall's tool-call grammars are llguidance's
    Lark); None: the engine's (--structured-outputs-backend)."""

    def __post_init__(self) -> None:
        kinds = self._set_kinds()
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, "
                             f"choice or grammar; got {found}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object, got "
                             f"{type(self.json).__name__}")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    def _set_kinds(self) -> list[str]:
        return [name for name in ("json", "json_object", "regex", "choice", "grammar")
                if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._set_kinds()[0]

    @property
    def spec(self) -> Any:
        """The constraint's own value (the schema, the pattern, the list of choices...)."""
        return getattr(self, self.kind)

    @property
    def key(self) -> tuple:
        """Equal for constraints that compile to the same grammar (the compile cache's key)."""
        spec = self.spec
        text = json.dumps(spec, sort_keys=True) if isinstance(spec, (dict, list, bool)) else spec
        return (self.backend, self.kind, text, self.disable_any_whitespace)


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions returned for the prompt."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 turns it off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens seen in the prompt or output (CTRL paper formula)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated."""
    stop: list[str] | str | None = None
    """Strings that end generation; they are not part of the returned text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to EOS unless ``ignore_eos``)."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None = up to the context window."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens were generated."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top logprobs per position."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs for each prompt position (plus the prompt token's own)."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, <|im_end|>, ...) out of the returned text."""
    priority: int = 0
    """Lower runs first when the scheduler uses priorities (FCFS ignores it)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (memwall/structured/)."""

    def __new__(cls, *args, **kwargs) -> "SamplingParams":
        for name in UNSUPPORTED.keys() & kwargs.keys():
            raise TypeError(f"SamplingParams({name}={kwargs[name]!r}) is not supported: "
                            f"{UNSUPPORTED[name]}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def _validate(self) -> None:
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (self.prompt_logprobs is None
             or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop must be non-empty strings, got {self.stop!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
            (self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams, got "
             f"{type(self.structured_outputs).__name__}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def clone_for_child(self, index: int) -> "SamplingParams":
        """Params for the index-th of n completions: n=1, and a distinct derived seed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
