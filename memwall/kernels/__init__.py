"""Fused device kernels, one subpackage per kernel language (``triton/`` today).

Importing this package costs nothing and needs no GPU: each subpackage guards its own
compiler import and says whether it can run (``memwall.kernels.triton.TRITON_AVAILABLE``).
Attention backends and layers pick kernels from here; nothing here knows about models.
"""
