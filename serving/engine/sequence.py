"""One request's state inside the engine: its sequences (one per completion generated), each with
its tokens, how many of them the KV cache holds, its KV blocks, its adapter, and its output so far."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from serving.engine.lora.request import LoRARequest
from serving.engine.outputs import FirstTokenTimes, Logprob
from serving.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.detokenizer import IncrementalDetokenizer
    from serving.engine.guided import Guide
    from serving.engine.lora.records import AdapterHandle


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request being served.

    ``token_ids`` holds the prompt followed by the generated tokens. ``num_computed_tokens`` of
    them have their keys and values in the KV cache; the rest are computed by the next steps (a
    prefill in chunks, then one token per decode step). Preemption by recompute sets it back to
    0 and frees the blocks: the tokens stay, and are prefilled again when the request resumes.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer
    lora_request: LoRARequest | None = None
    adapter: AdapterHandle | None = None
    priority: int = 0
    arrival_step: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # time.monotonic() of the step that first scheduled it (its first prompt chunk); kept through
    # a preemption, so its request's queue phase ends there (FirstTokenTimes).
    first_scheduled: float | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens sampled by steps still running on the device, whose ids the host has not read yet
    # (async scheduling, serving.engine.async_scheduling): the next step computes the first of them
    # as any decode token, its id taken on the device; they are not in token_ids until read.
    num_pending: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    lora_slot: int = -1
    output_text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    # With sampling_params.prompt_logprobs: one entry per prompt token recorded so far by the
    # prefill (model_runner), None for the first (nothing predicts it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: Exception | None = None
    num_preemptions: int = 0
    # Its grammar's matcher when its output is constrained (sampling_params.guided_decoding), set
    # once the grammar is compiled, before it is scheduled.
    guide: Guide | None = None
    # Its place among its request's sequences (n / best_of > 1): sequence 0 is queued and
    # prefilled; the others are forked from it in the step that completes its prompt.
    index: int = 0
    # Sequences still to fork from this one once its prompt is prefilled (the scheduler admits
    # it only with room for them too); 0 once forked.
    num_forks: int = 0
    # The sequences forked from this one in the current step: they sample from its logits row
    # (model_runner), then decode on their own. Emptied after the step.
    forks: list[Sequence] = field(default_factory=list)
    # Prefix caching (serving.engine.block_manager): the keys of its prompt's full blocks, made at
    # its first admission; how many of its leading blocks are registered under them (or were taken
    # from the cache); the prompt tokens its first admission found cached (None: caching is off).
    block_keys: list[bytes] | None = None
    cache_salt: str | None = None  # vLLM's: mixed into the keys' seed, so only the same salt shares
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None
    # int64 copies of the prompt and the output for the penalties (serving.engine.penalties), made
    # on first use and then grown by the new tokens only: a step never converts a whole token list.
    _prompt_array: np.ndarray | None = field(default=None, init=False, repr=False)
    _output_array: np.ndarray | None = field(default=None, init=False, repr=False)
    _output_filled: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    def prompt_array(self) -> np.ndarray:
        """The prompt's token ids as an int64 array."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int64)
        return self._prompt_array

    def output_array(self) -> np.ndarray:
        """The output's token ids as an int64 array (a view: valid until the next call). Output
        tokens are only ever appended, so the tokens copied before stay right."""
        count = self.num_output_tokens
        array = self._output_array
        if array is None or len(array) < count:
            grown = np.empty(max(16, 2 * count), dtype=np.int64)
            if array is not None:
                grown[: self._output_filled] = array[: self._output_filled]
            self._output_array = array = grown
        if self._output_filled < count:
            array[self._output_filled : count] = self.token_ids[self.num_prompt_tokens + self._output_filled :]
            self._output_filled = count
        return array[:count]

    @property
    def num_planned_tokens(self) -> int:
        """Its tokens once the steps in flight are read: ``token_ids`` and the pending ones."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    def ends_by_length(self, max_model_len: int) -> bool:
        """Its pending tokens already end it (``max_tokens`` or the context reached), whatever
        their ids: it must not be scheduled again (its next position may lie past the context)."""
        if self.num_pending == 0:
            return False
        limit = self.sampling_params.max_tokens
        planned = len(self.token_ids) + self.num_pending
        return (limit is not None and planned - len(self.prompt_token_ids) >= limit) or planned >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def adapter_key(self) -> str | None:
        """The scheduler's fairness group: the adapter's name, or None for the base model."""
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def fairness_client(self) -> str | None:
        """The client whose share of the batch it counts toward (serving.engine.fairness): its
        ``cache_salt``, which names the tenant (the gateway salts every request it forwards, base
        model or adapter, ``tenant-<id>``, and drops a caller's own), so a tenant's requests for
        every adapter share one counter; None for unsalted requests (one client between them)."""
        return self.cache_salt


@dataclass(eq=False)
class RequestState:
    """A request's sequences: ``sampling_params.num_sequences`` of them once forked, in index order.
    ``grammar`` is the compiled constraint each forked sequence starts a matcher of."""

    request_id: str
    sampling_params: SamplingParams
    seqs: list[Sequence]
    grammar: Any = None
    error: Exception | None = None
    added_ns: int = 0  # time.time_ns() when the engine took it (FirstTokenTimes.added_ns)
    first_token_times: FirstTokenTimes | None = None  # set when its first token is read

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        """Every sequence has ended (none is left to fork)."""
        # A loop, not all() over a generator: read for every request that samples, every step.
        if self.seqs[0].num_forks:
            return False
        for seq in self.seqs:
            if seq.finish_reason is None:
                return False
        return True
