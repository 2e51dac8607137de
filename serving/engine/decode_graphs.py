"""Flat steps and their CUDA graphs.

A *flat* step lays every scheduled token out as one row (decodes and prompt chunks alike): its
token id, position, cache slot, context length (position + 1), adapter slot and sequence index,
plus one block table per sequence and the rows whose logits are sampled. Attention then serves the
whole step in one paged launch (``StepContext.decode_row_seq``), so the forward's shapes depend on
the token count alone and a step with prompt chunks in it is captured like a pure decode.

The whole forward (LoRA metadata ``prepare``, the sampled rows' logits) is captured once per token
count of a ladder. A step of ``n`` tokens replays the smallest captured size ``>= n``; the rows past
``n`` are padding that writes its K/V into a scratch page nobody owns, attends to that one token
through a table of scratch pages and carries no adapter. Two graphs exist per size: one with the
LoRA layers' kernels (any token has an adapter) and one without (base-only steps pay nothing for
LoRA). Adapters loaded or swapped between steps need no re-capture: the slot tensors, scalings and
ranks are fixed tensors the graphs read, written in place on the same stream before the next replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels import LoRAMeta
from serving.engine.async_scheduling import Feed, FedRows
from serving.engine.context import StepContext, reset_context, set_context
from serving.engine.sequence import Sequence

# Rows of the packed per-token inputs (one host-to-device copy per step).
IDS, POS, SLOT, LEN, ADAPTER, SEQ = range(6)


@dataclass
class FlatStep:
    """A step's inputs on the host: ``rows[k][t]`` is field ``k`` of token ``t``; ``tables[s]`` is
    sequence ``s``'s block table padded to the widest; ``sample_rows[i]`` is the token whose logits
    ``sampled[i]`` samples from; ``fed``: the rows whose token id the step in flight samples (async
    scheduling), written on the device before the forward."""

    rows: list[list[int]]
    tables: list[list[int]]
    sample_rows: list[int]
    sampled: list[Sequence]
    lora: bool
    fed: FedRows

    @property
    def num_tokens(self) -> int:
        return len(self.rows[IDS])

    @property
    def max_context(self) -> int:
        return max(self.rows[LEN])


def flat_step(scheduled: list[tuple[Sequence, int]], block_size: int, feed: Feed | None = None) -> FlatStep:
    """Lay out ``scheduled`` (each sequence with its number of tokens to compute) as a flat step;
    ``feed``: the samples of the step in flight, which its tokens still there come from."""
    fed = FedRows(feed)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    lens: list[int] = []
    adapters: list[int] = []
    seq_rows: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    sampled: list[Sequence] = []
    widest = max(len(seq.block_table) for seq, _ in scheduled)
    for index, (seq, num) in enumerate(scheduled):
        # Only slices of token_ids are read: a tensor-parallel rank has the step's tokens alone
        # (serving.engine.distributed.step.TokenTail).
        start, table, num_tokens = seq.num_computed_tokens, seq.block_table, seq.num_tokens
        end = start + num
        if num == 1:  # a decode, most rows of most steps: one value a field, no ranges
            if start < num_tokens:
                ids.extend(seq.token_ids[start:end])
            else:
                ids.extend(fed.ids(seq, start, 1, len(ids)))
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
            lens.append(end)
            adapters.append(seq.lora_slot)
            seq_rows.append(index)
        else:
            span = range(start, end)
            ids.extend(fed.ids(seq, start, num, len(ids)))
            positions.extend(span)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            lens.extend(range(start + 1, end + 1))
            adapters.extend([seq.lora_slot] * num)
            seq_rows.extend([index] * num)
        tables.append(table + [0] * (widest - len(table)))
        if end >= num_tokens:  # its last known token, or past it the one in flight
            sample_rows.append(len(ids) - 1)
            sampled.append(seq)
    rows = [ids, positions, slots, lens, adapters, seq_rows]  # IDS, POS, SLOT, LEN, ADAPTER, SEQ
    lora = max(adapters, default=-1) >= 0
    return FlatStep(rows, tables, sample_rows, sampled, lora, fed)


def flat_context(
    inputs: torch.Tensor, tables: torch.Tensor, *, attention: str, splits: int, lora: LoRAMeta | None
) -> StepContext:
    """The step context of packed ``inputs [6, T]`` and per-sequence ``tables``; ``lora``, if
    given, is prepared from the tokens' adapter slots (device ops only: capturable)."""
    context = StepContext(
        slot_mapping=inputs[SLOT],
        num_decode=inputs.shape[1],
        decode_block_tables=tables,
        decode_context_lens=inputs[LEN],
        decode_row_seq=inputs[SEQ],
        attention=attention,
        decode_splits=splits,
    )
    if lora is not None:
        context.lora = lora.prepare(inputs[ADAPTER])
    return context


