"""Result files must not name the machine they were written on (benchmarks/report.py)."""

import json
import math
from pathlib import Path

from benchmarks import report


def test_result_files_hold_no_checkout_or_home_paths(tmp_path):
    home = str(Path.home())
    data = {"model": f"{report.ROOT}/benchmarks/results/x.gguf",
            "baseline": [f"{home}/.cache/memwall-baselines/llama.cpp/bin/llama-server"],
            "rate": math.nan, "n": 3}
    path = report.write_result("unit", data, tmp_path / "unit.json")
    text = path.read_text()
    assert str(report.ROOT) not in text and f"{home}/" not in text
    back = json.loads(text)
    assert back["model"] == "benchmarks/results/x.gguf"
    assert back["baseline"] == ["~/.cache/memwall-baselines/llama.cpp/bin/llama-server"]
    assert back["rate"] is None and back["n"] == 3


def test_stored_results_hold_no_absolute_home_or_checkout_paths():
    home = str(Path.home())
    for path in sorted(report.RESULTS.glob("*.json")):
        text = path.read_text()
        assert f"{home}/" not in text and str(report.ROOT) not in text, path.name
