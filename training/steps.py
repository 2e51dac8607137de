"""One optimizer step's forward and backward passes: its examples in micro-batches, each in rows.

A step takes `batch_size` examples (supervised) or pairs (DPO). They go through the model in
`gradient_accumulation_steps` micro-batches of consecutive examples, each laid out in rows
(training.packing: padded, or packed), and the gradients add up in the parameters before the
optimizer's one step. Every micro-batch's loss is divided by the whole step's count (trained
tokens, or pairs), not its own, so k micro-batches give the gradient of one batch k times larger:
the mean loss per trained token (or per pair) over the step, as one forward pass would.

With several ranks (training.distributed) a rank takes every world_size-th of the step's items
(DistributedSampler's split) and divides by the whole step's count, so the ranks' gradients summed
are the one-process step's. Every rank runs as many passes: FSDP's all-gathers in each forward are
collective, so a rank an item short runs its last pass on a copy of the step's first item with
its loss times zero.

On CUDA the passes run under bf16 autocast (the base is bf16, the LoRA weights fp32); the loss
is computed in fp32 either way.

A supervised step's code reads nothing off the GPU: its loss and counts stay on the device
(StepOutcome) until the trainer needs the numbers (a log, a checkpoint, the end). Reading one
(`.item()`, `int()`) makes the host wait for the step's backward to finish before it can queue what
follows (gradient clipping, the optimizer step, the next step's layout and forward), and the GPU
idles through all of that host work, every step. (transformers still reads one flag off the GPU in
each forward over packed rows, where it derives their mask, `find_packed_sequence_indices`: the host
waits there for the work queued before, but only the rest of that forward's launches follow the wait,
not the step's host work.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from training.dpo import pair_loss_sum, pair_rows
from training.examples import IGNORE_INDEX, EncodedExample
from training.hyperparameters import DPO, Hyperparameters
from training.packing import layout, target_logprobs, target_logprobs_and_hits
from training.preference import PreferencePair, TrainItem

Item = TypeVar("Item", EncodedExample, PreferencePair)


@dataclass(frozen=True)
class StepOutcome:
    """A step's summed loss and accuracy counts, where the step left them (module docstring)."""

    # float64 [summed loss, then supervised: next tokens predicted exactly (argmax) and tokens counted;
    # DPO: pairs ranked right and pairs]: on the step's device, or on the host where the step had read
    # them already. float64, the host's float, so that they add up to what adding their .item() gave.
    sums: torch.Tensor
    # The step's mean loss is the summed loss divided by this (trained tokens, or pairs), on the host:
    # on CUDA, PyTorch divides by a host number as a multiplication by its reciprocal (a bit off).
    denominator: int


def summed_outcomes(outcomes: Sequence[StepOutcome]) -> tuple[float, int, int]:
    """The steps' mean losses, correct and counted, each summed over the steps, read off the device in
    one transfer (one wait for the GPU)."""
    loss, correct, counted = 0.0, 0, 0
    read = torch.stack([outcome.sums for outcome in outcomes]).tolist() if outcomes else []
    for (loss_sum, step_correct, step_counted), outcome in zip(read, outcomes):
        loss += loss_sum / outcome.denominator
        correct, counted = correct + round(step_correct), counted + round(step_counted)
    return loss, correct, counted


def targets(item: EncodedExample) -> int:
    """The tokens a sequence is trained to predict: labelled ones after the first (training.packing)."""
    return sum(1 for label in item.labels[1:] if label != IGNORE_INDEX)


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batches(items: Sequence[Item], hp: Hyperparameters) -> Iterator[Sequence[Item]]:
    size = hp.micro_batch_size
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _passes(items: Sequence[Item], hp: Hyperparameters, rank: int,
            world_size: int) -> Iterator[tuple[Sequence[Item], bool]]:
    """This rank's micro-batches, each with whether it counts (False: a pass only for the collectives)."""
    share = items[rank::world_size]
    chunks = list(micro_batches(share, hp))
    needed = math.ceil(math.ceil(len(items) / world_size) / hp.micro_batch_size)
    yield from ((chunk, True) for chunk in chunks)
    yield from (([items[0]], False) for _ in range(needed - len(chunks)))


