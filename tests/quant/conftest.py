"""Most quant tests check the exact fp32 kernels (weights bit-identical to the reference
dequantizer); matmuls would otherwise take the integer-activation kernels, which have their
own tests in test_int_acts.py."""

import pytest

from memwall.kernels.cpu import quant_ops


@pytest.fixture(autouse=True)
def exact_kernels(request):
    if not quant_ops.available() or "int_acts" in request.node.nodeid:
        yield
        return
    quant_ops.set_int_acts(False)
    yield
    quant_ops.set_int_acts(True)
