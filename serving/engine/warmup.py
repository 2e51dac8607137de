"""The worker's warm-up: before it says it is ready, run every kind of step the scheduler can
produce, so the first requests after a start find nothing to compile, capture or load.

Capturing the CUDA graphs at start (serving.engine.decode_graphs) compiles the flat forward of each
captured token count, but a serving step reaches much that the capture never runs: the sampler's
branches (temperature, top-k/top-p, seeded draws, penalties, ``logit_bias`` and ``min_tokens``,
logprobs, ``n``/``best_of`` forks, a grammar's mask and the grammar compiler's first
tokenizer setup), the eager path of prompt logprobs and of steps past the flat size, the adapters'
first copies into GPU slots, the host allocator's pinned buffers of each batch size, and, with
``enforce_eager`` or on a CPU, every shape's kernels. On the H100 the first rate after a start had a
TTFT p50 of 1,929 ms against ~48 ms warm (issue 38).

``warm_up`` drives the engine itself, on its own thread, with real requests in four phases (each
run to completion before the next), so each step goes the way traffic's would:

1. the decode ladder: ``max_num_seqs`` short prompts whose ``i``-th asks for ``i + 1`` tokens, every
   one with an adapter named at launch or the base in turn: the running batch shrinks by one each
   step, so every decode batch size (every captured bucket up to ``max_num_seqs``) runs, with
   mixed adapters in it, and the adapters end resident in GPU slots where the pool holds them;
2. prefill chunks: one prompt at a time of each length in ``prefill_lengths`` (base, then with the
   first adapter): every captured graph size (a lone prompt of ``n`` tokens is a flat step of ``n``
   tokens, so each graph, with LoRA and without, is replayed once: the ladder's are all LoRA steps
   where adapters are named, and a serving step of decodes and prompt chunks lands on any size up
   to the budget), powers of two, the budget, and a prompt longer than the budget (two chunks);
3. mixed steps, as a backlog makes them: ``2 × max_num_seqs`` requests at once, every adapter
   named at launch and the base in turn, prompts around an eighth of the budget and up to 16 tokens
   out, so the scheduler packs full-budget steps of decodes and several prompts' chunks with many
   adapters in each (the LoRA kernels' many-segment launches, the block allocator and the
   sampler at a full batch);
4. the sampler's paths (``SAMPLER_PATHS``), all in one batch, half with an adapter.

Each warm-up prompt carries a cache salt of its own, so the prefix cache never shortens a prefill
the phase means to run whole. What ran is observed, not assumed: the runner records the shape of
every step (``ModelRunner.shape_log``: layout, token count, LoRA or not) and the report carries that
set, with the sampler paths of the requests that finished, the mixed steps seen (phase 3) and the
adapters left resident. After it, the runner names each step that runs kernels the warm-up did not
(``ModelRunner.cold_kernels``: a WARNING line and loraplex_engine_cold_step_seconds).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from serving.engine.guided import GuidedDecodingParams
from serving.engine.llm_engine import LLMEngine
from serving.engine.lora.request import LoRARequest
from serving.engine.model_runner import StepShape
from serving.engine.sampling_params import SamplingParams

# The sampler's paths and one request's parameters that take each (serving.engine.sampler,
# serving.engine.penalties): every branch a serving request can reach.
SAMPLER_PATHS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    "random": SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=4, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True),
    "penalties": SamplingParams(temperature=0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                                max_tokens=4, ignore_eos=True),
    "bias_min_tokens": SamplingParams(temperature=0, logit_bias={1: 1.0}, min_tokens=2, max_tokens=4),
    "logprobs": SamplingParams(temperature=0, logprobs=5, max_tokens=4, ignore_eos=True),
    "chosen_logprob": SamplingParams(temperature=0, logprobs=0, max_tokens=4, ignore_eos=True),
    "prompt_logprobs": SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=4, ignore_eos=True),
    "n": SamplingParams(n=2, temperature=0.8, max_tokens=4, ignore_eos=True),
    "best_of": SamplingParams(n=1, best_of=2, temperature=0.8, max_tokens=4, ignore_eos=True),
    "guided": SamplingParams(temperature=0, max_tokens=4, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
}

# Short prompts (decode ladder, sampler paths): long enough for penalties and prompt logprobs to
# have tokens to read.
_SHORT_PROMPT = 8
# The first token id the prompts use (past the special tokens of the models served).
_FIRST_ID = 300
# How long the warm-up waits for an adapter load or a grammar compile between steps with nothing to run.
_IDLE_WAIT_S = 0.05
# Phase 3's most output tokens: its requests finish over a spread of steps, as traffic's do.
_MIXED_MAX_TOKENS = 16


@dataclass(frozen=True)
class WarmRequest:
    """One warm-up request: ``prompt_len`` token ids, its parameters, and its adapter (None: base)."""

    prompt_len: int
    params: SamplingParams
    adapter: str | None
    path: str = ""  # the sampler path it takes (phase 3), for the report


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran: every step's shape (``StepShape``), the sampler paths of the requests
    that finished, the mixed steps (a step's outputs: decodes and first tokens both) and
    the most adapters (the base counting as one) in one of them, the adapters named at launch left
    in a GPU slot and those not (more than the pool holds), and its size and time."""

    shapes: frozenset[StepShape]
    sampler_paths: frozenset[str]
    mixed_steps: int
    mixed_adapters: int
    resident: tuple[str, ...]
    not_resident: tuple[str, ...]
    requests: int
    steps: int  # those that ran tokens (not the waits for a load or a compile)
    seconds: float

    def summary(self) -> str:
        """One log line."""
        layouts = sorted({s.layout for s in self.shapes})
        counts = ", ".join(f"{sum(s.layout == layout for s in self.shapes)} {layout}" for layout in layouts)
        return (f"warm-up: {self.requests} requests, {self.steps} steps in {self.seconds:.1f}s; step shapes: "
                f"{counts or 'none'}; sampler paths: {len(self.sampler_paths)}/{len(SAMPLER_PATHS)}; mixed steps "
                f"{self.mixed_steps} (up to {self.mixed_adapters} adapters in one); adapters resident "
                f"{len(self.resident)}, not {len(self.not_resident)}")


