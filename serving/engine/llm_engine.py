"""The synchronous engine core: requests in, one step at a time, outputs out.

``step()`` takes in finished grammar compilations and adapter loads, asks the scheduler for the
step's work, runs it on the model runner, and turns the sampled tokens into outputs
(serving.engine.output_processor), freeing what finished. ``LLM`` drives it in a loop;
``AsyncEngine`` drives it from a thread, ``ProcessEngine`` from a child process (both with
serving.engine.engine_core's loop). Not thread-safe: one thread calls everything (``encode`` aside).

A request of ``n`` (or ``best_of``) completions is one sequence until its prompt is prefilled; in
the step that completes the prompt the others are forked from it (``_fork``): they share its KV
blocks (reference-counted, the partial last block copied on write: serving.engine.block_manager),
sample their first token from its logits row, then decode on their own. So the prompt is
prefilled once whatever ``n`` (``EngineStats.prefill_tokens`` counts it). With prefix caching a
prompt's leading blocks computed before for its adapter are not prefilled at all: the scheduler
takes them at admission, and registers the full prompt blocks each step computes.

With ``EngineConfig.async_scheduling`` a step launches the next step on the device before it reads
the tokens of the one in flight (``_step_overlapped``; serving.engine.async_scheduling says how,
and what still waits for the tokens): its outputs are those of the step before.

``step(on_first_outputs=...)`` hands out a step's first outputs (of the requests whose first token
it read) as soon as they are made, before the step's other sequences are appended (detokenized)
and made outputs: a first token then need not wait for a few hundred other streams' processing and
their message (serving.engine.engine_core sends them ahead, through the same path). ``step()``
returns the rest.

Under ``EngineConfig.decode_stall_target`` each ``step()`` call's wall time feeds the scheduler's
step-time model (serving.engine.step_cost) with the tokens of the step it waited for: the step it
ran, or under async scheduling the step it read (launched by the call before; in a steady stream
the call lasts from one step's end on the device to the next's, so that step's time), one step
late, which a model fitted over many steps does not notice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from serving.engine.async_scheduling import host_bound
from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.detokenizer import IncrementalDetokenizer, fast_decode, token_bytes
from serving.engine.distributed.driver import DriverRunner
from serving.engine.layers.lora_linear import write_dora_scales
from serving.engine.guided import GrammarCompiler, Guide, grammar_tenant
from serving.engine.lora.borrow import Borrower
from serving.engine.lora.cache import LoRACache, Placement
from serving.engine.lora.integrity import SlotChecksums, SlotCorruptedError
from serving.engine.lora.reader import AdapterError
from serving.engine.lora.records import AdapterHandle, CachedAdapter, CopyDone
from serving.engine.lora.request import LoRARequest
from serving.engine.model_runner import ModelRunner, PendingStep, StepLogits, StepResult
from serving.engine.output_processor import OutputProcessor
from serving.engine.outputs import FirstTokenTimes, RequestOutput
from serving.engine.prompts import PromptType, encode_prompt, eos_token_ids, validate_prompt
from serving.engine.sampler import SampleResult
from serving.engine.sampling_params import SamplingParams, seed_of
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.sequence import RequestState, Sequence, SequenceStatus
from serving.engine.stats import EngineStats, LoRAInfo, SlotRepair, TokenCounts, engine_stats, lora_infos

log = logging.getLogger(__name__)

# After the warm-up, a step slower than this counts as slow (ModelRunner.slow_steps) and the first
# _SLOW_STEPS_LOGGED are logged: a full 2048-token step with 32 adapters takes ~85 ms on the H100,
# a compile, an allocator's growth or a host stall far longer (issue 38, "the first minute").
SLOW_STEP_S = 0.25
_SLOW_STEPS_LOGGED = 20

# A step's first outputs, handed on before the step's other tokens are processed (``step``).
EmitOutputs = Callable[[list[RequestOutput]], None]


class LLMEngine:
    def __init__(self, config: EngineConfig, *, on_load_done: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.hf_config = AutoConfig.from_pretrained(config.model)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model)
        self._decode = fast_decode(self.tokenizer)
        self._token_bytes = token_bytes(self.tokenizer)
        context = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or None
        if config.max_model_len is not None and context is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {context} tokens")
        self.max_model_len = config.max_model_len or context or 4096
        self.model_name = config.base_model_name or Path(config.model).resolve().name
        self.eos_token_ids = eos_token_ids(self.hf_config, self.tokenizer, self.config.model)
        # Under tensor parallelism this process is rank 0, and its runner spawns and drives the others.
        runner_class = DriverRunner if config.uses_driver else ModelRunner
        self.runner = runner_class(config, self.hf_config, self.max_model_len, self.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.lora_cache: LoRACache | None = None
        self.slot_checksums: SlotChecksums | None = None
        memory = self.runner.memory
        if memory.lora_rows > 0:
            runner = self.runner
            self.slot_checksums = SlotChecksums(runner.lora_pools(), runner.lora_scaling, runner.lora_ranks,
                                                runner.lora_rows, [layer.dora_scale for layer in runner.model.lora_layers()
                                                                   if layer.dora_scale is not None])
            self.lora_cache = LoRACache(
                num_slots=memory.lora_slots,
                num_rows=memory.lora_rows,
                cpu_cache_bytes=memory.cpu_cache_bytes,
                max_cpu_loras=config.max_cpu_loras,
                row_bytes=runner.lora_row_bytes,
                max_lora_rank=config.max_lora_rank,
                base_config=self.hf_config,
                base_model_name=config.base_model_name,
                dtype=self.runner.dtype,
                pin_memory=self.runner.device.type == "cuda",
                write_rows=self._write_rows,
                on_load_done=on_load_done,
                dora_refusal=config.dora_refusal,
                vocab_refusal=runner.vocab_refusal,
                base_vocab=runner.base_vocab,
            )
        # With borrow_kv_memory the row pools are views into the KV cache and this moves their boundary.
        borrow = None
        if self.runner.flex is not None and self.lora_cache is not None and memory.kv_blocks_at_start is not None:
            borrow = Borrower(self.runner.flex, self.block_manager, self.lora_cache,
                              start_kv_blocks=memory.kv_blocks_at_start)
        self.scheduler = Scheduler(config, self.block_manager, self.lora_cache, max_model_len=self.max_model_len,
                                   borrow=borrow)
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size=self.hf_config.vocab_size,
                                        stop_token_ids=self.eos_token_ids, budget=config.grammar,
                                        on_done=on_load_done)
        self.outputs = OutputProcessor(self._decode, self.eos_token_ids, self.max_model_len)
        self._requests: dict[str, RequestState] = {}
        # Constrained requests whose grammar is being compiled (off the step, on the compiler's
        # thread): scheduled once it is done, as a request waits for its adapter's load.
        self._compiling: dict[str, Future[Any]] = {}
        # Outputs made between steps (verify_slots: the requests it ended, and the step in flight it
        # read first), handed out by the next step with its own outputs.
        self._ended: list[RequestOutput] = []
        self.counts = TokenCounts()
        # Tokens of the step ``step()`` launched, or, when it launched none, of the step it read:
        # 0 means the call did no work (callers then wait for loads rather than spin).
        self.last_step_tokens = 0
        # Async scheduling: the step launched and not yet read, with its token count.
        self._inflight: tuple[PendingStep, int] | None = None
        # Tokens of the step whose end the current ``step()`` call waited for (0: none), timed for
        # the step-time model under decode_stall_target.
        self._timed_tokens = 0

    # ---- requests -------------------------------------------------------------------------

    def encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(prompt text or None, token ids)`` of a string or ``{"prompt_token_ids": [...]}``."""
        return encode_prompt(self.tokenizer, prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Reject a prompt the engine cannot serve, with the reason."""
        validate_prompt(token_ids, params, vocab=self.hf_config.vocab_size, max_model_len=self.max_model_len,
                        max_num_seqs=self.config.max_num_seqs)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        *,
        encoded: tuple[str | None, list[int]] | None = None,
    ) -> None:
        """Queue a request; raises ValueError (bad prompt, duplicate id) or AdapterError at once."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = encoded if encoded is not None else self.encode(prompt)
        self.validate(token_ids, sampling_params)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        adapter: AdapterHandle | None = None
        if lora_request is not None:
            adapter = self._loras().resolve(lora_request)
        # Where its queue phase starts: the wall clock for the HTTP layer (read first: FirstTokenTimes).
        added_ns, added = time.time_ns(), time.monotonic()
        seq = Sequence(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            sampling_params=sampling_params,
            detokenizer=IncrementalDetokenizer(self._decode, token_ids, sampling_params.skip_special_tokens,
                                              self._token_bytes),
            lora_request=lora_request,
            adapter=adapter,
            priority=priority,
            arrival_time=added,
            generator=self._generator(sampling_params, 0),
            num_forks=sampling_params.num_sequences - 1,
            cache_salt=cache_salt,
        )
        state = RequestState(request_id, sampling_params, [seq], added_ns=added_ns)
        guided = sampling_params.guided_decoding
        if guided is not None:
            # Compiled in the tenant's share of the pool and cached in its own cache (guided.py).
            grammar = self.grammars.compile(guided, grammar_tenant(cache_salt, seq.adapter_key))
            if grammar.done():
                state.grammar = grammar.result()  # a cached grammar, or its error raised here
                seq.guide = Guide(state.grammar)
            else:
                self._requests[request_id] = state
                self._compiling[request_id] = grammar
                return
        self._requests[request_id] = state
        self.counts.prompt_tokens += len(token_ids)
        self.scheduler.add(seq)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sequence ``index``'s own random generator when the request is seeded."""
        if params.seed is None:
            return None
        return torch.Generator(device=self.runner.device).manual_seed(seed_of(params.seed, index))

    def _take_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is compiled; fail those whose grammar failed."""
        outputs: list[RequestOutput] = []
        for request_id, grammar in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[request_id]
            state = self._requests[request_id]
            seq = state.first
            error = grammar.exception()
            if error is None:
                state.grammar = grammar.result()
                seq.guide = Guide(state.grammar)
                self.counts.prompt_tokens += seq.num_prompt_tokens
                self.scheduler.add(seq)
                continue
            seq.finish_reason = "error"
            state.error = error if isinstance(error, Exception) else RuntimeError(repr(error))
            self._requests.pop(request_id, None)
            self._drop_unscheduled(seq)
            outputs.append(self.outputs.output(state))
        return outputs

    def _drop_unscheduled(self, seq: Sequence) -> None:
        """End a request the scheduler never took (its grammar was compiling): only its adapter
        reference is held."""
        seq.status = SequenceStatus.FINISHED
        if seq.adapter is not None and self.lora_cache is not None:
            self.lora_cache.release(seq.adapter)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks and adapter refs; None if unknown or done."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        if (grammar := self._compiling.pop(request_id, None)) is not None:
            self.grammars.release(grammar)  # its compile is cancelled when no other request waits for it
            state.first.finish_reason = "abort"
            self._drop_unscheduled(state.first)
        else:
            self._end(state, "abort")
        return self.outputs.output(state)

    def _end(self, state: RequestState, reason: str, error: Exception | None = None) -> None:
        """Stop every sequence of ``state`` still running or waiting (an abort, or a failure of one
        of them: its request fails as a whole), with ``reason``."""
        state.error = state.error or error
        state.first.num_forks = 0
        for seq in state.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.finish_reason = seq.finish_reason or reason
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # ---- one step -------------------------------------------------------------------------

    def step(self, on_first_outputs: EmitOutputs | None = None) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that progressed or ended (under
        async scheduling: in the step read here, launched by the call before). With
        ``on_first_outputs``, the outputs of the requests whose first token the step read are
        handed to it instead, once per step that has any, before the step's other tokens are
        processed; they are not returned. After the warm-up, a call slower than ``SLOW_STEP_S`` is
        counted (the first ones logged at WARNING)."""
        started = time.perf_counter()
        self._timed_tokens = 0
        outputs = self._step(on_first_outputs)
        elapsed = time.perf_counter() - started
        if self.scheduler.step_cost is not None and self._timed_tokens:
            self.scheduler.step_cost.observe(self._timed_tokens, elapsed)
        if elapsed > SLOW_STEP_S and self.runner.warm_kernels is not None:
            self.runner.slow_steps += 1
            if self.runner.slow_steps <= _SLOW_STEPS_LOGGED:
                log.warning("slow step %d since the warm-up: %.0f ms, %d tokens, %d running, %d waiting%s",
                            self.runner.slow_steps, 1000 * elapsed, self.last_step_tokens, self.scheduler.num_running,
                            self.scheduler.num_waiting,
                            "; further slow steps are only counted" if self.runner.slow_steps == _SLOW_STEPS_LOGGED else "")
        return outputs

    def _step(self, on_first_outputs: EmitOutputs | None) -> list[RequestOutput]:
        outputs, self._ended = self._ended, []
        if self._compiling:
            outputs += self._take_compiled()
        outputs += self._fail_adapter_errors()
        if self.config.async_scheduling:
            return outputs + self._step_overlapped(on_first_outputs)
        plan = self.scheduler.schedule()
        self.last_step_tokens = self._timed_tokens = sum(num for _, num in plan.scheduled)
        if not plan.scheduled:
            return outputs
        self._prepare(plan)
        try:
            self.runner.copy_blocks(self.block_manager.take_copies())
            result = self.runner.execute(plan.scheduled)
        except BaseException:
            self.block_manager.step_done(written=False)  # the prefix blocks it was to write are not
            raise
        self._launched(plan, result.sampled)
        return outputs + self._process(result, on_first_outputs)

    def _step_overlapped(self, on_first_outputs: EmitOutputs | None) -> list[RequestOutput]:
        """Schedule and launch the next step, then read the one in flight while it runs. A step
        that samples a sequence whose sampling reads what its token in flight changes
        (``host_bound``: a grammar, penalties) has its forward launched first, and its sampling once
        the step in flight is read."""
        previous, self._inflight = self._inflight, None
        plan = self.scheduler.schedule()
        launched = sum(num for _, num in plan.scheduled)
        logits: StepLogits | None = None
        step: PendingStep | None = None
        if plan.scheduled:
            late = previous is not None and any(seq.num_pending and host_bound(seq) for seq, _ in plan.scheduled)
            self._prepare(plan)
            try:
                self.runner.copy_blocks(self.block_manager.take_copies())
                logits = self.runner.forward(plan.scheduled, feed=previous[0].feed() if previous is not None else None)
                step = None if late else self.runner.sample(logits)
            except BaseException:
                self.block_manager.step_done(written=False)
                self._inflight = previous  # still to read
                raise
        self.last_step_tokens = launched or (previous[1] if previous is not None else 0)
        self._timed_tokens = previous[1] if previous is not None else 0
        outputs = self._process(previous[0].result(), on_first_outputs) if previous is not None else []
        if logits is not None:
            try:
                if step is None:  # its sampling reads the tokens just processed
                    step = self.runner.sample(logits)
            except BaseException:
                self.block_manager.step_done(written=False)
                raise
            self._launched(plan, step.sampled)
            self._inflight = (step, launched)
        return outputs

    def _read_inflight(self) -> list[RequestOutput]:
        """Wait for the step in flight and process its tokens (none in flight: nothing)."""
        if self._inflight is None:
            return []
        step, _ = self._inflight
        self._inflight = None
        return self._process(step.result(), None)

    def _prepare(self, plan: SchedulerOutput) -> None:
        """Before the step runs: stamp the sequences it schedules first, count its prefill tokens and
        fork the sequences whose prompt it completes."""
        now = time.monotonic()
        prefilled = 0
        for seq, num in plan.scheduled:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            start = seq.num_computed_tokens
            prompt = len(seq.prompt_token_ids)
            if start < prompt:  # the step computes prompt tokens (a decode, most rows, computes none)
                prefilled += min(start + num, prompt) - start
            if seq.num_forks and start + num == seq.num_tokens:
                self._fork(seq, start + num)
        self.counts.prefill_tokens += prefilled

    def _launched(self, plan: SchedulerOutput, sampled: list[Sequence]) -> None:
        """The step is queued: its tokens count as computed and each sampled token as pending."""
        self.block_manager.step_done(written=True)
        for seq, num in plan.scheduled:
            seq.num_computed_tokens += num
            seq.forks = []
        for seq in sampled:
            seq.num_pending += 1

    def _process(self, result: StepResult, on_first_outputs: EmitOutputs | None) -> list[RequestOutput]:
        """Append a step's sampled tokens to their sequences and make the outputs. A sequence that
        ended since the step was launched (finished by the step before, or aborted) takes no token:
        under async scheduling it was computed only because the step was launched before the end
        was seen. With ``on_first_outputs``, the sequences of requests without a first token yet go
        first, all of a request's together (its n / best_of siblings sample their first tokens in
        the same step), and their outputs are handed to it before the others are appended."""
        if result.samples is None:
            return []
        # The moment the host has the step's tokens, before any is appended (detokenized) or made an
        # output: the end of a first token's prefill phase. Monotonic first: FirstTokenTimes.
        read, read_ns = time.monotonic(), time.time_ns()
        samples = result.samples
        rows: Iterable[tuple[int, Sequence]] = enumerate(result.sampled)
        if on_first_outputs is not None:
            first, rows = self._split_first(result.sampled)
            if first:
                early = self._append(first, samples, read, read_ns)
                if early:  # a best_of > n request shows nothing until it ends
                    on_first_outputs(early)
        return self._append(rows, samples, read, read_ns)

    def _split_first(self, sampled: list[Sequence]) -> tuple[list[tuple[int, Sequence]], list[tuple[int, Sequence]]]:
        """The step's rows of requests without a first token yet, and the others (ended ones too)."""
        first: list[tuple[int, Sequence]] = []
        rest: list[tuple[int, Sequence]] = []
        requests, finished = self._requests, SequenceStatus.FINISHED
        for row, seq in enumerate(sampled):
            if seq.status is not finished and requests[seq.request_id].first_token_times is None:
                first.append((row, seq))
            else:
                rest.append((row, seq))
        return first, rest

    def _append(self, rows: Iterable[tuple[int, Sequence]], samples: SampleResult, read: float,
                read_ns: int) -> list[RequestOutput]:
        """Append the tokens of ``rows`` (every sequence of a request the step sampled, with its
        row in ``samples``) and make their requests' outputs; ``read``/``read_ns``: when the
        step's tokens were read."""
        progressed: dict[str, RequestState] = {}
        # Once per sampled sequence each step: the lookups are hoisted and the count added once.
        append, requests, finished = self.outputs.append, self._requests, SequenceStatus.FINISHED
        appended = 0
        for row, seq in rows:
            seq.num_pending -= 1
            if seq.status is finished:
                continue
            append(seq, row, samples)
            appended += 1
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            progressed[seq.request_id] = requests[seq.request_id]
        self.counts.generation_tokens += appended
        outputs: list[RequestOutput] = []
        for state in progressed.values():
            if state.first_token_times is None:
                scheduled = state.first.first_scheduled
                assert scheduled is not None, "a token from a sequence no step scheduled"
                state.first_token_times = FirstTokenTimes(added_ns=state.added_ns, queue=scheduled - state.first.arrival_time,
                                                          prefill=read - scheduled, first_token_ns=read_ns)
            outputs += self._progress(state)
        return outputs

    def _fork(self, parent: Sequence, computed: int) -> None:
        """Start ``parent``'s sibling sequences in the step that completes its prompt: they hold its
        blocks (``computed`` tokens' worth, written by this step) and sample from its logits."""
        assert parent.num_output_tokens == 0, "a sequence forks before its first token"
        state = self._requests[parent.request_id]
        params = parent.sampling_params
        for index in range(1, parent.num_forks + 1):
            child = Sequence(
                request_id=parent.request_id,
                prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=params,
                detokenizer=IncrementalDetokenizer(self._decode, parent.prompt_token_ids, params.skip_special_tokens,
                                                  self._token_bytes),
                lora_request=parent.lora_request,
                adapter=self.lora_cache.share(parent.adapter) if parent.adapter and self.lora_cache else None,
                priority=parent.priority,
                arrival_time=parent.arrival_time,
                first_scheduled=parent.first_scheduled,
                generator=self._generator(params, index),
                num_computed_tokens=computed,
                guide=Guide(state.grammar) if state.grammar is not None else None,
                index=index,
                cache_salt=parent.cache_salt,  # its prefix-cache keys if it is preempted, and its tenant
            )
            child.prompt_logprobs = None  # the request's are its first sequence's, computed once
            self.block_manager.fork(parent, child)
            self.scheduler.adopt(child, parent)
            state.seqs.append(child)
            parent.forks.append(child)
        parent.num_forks = 0

    def _progress(self, state: RequestState) -> list[RequestOutput]:
        """The output of a request that sampled this step (none for an unfinished ``best_of > n``)."""
        for seq in state.seqs:  # a loop, not next() over a generator: every request that samples, every step
            if seq.error is not None:
                self._end(state, "error", seq.error)
                break
        if state.error is not None or state.finished:
            self._requests.pop(state.request_id, None)
        elif state.sampling_params.num_sequences > state.sampling_params.n:
            return []
        return [self.outputs.output(state)]

    def wait_for_loads(self, timeout: float) -> None:
        """Block until an adapter load or a grammar compilation finishes (or ``timeout``): for a
        caller with nothing to run."""
        if self._compiling:
            wait_futures(list(self._compiling.values()), timeout, FIRST_COMPLETED)
            return
        if self.lora_cache is not None:
            self.lora_cache.wait(timeout)

    def _fail_adapter_errors(self) -> list[RequestOutput]:
        if self.lora_cache is None:
            return []
        failed = dict(self.lora_cache.poll())
        outputs: list[RequestOutput] = []
        if not failed:
            return outputs
        for seq in self.scheduler.waiting():
            error = failed.get(seq.adapter) if seq.adapter is not None else None
            state = self._requests.pop(seq.request_id, None) if error is not None else None
            if state is not None:
                self._end(state, "error", error)
                outputs.append(self.outputs.output(state))
        return outputs

    # ---- adapters -------------------------------------------------------------------------

    def _loras(self) -> LoRACache:
        if self.lora_cache is None:
            raise AdapterError("LoRA is disabled on this engine (max_loras=0)")
        return self.lora_cache

    def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False, *,
                 background: bool = False) -> Future[CachedAdapter]:
        """Start loading an adapter under its name; the future resolves once it is in the CPU cache.
        ``background``: a prefetch's read, on the prefetch thread (``LoRACache.add``)."""
        return self._loras().add(lora_request, load_inplace=load_inplace, background=background)

    def prefetch_lora(self, lora_request: LoRARequest, *, to_gpu: bool,
                      keep: Collection[str] = ()) -> Future[Placement]:
        """Bring an adapter into the CPU cache and, with ``to_gpu``, into a slot that is empty or
        idle and holds none of the names in ``keep``; the future says where it ended
        (``LoRACache.prefetch``)."""
        return self._loras().prefetch(lora_request, to_gpu=to_gpu, keep=keep)

    def verify_slots(self) -> list[SlotRepair]:
        """Check every occupied GPU slot against the checksum taken when it was written; stop what
        ran on each that differs (``_stop_corrupted``) and start its repair (a re-read from storage,
        ``LoRACache.repair``). One device synchronisation: call it between steps, never from inside
        one. The requests stopped here end in the next ``step()``'s outputs."""
        if self.lora_cache is None or self.slot_checksums is None:
            return []
        # A requeue must see every token: one in flight would be prefilled before it is read.
        self._ended += self._read_inflight()
        placed = [(a.slot, a.row, a.rank) for a in self.lora_cache.landed() if a.slot is not None and a.row is not None]
        repairs = []
        for slot in self.slot_checksums.mismatched(placed):
            corrupted = self.lora_cache.slots()[slot]
            if corrupted is not None:  # KV its rows computed may be wrong: no later prompt reuses it
                self.block_manager.forget_adapter(corrupted.digest)
            stopped = self._stop_corrupted(slot)
            adapter = self.lora_cache.repair(slot)
            if adapter is not None:
                repairs.append(SlotRepair(slot=slot, digest=adapter.digest, names=tuple(sorted(adapter.names)),
                                          stopped=stopped))
        return repairs

    def _stop_corrupted(self, slot: int) -> int:
        """No sequence keeps running on a corrupted slot, so it can be emptied and refilled without a
        step reading it. One that has produced a token (running, or waiting after a preemption) ends
        with SlotCorruptedError: that output came from the bad weights and cannot be taken back. One
        that has produced nothing yet (its prefill under way) only loses KV entries computed with
        the bad weights: it is queued again and served whole once the slot is repaired. Returns
        the number stopped."""
        assert self.lora_cache is not None
        adapter = self.lora_cache.slots()[slot]
        bound = [seq for seq in self.scheduler.running if seq.lora_slot == slot]
        bound += [seq for seq in self.scheduler.waiting() if seq.adapter is not None and seq.adapter.adapter is adapter]
        ended_before = len(self._ended)
        for seq in bound:
            if seq.num_output_tokens == 0:
                if seq.status is SequenceStatus.RUNNING:
                    self.scheduler.requeue(seq)
                continue
            state = self._requests.pop(seq.request_id, None)
            if state is None:
                continue  # a sibling's failure already ended its request
            assert seq.adapter is not None
            self._end(state, "error", SlotCorruptedError(seq.adapter.name, slot))
            self._ended.append(self.outputs.output(state))
        return len(self._ended) - ended_before

    def _write_rows(self, slot: int, row: int, adapter: CachedAdapter) -> CopyDone | None:
        landed = self.runner.write_rows(slot, row, adapter)
        write_dora_scales(self.runner.lora_modules, slot, adapter)
        self.runner.write_vocab(slot, adapter)
        assert self.slot_checksums is not None
        self.slot_checksums.record(slot, content=self.runner.rows_checksum(adapter), scaling=adapter.scaling,
                                   rank=adapter.rank, row=row)  # fmt: skip
        return landed

    def remove_lora(self, name: str) -> None:
        """Unload ``name``; its slot and CPU copy are freed once its in-flight requests finish."""
        self._loras().remove(name)

    def list_loras(self, names: Collection[str] | None = None) -> list[LoRAInfo]:
        """The loaded adapters by name, or only ``names`` (those of them loaded, in their order):
        a caller about a few names (a prefetch call, a load's description) must not build an entry
        for every adapter on the engine thread, where its cost delays every request's next step
        (1,000 bound registry versions made each such call O(all) twice per prefetch phase)."""
        return [] if self.lora_cache is None else lora_infos(self.lora_cache, names)

    def stats(self) -> EngineStats:
        return engine_stats(scheduler=self.scheduler, blocks=self.block_manager, runner=self.runner, config=self.config,
                            lora_cache=self.lora_cache, checksums=self.slot_checksums, counts=self.counts,
                            adapters=tuple(self.list_loras()))

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self.lora_cache is not None:
            self.lora_cache.shutdown()
        self.runner.shutdown()
