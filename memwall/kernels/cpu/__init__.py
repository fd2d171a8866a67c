"""C kernels for the CPU, compiled on first use with the system compiler into one library
(build.py; kernels.h lists the C files and what each exports).

    build.py       compile, cache and load the library (``lib()``, ``available()``)
    layout.py      ``PackedWeight``: the f32/q4/q8 weight layouts the kernels read; quantized
                   layers describe themselves with it, so nothing here imports memwall.quant
    quant_ops.py   the q4/q8 matmuls as torch functions (``q4_matmul``, ``q8_matmul``, ...)
    decode.py      ``NativeDecoder`` (the fused decode step) and ``paged_decode_attention``
    threads.py     OpenMP thread-pool housekeeping for the server's engine thread
"""
