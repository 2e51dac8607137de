"""The paged KV cache's bookkeeping: which fixed-size blocks of the cache each sequence owns.

The cache itself (tensors) lives in the model runner; this class only hands out block numbers.
A sequence's ``block_table`` lists its blocks in order: token ``i`` lives in block
``block_table[i // block_size]`` at offset ``i % block_size``.

Blocks are reference-counted: the sequences forked from one (a request's ``n`` / ``best_of``
completions) share its prompt's blocks instead of prefilling their own. Full blocks are only ever
read. A shared *partial* last block is copied on write: the first sequence to write past the
shared tokens gets a fresh block, and ``take_copies`` hands the model runner the ``(src, dst)``
pages to copy before the step that writes there (the last holder keeps the original).
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
        self._refs = [0] * num_blocks
        self._copies: list[tuple[int, int]] = []

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

    def _copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq``'s next tokens land in a last block it shares."""
        return (num_new_tokens > 0 and seq.num_computed_tokens % self.block_size != 0
                and len(seq.block_table) * self.block_size > seq.num_computed_tokens
                and self._refs[seq.block_table[seq.num_computed_tokens // self.block_size]] > 1)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold ``num_new_tokens`` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        grow = max(0, -(-total // self.block_size) - len(seq.block_table))
        return grow + int(self._copy_on_write(seq, num_new_tokens))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_new_tokens`` more tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache has {len(self._free)} free blocks, {needed} needed (check can_allocate first)")
        if self._copy_on_write(seq, num_new_tokens):
            position = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[position]
            copy = self._take()
            self._refs[shared] -= 1
            seq.block_table[position] = copy
            self._copies.append((shared, copy))
            needed -= 1
        for _ in range(needed):
            seq.block_table.append(self._take())

    def _take(self) -> int:
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` ``parent``'s blocks, shared (its prompt's KV, computed once)."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self._refs[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks no other sequence holds return to the pool."""
        released = []
        for block in seq.block_table:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                released.append(block)
        if released and self._copies:
            # A copy into a block freed in the same step (its sequence preempted) is not wanted.
            gone = set(released)
            self._copies = [(src, dst) for src, dst in self._copies if dst not in gone]
        self._free.extend(released)
        seq.block_table = []

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` page copies the scheduled step needs first; clears them."""
        copies, self._copies = self._copies, []
        return copies

    def slot_of(self, seq: Sequence, position: int) -> int:
        """Index of token ``position``'s entry in the flattened ``[num_blocks * block_size]`` cache."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
