"""C kernels for the CPU, compiled on first use with the system compiler (see
memwall/quant/native.py, which builds them into one library with the quantized matmuls).

    decode.c    the fused decode step (all layers of a Llama-family model in one call) and
                the paged decode attention it uses, which reads KV blocks in place
    decode.py   the ctypes side: describes a loaded model to decode.c and calls it
"""
