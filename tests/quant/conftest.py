"""Most quant tests check the exact fp32 kernels (weights bit-identical to the reference
dequantizer); one-token matmuls would otherwise take the int8-activation kernels, which have
their own tests in test_int8_dot.py."""

import pytest

from memwall.kernels.cpu import quant_ops


@pytest.fixture(autouse=True)
def exact_kernels(request):
    if not quant_ops.available() or "int8_dot" in request.node.nodeid:
        yield
        return
    quant_ops.set_int8_dot(False)
    yield
    quant_ops.set_int8_dot(True)
