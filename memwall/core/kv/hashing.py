"""Content hashes of full KV blocks, chained so a hash names the whole prefix up to its block.

    h0 = H(None, tokens[0:16], extra)      h1 = H(h0, tokens[16:32], extra)     ...

Two requests share block i's KV exactly when their h_i are equal: same tokens in that block,
same tokens before it (through the parent hash), and the same extra keys (a LoRA adapter id or a
cache salt: the same tokens through another adapter give other K/V).
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: tuple = ()) -> BlockHash:
    # blake2b is fast in CPython and, unlike hash(), collision-resistant: a collision here would
    # silently serve one request another request's attention state.
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(repr(extra).encode())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], block_size: int,
                        extra: tuple = (), start: int = 0) -> None:
    """Appends the hashes of the full blocks of the sequence not yet in ``hashes``.

    ``token_ids`` holds the sequence from token ``start`` on (0, or where the hashed blocks
    end: a long sequence need not be copied whole to hash its newest block)."""
    if start and start != len(hashes) * block_size:
        raise ValueError(f"tokens from {start} given, but {len(hashes)} blocks are hashed")
    for index in range(len(hashes), (start + len(token_ids)) // block_size):
        parent = hashes[-1] if hashes else None
        first = index * block_size - start
        hashes.append(hash_block(parent, token_ids[first:first + block_size], extra))
