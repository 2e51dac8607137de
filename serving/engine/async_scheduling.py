"""Async scheduling (``EngineConfig.async_scheduling``, the worker's ``--async-scheduling``): the
next step is scheduled, its inputs built and its forward launched while the current step still runs
on the device, as vLLM V1's async scheduling does.

A step without it is: schedule, build the inputs on the host, forward, sample, copy the tokens to
the host, process them (detokenize, stop checks, outputs); the device idles through every host
part. With it ``LLMEngine.step`` launches step N+1 before it reads step N's tokens:

1. The scheduler counts each sequence that sampled in step N as one token longer
   (``Sequence.num_pending``), so it decodes again in N+1 (vLLM's placeholder token).
2. Such a decode row's token id is a placeholder on the host; on the device it is taken from step
   N's sampled ids (``Feed``: that tensor and each sequence's row in it) before N+1's forward, in
   stream order (``FedRows``).
3. Step N's samples are copied to pinned host memory without blocking, and an event recorded
   (``serving.engine.sampler.DeviceSamples``); the host waits for that event only once N+1 is
   launched, and processes step N while N+1 runs.

Every device operation of a step (its inputs' copies, the gather of fed ids, the forward, the
sampling, the copy of the samples) is queued on the one current stream, so step N+1 reads what
step N wrote; host lists reach the device through pinned memory (``device_tensor``), never a
blocking copy, which would wait for the whole stream.

A sequence that ends at step N (an EOS or stop token, a stop string, a grammar error) or is
aborted between steps has one more token computed in N+1: it is dropped when N+1 is read (a
finished sequence takes no token, ``LLMEngine._process``) and never emitted. Its KV blocks and
adapter slot are freed when it ends, while N+1 may still write there: any later step that reuses
them is queued after N+1 on the same stream, and an adapter copy into a freed slot waits for that
stream first (``ModelRunner.write_rows``). A sequence whose pending tokens reach ``max_tokens`` or
the context ends whatever their ids, so it is not scheduled again (``Sequence.ends_by_length``).

Policy: what must see a token on the host before the next step
- guided decoding (the grammar's matcher advances on the host with each token), penalties (counts
  of the generated tokens, laid out on the host) and ``min_tokens`` reached by the token in flight
  (the stop-token ban counts the outputs on the host): only their sampling reads that state. A
  step that feeds such a sequence (``host_bound``) has its forward queued as any other's, but is
  sampled once the step in flight is read and processed (``ModelRunner.forward``, then ``sample``):
  the output processing still overlaps the forward, but the device idles (after that short
  sampling) while the host schedules the next step and builds its inputs. A sequence that ended meanwhile samples without its grammar (its matcher
  has ended too) and its token is dropped;
- ``n`` / ``best_of``: siblings fork at schedule time in the step that completes the prompt and
  decode on their own: nothing waits; best_of's ranking reads the logprobs, copied with the tokens;
- logprobs: copied with the tokens, without waiting;
- prefix caching: only prompt blocks are hashed, never a generated token: nothing waits;
- a requeue of running sequences (``LLMEngine.verify_slots``) reads the step in flight first;
- tensor parallelism: refused (``EngineConfig``); speculative decoding: the engine has none.
Still correct but not overlapped, because the host waits for the device inside it: a step that
records prompt logprobs (read on the host as the step computes them). (Penalties' tensors reach the
device through pinned memory too, ``device_tensor``, so their steps overlap like the others.)

On CPU nothing runs beside the host, so async scheduling gains nothing there, but the same code
path runs (and is tested) step for step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.engine.sequence import Sequence


def host_bound(seq: Sequence) -> bool:
    """``seq``'s next sampling must see its tokens on the host first (the policy above)."""
    params = seq.sampling_params
    if seq.guide is not None or params.has_penalties:
        return True
    # min_tokens bans stop tokens while the host's count of outputs is below it: a count short by
    # the tokens in flight is still below it, except when those very tokens reach it. (No count is
    # below 0: the usual min_tokens of 0 is settled without counting, for every decode each step.)
    min_tokens = params.min_tokens
    return min_tokens > 0 and seq.num_output_tokens < min_tokens <= seq.num_planned_tokens - seq.num_prompt_tokens


def device_tensor(values: Seq[Any], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list, or a rectangular list of lists) on ``device`` without waiting for it
    (``to_device``)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for it: on CUDA through pinned memory, copied in
    stream order (a copy from pageable memory, as ``torch.tensor(values, device=cuda)`` makes,
    synchronises the whole stream; the caching host allocator keeps the pinned block until its copy
    is done)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class Feed:
    """The step in flight's sampled token ids, still on the device, and each sampling sequence's
    row in them: where the next step's decode rows take their token id."""

    tokens: torch.Tensor
    rows: dict[Sequence, int]

    @classmethod
    def of(cls, sampled: list[Sequence], tokens: torch.Tensor) -> Feed:
        return cls(tokens, {seq: row for row, seq in enumerate(sampled)})


@dataclass
class FedRows:
    """A step's input rows whose token id comes from the previous step's samples on the device."""

    feed: Feed | None
    rows: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)

    def ids(self, seq: Sequence, start: int, num: int, row: int) -> list[int]:
        """``seq``'s input ids for its tokens ``start .. start + num``, laid out from input row
        ``row``: the ids on the host, and for a token still in flight a placeholder 0 that
        ``apply`` replaces on the device."""
        ids = seq.token_ids[start : start + num]
        if len(ids) == num:
            return ids
        # The scheduler gives a sequence with a token in flight that one token alone (it decodes).
        assert self.feed is not None and len(ids) == num - 1 and seq in self.feed.rows, (
            f"sequence {seq.request_id} has {num - len(ids)} tokens the step in flight did not sample"
        )
        self.rows.append(row + num - 1)
        self.sources.append(self.feed.rows[seq])
        return [*ids, 0]

    def apply(self, input_ids: torch.Tensor, indices: torch.Tensor | None = None) -> None:
        """Write the fed rows' ids into the step's ``input_ids`` on the device (stream order).
        ``indices``: ``[rows, sources]`` already on the device (a graph replay uploads them with its
        inputs); None: uploaded here."""
        if not self.rows:
            return
        assert self.feed is not None
        if indices is None:
            indices = device_tensor([self.rows, self.sources], input_ids.device)
        input_ids.index_copy_(0, indices[0], self.feed.tokens.index_select(0, indices[1]))
