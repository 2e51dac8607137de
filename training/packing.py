"""The rows a micro-batch's sequences go through the model in: one sequence a row, or packed.

Padded: each sequence in a row of its own, right-padded to the longest, with the usual 2-D
attention mask. Packed: sequences laid end to end into rows of at most `capacity` tokens (first
fit, in order, so the layout is a function of the batch alone), with `position_ids` that restart
at 0 for every sequence and no attention mask: transformers then derives from the restarts a
block-diagonal causal mask (`find_packed_sequence_indices`, for eager and SDPA attention;
flash-attention uses the same position ids for its variable-length kernel), so no sequence
attends to another one packed beside it. The padding after a row's last sequence restarts its
positions too and is attended only by itself.

In both layouts the first token of every sequence is never a target: the logits at the last
token of one packed sequence must not be trained to predict the first token of the next. So a
sequence's loss is the same, packed or not, and `owner` tells, for every token, which sequence
of the micro-batch it belongs to (-1 for padding), which DPO needs to sum log-probabilities per
sequence. Packed rows also carry their sequences' bounds over the rows laid end to end
(`cu_seq_lens_q`, each row's padding tail a sequence of its own), which training.packed_attention
attends by instead of the mask; attention implementations that do not read them ignore them.

The loss's part is here too: the log-probability of each next token from the rows' logits
(`target_logprobs`), which a run with compiled layers compiles (`compiled_loss`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from training.examples import IGNORE_INDEX, EncodedExample

PADDING_OWNER = -1


@dataclass(frozen=True)
class Rows:
    input_ids: torch.Tensor
    labels: torch.Tensor
    owner: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    # Packed rows: cumulative sequence lengths over the flattened rows (int32) and the longest sequence.
    bounds: torch.Tensor | None = None
    longest: int = 0

    def model_inputs(self) -> dict[str, Any]:
        # No KV cache: with one, transformers would not derive the packed mask from the positions.
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "use_cache": False}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.bounds is not None:
            inputs.update(cu_seq_lens_q=self.bounds, cu_seq_lens_k=self.bounds, max_length_q=self.longest,
                          max_length_k=self.longest)
        return inputs


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence indices by row: each goes, in order, into the first row with room for it."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"a sequence of {length} tokens does not fit rows of {capacity}")
        row = next((number for number, left in enumerate(room) if left >= length), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= length
    return rows


def layout(sequences: Sequence[EncodedExample], *, pad_id: int, device: torch.device, packed: bool,
           capacity: int) -> Rows:
    """The rows of `sequences`: packed into rows of `capacity` tokens, or one sequence a row."""
    groups = first_fit([len(item.input_ids) for item in sequences], capacity) if packed else [
        [index] for index in range(len(sequences))]
    width = max(sum(len(sequences[index].input_ids) for index in group) for group in groups)
    shape = (len(groups), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    owner = torch.full(shape, PADDING_OWNER, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    lengths: list[int] = []
    for row, group in enumerate(groups):
        at = 0
        for index in group:
            item = sequences[index]
            length = len(item.input_ids)
            ids[row, at:at + length] = torch.tensor(item.input_ids)
            labels[row, at + 1:at + length] = torch.tensor(item.labels[1:], dtype=torch.long)
            owner[row, at:at + length] = index
            positions[row, at:at + length] = torch.arange(length)
            lengths.append(length)
            at += length
        positions[row, at:] = torch.arange(width - at)
        if at < width:
            lengths.append(width - at)
    if packed:
        bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        return Rows(_to(device, ids), _to(device, labels), _to(device, owner), None, _to(device, positions),
                    _to(device, bounds), max(lengths))
    mask = (owner != PADDING_OWNER).long()
    return Rows(_to(device, ids), _to(device, labels), _to(device, owner), _to(device, mask), None)


def _to(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, built on the host, on `device`: to a GPU from pinned memory, without blocking. PyTorch's
    blocking copy from pageable memory synchronises the stream after it, so each micro-batch's layout
    would wait for the GPU to finish all the work queued before it (the previous step's backward and
    optimizer step) before its forward could be queued, and the GPU would idle through that host work.
    The pinned block is not reused before the copy has read it (PyTorch's pinned-memory allocator
    records the copy's stream)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def target_logprobs(logits: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each next token, whether it is trained), both (rows, width − 1): the
    logits at position i predict the label at i + 1. Computed in fp32 whatever the model's dtype;
    compiled inside `compiled_loss`."""
    return _LOSS.logprobs(logits, rows.labels)


