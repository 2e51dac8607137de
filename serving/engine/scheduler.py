"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step, under a budget of ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences:

1. running sequences that decode (one token each) go first, in priority order, so a long prompt
   never stalls decoding;
2. running sequences still in their prefill get the next chunk of their prompt;
3. waiting sequences are admitted while budget, KV blocks and adapter slots allow; with prefix
   caching, the leading blocks of a prompt that the cache holds for its adapter are taken by
   reference and its prefill starts after them (they cost no budget).

When the KV cache cannot hold a running sequence's next tokens, one is preempted by recompute:
among the running sequences of the lowest-ranked one's priority, the most-served tenant's newest
(serving.engine.fairness; with one tenant, the lowest-ranked itself). Its blocks are freed and it
waits again with its tokens, to be prefilled anew (vLLM's default). Nothing is admitted in a step
that preempted.

Under async scheduling (serving.engine.async_scheduling) a running sequence's token sampled by
the step still in flight counts as its next token to compute (``Sequence.num_pending``), so it
decodes again without waiting for the id; one whose pending tokens already reach ``max_tokens``
or the context is not scheduled, since it ends whatever their ids.

Waiting order: ``priority`` (lower first, vLLM's convention) improved by one level per
``priority_aging_steps`` waited, so nothing starves; the tier admitted from is the raw priority of
the waiting request whose level is best (ties: the adapter with the fewest running sequences, then
arrival). Within that tier, the tenant that has been served the fewest weighted tokens goes first
(the Virtual Token Counter, serving.engine.fairness: a tenant flooding requests gets its share, not
the batch; an older request of the same tier does not outrank another tenant's by its age); among
one tenant's requests, the best level, then the adapter with the fewest running sequences
(fairness between adapters: a burst for one adapter does not queue everyone else behind it), then
arrival. Every scheduled token is charged to its tenant's counter as it is scheduled, so
admissions within one step alternate between tenants. Each decision is O(waiting queues), one
queue per tenant, adapter and priority, never O(requests). A request whose adapter is still loading
waits without holding up the others, and so does one whose adapter is being copied into the GPU
pool (on CUDA the copy runs beside the steps; the request is admitted in the first step after it
lands). One whose adapter finds no room (running sequences pin the rows it would need) waits too;
once it has waited longer than an aging period, admissions stop until running sequences finish and
free room, so no adapter waits longer than that plus the longest running sequence's remaining
tokens.

Resident adapters first: in each step, requests whose adapter holds a GPU slot (and base-model
requests) are admitted, in the order above, before any request whose admission would start a copy
into the pool, so a burst of resident groups is admitted whole and no copy evicts the adapter of a
request still waiting behind it. A request that needs a copy is passed over only by resident ones of
its aged level or better, and only until it has waited an aging period; past either it takes its
place in the order above, so the bounds above stand. Then, with ``lora_prefetch_groups`` = k, the
scheduler looks ahead: the next k waiting groups, by aged level (then the adapter with the fewest
running sequences, then arrival), whose adapter is neither resident nor being read, get their copy
into the pool started, or their read from storage (``LoRACache.prefetch_queued``: it evicts only idle
adapters, never one a running sequence or a waiting request uses), so their requests find it landed.

With ``decode_stall_target`` (the adaptive token budget, off by default) a step that decodes gives
prompts only what keeps it within that many times the decode-only step's time, by the step-time
model the engine feeds (serving.engine.step_cost): the budget becomes
``stall_budget(fit, decode tokens, target, max_num_batched_tokens)`` once the decodes are scheduled.
A step with no decodes, one taken before the model has a fit, and one whose oldest prompt without
a first token (waiting or in its prefill) has waited ``decode_stall_max_wait_steps`` steps (the TTFT
guard, so prompts never queue without bound behind short steps) keep the full budget. The model is
the scheduler's only input about time; the scheduler reads no clock.

With ``borrow_kv_memory`` (serving.engine.lora.borrow) each step first lets the borrower move the
boundary between KV blocks and adapter rows: it is told the rank of the largest adapter that found
no room in the step before, and the free blocks this step would take (every running sequence's
next chunk and the waiting prompts' first chunks, within the token budget and the free places).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import sys
from dataclasses import dataclass, field

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.fairness import Client, VirtualTokenCounter
from serving.engine.lora.borrow import Borrower
from serving.engine.lora.cache import LoRACache
from serving.engine.lora.records import AdapterHandle
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.step_cost import StepCostModel, stall_budget


@dataclass
class SchedulerOutput:
    """The step's work: ``(sequence, number of tokens to compute)``, decodes first."""

    scheduled: list[tuple[Sequence, int]]
    preempted: list[Sequence]


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    peak_waiting: int = 0
    slot_waits: int = 0
    load_waits: int = 0
    fill_waits: int = 0
    # decode_stall_target: steps whose budget the step-time model lowered, and steps the TTFT guard
    # gave the full budget although the model had a fit.
    budget_limited_steps: int = 0
    wait_guard_steps: int = 0


@dataclass(order=True)
class _Waiting:
    key: int
    order: int
    seq: Sequence = field(compare=False)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, lora_cache: LoRACache | None, *,
                 max_model_len: int | None = None, borrow: Borrower | None = None,
                 step_cost: StepCostModel | None = None) -> None:
        """``max_model_len``: the engine's context (the config's when None; unbounded if both are);
        ``borrow``: the owner of the KV / adapter boundary, where the engine borrows KV memory;
        ``step_cost``: the step-time model under ``decode_stall_target`` (a fresh one when None),
        which the engine feeds; None when the target is off."""
        self.borrow = borrow
        self.stall_target = config.decode_stall_target
        self.max_prompt_wait = config.decode_stall_max_wait_steps
        self.step_cost = None if self.stall_target is None else step_cost or StepCostModel()
        self._rows_wanted = 0  # the largest rank that found no room in the step before (borrow)
        self.max_model_len = max_model_len or config.max_model_len or sys.maxsize
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.aging = config.priority_aging_steps
        self.blocks = block_manager
        self.lora_cache = lora_cache
        self.prefetch_groups = config.lora_prefetch_groups if lora_cache is not None else 0
        self.running: list[Sequence] = []  # sorted by _key
        # The running sequences of each (tenant, priority), sorted by _key: the preemption candidates.
        self._running_by: dict[tuple[Client, int], list[Sequence]] = {}
        self.fairness = VirtualTokenCounter(config.fairness_prompt_weight, config.fairness_output_weight)
        # One heap per (tenant, adapter, priority): a tenant's requests for one adapter in one tier
        # wait in arrival order, so every tier sees each tenant's oldest request of it.
        self._waiting: dict[tuple[Client, str | None, int], list[_Waiting]] = {}
        self._num_waiting = 0
        self._running_per_group: dict[str | None, int] = {}
        self._order = itertools.count()
        self.step_count = 0
        self.stats = SchedulerStats()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return self._num_waiting > 0 or bool(self.running)

    def waiting(self) -> list[Sequence]:
        return [w.seq for queue in self._waiting.values() for w in queue if not w.seq.is_finished]

    def _key(self, seq: Sequence) -> int:
        """Aging-invariant order: ``priority - waited/aging`` ranks like ``priority*aging + arrival``."""
        return seq.priority * self.aging + seq.arrival_step

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.step_count
        self.fairness.join(seq.fairness_client)
        self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        queue = self._waiting.setdefault((seq.fairness_client, seq.adapter_key, seq.priority), [])
        heapq.heappush(queue, _Waiting(self._key(seq), next(self._order), seq))
        self._num_waiting += 1
        self.stats.peak_waiting = max(self.stats.peak_waiting, self._num_waiting)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out (finished, aborted or failed) and free its blocks, slot and adapter ref."""
        if seq.status is SequenceStatus.RUNNING:
            self._stop_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped when it reaches the top
        self.fairness.leave(seq.fairness_client)
        seq.status = SequenceStatus.FINISHED
        if seq.adapter is not None and self.lora_cache is not None:
            self.lora_cache.release(seq.adapter)

    def adopt(self, child: Sequence, parent: Sequence) -> None:
        """Run ``child``, forked from the running ``parent`` (whose prompt it shares), beside it:
        its adapter is already in ``parent``'s slot, so pinning it cannot fail."""
        slot = -1
        if child.adapter is not None and self.lora_cache is not None:
            grant = self.lora_cache.acquire_slot(child.adapter)
            assert isinstance(grant, int) and grant == parent.lora_slot, f"forked onto slot {grant!r}"
            slot = grant
        child.status = SequenceStatus.RUNNING
        child.lora_slot = slot
        child.arrival_step = parent.arrival_step
        self._start_running(child)
        self.fairness.join(child.fairness_client)
        self.fairness.charge(child.fairness_client, 1, samples=True)  # it sampled from its parent's logits

    def requeue(self, seq: Sequence) -> None:
        """Stop running ``seq`` and queue it again, to be prefilled anew (a preemption by recompute):
        for a sequence whose KV entries can no longer be trusted."""
        self._preempt(seq)

    def schedule(self) -> SchedulerOutput:
        now = self.step_count
        self.step_count += 1
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        if self.borrow is not None:
            self.borrow.step(rows_wanted=self._rows_wanted, kv_blocks_wanted=self._kv_demand())
            self._rows_wanted = 0

        # Decodes first, in running order; the running sequences with a prompt chunk to compute (any
        # count but one) are kept in that order for after them. A sequence of either list may be
        # preempted (its status no longer RUNNING) by one after it that needs room.
        chunks: list[Sequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_uncomputed_tokens != 1:
                chunks.append(seq)
                continue
            if seq.num_pending and seq.ends_by_length(self.max_model_len):
                continue
            budget = self._schedule_running(seq, 1, budget, scheduled, preempted)
        budget = self._prompt_budget(now, budget, sum(scheduled.values()))
        for seq in chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_pending and seq.ends_by_length(self.max_model_len):
                continue
            budget = self._schedule_running(seq, min(seq.num_uncomputed_tokens, budget), budget, scheduled, preempted)

        # No sequence scheduled so far can be preempted now: the prompt blocks their step completes
        # may be shared from this step on (admissions register theirs as they are made), and the
        # tokens they compute are served (admissions charge theirs as they are made).
        for seq, num in scheduled.items():
            self.blocks.register_full(seq, seq.num_computed_tokens + num)
            self._charge(seq, num)
        if not preempted:
            budget = self._admit(now, budget, scheduled)
        if self.prefetch_groups and self._num_waiting:
            self._prefetch(now)
        return SchedulerOutput(list(scheduled.items()), preempted)

    def _schedule_running(self, seq: Sequence, num: int, budget: int, scheduled: dict[Sequence, int],
                          preempted: list[Sequence]) -> int:
        """Schedule ``num`` tokens of the running ``seq``, preempting (``_victim``) until its blocks
        fit or it is the victim itself; returns the budget left (the victims' scheduled tokens back)."""
        while not self.blocks.try_allocate(seq, num):
            victim = self._victim()
            budget += scheduled.pop(victim, 0)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return budget
        scheduled[seq] = num
        return budget - num

    def _prompt_budget(self, now: int, budget: int, decodes: int) -> int:
        """The tokens prompts may take in this step, ``budget`` being what the ``decodes`` left of
        the full one: under ``decode_stall_target``, what keeps the step within the target by the
        step-time model (module docstring), unless the TTFT guard holds."""
        if self.step_cost is None or self.stall_target is None or decodes == 0:
            return budget
        fit = self.step_cost.fit()
        if fit is None:
            return budget
        if now - self._oldest_prompt_arrival(now) >= self.max_prompt_wait:
            self.stats.wait_guard_steps += 1
            return budget
        limit = stall_budget(fit, decodes, self.stall_target, self.max_num_batched_tokens)
        if limit < self.max_num_batched_tokens:
            self.stats.budget_limited_steps += 1
        return max(0, min(budget, limit - decodes))

    def _oldest_prompt_arrival(self, now: int) -> int:
        """The arrival step of the oldest sequence with a prompt still to compute, waiting or running
        (``now`` if none). Each waiting queue's head is its oldest (one tenant, adapter and priority
        per queue, ordered by arrival). O(running + waiting queues)."""
        oldest = now
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1:
                oldest = min(oldest, seq.arrival_step)
        for queue in self._waiting.values():
            while queue and queue[0].seq.is_finished:
                heapq.heappop(queue)  # finished while waiting: already uncounted (finish)
            if queue:
                oldest = min(oldest, queue[0].seq.arrival_step)
        return oldest

    def _admit(self, now: int, budget: int, scheduled: dict[Sequence, int]) -> int:
        blocked: set[str | None] = set()
        # Running sequences' forks still to come (n > 1, prompt not yet prefilled) hold their places.
        reserved = sum(seq.num_forks for seq in self.running)
        resident_first = self.lora_cache is not None  # the step's first phase (module docstring)
        while budget > 0 and len(self.running) + reserved < self.max_num_seqs:
            head = self._best_head(now, blocked, resident_first=resident_first)
            if head is None:
                if resident_first:
                    resident_first = False
                    continue
                break
            seq, group = head.seq, head.seq.adapter_key
            # Its prefill would read a token still in flight: a step that preempts admits nothing, and
            # a requeue (verify_slots) first waits for the step in flight.
            assert seq.num_pending == 0, "a waiting sequence is admitted only once its tokens are read"
            if len(self.running) + reserved + 1 + seq.num_forks > self.max_num_seqs:
                break  # its forks must fit too; in arrival order, so it is next once they do
            slot = -1
            handle, cache = seq.adapter, self.lora_cache
            if handle is not None and cache is not None:
                if not cache.ready(handle):
                    self.stats.load_waits += 1
                    blocked.add(group)
                    continue
                acquired = cache.acquire_slot(handle)
                if acquired == "filling":
                    self.stats.fill_waits += 1
                    blocked.add(group)
                    continue
                if acquired is None:
                    self.stats.slot_waits += 1
                    if handle.adapter is not None:
                        self._rows_wanted = max(self._rows_wanted, handle.adapter.rank)
                    if now - seq.arrival_step > self.aging:
                        break  # let the pinned slots drain so this long-waiting request gets one
                    blocked.add(group)
                    continue
                slot = acquired
            # Its prompt's leading blocks already in the prefix cache are taken, not computed.
            prefix = self.blocks.find_prefix(seq)
            num = min(seq.num_uncomputed_tokens - len(prefix) * self.blocks.block_size, budget)
            if not self.blocks.can_allocate(seq, num, prefix):
                if handle is not None and cache is not None and slot >= 0:
                    cache.release_slot(handle)
                break
            heapq.heappop(self._waiting[seq.fairness_client, group, seq.priority])
            self._num_waiting -= 1
            seq.status = SequenceStatus.RUNNING
            seq.lora_slot = slot
            self._start_running(seq)
            self.blocks.take_prefix(seq, prefix)
            self.blocks.allocate(seq, num)
            self.blocks.register_full(seq, seq.num_computed_tokens + num)
            self._charge(seq, num)
            scheduled[seq] = num
            budget -= num
            reserved += seq.num_forks
        return budget

    def _kv_demand(self) -> int:
        """Free blocks the step about to be scheduled would take: each running sequence's next chunk,
        then waiting prompts' first chunks while the token budget and the free sequence places last
        (any waiting ones: the step's admission order is not worked out twice). O(running + admitted)."""
        budget = self.max_num_batched_tokens
        places = self.max_num_seqs - len(self.running)
        need = 0
        for seq in self.running:
            num = min(max(1, seq.num_uncomputed_tokens), budget)
            need += self.blocks.blocks_needed(seq, num)
            budget = max(0, budget - num)
        for queue in self._waiting.values():
            for waiting in queue:
                if budget == 0 or places == 0:
                    return need
                if not waiting.seq.is_finished:
                    num = min(waiting.seq.num_uncomputed_tokens, budget)
                    need += -(-num // self.blocks.block_size)
                    budget -= num
                    places -= 1
        return need

    def _best_head(self, now: int, blocked: set[str | None], *, resident_first: bool = False) -> _Waiting | None:
        """The waiting request to admit next: the tier (raw priority) of the best aged level, then,
        within it, the least-served tenant, then that tenant's best aged level, adapter fairness
        and age. One pass over the queues, whose heads are their best (a heap by aged key).

        ``resident_first``: pass over heads whose admission would start a copy into the GPU pool;
        None once no other is left, or one of those has waited an aging period or has a better aged
        level than every other (then the step goes on in the plain order)."""
        tier, tier_rank = None, None
        deferred_level: int | None = None  # the best aged level among the heads passed over
        in_tier: dict[int, tuple[tuple[int, int, int, int, int], _Waiting]] = {}  # raw priority -> best
        for (client, group, priority), queue in list(self._waiting.items()):
            while queue and queue[0].seq.is_finished:
                heapq.heappop(queue)
            if not queue:
                del self._waiting[client, group, priority]
                continue
            if group in blocked:
                continue
            head = queue[0]
            level = (head.key - now) // self.aging
            if resident_first and self._needs_copy(head.seq):
                if now - head.seq.arrival_step > self.aging:
                    return None
                deferred_level = level if deferred_level is None else min(deferred_level, level)
                continue
            rank = (level, self._running_per_group.get(group, 0), head.key, head.order)
            if tier_rank is None or rank < tier_rank:
                tier, tier_rank = priority, rank
            fair = (self.fairness.counter(client), *rank)
            best = in_tier.get(priority)
            if best is None or fair < best[0]:
                in_tier[priority] = (fair, head)
        if tier is None or tier_rank is None or (deferred_level is not None and deferred_level < tier_rank[0]):
            return None
        return in_tier[tier][1]

    def _needs_copy(self, seq: Sequence) -> bool:
        return seq.adapter is not None and self.lora_cache is not None and self.lora_cache.needs_copy(seq.adapter)

    def _prefetch(self, now: int) -> None:
        """Start bringing up the adapters of the next ``prefetch_groups`` waiting groups whose adapter
        is neither resident nor being read (module docstring). One pass over the queues' heads."""
        cache = self.lora_cache
        assert cache is not None
        wanted: dict[int, tuple[tuple[int, int, int, int], AdapterHandle]] = {}  # id(adapter) -> best rank
        for (_, group, _), queue in self._waiting.items():
            while queue and queue[0].seq.is_finished:
                heapq.heappop(queue)  # finished while waiting: already uncounted (finish)
            if not queue:
                continue
            head = queue[0]
            handle = head.seq.adapter
            if handle is None or handle.adapter is None or not cache.needs_prefetch(handle):
                continue
            rank = ((head.key - now) // self.aging, self._running_per_group.get(group, 0), head.key, head.order)
            best = wanted.get(id(handle.adapter))
            if best is None or rank < best[0]:
                wanted[id(handle.adapter)] = (rank, handle)
        if wanted:
            nearest = heapq.nsmallest(self.prefetch_groups, wanted.values(), key=lambda item: item[0])
            cache.prefetch_queued(handle for _, handle in nearest)

    def _charge(self, seq: Sequence, num: int) -> None:
        """Charge ``seq``'s tenant for ``num`` tokens computed in this step (sampling one after them
        when they are all it has left to compute)."""
        self.fairness.charge(seq.fairness_client, num, samples=num == seq.num_uncomputed_tokens)

    def _victim(self) -> Sequence:
        """The sequence to preempt: among the running of the lowest level (the last one's raw
        priority), the most-served tenant's newest. O(tenants × priorities running)."""
        worst = self.running[-1].priority
        tier = [(self.fairness.counter(client), self._key(seqs[-1]), seqs[-1])
                for (client, priority), seqs in self._running_by.items() if priority == worst]
        return max(tier, key=lambda candidate: candidate[:2])[2]

    def _start_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=self._key)
        bisect.insort(self._running_by.setdefault((seq.fairness_client, seq.priority), []), seq, key=self._key)
        self._running_per_group[seq.adapter_key] = self._running_per_group.get(seq.adapter_key, 0) + 1

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        mates = self._running_by[seq.fairness_client, seq.priority]
        mates.remove(seq)
        if not mates:
            del self._running_by[seq.fairness_client, seq.priority]
        group = seq.adapter_key
        self._running_per_group[group] -= 1
        self.blocks.free(seq)
        if seq.lora_slot >= 0 and seq.adapter is not None and self.lora_cache is not None:
            self.lora_cache.release_slot(seq.adapter)
        seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._stop_running(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._push_waiting(seq)
