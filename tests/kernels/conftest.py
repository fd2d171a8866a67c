"""Fixtures shared by the native kernel tests."""

from __future__ import annotations

import pytest

from memwall.kernels.cpu import build

# each build compiles its own code paths: -march=native, AVX2 + FMA, baseline x86-64 (no AVX)
ISAS = ["native", "avx2", "baseline"]


@pytest.fixture(params=ISAS)
def isa_library(request, monkeypatch):
    """(name, library): the kernels of one instruction-set build stand in for this CPU's
    (``build.lib``); skipped where this CPU cannot run the build or it cannot be compiled."""
    if not build.runs_here(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    try:
        cdll = build.library(request.param)
    except build.BuildError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(build, "lib", lambda: cdll)
    return request.param, cdll