def target_logprobs_and_hits(logits: torch.Tensor,
                             rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target_logprobs' two, and whether each trained next token is the logits' argmax (the token
    accuracy's hits): compiled, one pass over the logits gives both."""
    return _LOSS.logprobs_and_hits(logits, rows.labels)


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Every position's log-probability of the label after it (the last position has none: IGNORE_INDEX,
    # zero), the last one dropped after. Compiled with dynamic widths, the cross-entropy of the slice
    # logits[:, :-1] flattened had the fp32 copy of the logits saved for the backward, and log_softmax
    # with gather had the backward scatter into fp32 zeros of the logits' size; over the whole logits
    # (contiguous) only the bf16 logits and numbers per token are saved, and the backward is elementwise.
    following = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    logprobs = -torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), following.flatten(),
                                                  ignore_index=IGNORE_INDEX, reduction="none")
    return logprobs.view_as(following)[:, :-1], following[:, :-1] != IGNORE_INDEX


def _logprobs_and_hits(logits: torch.Tensor,
                       labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs, trained = _logprobs(logits, labels)
    return logprobs, trained, (logits[:, :-1].argmax(dim=-1) == labels[:, 1:]) & trained


@dataclass
class _LossFunctions:
    """What target_logprobs and target_logprobs_and_hits run: the functions above, or compiled ones."""

    logprobs: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = _logprobs
    logprobs_and_hits: Callable[[torch.Tensor, torch.Tensor],
                                tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = _logprobs_and_hits


_LOSS = _LossFunctions()

Scores = TypeVar("Scores")


def _dynamic(compiled: Callable[[torch.Tensor, torch.Tensor], Scores],
             ) -> Callable[[torch.Tensor, torch.Tensor], Scores]:
    """`compiled` with its inputs' rows and widths dynamic from the first call, so that a new width is
    not a new compilation (a row count of 1 still is one of its own: Dynamo specialises sizes 0 and 1)."""

    def call(logits: torch.Tensor, labels: torch.Tensor) -> Scores:
        for tensor in (logits, labels):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        return compiled(logits, labels)

    return call


@contextlib.contextmanager
def compiled_loss(backend: str = "inductor") -> Iterator[None]:
    """target_logprobs and target_logprobs_and_hits compiled with torch.compile while inside.

    Eager, the loss copies the logits to fp32 (tokens × vocabulary: 1 GB for 2,048 tokens of Llama
    3's 128,256), log-softmaxes the copy into another one kept for the backward, and the backward
    writes an fp32 gradient of that size before casting it to bf16 (log-softmax forward and backward
    took 2.8 ms of the 8B shape's step on an H100, docs/benchmarks.md). Compiled, inductor reads the
    bf16 logits for the log-softmax's sums, the target's logit and the argmax without writing an fp32
    copy (on the CPU all in one kernel), keeps the logits and numbers per token for the backward, and
    the backward writes the bf16 gradient alone. Micro-batches' widths and row counts vary: both are
    dynamic (`_dynamic`); the vocabulary stays static, the reduction's size inductor's kernels are
    made for. The compiled code stays in Dynamo's cache until torch._dynamo.reset()
    (training.compiled_layers, which enters this, does it on leaving).
    """
    eager = _LOSS.logprobs, _LOSS.logprobs_and_hits
    _LOSS.logprobs = _dynamic(torch.compile(_logprobs, backend=backend))
    _LOSS.logprobs_and_hits = _dynamic(torch.compile(_logprobs_and_hits, backend=backend))
    try:
        yield
    finally:
        _LOSS.logprobs, _LOSS.logprobs_and_hits = eager


def sequence_sums(values: torch.Tensor, rows: Rows, count: int) -> torch.Tensor:
    """Per sequence of the micro-batch, the sum of `values` (rows, width − 1) over its target tokens."""
    owner = rows.owner[:, 1:].reshape(-1)
    kept = owner != PADDING_OWNER
    sums = torch.zeros(count, dtype=values.dtype, device=values.device)
    return sums.index_add(0, owner[kept], values.reshape(-1)[kept])
