"""What a request's sampling parameters do to its logits before temperature and filters, for a
whole batch at once: ``min_tokens``, ``logit_bias`` and vLLM's presence / frequency / repetition
penalties.

Each is one set of tensor operations over the rows that use it; the host only lays out those rows'
token ids, from int64 arrays each sequence keeps growing (``Sequence.output_array``: one slice copy
a row, no list converted), and their counts over the vocabulary are a scatter on the device, with no
loop over the vocabulary. Rows that use none of them are not touched. In vLLM's order and meaning:

1. ``min_tokens``: while a row has fewer output tokens, its EOS ids (unless ``ignore_eos``) and its
   stop token ids are set to -inf;
2. ``logit_bias``: each listed token's bias is added;
3. ``repetition_penalty`` ``r``: a token seen in the prompt or the output has its logit divided by
   ``r`` if positive, multiplied by ``r`` if not;
4. ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``: ``logit -= f * count + p * (count > 0)``
   with ``count`` the token's occurrences in the output only.

The host lists reach the device through pinned memory in stream order
(``serving.engine.async_scheduling.device_tensor``): a plain ``torch.tensor(values, device=cuda)``
waits for everything queued on the stream, which under async scheduling is the step in flight.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np
import torch

from serving.engine.async_scheduling import device_tensor, to_device
from serving.engine.sampling_params import SamplingParams


class History(Protocol):
    """What the penalties read of a row's sequence (serving.engine.sequence.Sequence is one)."""

    @property
    def num_output_tokens(self) -> int: ...

    def prompt_array(self) -> np.ndarray: ...

    def output_array(self) -> np.ndarray: ...


def needs_processing(params: Sequence[SamplingParams], history: Sequence[History]) -> bool:
    """Whether ``apply`` would change any row (so the caller can skip the copy it writes into)."""
    return any(
        p.logit_bias or p.has_penalties or (p.min_tokens and h.num_output_tokens < p.min_tokens)
        for p, h in zip(params, history)
    )


def apply(logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[History],
          eos_token_ids: Collection[int]) -> None:
    """Apply every row's min_tokens, logit_bias and penalties to ``logits [rows, vocab]`` in place."""
    _ban_stops(logits, params, history, eos_token_ids)
    _add_bias(logits, params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if rows:
        _penalize(logits, rows, [params[i] for i in rows], [history[i] for i in rows])


def _ban_stops(logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[History],
               eos_token_ids: Collection[int]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    vocab = logits.shape[1]
    for i, (p, h) in enumerate(zip(params, history)):
        if p.min_tokens and h.num_output_tokens < p.min_tokens:
            assert p.stop_token_ids is not None  # SamplingParams.__post_init__ makes it a list
            banned = {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
            banned = {t for t in banned if t < vocab}
            rows.extend([i] * len(banned))
            tokens.extend(banned)
    if rows:
        index = (device_tensor(rows, logits.device), device_tensor(tokens, logits.device))
        logits.index_put_(index, logits.new_full((), float("-inf")))


def _add_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            tokens.extend(p.logit_bias)
            biases.extend(p.logit_bias.values())
    if rows:
        device = logits.device
        index = (device_tensor(rows, device), device_tensor(tokens, device))
        logits.index_put_(index, device_tensor(biases, device, logits.dtype), accumulate=True)


def _penalize(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], history: list[History]) -> None:
    device, vocab = logits.device, logits.shape[1]
    counts = _bincount([h.output_array() for h in history], vocab, device, logits.dtype)
    index = device_tensor(rows, device)
    selected = logits.index_select(0, index)
    repetition = device_tensor([p.repetition_penalty for p in params], device, logits.dtype).unsqueeze(1)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (counts > 0) | (_bincount([h.prompt_array() for h in history], vocab, device, logits.dtype) > 0)
        penalized = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(seen, penalized, selected)
    frequency = device_tensor([p.frequency_penalty for p in params], device, logits.dtype).unsqueeze(1)
    presence = device_tensor([p.presence_penalty for p in params], device, logits.dtype).unsqueeze(1)
    selected = selected - frequency * counts - presence * (counts > 0).to(logits.dtype)
    logits.index_copy_(0, index, selected)


def _bincount(rows: list[np.ndarray], vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[len(rows), vocab]`` occurrence counts of each row's token ids: rows padded with ``vocab``,
    counted into one extra column that is dropped."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab + 1, device=device, dtype=dtype)
    if width:
        padded = np.full((len(rows), width), vocab, dtype=np.int64)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row
        index = to_device(torch.from_numpy(padded), device)
        counts.scatter_add_(1, index, torch.ones(index.shape, device=device, dtype=dtype))
    return counts[:, :vocab]
