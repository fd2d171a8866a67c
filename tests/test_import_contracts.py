"""Which way imports go: the contracts in .importlinter, checked by import-linter.

    core       no torch; nothing from memwall beyond config, request, sampling_params
    planner    no torch (its calibrate module excepted)
    models     no engine, worker or core
    HTTP       only memwall.entrypoints.openai imports fastapi, uvicorn or starlette
    kernels    no memwall.quant

Forbidden contracts count indirect and function-level (lazy) imports too: importing core must
not pull torch in by any route. A broken contract's test prints import-linter's report, with
the chain of imports that breaks it. The last test plants one violation per contract in a copy
of the package and checks that every contract notices.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="pip install import-linter (in the test extras)")
import grimp  # noqa: E402  (installed with import-linter)
from importlinter.cli import lint_imports  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
CORE_MAY_IMPORT = {"memwall.config", "memwall.request", "memwall.sampling_params"}


def contracts() -> dict[str, configparser.SectionProxy]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    prefix = "importlinter:contract:"
    return {name.removeprefix(prefix): parser[name] for name in parser.sections()
            if name.startswith(prefix)}


@pytest.mark.parametrize("contract_id", sorted(contracts()))
def test_contract_is_kept(contract_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # lint_imports puts the working directory on sys.path
    status = lint_imports(str(CONFIG), limit_to_contracts=(contract_id,), no_cache=True,
                          no_logo=True)
    assert status == 0, f"contract {contract_id!r} is broken: the report above shows the imports"


def test_core_allowlist_names_every_other_memwall_package() -> None:
    """A forbidden list goes stale when a package is added; this keeps it an allowlist."""
    graph = grimp.build_graph("memwall")
    others = graph.find_children("memwall") - CORE_MAY_IMPORT - {"memwall.core"}
    forbidden = set(contracts()["core-allowlist"]["forbidden_modules"].split())
    missing = sorted(others - forbidden)
    assert not missing, f"add {missing} to forbidden_modules of core-allowlist in .importlinter"


# One violation per contract, each in a file every version of the package has.
PLANTED = {
    "core-no-torch": ("memwall/core/__init__.py", "torch"),
    "planner-no-torch": ("memwall/planner/__init__.py", "torch"),
    "core-allowlist": ("memwall/core/__init__.py", "memwall.engine"),
    "models-below-engine": ("memwall/models/__init__.py", "memwall.worker"),
    "http-only-in-openai": ("memwall/config.py", "fastapi"),
    "kernels-no-quant": ("memwall/kernels/__init__.py", "memwall.quant"),
    "spec-decode-below-worker": ("memwall/spec_decode/proposer.py", "memwall.worker"),
}
RUN_EACH = """
import sys
from importlinter.cli import lint_imports
for contract_id in sys.argv[1:]:
    status = lint_imports(".importlinter", limit_to_contracts=(contract_id,), no_cache=True,
                          no_logo=True)
    print("STATUS", contract_id, status, flush=True)
"""


def test_every_contract_catches_a_planted_violation(tmp_path: Path) -> None:
    assert set(PLANTED) == set(contracts()), "plant a violation for each contract in .importlinter"
    shutil.copytree(ROOT / "memwall", tmp_path / "memwall",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(CONFIG, tmp_path / ".importlinter")
    expected = {}
    for contract_id, (path, imported) in PLANTED.items():
        file = tmp_path / path
        file.write_text(file.read_text() + f"\nimport {imported}\n")
        importer = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        line = len(file.read_text().splitlines())
        expected[contract_id] = f"{importer} -> {imported} (l.{line})"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-c", RUN_EACH, *PLANTED], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    report = result.stdout + result.stderr
    statuses = dict(line.split()[1:] for line in result.stdout.splitlines()
                    if line.startswith("STATUS "))
    assert set(statuses) == set(PLANTED), report
    for contract_id, violation in expected.items():
        assert statuses[contract_id] != "0", f"{contract_id} missed `{violation}`:\n{report}"
        assert violation in report, f"{contract_id} did not name `{violation}`:\n{report}"