def prefill_lengths(budget: int, max_prompt: int, graph_sizes: Iterable[int] = ()) -> list[int]:
    """The prompt lengths phase 2 prefills: every captured graph size within the budget, powers of
    two from 16 up to the step budget, the budget itself, and 1.5 × the budget (two chunks), each at
    most ``max_prompt``."""
    lengths = {n for n in (2**k for k in range(4, 32)) if n <= budget} | {budget, budget + budget // 2}
    lengths |= {n for n in graph_sizes if n <= budget}
    return sorted(n for n in lengths if 1 <= n <= max_prompt)


def mixed_requests(count: int, budget: int, max_prompt: int, turns: Sequence[str | None]) -> list[WarmRequest]:
    """Phase 3: ``count`` requests, adapters from ``turns`` in turn, prompts of budget/16 to
    3 × budget/16 tokens (uneven: their chunks end anywhere in a step) and 1 to
    ``_MIXED_MAX_TOKENS`` tokens out, each fitting the context (``max_prompt`` + 2 tokens)."""
    low, spread = max(1, budget // 16), max(1, budget // 8)
    requests = []
    for i in range(count):
        prompt = max(1, min(low + (i * 37) % spread, max_prompt - _MIXED_MAX_TOKENS))
        out = max(1, min(1 + i % _MIXED_MAX_TOKENS, max_prompt - prompt))
        requests.append(WarmRequest(prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                                    turns[i % len(turns)]))
    return requests


def warmup_phases(engine: LLMEngine, adapters: Sequence[str]) -> list[list[WarmRequest]]:
    """The four phases' requests for this engine's settings (module docstring)."""
    config = engine.config
    # A request's prompt plus its output must fit the context.
    max_prompt = engine.max_model_len - 2
    turns: list[str | None] = [*adapters, None]
    ladder = [
        WarmRequest(_SHORT_PROMPT, SamplingParams(temperature=0, max_tokens=max(1, min(i + 1, max_prompt - _SHORT_PROMPT)),
                                                  ignore_eos=True), turns[i % len(turns)])
        for i in range(config.max_num_seqs)
    ]
    prefills = [
        [WarmRequest(length, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), adapter)]
        for length in prefill_lengths(config.max_num_batched_tokens, max_prompt, config.graph_sizes())
        for adapter in (None, *adapters[:1])
    ]
    # Twice the running batch's room: the scheduler admits the rest as the first finish, decoding
    # a full batch while it prefills, as under a backlog.
    mixed = mixed_requests(max(2 * config.max_num_seqs, len(turns)), config.max_num_batched_tokens, max_prompt, turns)
    # Without xgrammar installed (a GPU machine given only the engine's wheels) no guided request can
    # be served at all, and the rest must still warm: the report then lacks the "guided" path.
    grammars = importlib.util.find_spec("xgrammar") is not None
    paths = [WarmRequest(_SHORT_PROMPT, params, adapters[i % len(adapters)] if adapters and i % 2 else None, name)
             for i, (name, params) in enumerate(SAMPLER_PATHS.items()) if grammars or name != "guided"]
    return [ladder, *prefills, mixed, paths]


def warm_up(engine: LLMEngine, adapters: Iterable[str] = ()) -> WarmupReport:
    """Run the warm-up on ``engine`` (which must have no requests: the warm-up reads every output
    of the steps it runs) with the adapters named at launch, already loaded under those names.
    Raises RuntimeError naming the request when one of its requests fails."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the warm-up runs before any traffic: the engine already has requests")
    names = list(dict.fromkeys(adapters))
    start = time.perf_counter()
    runner = engine.runner
    shapes: set[StepShape] = set()
    runner.shape_log = shapes
    paths: set[str] = set()
    steps = requests = mixed_steps = mixed_adapters = 0
    answered: set[str] = set()  # requests that have had a token (their next ones are decodes)
    vocab = engine.hf_config.vocab_size
    try:
        for phase in warmup_phases(engine, names):
            outstanding: dict[str, WarmRequest] = {}
            for request in phase:
                request_id = f"warmup-{requests}"
                requests += 1
                # Distinct token ids per request, and a salt of its own: the prefix cache holds none of it.
                ids = [_FIRST_ID + (requests * 7 + k) % max(1, vocab - _FIRST_ID) for k in range(request.prompt_len)]
                lora = LoRARequest(request.adapter) if request.adapter is not None else None
                engine.add_request(request_id, {"prompt_token_ids": ids, "cache_salt": request_id}, request.params, lora)
                outstanding[request_id] = request
            while outstanding:
                outputs = engine.step()
                steps += engine.last_step_tokens > 0
                # A step that decoded some requests and gave others their first token is a mixed one.
                sampled = [o.request_id for o in outputs if any(c.token_ids for c in o.outputs)]
                firsts = [r for r in sampled if r not in answered]
                decodes = [r for r in sampled if r in answered]
                if decodes and firsts:
                    mixed_steps += 1
                    mixed_adapters = max(mixed_adapters, len({outstanding[r].adapter for r in firsts + decodes
                                                              if r in outstanding}))
                answered.update(firsts)
                for output in outputs:
                    if output.error is not None:
                        raise RuntimeError(f"warm-up request {output.request_id} failed: {output.error!r}") from output.error
                    if output.finished:
                        done = outstanding.pop(output.request_id)
                        if done.path:
                            paths.add(done.path)
                if outstanding and engine.last_step_tokens == 0:
                    engine.wait_for_loads(_IDLE_WAIT_S)  # an adapter load or a grammar compile
    finally:
        runner.shape_log = None
    # From now on a step whose kernels were not run here counts as cold (EngineStats.cold_step_shapes).
    runner.warm_kernels = frozenset(shape.kernels() for shape in shapes)
    runner.cold_kernels.clear()
    on_gpu = {info.name for info in engine.list_loras(names) if info.gpu_slot is not None}
    return WarmupReport(
        shapes=frozenset(shapes),
        sampler_paths=frozenset(paths),
        mixed_steps=mixed_steps,
        mixed_adapters=mixed_adapters,
        resident=tuple(n for n in names if n in on_gpu),
        not_resident=tuple(n for n in names if n not in on_gpu),
        requests=requests,
        steps=steps,
        seconds=time.perf_counter() - start,
    )
