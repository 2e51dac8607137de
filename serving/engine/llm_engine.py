"""The synchronous engine core: requests in, one step at a time, outputs out.

``step()`` takes in finished grammar compilations and adapter loads, asks the scheduler for the step's work, runs it on the
model runner, and turns the sampled tokens into outputs (detokenizing, checking stop conditions,
freeing what finished). ``LLM`` drives it in a loop; ``AsyncEngine`` drives it from a background
thread. It is not thread-safe: one thread calls everything (``encode`` aside).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.detokenizer import IncrementalDetokenizer, fast_decode, find_stop
from serving.engine.guided import GrammarCompiler, Guide
from serving.engine.lora.cache import LoRACache, Placement
from serving.engine.lora.integrity import SlotChecksums, SlotCorruptedError
from serving.engine.lora.reader import AdapterError
from serving.engine.lora.records import AdapterHandle, CachedAdapter, CopyDone
from serving.engine.lora.request import LoRARequest
from serving.engine.model_runner import ModelRunner
from serving.engine.outputs import CompletionOutput, Logprob, RequestOutput
from serving.engine.sampler import SampleResult
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.engine.sequence import Sequence, SequenceStatus
from serving.engine.stats import EngineStats, LoRAInfo, SlotRepair

PromptType = str | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig, *, on_load_done: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.hf_config = AutoConfig.from_pretrained(config.model)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model)
        self._decode = fast_decode(self.tokenizer)
        context = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or None
        if config.max_model_len is not None and context is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {context} tokens")
        self.max_model_len = config.max_model_len or context or 4096
        self.model_name = config.base_model_name or Path(config.model).resolve().name
        self.eos_token_ids = self._eos_token_ids()
        self.runner = ModelRunner(config, self.hf_config, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size)
        self.lora_cache: LoRACache | None = None
        self.slot_checksums: SlotChecksums | None = None
        memory = self.runner.memory
        if memory.lora_rows > 0:
            runner = self.runner
            self.slot_checksums = SlotChecksums(runner.lora_pools(), runner.lora_scaling, runner.lora_ranks,
                                                runner.lora_rows)
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
            )
        self.scheduler = Scheduler(config, self.block_manager, self.lora_cache)
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size=self.hf_config.vocab_size,
                                        stop_token_ids=self.eos_token_ids, on_done=on_load_done)
        self._requests: dict[str, Sequence] = {}
        # Constrained requests whose grammar is being compiled (off the step, on the compiler's
        # thread): scheduled once it is done, as a request waits for its adapter's load.
        self._compiling: dict[str, tuple[Sequence, Future[Any]]] = {}
        # Requests ended between steps (verify_slots), handed out by the next step with its own outputs.
        self._ended: list[RequestOutput] = []
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.last_step_tokens = 0

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        candidates: list[Any] = [getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id]
        try:
            candidates.append(GenerationConfig.from_pretrained(self.config.model).eos_token_id)
        except OSError:
            pass  # no generation_config.json: the config's and tokenizer's EOS are all there is
        for value in candidates:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return frozenset(ids)

    # ---- requests -------------------------------------------------------------------------

    def encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(prompt text or None, token ids)`` of a string or ``{"prompt_token_ids": [...]}``."""
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], list(self.tokenizer(prompt["prompt"]).input_ids)
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'), got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Reject a prompt the engine cannot serve, with the reason."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.hf_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens; the context is {self.max_model_len}, "
                "which leaves no room for a completion"
            )

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
        adapter: AdapterHandle | None = None
        if lora_request is not None:
            if self.lora_cache is None:
                raise AdapterError("LoRA is disabled on this engine (max_loras=0)")
            adapter = self.lora_cache.resolve(lora_request)
        generator = None
        if sampling_params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(sampling_params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            sampling_params=sampling_params,
            detokenizer=IncrementalDetokenizer(self._decode, token_ids, sampling_params.skip_special_tokens),
            lora_request=lora_request,
            adapter=adapter,
            priority=priority,
            generator=generator,
        )
        guided = sampling_params.guided_decoding
        if guided is not None:
            grammar = self.grammars.compile(guided)
            if grammar.done():
                seq.guide = Guide(grammar.result())  # a cached grammar, or its error raised here
            else:
                self._requests[request_id] = seq
                self._compiling[request_id] = (seq, grammar)
                return
        self._requests[request_id] = seq
        self._prompt_tokens += len(token_ids)
        self.scheduler.add(seq)

    def _take_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is compiled; fail those whose grammar failed."""
        outputs: list[RequestOutput] = []
        for request_id, (seq, grammar) in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[request_id]
            error = grammar.exception()
            if error is None:
                seq.guide = Guide(grammar.result())
                self._prompt_tokens += seq.num_prompt_tokens
                self.scheduler.add(seq)
                continue
            seq.error = error if isinstance(error, Exception) else RuntimeError(repr(error))
            seq.finish_reason = "error"
            self._requests.pop(request_id, None)
            self._drop_unscheduled(seq)
            outputs.append(self._output(seq))
        return outputs

    def _drop_unscheduled(self, seq: Sequence) -> None:
        """End a request the scheduler never took (its grammar was compiling): only its adapter
        reference is held."""
        seq.status = SequenceStatus.FINISHED
        if seq.adapter is not None and self.lora_cache is not None:
            self.lora_cache.release(seq.adapter)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks and adapter refs; None if unknown or done."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        if self._compiling.pop(request_id, None) is not None:
            self._drop_unscheduled(seq)
        else:
            self.scheduler.finish(seq)
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that progressed or ended."""
        outputs, self._ended = self._ended, []
        if self._compiling:
            outputs += self._take_compiled()
        outputs += self._fail_adapter_errors()
        plan = self.scheduler.schedule()
        self.last_step_tokens = sum(num for _, num in plan.scheduled)
        if not plan.scheduled:
            return outputs
        result = self.runner.execute(plan.scheduled)
        for seq, num in plan.scheduled:
            seq.num_computed_tokens += num
        if result.samples is not None:
            for row, seq in enumerate(result.sampled):
                self._append_token(seq, row, result.samples)
                if seq.finish_reason is not None:
                    self._requests.pop(seq.request_id, None)
                    self.scheduler.finish(seq)
                outputs.append(self._output(seq))
        return outputs

    def wait_for_loads(self, timeout: float) -> None:
        """Block until an adapter load or a grammar compilation finishes (or ``timeout``): for a
        caller with nothing to run."""
        if self._compiling:
            wait_futures([grammar for _, grammar in self._compiling.values()], timeout, FIRST_COMPLETED)
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
            if error is not None:
                seq.error = error
                seq.finish_reason = "error"
                self._requests.pop(seq.request_id, None)
                self.scheduler.finish(seq)
                outputs.append(self._output(seq))
        return outputs

    def _append_token(self, seq: Sequence, row: int, samples: SampleResult) -> None:
        token = samples.token_ids[row]
        params = seq.sampling_params
        assert params.stop_token_ids is not None  # SamplingParams.__post_init__ makes it a list
        seq.token_ids.append(token)
        self._generation_tokens += 1
        if seq.guide is not None and not seq.guide.accept(token):
            # The mask allows only what the grammar accepts: a refused token is an engine bug.
            seq.error = RuntimeError(f"token {token} was sampled outside the request's grammar")
            seq.finish_reason = "error"
            return
        if seq.logprobs is not None and samples.logprobs is not None:
            self._record_logprobs(seq, row, token, samples)
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None
            if params.detokenize:
                seq.output_text += seq.detokenizer.flush()
            return
        delta = seq.detokenizer.add(token) if params.detokenize else ""
        if delta:
            seq.output_text += delta
            if params.stop_strings:
                found = find_stop(seq.output_text, len(delta), params.stop_strings)
                if found is not None:
                    index, stop = found
                    seq.output_text = seq.output_text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
            if params.detokenize:
                seq.output_text += seq.detokenizer.flush()

    def _record_logprobs(self, seq: Sequence, row: int, token: int, samples: SampleResult) -> None:
        assert seq.logprobs is not None and samples.logprobs is not None
        assert samples.ranks is not None and samples.top_ids is not None and samples.top_logprobs is not None
        num_top = seq.sampling_params.logprobs or 0
        detokenize = seq.sampling_params.detokenize

        def text(tid: int) -> str | None:
            return self._decode([tid], False) if detokenize else None

        entry = {token: Logprob(samples.logprobs[row], samples.ranks[row], text(token))}
        for rank, (tid, lp) in enumerate(zip(samples.top_ids[row][:num_top], samples.top_logprobs[row][:num_top]), 1):
            entry.setdefault(tid, Logprob(lp, rank, text(tid)))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += samples.logprobs[row]

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.finish_reason is not None
        text = seq.output_text
        stops = seq.sampling_params.stop_strings
        if not finished and stops:
            # Hold back what could be the start of a stop string, so a streamed text never shows
            # characters the final text cuts: every streamed text is a prefix of the final one.
            hold = max(len(s) for s in stops) - 1
            text = text[: max(0, len(text) - hold)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            lora_request=seq.lora_request,
            error=seq.error,
        )

    # ---- adapters -------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False, *,
                 background: bool = False) -> Future[CachedAdapter]:
        """Start loading an adapter under its name; the future resolves once it is in the CPU cache.
        ``background``: a prefetch's read, on the prefetch thread (``LoRACache.add``)."""
        if self.lora_cache is None:
            raise AdapterError("LoRA is disabled on this engine (max_loras=0)")
        return self.lora_cache.add(lora_request, load_inplace=load_inplace, background=background)

    def prefetch_lora(self, lora_request: LoRARequest, *, to_gpu: bool,
                      keep: Collection[str] = ()) -> Future[Placement]:
        """Bring an adapter into the CPU cache and, with ``to_gpu``, into a slot that is empty or
        idle and holds none of the names in ``keep``; the future says where it ended
        (``LoRACache.prefetch``)."""
        if self.lora_cache is None:
            raise AdapterError("LoRA is disabled on this engine (max_loras=0)")
        return self.lora_cache.prefetch(lora_request, to_gpu=to_gpu, keep=keep)

    def verify_slots(self) -> list[SlotRepair]:
        """Check every occupied GPU slot against the checksum taken when it was written; stop what
        ran on each that differs (``_stop_corrupted``) and start its repair (a re-read from storage,
        ``LoRACache.repair``). One device synchronisation: call it between steps, never from inside
        one. The requests stopped here end in the next ``step()``'s outputs."""
        if self.lora_cache is None or self.slot_checksums is None:
            return []
        placed = [(a.slot, a.row, a.rank) for a in self.lora_cache.landed() if a.slot is not None and a.row is not None]
        repairs = []
        for slot in self.slot_checksums.mismatched(placed):
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
            assert seq.adapter is not None
            seq.error = SlotCorruptedError(seq.adapter.name, slot)
            seq.finish_reason = "error"
            self._requests.pop(seq.request_id, None)
            self.scheduler.finish(seq)
            self._ended.append(self._output(seq))
        return len(self._ended) - ended_before

    def _write_rows(self, slot: int, row: int, adapter: CachedAdapter) -> CopyDone | None:
        landed = self.runner.write_rows(slot, row, adapter)
        assert self.slot_checksums is not None
        self.slot_checksums.record(slot, content=adapter.checksum, scaling=adapter.scaling, rank=adapter.rank, row=row)
        return landed

    def remove_lora(self, name: str) -> None:
        """Unload ``name``; its slot and CPU copy are freed once its in-flight requests finish."""
        if self.lora_cache is None:
            raise AdapterError("LoRA is disabled on this engine (max_loras=0)")
        self.lora_cache.remove(name)

    def list_loras(self, names: Collection[str] | None = None) -> list[LoRAInfo]:
        """The loaded adapters by name, or only ``names`` (those of them loaded, in their order):
        a caller about a few names (a prefetch call, a load's description) must not build an entry
        for every adapter on the engine thread, where its cost delays every request's next step
        (1,000 bound registry versions made each such call O(all) twice per prefetch phase)."""
        if self.lora_cache is None:
            return []
        cache = self.lora_cache
        if names is None:
            pairs = sorted(cache.named().items())
        else:
            pairs = [(name, a) for name in names if (a := cache.get(name)) is not None]
        return [
            LoRAInfo(
                name=name,
                path=a.path,
                digest=a.digest,
                rank=a.rank,
                lora_alpha=a.lora_alpha,
                target_modules=a.target_modules,
                gpu_slot=a.slot,
                gpu_row=a.row,
                in_cpu_cache=a.weights is not None,
                active_requests=a.refs,
                load_seconds=a.load_seconds,
            )
            for name, a in pairs
        ]

    def stats(self) -> EngineStats:
        cache = self.lora_cache
        lora = cache.stats if cache is not None else None
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_usage=self.block_manager.usage,
            num_preemptions=self.scheduler.stats.num_preemptions,
            peak_waiting=self.scheduler.stats.peak_waiting,
            steps=self.scheduler.step_count,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            max_loras=self.runner.memory.lora_slots,
            max_cpu_loras=self.config.max_cpu_loras or 0,
            adapters_loading=cache.num_loading if cache is not None else 0,
            adapter_loads=lora.loads if lora else 0,
            adapter_load_failures=lora.load_failures if lora else 0,
            adapter_load_seconds_total=lora.load_seconds_total if lora else 0.0,
            adapter_last_load_seconds=lora.last_load_seconds if lora else 0.0,
            slot_loads=lora.slot_loads if lora else 0,
            slot_evictions=lora.slot_evictions if lora else 0,
            cpu_evictions=lora.cpu_evictions if lora else 0,
            slot_waits=self.scheduler.stats.slot_waits,
            slot_hits=lora.slot_hits if lora else 0,
            slot_misses=lora.slot_misses if lora else 0,
            lora_rows_total=self.runner.memory.lora_rows,
            lora_rows_used=lora.rows_used if lora else 0,
            lora_row_bytes=self.runner.lora_row_bytes,
            lora_bytes_loaded=lora.bytes_loaded if lora else 0,
            fill_waits=self.scheduler.stats.fill_waits,
            cpu_cache_bytes=self.runner.memory.cpu_cache_bytes,
            cpu_cache_bytes_used=lora.cpu_bytes if lora else 0,
            adapter_load_stalls=lora.load_stalls if lora else 0,
            slot_checks=self.slot_checksums.checks if self.slot_checksums is not None else 0,
            slot_corruptions=self.slot_checksums.mismatches if self.slot_checksums is not None else 0,
            slot_repairs=lora.slot_repairs if lora else 0,
            gpu_slots=tuple(_label(a) for a in cache.slots()) if cache is not None else (),
            cpu_cached=tuple(_label(a) or a.digest for a in cache.cpu_resident()) if cache is not None else (),
            adapters=tuple(self.list_loras()),
        )

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self.lora_cache is not None:
            self.lora_cache.shutdown()


def _label(adapter: CachedAdapter | None) -> str | None:
    """An adapter's name for metrics (its first name, else its digest), None for an empty slot."""
    if adapter is None:
        return None
    return min(adapter.names) if adapter.names else adapter.digest[:12]
