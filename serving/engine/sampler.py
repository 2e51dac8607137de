"""Choosing each sequence's next token from its logits, for a whole batch at once.

Greedy rows take the argmax. Sampled rows divide by their temperature, mask outside their top-k
and top-p, and draw with the exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which is
a draw from ``p``. A request with a seed draws its ``q`` row from its own generator, so what it
samples depends on its seed and its logits only, never on the rest of the batch.

Rows with a guide (structured output, serving.engine.guided) first have every token their grammar
does not allow set to -inf, in the same batch as the free rows, which are left untouched. Then
``min_tokens``, ``logit_bias`` and the penalties apply (serving.engine.penalties), before
temperature and filters, to greedy and sampled rows alike.

Log-probabilities come from the model's raw distribution (before grammar masks, temperature and
filters), as in vLLM: the chosen token's, its rank, and the ``k`` most likely tokens when asked.

``sample`` leaves the results on the device (``DeviceSamples``): their copy to the host starts
without blocking, and the host waits for it only when it reads them, so under async scheduling
(serving.engine.async_scheduling) the next step is launched first. Host lists the sampling needs
on the device go through pinned memory, never a copy that waits for the stream.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from serving.engine import penalties
from serving.engine.async_scheduling import device_tensor
from serving.engine.guided import Guide, mask_logits
from serving.engine.penalties import History
from serving.engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    """Host-side results: per row the token, and when asked its logprob, rank and top-k."""

    token_ids: list[int]
    logprobs: list[float] | None
    ranks: list[int] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


@dataclass
class DeviceSamples:
    """A batch's samples on the device: per row the token, and when asked its logprob, rank and
    top-k (``top_ids`` None with logprobs: none asked beyond the chosen token's)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    _copies: tuple[torch.Tensor | None, ...] | None = field(default=None, init=False, repr=False)
    _copied: torch.cuda.Event | None = field(default=None, init=False, repr=False)

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.tokens, self.logprobs, self.ranks, self.top_ids, self.top_logprobs

    def start_copy(self) -> None:
        """Start copying the samples to (pinned) host memory, in stream order, without waiting
        (CUDA; on CPU they are there already)."""
        if self.tokens.device.type != "cuda" or self._copies is not None:
            return
        self._copies = tuple(t.to("cpu", non_blocking=True) if t is not None else None for t in self._tensors())
        # On the stream of the samples' device, which their copies were queued on (the thread's
        # current device may be another).
        self._copied = torch.cuda.current_stream(self.tokens.device).record_event()

    def host(self) -> SampleResult:
        """The samples as host lists; waits for their copy (started here if it was not)."""
        self.start_copy()
        if self._copied is not None:
            self._copied.synchronize()
        tokens, logprobs, ranks, top_ids, top_logprobs = self._copies or self._tensors()
        assert tokens is not None
        if logprobs is None or ranks is None:
            return SampleResult(tokens.tolist(), None, None, None, None)
        rows = tokens.shape[0]
        return SampleResult(
            tokens.tolist(),
            logprobs.tolist(),
            ranks.tolist(),
            top_ids.tolist() if top_ids is not None else [[] for _ in range(rows)],
            top_logprobs.tolist() if top_logprobs is not None else [[] for _ in range(rows)],
        )


class Sampler:
    """``eos_token_ids``: what ``min_tokens`` bans besides each row's stop token ids."""

    def __init__(self, device: torch.device, eos_token_ids: Collection[int] = ()) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        guides: list[Guide | None] | None = None,
        history: Sequence[History] | None = None,
    ) -> SampleResult:
        """``sample``'s results on the host."""
        return self.sample(logits, params, generators, guides, history).host()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        guides: list[Guide | None] | None = None,
        history: Sequence[History] | None = None,
    ) -> DeviceSamples:
        """Each row's token (and logprobs when asked) on the device. ``history``: each row's
        sequence, whose tokens the penalties and ``min_tokens`` read (None: no row has any tokens
        to count, as for a bare logits test)."""
        logits = logits.float()
        chosen_from = logits
        guided = guides is not None and guides.count(None) < len(guides)
        processed = history is not None and penalties.needs_processing(params, history)
        if guided or processed:
            # A copy: the raw logits stay for the logprobs (and may be a captured graph's output).
            chosen_from = logits.clone()
        if guided:
            assert guides is not None
            mask_logits(chosen_from, guides)
        if processed:
            assert history is not None
            penalties.apply(chosen_from, params, history, self.eos_token_ids)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = chosen_from.argmax(dim=-1)
        else:
            tokens = self._sample(chosen_from, params, generators, greedy)
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if num_top is None and any(p.num_sequences > p.n for p in params):
            num_top = 0  # best_of ranks its sequences by the chosen tokens' logprobs
        if num_top is None:
            return DeviceSamples(tokens)
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        ranks = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1
        if num_top == 0:
            return DeviceSamples(tokens, chosen, ranks)
        top = logp.topk(num_top, dim=-1)
        return DeviceSamples(tokens, chosen, ranks, top.indices, top.values)

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[1]
        # Every row's knobs in one upload: temperature, greedy (1/0), top-k, top-p (float32 holds a
        # top-k exactly up to 2**24, past any vocabulary).
        knobs = device_tensor([
            [1.0 if g else p.temperature for p, g in zip(params, greedy)],
            [float(g) for g in greedy],
            [float(p.top_k if p.top_k_enabled else vocab) for p in params],
            [p.top_p for p in params],
        ], device, torch.float32)  # fmt: skip
        scaled = logits / knobs[0].unsqueeze(1)
        if any(p.top_k_enabled or p.top_p < 1.0 for p in params):
            scaled = self._filter(scaled, knobs[2], knobs[3])
        probs = torch.softmax(scaled, dim=-1)
        race = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            race.exponential_()  # the same draws as the rows drawn apart below, without an index upload
        elif unseeded:
            draws = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
            race.index_copy_(0, device_tensor(unseeded, device), draws)
        for i, generator in enumerate(generators):
            if generator is not None:
                race[i].exponential_(generator=generator)
        sampled = (probs / race).argmax(dim=-1)
        return torch.where(knobs[1] > 0, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Mask every token outside each row's ``top_k`` and ``top_p`` (nucleus) set with -inf."""
        vocab = scaled.shape[1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        position = torch.arange(vocab, device=scaled.device).unsqueeze(0)
        outside = position >= top_k.unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits.masked_fill(outside, float("-inf")), dim=-1)
        # A token is kept while the mass of the tokens before it is below top_p: the top token always is.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside |= mass_before >= top_p.unsqueeze(1)
        masked = sorted_logits.masked_fill(outside, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, masked)
