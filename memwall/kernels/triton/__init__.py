"""Triton kernels for the GPU backend: paged attention and KV writes.

Modules (each a few kernels plus the Python launchers that check shapes and pick the grid):

    paged_attention.py   reshape_and_cache, prefill (varlen, causal, chunked) and decode (split-K)

Norm, rotary and activation run as torch ops (memwall/layers/): fused Triton versions of them
were removed because no model called them.

Every module imports without triton installed and without CUDA: the kernels are then stubs
that raise on call, and ``TRITON_AVAILABLE`` is False. On a machine without a GPU the kernels
still run under Triton's interpreter (set ``TRITON_INTERPRET=1`` before the first import),
which is how the tests check them on the CPU.
"""

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # the CPU-only install: keep the modules importable
    TRITON_AVAILABLE = False

    class _NoTriton:
        """Stands in for ``triton`` and ``triton.language``: kernels defined, never runnable."""

        constexpr = int  # only ever used as an annotation

        @staticmethod
        def jit(fn=None, **_kwargs):
            return _Unrunnable() if fn is not None else (lambda f: _Unrunnable())

    class _Unrunnable:
        """A kernel defined without triton: ``kernel[grid](...)`` raises a helpful error."""

        def __getitem__(self, _grid):
            return self

        def __call__(self, *_args, **_kwargs):
            require_triton()

    triton = tl = _NoTriton()  # type: ignore[assignment]


def require_triton() -> None:
    """Raises a clear error before a launch when triton is missing."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("these kernels need triton: pip install triton, or run with the "
                           "torch attention backend")


__all__ = ["TRITON_AVAILABLE", "require_triton", "triton", "tl"]
