"""The paged KV cache's bookkeeping: which fixed-size blocks of the cache each sequence owns.

The cache itself (tensors) lives in the model runner; this class only hands out block numbers.
A sequence's ``block_table`` lists its blocks in order: token ``i`` lives in block
``block_table[i // block_size]`` at offset ``i % block_size``.

Blocks are reference-counted: the sequences forked from one (a request's ``n`` / ``best_of``
completions) share its prompt's blocks instead of prefilling their own. Full blocks are only ever
read. A shared *partial* last block is copied on write: the first sequence to write past the
shared tokens gets a fresh block, and ``take_copies`` hands the model runner the ``(src, dst)``
pages to copy before the step that writes there (the last holder keeps the original).

With prefix caching, each full prompt block whose KV a step has written is registered under its
key (serving.engine.prefix_hash: the adapter's seed and every token up to the block's end). A
request admitted later looks its prompt's keys up in order and takes the blocks that hit by
reference (``find_prefix``, ``take_prefix``): its prefill starts after them. A registered block no
sequence holds stays registered and is handed out again only when no unregistered block is free,
least recently freed first (its key is then dropped): freed KV is reusable until the memory is
needed.

A block registers when the step that completes it is sure to run (``register_full``, called by the
scheduler once the step's preemptions are over), so a request admitted in the same step can take it
already: every layer writes the whole step's keys and values into the cache before any token
attends, so its KV is there when read. A block freed before its step ran (a preemption inside
``schedule``) never carries a key.

The manager may hand out fewer blocks than the cache holds (``set_capacity``): blocks from the
capacity up are lent to the adapter row pool (serving.engine.lora.borrow, behind
``EngineConfig.borrow_kv_memory``). It never shrinks under a block a sequence holds, and once a
capacity has been set free blocks are handed out lowest first, so the top of the cache stays free
to lend. An engine that never sets one hands blocks out in the order they were freed, as before.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

from serving.engine.prefix_hash import BASE_SEED, adapter_seed, block_hashes, salted
from serving.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks  # physical: what the cache holds
        self.capacity = num_blocks  # what may be handed out: blocks 0 .. capacity - 1
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        # Free and unregistered: in the order freed, or (once a capacity is set) a heap, lowest first.
        self._free: deque[int] | list[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._copies: list[tuple[int, int]] = []
        self._by_key: dict[bytes, int] = {}
        # Each registered block's key and the digest of the adapter that computed it (None: the base).
        self._key_of: dict[int, tuple[bytes, str | None]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none; LRU first
        # Blocks registered for the step being scheduled, whose KV that step has still to write.
        self._unwritten: list[int] = []
        # Prompt tokens looked up in the prefix cache at admission, and those found there.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.capacity - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held by a sequence or not."""
        return len(self._key_of)

    @property
    def usage(self) -> float:
        """Fraction of the KV cache's capacity in use, 0..1 (cached blocks no sequence holds are free)."""
        return self.num_used_blocks / self.capacity

    def set_capacity(self, blocks: int) -> None:
        """Hand out only blocks ``0 .. blocks - 1``. Growing frees the blocks given back; shrinking
        drops the free and cached-but-unheld blocks above ``blocks`` (their prefix keys go) and is
        refused (ValueError, nothing changed) while a sequence holds one of them."""
        if not 1 <= blocks <= self.num_blocks:
            raise ValueError(f"capacity must be in 1 .. {self.num_blocks} blocks, got {blocks}")
        if isinstance(self._free, deque):
            self._free = sorted(self._free)  # a sorted list is a heap
        if blocks < self.capacity:
            held = [block for block in range(blocks, self.capacity) if self._refs[block]]
            if held:
                raise ValueError(f"cannot shrink the KV cache to {blocks} blocks: block {held[0]} is in use")
            for block in range(blocks, self.capacity):
                if block in self._evictable:
                    self._unregister(block)
            kept = [block for block in self._free if block < blocks]
            heapq.heapify(kept)
            self._free = kept
        else:
            self._release(list(range(self.capacity, blocks)))
        self.capacity = blocks

    def highest_held_from(self, start: int) -> int:
        """The highest block from ``start`` up to the capacity that a sequence holds, ``start - 1``
        for none (the capacity cannot go below it + 1). O(capacity - start)."""
        return next((block for block in range(self.capacity - 1, start - 1, -1) if self._refs[block]), start - 1)

    def _copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq``'s next tokens land in a last block it shares."""
        return (num_new_tokens > 0 and seq.num_computed_tokens % self.block_size != 0
                and len(seq.block_table) * self.block_size > seq.num_computed_tokens
                and self._refs[seq.block_table[seq.num_computed_tokens // self.block_size]] > 1)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: list[int] | None = None) -> int:
        """Free blocks ``seq`` must take to hold ``num_new_tokens`` more computed tokens; after
        ``prefix`` (blocks from ``find_prefix``) when given, those of them no one holds counted too."""
        if prefix:
            total = len(prefix) * self.block_size + num_new_tokens
            revived = sum(1 for block in prefix if self._refs[block] == 0)
            return max(0, -(-total // self.block_size) - len(prefix)) + revived
        total = seq.num_computed_tokens + num_new_tokens
        grow = max(0, -(-total // self.block_size) - len(seq.block_table))
        return grow + int(self._copy_on_write(seq, num_new_tokens))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] | None = None) -> bool:
        return self.blocks_needed(seq, num_new_tokens, prefix) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_new_tokens`` more tokens."""
        if not self.try_allocate(seq, num_new_tokens):
            needed = self.blocks_needed(seq, num_new_tokens)
            raise RuntimeError(f"KV cache has {self.num_free_blocks} free blocks, {needed} needed (check can_allocate first)")

    def try_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """``allocate`` when the free blocks suffice (True), else change nothing (False): the check
        and the allocation in one look at the block table, which every running sequence pays each
        step (most decodes need no block: their token lands in a last block they hold alone)."""
        table, computed, size = seq.block_table, seq.num_computed_tokens, self.block_size
        grow = -(-(computed + num_new_tokens) // size) - len(table)
        # _copy_on_write, inlined (this runs for every scheduled sequence)
        copy = (num_new_tokens > 0 and computed % size != 0 and len(table) * size > computed
                and self._refs[table[computed // size]] > 1)
        needed = max(0, grow) + copy
        if needed == 0:
            return True
        if needed > len(self._free) + len(self._evictable):
            return False
        if copy:
            position = computed // size
            shared = table[position]
            fresh = self._take()
            self._refs[shared] -= 1
            table[position] = fresh
            self._copies.append((shared, fresh))
            needed -= 1
        for _ in range(needed):
            table.append(self._take())
        return True

    def _take(self) -> int:
        """A free block: an unregistered one, else the least recently freed cached one (evicted)."""
        if self._free:
            block = heapq.heappop(self._free) if isinstance(self._free, list) else self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            key, _ = self._key_of.pop(block)
            del self._by_key[key]
        self._refs[block] = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` ``parent``'s blocks, shared (its prompt's KV, computed once)."""
        child.block_table = list(parent.block_table)
        child.num_registered_blocks = parent.num_registered_blocks
        for block in child.block_table:
            self._refs[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks no other sequence holds return to the pool, a
        registered one kept for later hits. Last blocks first, so the eviction order takes a
        prompt's tail before its head (a tail is no use without the blocks before it)."""
        released = []
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    released.append(block)
        if released and self._copies:
            # A copy into a block freed in the same step (its sequence preempted) is not wanted.
            gone = set(released)
            self._copies = [(src, dst) for src, dst in self._copies if dst not in gone]
        self._release(released)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` page copies the scheduled step needs first; clears them."""
        copies, self._copies = self._copies, []
        return copies

    def slot_of(self, seq: Sequence, position: int) -> int:
        """Index of token ``position``'s entry in the flattened ``[num_blocks * block_size]`` cache."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- prefix caching --------------------------------------------------------------------

    def _keys(self, seq: Sequence) -> list[bytes]:
        """``seq``'s prompt block keys, made once (its adapter is loaded by the time it is admitted)."""
        if seq.block_keys is None:
            handle = seq.adapter
            if handle is None:
                seed = BASE_SEED
            else:
                assert handle.adapter is not None, "a sequence is admitted once its adapter is loaded"
                seed = adapter_seed(handle.name, handle.adapter.digest)
            if seq.cache_salt is not None:
                seed = salted(seed, seq.cache_salt)
            seq.block_keys = block_hashes(seed, seq.prompt_token_ids, self.block_size)
        return seq.block_keys

    def find_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding ``seq``'s leading full prompt blocks, for a sequence with
        nothing computed; at most all of its tokens but the last, which must be computed for its
        logits. None hit for a sequence that asks for its prompt's logprobs (computed from every
        prompt position's hidden state)."""
        if not self.prefix_caching or seq.block_table or seq.prompt_logprobs is not None:
            return []
        keys = self._keys(seq)
        hits: list[int] = []
        for key in keys[: (seq.num_tokens - 1) // self.block_size]:
            block = self._by_key.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def take_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Start ``seq``'s block table with ``prefix`` (``find_prefix``'s, checked with
        ``can_allocate``), held by reference: those tokens count as computed. Counts the look-up."""
        if not self.prefix_caching:
            return
        if seq.prompt_logprobs is not None:
            seq.num_cached_tokens = 0
            return
        for block in prefix:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = list(prefix)
        seq.num_registered_blocks = len(prefix)
        hit = len(prefix) * self.block_size
        seq.num_computed_tokens = hit
        if seq.num_cached_tokens is None:  # what the request reports: its first admission's hit
            seq.num_cached_tokens = hit
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += hit

    def register_full(self, seq: Sequence, num_tokens: int) -> None:
        """Register ``seq``'s full prompt blocks among its first ``num_tokens`` tokens (those
        computed and those the step being scheduled computes). A key already held by another block
        stays with that one; this block stays unregistered."""
        if not self.prefix_caching or seq.block_keys is None:
            return
        full = min(num_tokens, seq.num_prompt_tokens) // self.block_size
        if full <= seq.num_registered_blocks:
            return
        digest = seq.adapter.adapter.digest if seq.adapter is not None and seq.adapter.adapter is not None else None
        for index in range(seq.num_registered_blocks, full):
            key, block = seq.block_keys[index], seq.block_table[index]
            if key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = (key, digest)
                self._unwritten.append(block)
        seq.num_registered_blocks = full

    def step_done(self, written: bool) -> None:
        """The scheduled step ran (``written``), or failed, leaving the KV of the blocks registered
        for it unwritten: those are unregistered, so no later prompt reads them."""
        if not written:
            for block in self._unwritten:
                if block in self._key_of:
                    self._unregister(block)
        self._unwritten.clear()

    def forget_adapter(self, digest: str) -> int:
        """Unregister every block an adapter's weights computed (its GPU rows were found corrupted:
        that KV may be wrong). Blocks in use stay with their sequences; returns how many."""
        dropped = [block for block, (_, owner) in self._key_of.items() if owner == digest]
        for block in dropped:
            self._unregister(block)
        return len(dropped)

    def _unregister(self, block: int) -> None:
        key, _ = self._key_of.pop(block)
        del self._by_key[key]
        if block in self._evictable:
            del self._evictable[block]
            self._release([block])

    def _release(self, blocks: list[int]) -> None:
        """Return unregistered ``blocks`` to the free list, keeping its order (a heap once lowest first)."""
        if isinstance(self._free, list):
            for block in blocks:
                heapq.heappush(self._free, block)
        else:
            self._free.extend(blocks)
