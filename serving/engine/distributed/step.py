"""What rank 0 sends the other ranks each step: a small pickled description over the control group,
then the tensors of the adapters it wrote, over the compute group.

A step is described by what the model runner reads of each scheduled sequence (``StepSeq``: the
tokens it computes this step, its position, block table and adapter slot), the KV block copies
before it, and the adapter writes rank 0's cache decided since the last step (``AdapterWrite``: the
slot, rows and scaling, and which tensors follow), in the order they were made, so every rank's slot
table and row pools go through the same states. Each write's tensors (whole adapters: each rank keeps
its part) follow as broadcasts on the compute group, in ``AdapterWrite.tensors``' order: on NCCL
they travel device to device, and like the forward's collectives they time out, where a large
pickle on the control group could wait on a hung rank for as long as an idle rank waits for a step. The path rank 0 runs (flat or eager) goes with it: the ranks'
all-reduces add the rows of one token together only if every rank lays the tokens out alike.
Prefix caching adds nothing here: a prefill that starts after blocks taken from the cache is a
sequence whose computed count and block table say so, and those blocks' KV was written on every
rank by the same earlier (or the same) step.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from serving.engine.sequence import Sequence


class TokenTail:
    """A sequence's token ids from ``offset`` on: the model runner slices out only the tokens it
    computes this step, and no other rank needs the rest."""

    def __init__(self, offset: int, values: list[int]) -> None:
        self.offset = offset
        self.values = values

    def __getitem__(self, index: slice) -> list[int]:
        start = index.start - self.offset
        if start < 0 or index.step is not None:
            raise IndexError(f"tokens from {index.start} were not sent (the step sent those from {self.offset})")
        return self.values[start : index.stop - self.offset]


@dataclass
class StepSeq:
    """What the model runner reads of one scheduled sequence, on ranks 1..N-1."""

    token_ids: TokenTail
    num_computed_tokens: int
    num_tokens: int
    block_table: list[int]
    lora_slot: int
    prompt_logprobs: None = None  # rank 0 alone computes a prompt's logprobs (from logits it asks for)


@dataclass(frozen=True)
class AdapterWrite:
    """``ModelRunner.write_rows(slot, row, adapter)`` as rank 0 made it; ``tensors`` lists the
    adapter's ``(layer, module)`` pairs with the shapes of A and B^T, whose tensors follow in this
    order (A, then B^T, per pair)."""

    slot: int
    row: int
    rank: int
    scaling: float
    digest: str
    tensors: list[tuple[tuple[int, str], tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class StepMessage:
    writes: list[AdapterWrite]
    copies: list[tuple[int, int]]
    scheduled: list[tuple[StepSeq, int]]
    flat: bool


def describe(scheduled: SequenceOf[tuple[Sequence, int]]) -> list[tuple[StepSeq, int]]:
    """The step's sequences as the other ranks need them."""
    out = []
    for seq, num in scheduled:
        start = seq.num_computed_tokens
        tail = TokenTail(start, seq.token_ids[start : start + num])
        out.append((StepSeq(tail, start, seq.num_tokens, list(seq.block_table), seq.lora_slot), num))
    return out