def train_step(model: Any, items: Sequence[TrainItem], hp: Hyperparameters, *, pad_id: int,
               device: torch.device, rank: int = 0, world_size: int = 1) -> StepOutcome:
    """The forward and backward passes of one step (gradients accumulated, the optimizer not stepped).

    `items` are the whole step's; with world_size > 1 this rank's share of them is passed through
    (module docstring) and the outcome is the rank's part, to be summed over the ranks.
    """
    if hp.method == DPO:
        return _dpo_step(model, items, hp, pad_id=pad_id, device=device, rank=rank, world_size=world_size)
    sequences = [item for item in items if isinstance(item, EncodedExample)]
    denominator = max(1, sum(targets(item) for item in sequences))
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for chunk, counts in _passes(sequences, hp, rank, world_size):
        rows = layout(chunk, pad_id=pad_id, device=device, packed=hp.packing, capacity=hp.max_seq_length)
        with autocast(device):
            logits = model(**rows.model_inputs()).logits
        logprobs, trained, hits = target_logprobs_and_hits(logits, rows)
        loss_sum = -(logprobs * trained).sum() * (1 if counts else 0)
        (loss_sum / denominator).backward()
        if not counts:
            continue
        with torch.no_grad():
            sums += torch.stack([loss_sum.double(), hits.sum(dtype=torch.float64), trained.sum(dtype=torch.float64)])
    return StepOutcome(sums, denominator)


def _dpo_step(model: Any, items: Sequence[TrainItem], hp: Hyperparameters, *, pad_id: int,
              device: torch.device, rank: int, world_size: int) -> StepOutcome:
    # Read on the host every micro-batch: training.dpo's pair_loss_sum reads its pairs ranked right
    # (an int) anyway, so the host waits for the GPU there whatever this step does with its loss.
    pairs = [item for item in items if isinstance(item, PreferencePair)]
    loss_total, preferred = 0.0, 0
    for chunk, counts in _passes(pairs, hp, rank, world_size):
        rows = pair_rows(chunk, pad_id=pad_id, device=device, packed=hp.packing, capacity=hp.max_seq_length)
        with autocast(device):
            outcome = pair_loss_sum(model, rows, len(chunk), hp.beta)
        (outcome.loss_sum * (1 if counts else 0) / len(pairs)).backward()
        if counts:
            loss_total += outcome.loss_sum.item()
            preferred += outcome.preferred
    return StepOutcome(torch.tensor([loss_total, preferred, len(pairs) if rank == 0 else 0], dtype=torch.float64),
                       len(pairs))


def evaluation_loss(model: Any, items: Sequence[TrainItem], hp: Hyperparameters, *, pad_id: int,
                    device: torch.device) -> float:
    """The mean loss over held-out items (eval mode, no gradient): per trained token, or per pair for DPO."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), autocast(device):
        for start in range(0, len(items), hp.micro_batch_size):
            chunk = items[start:start + hp.micro_batch_size]
            if hp.method == DPO:
                pairs = [item for item in chunk if isinstance(item, PreferencePair)]
                outcome = pair_loss_sum(model, pair_rows(pairs, pad_id=pad_id, device=device, packed=False,
                                                         capacity=hp.max_seq_length), len(pairs), hp.beta)
                total, count = total + outcome.loss_sum.item(), count + len(pairs)
                continue
            sequences = [item for item in chunk if isinstance(item, EncodedExample)]
            rows = layout(sequences, pad_id=pad_id, device=device, packed=False, capacity=hp.max_seq_length)
            logprobs, trained = target_logprobs(model(**rows.model_inputs()).logits, rows)
            total, count = total - float((logprobs * trained).sum()), count + int(trained.sum())
    model.train(was_training)
    return total / max(count, 1)

