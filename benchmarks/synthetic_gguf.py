"""Presets of memwall/loader/synthetic.py's random-weight GGUF (a Llama shape, Q4_1 matrices,
the embedded SmolLM2 tokenizer padded to the preset's vocabulary), for measurements that need a
model larger than the embedded one (memory, speed) without downloading one.

    python benchmarks/synthetic_gguf.py --preset llama-1b --out /tmp/llama-1b-q4_1.gguf

``cached(preset)`` writes the preset once to ~/.cache/memwall/synthetic/ and reuses it after.
Both memwall and llama.cpp load and run the file. The text it generates is noise; its sizes
are those of a real model of that shape.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memwall.loader.synthetic import write  # noqa: E402

# name -> (hidden, layers, heads, kv_heads, ffn, vocab)
PRESETS = {
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),   # Llama-3.2-1B's shape and vocabulary size
    "llama-3b": (3072, 28, 24, 8, 8192, 128256),   # Llama-3.2-3B's
    "smollm2-360m": (960, 32, 15, 5, 2560, 49152),
}
CACHE_DIR = Path.home() / ".cache" / "memwall" / "synthetic"


def cached(preset: str, directory: Path = CACHE_DIR) -> Path:
    """The preset's file (seed 0) under ``directory``, written first if it is not there yet
    (to a temporary name, so an interrupted write never leaves a half file behind)."""
    out = directory / f"{preset}-v{PRESETS[preset][-1]}-q4_1.gguf"
    if not out.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        print(f"writing {out} (once; takes a minute)", file=sys.stderr)
        write(tmp, *PRESETS[preset]).rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    parser.add_argument("--out", required=True, help="GGUF file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write(Path(args.out), *PRESETS[args.preset], seed=args.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
