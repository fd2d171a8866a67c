"""Most quant tests check the exact fp32 kernels (weights bit-identical to the reference
dequantizer); one-token matmuls would otherwise take the int8-activation kernels, which have
their own tests in test_int8_dot.py."""

import pytest

from memwall.quant import native


@pytest.fixture(autouse=True)
def exact_kernels(request):
    if not native.available() or "int8_dot" in request.node.nodeid:
        yield
        return
    native.set_int8_dot(False)
    yield
    native.set_int8_dot(True)