def host_tensor(rows: list[list[int]] | list[int]) -> torch.Tensor:
    """An int64 CPU tensor of (rectangular) nested lists, through numpy: 3–4 × faster than
    ``torch.tensor`` on lists of Python ints (0.23 against 0.77 ms for 64 block tables of 37 pages
    on the development machine), and a step builds several."""
    return torch.from_numpy(np.array(rows, dtype=np.int64))


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Captured flat steps of ``sizes`` tokens and at most ``max_seqs`` sequences.

    ``forward(input_ids, positions, sample_rows)`` runs the model under the set step context and
    returns the logits of ``sample_rows``."""

    def __init__(
        self,
        *,
        sizes: list[int],
        max_seqs: int,
        forward: Forward,
        lora_meta: LoRAMeta | None,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        attention: str,
        splits_for: Callable[[int], int],
        device: torch.device,
    ) -> None:
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.scratch_block = scratch_block
        self._forward = forward
        self._meta = lora_meta
        self._attention = attention
        self._splits_for = splits_for
        self._device = device
        # Padding rows: token 0 at position 0, K/V into the scratch page, one key, no adapter, and
        # the extra table row (all scratch pages) past the real sequences'.
        self._pad = [0, 0, scratch_block * block_size, 1, -1, max_seqs]
        # The static inputs live in one device buffer (the packed rows, the sampled rows, the rows
        # fed from the step in flight with their sources, the tables), mirrored in pinned host memory: a step writes its inputs into the mirror with
        # numpy (no padded Python lists) and one copy of the mirror's used prefix moves them, with
        # no staging copy and one GIL round trip (the event loop holds the GIL much of the time).
        # `_copied` marks when the last copy is done, so a step never rewrites what it still reads.
        rows_end = len(self._pad) * self.max_tokens
        fed_start = rows_end + max_seqs
        self._tables_offset = fed_start + 2 * max_seqs
        host = torch.empty(self._tables_offset + (max_seqs + 1) * max_blocks_per_seq, dtype=torch.long).pin_memory()
        self._host = host
        self._np_inputs = host[:rows_end].view(len(self._pad), self.max_tokens).numpy()
        self._np_samples = host[rows_end:fed_start].numpy()
        self._np_fed = host[fed_start : self._tables_offset].view(2, max_seqs).numpy()
        self._np_tables = host[self._tables_offset :].view(max_seqs + 1, max_blocks_per_seq).numpy()
        self._pad_column = np.array(self._pad, dtype=np.int64)[:, None]
        self._np_inputs[:] = self._pad_column
        self._np_samples[:] = 0
        self._np_tables[:] = scratch_block
        self._buffer = host.to(device)
        self._inputs = self._buffer[:rows_end].view(len(self._pad), self.max_tokens)
        self._samples = self._buffer[rows_end:fed_start]
        self._fed = self._buffer[fed_start : self._tables_offset].view(2, max_seqs)
        self._tables = self._buffer[self._tables_offset :].view(max_seqs + 1, max_blocks_per_seq)
        self._copied: torch.cuda.Event | None = None
        self._logits: torch.Tensor | None = None
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self.chunk_replays = 0  # replays of steps that carried a prompt chunk

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
        context = flat_context(
            inputs, self._tables, attention=self._attention, splits=self._splits_for(size),
            lora=self._meta if lora else None,
        )  # fmt: skip
        set_context(context)
        try:
            logits = self._forward(inputs[IDS], inputs[POS], self._samples[: min(size, self.max_seqs)])
        finally:
            reset_context()
        # Every graph writes its logits into one buffer, allocated by the first (uncaptured) run:
        # a graph's own output would stay allocated with it (about 65 MB each at 256 rows of a
        # 128k vocabulary).
        if self._logits is None:
            self._logits = torch.empty((self.max_seqs, logits.shape[1]), dtype=logits.dtype, device=self._device)
        out = self._logits[: logits.shape[0]]
        out.copy_(logits)
        return out

    def size_for(self, step: FlatStep) -> int | None:
        """The captured size ``step`` replays, or None if none holds it."""
        if step.num_tokens > self.max_tokens or len(step.tables) > self.max_seqs:
            return None
        return next(size for size in self.sizes if size >= step.num_tokens)

    def replay(self, step: FlatStep, size: int) -> torch.Tensor:
        """Copy ``step``'s inputs into the static buffers, padded to ``size`` rows, replay, and
        return the ``[len(step.sampled), vocab]`` logits."""
        if self._copied is not None:
            self._copied.synchronize()
        count, seqs, width = step.num_tokens, len(step.tables), min(size, self.max_seqs)
        self._np_inputs[:, :count] = step.rows
        self._np_inputs[:, count:size] = self._pad_column
        # Every sampled row index must lie inside this size's rows: stale ones of a larger step would not.
        self._np_samples[: len(step.sample_rows)] = step.sample_rows
        self._np_samples[len(step.sample_rows) : width] = 0
        # Whole table rows go (the prefix stays contiguous); the columns past this step's widest
        # are never read. The inputs' unused columns (under 100 KB in all) go too.
        self._np_tables[:seqs, : len(step.tables[0])] = step.tables
        fed = len(step.fed.rows)
        self._np_fed[0, :fed] = step.fed.rows
        self._np_fed[1, :fed] = step.fed.sources
        used = self._tables_offset + seqs * self._np_tables.shape[1]
        self._buffer[:used].copy_(self._host[:used], non_blocking=True)
        step.fed.apply(self._inputs[IDS], self._fed[:, :fed])
        self._copied = torch.cuda.current_stream(self._device).record_event()
        graph, logits = self._graphs[size, step.lora and self._meta is not None]
        graph.replay()
        self.replays += 1
        self.chunk_replays += step.num_tokens > len(step.tables)  # some sequence computed > 1 token
        return logits[: len(step.sampled)]
