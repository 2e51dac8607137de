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
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    logits at position i predict the label at i + 1. Computed in fp32 whatever the model's dtype."""
    targets = rows.labels[:, 1:]
    trained = targets != IGNORE_INDEX
    logprobs = -torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="none").view_as(targets)
    return logprobs, trained


def sequence_sums(values: torch.Tensor, rows: Rows, count: int) -> torch.Tensor:
    """Per sequence of the micro-batch, the sum of `values` (rows, width − 1) over its target tokens."""
    owner = rows.owner[:, 1:].reshape(-1)
    kept = owner != PADDING_OWNER
    sums = torch.zeros(count, dtype=values.dtype, device=values.device)
    return sums.index_add(0, owner[kept], values.reshape(-1)[kept])
