"""CUDA graphs of the decode step: the whole forward (LoRA metadata ``prepare`` and the logits
included) captured once per batch size of a ladder, replayed with the step's inputs copied into
static buffers.

A pure-decode step of ``n`` sequences replays the smallest captured size ``>= n``; the rows past
``n`` are padding that writes its K/V into a scratch page nobody owns, attends to that one token
and carries no adapter. Two graphs exist per size: one with the LoRA layers' kernels (any token
has an adapter) and one without (base-only steps pay nothing for LoRA). Adapters loaded or
swapped between steps need no re-capture: the slot tensors, scalings and ranks are fixed tensors
the graphs read, written in place on the same stream before the next replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kernels import LoRAMeta
from serving.engine.context import StepContext, reset_context, set_context
from serving.engine.sequence import Sequence

# Rows of the packed per-token inputs (one host-to-device copy per step).
_IDS, _POS, _SLOT, _LEN, _ADAPTER = range(5)


class DecodeGraphs:
    def __init__(
        self,
        *,
        sizes: list[int],
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        lora_meta: LoRAMeta | None,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        attention: str,
        splits_for: Callable[[int], int],
        device: torch.device,
    ) -> None:
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.scratch_block = scratch_block
        self._forward = forward
        self._meta = lora_meta
        self._attention = attention
        self._splits_for = splits_for
        self._device = device
        self._pad = [0, 0, scratch_block * block_size, 1, -1]
        self._inputs = torch.tensor([[v] * self.max_batch for v in self._pad], dtype=torch.long, device=device)
        self._tables = torch.full((self.max_batch, max_blocks_per_seq), scratch_block, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0
        self.replays = 0

    def capture(self) -> None:
        """Capture every (size, LoRA or not) graph, largest first, into one shared memory pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self._device)
        free_before = torch.cuda.mem_get_info(self._device)[0]
        pool = torch.cuda.graph_pool_handle()
        variants = (False, True) if self._meta is not None else (False,)
        for size in reversed(self.sizes):
            for lora in variants:
                self._run(size, lora)  # compiles the kernels and sets the allocator's pool sizes
                graph = torch.cuda.CUDAGraph()
                # thread_local: adapter loader threads may pin host memory meanwhile (not captured).
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = self._run(size, lora)
                self._graphs[size, lora] = (graph, logits)
        torch.cuda.synchronize(self._device)
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self._device)[0])
        self.capture_seconds = time.perf_counter() - start

    def _run(self, size: int, lora: bool) -> torch.Tensor:
        inputs = self._inputs[:, :size]
        context = StepContext(
            slot_mapping=inputs[_SLOT],
            num_decode=size,
            decode_block_tables=self._tables[:size],
            decode_context_lens=inputs[_LEN],
            attention=self._attention,
            decode_splits=self._splits_for(size),
        )
        if lora:
            assert self._meta is not None
            context.lora = self._meta.prepare(inputs[_ADAPTER])
        set_context(context)
        try:
            return self._forward(inputs[_IDS], inputs[_POS])
        finally:
            reset_context()

    def size_for(self, num_seqs: int) -> int | None:
        """The captured batch size a step of ``num_seqs`` decodes replays, or None if none fits."""
        if num_seqs > self.max_batch:
            return None
        return next(size for size in self.sizes if size >= num_seqs)

    def replay(self, seqs: list[Sequence], size: int) -> torch.Tensor:
        """Copy the decode inputs of ``seqs`` (each with one token to compute) into the static
        buffers, padded to ``size`` rows, replay, and return the ``[len(seqs), vocab]`` logits."""
        block_size = self.block_size
        rows: list[list[int]] = [[] for _ in self._pad]
        tables: list[list[int]] = []
        widest = max(len(seq.block_table) for seq in seqs)
        lora = False
        for seq in seqs:
            position = seq.num_computed_tokens
            table = seq.block_table
            rows[_IDS].append(seq.token_ids[position])
            rows[_POS].append(position)
            rows[_SLOT].append(table[position // block_size] * block_size + position % block_size)
            rows[_LEN].append(position + 1)
            rows[_ADAPTER].append(seq.lora_slot)
            lora |= seq.lora_slot >= 0
            tables.append(table + [0] * (widest - len(table)))
        padding = size - len(seqs)
        if padding:
            for row, value in zip(rows, self._pad):
                row.extend([value] * padding)
            tables.extend([[self.scratch_block] * widest] * padding)
        self._inputs[:, :size].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)
        self._tables[:size, :widest].copy_(torch.tensor(tables, dtype=torch.long), non_blocking=True)
        graph, logits = self._graphs[size, lora and self._meta is not None]
        graph.replay()
        self.replays += 1
        return logits[: len(seqs)]
