"""memwall plan: JSON and table output, one-line errors, --plot, --calibrate without its module,
plan_json's validation, and no torch on the planning path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memwall.entrypoints.cli import main
from memwall.planner import plan_json

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_plan_fields(capsys) -> None:
    code, out, _ = run(capsys, "--model", "llama-3-8b", "--gpu", "H100", "--json")
    assert code == 0
    doc = json.loads(out)
    assert {"model", "device", "parallel", "precision", "memory", "decode", "prefill", "cost",
            "notes"} <= set(doc)
    assert doc["model"]["params"] == 8_030_261_248 and doc["device"]["name"] == "H100-SXM"
    assert doc["precision"] == {"dtype": "bf16", "quantization": "auto", "weights": "bf16",
                                "kv_cache_dtype": "bf16"}
    assert doc["memory"]["kv_bytes_per_token"] == 131_072
    assert doc["decode"]["tokens_per_s"] > 0 and doc["prefill"]["ttft_s"] > 0
    assert doc == plan_json({"model": "llama-3-8b", "gpu": "H100"})  # the dashboard's call


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-9b"], "unknown model 'llama-9b'"),
    (["--model", "llama-3-8b", "--dtype", "int9"], "dtype must be auto, float32"),
    (["--model", "llama-3-8b", "--kv-cache-dtype", "q4"], "kv_cache_dtype must be one of"),
    (["--model", "llama-3-8b", "--gpu", "H100x3", "--tensor-parallel-size", "2"], "multiple of 2"),
    (["--model", "llama-3-8b", "--what-if", "kv"], "write key=value"),
    (["llama-3-8b", "--model", "qwen2.5-7b"], "two models given"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(capsys, argv, message) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert err.startswith("memwall: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_table_has_a_column_per_what_if(capsys) -> None:
    code, out, _ = run(capsys, "llama-3-8b", "--gpu", "H100", "--max-model-len", "4096",
                       "--what-if", "kv=fp8", "--what-if", "gpus=2", "--price-per-hour", "2")
    assert code == 0
    header = next(line for line in out.splitlines() if "kv=fp8" in line)
    assert header.split() == ["plan", "kv=fp8", "gpus=2"]
    requests = next(line for line in out.splitlines() if line.startswith("max concurrent"))
    assert requests.split()[-3:] == ["88", "176", "176"]  # fp8 KV halves it; 2 GPUs, 2 replicas
    assert "$ / 1M output tokens" in out


def test_plot_writes_a_png(capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="needs matplotlib: pip install 'memwall[plot]'")
    png = tmp_path / "plan.png"
    code, _, err = run(capsys, "llama-3-8b", "--gpu", "H100", "--what-if", "kv=fp8",
                       "--plot", str(png))
    assert code == 0 and f"wrote {png}" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_a_gpu_is_one_line(capsys) -> None:
    code, _, err = run(capsys, "--gpu", "H100", "--calibrate")
    assert code == 1 and "use it with --device this" in err


def test_plan_json_validates_its_keys() -> None:
    with pytest.raises(ValueError, match="unknown plan key"):
        plan_json({"model": "llama-3-8b", "gpus": 8})
    with pytest.raises(ValueError, match="batch must be an integer"):
        plan_json({"model": "llama-3-8b", "batch": "many"})
    with pytest.raises(ValueError, match="give --gpu 'H100' or --device 'A100', not both"):
        plan_json({"gpu": "H100", "device": "A100"})
    form = plan_json({"model": "llama-3-8b", "gpu": "H100", "batch": "8", "what_if": "kv=fp8"})
    assert form["decode"]["batch"] == 8 and form["what_ifs"][0]["what_if"] == "kv=fp8"


NO_TORCH = """
import sys
{body}
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
"""


@pytest.mark.parametrize("body", [
    "import memwall.planner",
    "from memwall.entrypoints.cli import main\n"
    "assert main(['plan', '--model', 'llama-3-8b', '--gpu', 'H100', '--json']) == 0",
    "from memwall.planner import plan_json\nplan_json({'device': 'this'})  # the embedded GGUF",
])
def test_planning_imports_no_torch(body: str) -> None:
    result = subprocess.run([sys.executable, "-c", NO_TORCH.format(body=body)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
