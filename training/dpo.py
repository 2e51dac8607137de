"""Direct Preference Optimization's loss (Rafailov et al. 2023, the sigmoid form) for the trainer.

For a pair, with log-probabilities summed over each reply's tokens under the policy (the base
with the adapter) and the reference (the same base with the adapter off):

    margin = β · ((log π(chosen) − log π_ref(chosen)) − (log π(rejected) − log π_ref(rejected)))
    loss   = −log σ(margin)

The reference is the base with the adapter disabled (`model.disable_adapter()`), so no second
copy of the weights is held; at step 0 the adapter's B matrices are zero and the policy equals
the reference (margin 0, loss log 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from training.packing import Rows, layout, sequence_sums, target_logprobs
from training.preference import PreferencePair


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
               reference_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """The loss of each pair from its summed log-probabilities (each a tensor of one value per pair)."""
    margin = beta * ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))
    return -torch.nn.functional.logsigmoid(margin)


@dataclass(frozen=True)
class PairOutcome:
    loss_sum: torch.Tensor
    # Pairs whose implicit reward (β · the log-ratio) is higher for the chosen reply.
    preferred: int


def pair_rows(pairs: Sequence[PreferencePair], *, pad_id: int, device: torch.device, packed: bool,
              capacity: int) -> Rows:
    """The micro-batch's sequences: every pair's chosen reply, then every pair's rejected one."""
    return layout([pair.chosen for pair in pairs] + [pair.rejected for pair in pairs], pad_id=pad_id, device=device,
                  packed=packed, capacity=capacity)


def _sequence_logprobs(model: Any, rows: Rows, count: int) -> torch.Tensor:
    logprobs, trained = target_logprobs(model(**rows.model_inputs()).logits, rows)
    return sequence_sums(logprobs * trained, rows, count)


def pair_loss_sum(model: Any, rows: Rows, num_pairs: int, beta: float) -> PairOutcome:
    """The summed DPO loss of the micro-batch's pairs (laid out by pair_rows), with the gradient of the policy."""
    with torch.no_grad(), model.disable_adapter():
        reference = _sequence_logprobs(model, rows, 2 * num_pairs)
    policy = _sequence_logprobs(model, rows, 2 * num_pairs)
    chosen, rejected = policy[:num_pairs], policy[num_pairs:]
    losses = dpo_losses(chosen, rejected, reference[:num_pairs], reference[num_pairs:], beta)
    with torch.no_grad():
        preferred = int(((chosen - reference[:num_pairs]) > (rejected - reference[num_pairs:])).sum())
    return PairOutcome(loss_sum=losses.sum(), preferred=preferred)
