"""Where benchmark results go and how: one JSON file per run in benchmarks/results/, named
<kind>-<time>.json, with this checkout's absolute paths made relative to it and the home
directory written as ~ (a result file must not name the machine it was written on)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOME = str(Path.home())
RESULTS = ROOT / "benchmarks" / "results"


def portable(value: Any) -> Any:
    """``value`` with every string that names a path inside this checkout made relative to it,
    the home directory as ~ (caches, baseline builds), and NaN and inf as null (strict JSON
    readers refuse them)."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        value = value.replace(f"{ROOT}/", "")
        return value.replace(f"{HOME}/", "~/") if HOME not in ("/", "") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_result(kind: str, data: dict, path: Path | None = None, indent: int = 2) -> Path:
    """Writes ``data`` to ``path`` (default benchmarks/results/<kind>-<time>.json); returns it."""
    path = path or RESULTS / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable(data), indent=indent, default=str) + "\n")
    return path


def engine_bench_parser(doc: str, max_tokens: int = 128) -> argparse.ArgumentParser:
    """The flags every in-process engine comparison takes: --model, --threads, --runs,
    --max-tokens (the benchmark adds its own)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    return parser
