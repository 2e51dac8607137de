"""The paged KV cache's bookkeeping: which fixed-size blocks of the cache each sequence owns.

The cache itself (tensors) lives in the model runner; this class only hands out block numbers.
A sequence's ``block_table`` lists its blocks in order: token ``i`` lives in block
``block_table[i // block_size]`` at offset ``i % block_size``.
"""

from __future__ import annotations

from collections import deque

from serving.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the KV cache in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold ``num_new_tokens`` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_new_tokens`` more tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache has {len(self._free)} free blocks, {needed} needed (check can_allocate first)")
        for _ in range(needed):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool."""
        self._free.extend(seq.block_table)
        seq.block_table = []

    def slot_of(self, seq: Sequence, position: int) -> int:
        """Index of token ``position``'s entry in the flattened ``[num_blocks * block_size]`` cache."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
