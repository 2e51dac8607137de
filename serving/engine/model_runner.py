"""Runs the model: loads the base weights once, owns the KV cache and the LoRA slot tensors, and
executes one scheduled step (inputs → per-step context → forward → sampled tokens).

The step's host-side preparation (token ids, positions, cache slots, block tables, each token's
adapter slot) happens before the forward; the forward itself reads only device tensors from the
context, so no host synchronisation happens inside it. A pure-decode step, and with the Triton
attention backend any step of at most ``max_flat_tokens`` tokens, runs *flat*
(``serving.engine.decode_graphs``): every token a row of one paged-attention launch, prompt chunks
included, so on CUDA the whole forward replays a captured graph unless ``enforce_eager`` (and runs
the same kernels eagerly otherwise). Longer steps run eagerly with each prompt chunk in SDPA.

A step is queued in two parts: ``forward`` (the logits of the rows that sample, ``StepLogits``)
and ``sample`` (the tokens, whose copy to the host starts without waiting: ``PendingStep``);
``launch`` queues both, ``execute`` is a launch read at once. Under async scheduling the engine
queues the next step with the one in flight's samples as its ``feed``, and samples a step whose
sampling reads host state (a grammar, penalties) only once the step before is read
(serving.engine.async_scheduling).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from kernels import LoRAMeta
from serving.engine.async_scheduling import Feed, FedRows, device_tensor, to_device
from serving.engine.config import EngineConfig
from serving.engine.context import PrefillSpan, StepContext, reset_context, set_context
from serving.engine.decode_graphs import ADAPTER, IDS, POS, DecodeGraphs, FlatStep, flat_context, flat_step, host_tensor
from serving.engine.distributed.parallel import SINGLE, TensorParallel
from serving.engine.layers.lora_linear import MultiLoRALinear, quantize_fp8
from serving.engine.layers.parallel_linear import VocabParallelEmbedding
from serving.engine.layers.vocab_lora import VocabAdapters
from serving.engine.lora.flex import pool_views, row_elements
from serving.engine.lora.integrity import raw_sum
from serving.engine.lora.records import CachedAdapter, CopyDone
from serving.engine.memory_plan import borrow_plan, plan_memory
from serving.engine.models import build_model
from serving.engine.outputs import Logprob
from serving.engine.sampler import DeviceSamples, SampleResult, Sampler
from serving.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShape:
    """What decides the kernels a step runs: its layout (``"graph"``: a captured flat step replayed,
    ``tokens`` its captured size; ``"flat"``: a flat step run eagerly; ``"eager"``: prompt chunks in
    SDPA), its token count, and whether the LoRA kernels run in it."""

    layout: str
    tokens: int
    lora: bool

    def kernels(self) -> tuple[str, int, bool]:
        """What picks the compiled kernels of a step of this shape: a graph is its own (one per
        size); an uncaptured step launches the same kernels at any token count, save that Triton
        specialises an integer argument on being 1 or a multiple of 16 (0: neither)."""
        if self.layout == "graph":
            return (self.layout, self.tokens, self.lora)
        return (self.layout, 1 if self.tokens == 1 else 16 if self.tokens % 16 == 0 else 0, self.lora)


@dataclass(frozen=True)
class ColdStep:
    """The first step after the warm-up to run kernels (``StepShape.kernels``) that it never ran:
    those kernels, the step's own token count, and its seconds from its inputs' preparation to the
    end of its forward on the device (the one step of each such key waits for the device, so that a
    GPU run shows which shapes cost what: loraplex_engine_cold_step_seconds)."""

    kernels: tuple[str, int, bool]
    tokens: int
    seconds: float


@dataclass
class StepResult:
    """The sequences that produced a token this step (their prompt is complete), in row order."""

    sampled: list[Sequence]
    samples: SampleResult | None


@dataclass
class StepLogits:
    """A queued forward: the sequences that sample in it (row order; siblings forked in this step
    after the sequence they fork from, on its row) and the logits of those rows, on the device."""

    sampled: list[Sequence]
    logits: torch.Tensor | None


@dataclass
class PendingStep:
    """A launched step: the sequences that sample in it (row order) and their samples, on the
    device (their copy to the host under way) until ``result`` reads them."""

    sampled: list[Sequence]
    samples: DeviceSamples | None

    def feed(self) -> Feed | None:
        """Where the next step's decode rows of these sequences take their token ids."""
        return Feed.of(self.sampled, self.samples.tokens) if self.samples is not None else None

    def result(self) -> StepResult:
        """The samples on the host (waits for their copy)."""
        return StepResult(self.sampled, self.samples.host() if self.samples is not None else None)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int,
                 eos_token_ids: Collection[int] = (), *, tp: TensorParallel = SINGLE) -> None:
        """``tp``: this process's rank of a tensor-parallel engine (its shard of the model, and it
        samples only as rank 0); ``serving.engine.distributed`` makes the group."""
        self.config = config
        self.tp = tp
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.model = build_model(hf_config, max_positions=max_model_len, device=self.device, dtype=self.dtype, tp=tp)
        with torch.no_grad():
            if config.load_format == "dummy":
                self._init_dummy_weights(config.seed)
            else:
                self.model.load_weights(_read_safetensors(Path(config.model)))
            if config.quantization == "fp8":
                # Before the memory plan measures what is free: it sizes the KV cache by the smaller weights.
                quantize_fp8(self.model.lora_layers())
        attn = self.model.attention_layers()
        kv_block_bytes = 2 * len(attn) * self.block_size * attn[0].num_kv_heads * attn[0].head_dim * self.dtype.itemsize
        self.lora_row_bytes = sum(layer.row_elements for layer in self.model.lora_layers()) * self.dtype.itemsize
        # DoRA's scale tables, allocated with the row pools (before the graphs are captured) and charged with them.
        dora_row_bytes = (sum(layer.dora_row_elements for layer in self.model.lora_layers()) * self.dtype.itemsize
                          if config.serves_dora else 0)
        budget = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Every rank plans alike (rank 0's block and row numbers hold on all), to the tightest device.
            budget = tp.all_reduce_min(int(total * config.gpu_memory_utilization - (total - free)))
        self.memory = plan_memory(config, kv_block_bytes=kv_block_bytes, lora_row_bytes=self.lora_row_bytes,
                                  max_model_len=max_model_len, budget=budget, dora_row_bytes=dora_row_bytes)
        if config.borrow_kv_memory:
            a_elements, b_elements = row_elements(self.model.lora_layers())
            self.memory = borrow_plan(self.memory, config, a_elements=a_elements, b_elements=b_elements,
                                      block_elements=self.block_size * attn[0].num_kv_heads * attn[0].head_dim,
                                      max_model_len=max_model_len, kv_block_bytes=kv_block_bytes,
                                      lora_row_bytes=self.lora_row_bytes, dora_row_bytes=dora_row_bytes,
                                      on_cuda=budget is not None)
        # Where the adapter pools are views into the KV cache (borrow_kv_memory): the region they share.
        self.flex = self.memory.flex
        self.lora_modules: dict[tuple[int, str], MultiLoRALinear] = {}
        self.lora_meta: LoRAMeta | None = None
        # Adapter copies run here, so the batch keeps decoding while they land (CUDA only).
        self._copy_stream = (
            torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]
        )
        # The flex region's pools are views into the KV cache, so it is allocated first there.
        if self.flex is not None:
            self.num_kv_blocks = self._allocate_kv_cache(self.memory.num_kv_blocks)
        if self.memory.lora_rows > 0:
            self._init_lora(config)
        if self.flex is None:
            self.num_kv_blocks = self._allocate_kv_cache(self.memory.num_kv_blocks)
        self.sampler = Sampler(self.device, eos_token_ids)
        # Read at each step, so a benchmark can compare backends and eager/graphs in one process.
        self.attention = config.attention
        self.enforce_eager = config.enforce_eager
        self.max_flat_tokens = config.max_flat_tokens
        # The warm-up's record (serving.engine.warmup): while it runs, every step's shape is added to
        # ``shape_log``; once it is over, ``warm_kernels`` holds the kernels (``StepShape.kernels``)
        # it ran and the first step to run each other one lands in ``cold_kernels`` (what the
        # warm-up missed: loraplex_engine_cold_step_shapes and _seconds, one WARNING line each).
        self.shape_log: set[StepShape] | None = None
        self.warm_kernels: frozenset[tuple[str, int, bool]] | None = None
        self.cold_kernels: dict[tuple[str, int, bool], ColdStep] = {}
        # Engine steps slower than LLMEngine's SLOW_STEP_S since the warm-up (counted by the engine).
        self.slow_steps = 0
        self.graphs: DecodeGraphs | None = None
        sizes = config.graph_sizes()
        if sizes:
            self.graphs = DecodeGraphs(
                sizes=sizes,
                max_seqs=config.max_num_seqs,
                forward=self._forward_sampled,
                lora_meta=self.lora_meta,
                block_size=self.block_size,
                max_blocks_per_seq=-(-max_model_len // self.block_size),
                scratch_block=self.num_kv_blocks,
                attention=self.attention,
                splits_for=lambda size: self._decode_splits(size, max_model_len),
                device=self.device,
            )
            with torch.inference_mode():
                self.graphs.capture()

    # ---- set-up ---------------------------------------------------------------------------

    def _init_dummy_weights(self, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in self.model.named_parameters():
            if name.endswith("norm.weight"):
                # An identity norm: Gemma's stores its weight as an offset from one.
                param.fill_(0.0 if getattr(self.model.get_submodule(name.rpartition(".")[0]), "unit_offset", False) else 1.0)
            else:
                param.uniform_(-1e-2, 1e-2, generator=generator)

    def _init_lora(self, config: EngineConfig) -> None:
        slots, rows = self.memory.lora_slots, self.memory.lora_rows
        self.lora_scaling = torch.zeros(slots, device=self.device, dtype=torch.float32)
        self.lora_ranks = torch.zeros(slots, device=self.device, dtype=torch.int32)
        self.lora_rows = torch.zeros(slots, device=self.device, dtype=torch.int32)
        views = pool_views(self.kv_cache, self.flex, self.model.lora_layers()) if self.flex is not None else {}
        for layer in self.model.lora_layers():
            layer.allocate_rows(rows, scaling=self.lora_scaling, ranks=self.lora_ranks, rows=self.lora_rows,
                                max_rank=config.max_lora_rank, dora=config.serves_dora, pools=views.get(layer))
            for name in layer.slice_names:
                self.lora_modules[(layer.layer_idx, name)] = layer
        self.lora_meta = LoRAMeta(config.max_num_batched_tokens, slots, self.device)
        if self.vocab_refusal is None:
            self.model.vocab_adapters = VocabAdapters(self.device)

    @property
    def vocab_refusal(self) -> str | None:
        """Why adapters on embed_tokens / lm_head are refused here; None where they are served."""
        if self.tp.size > 1:
            return (f"not under tensor parallelism (tensor_parallel_size={self.tp.size}): each rank holds a share of "
                    "the vocabulary")
        return None

    def base_vocab(self, module: str) -> torch.Tensor:
        """The base's ``[vocab, hidden]`` matrix of ``module`` ("embed_tokens" or "lm_head"), which the
        reader compares an adapter's full copy with (read from a loader thread, never written)."""
        embed = cast(VocabParallelEmbedding, self.model.model.get_submodule("embed_tokens"))
        head = module == "lm_head" and not self.model.tie_word_embeddings
        return (self.model.lm_head.weight if head else embed.weight).detach()

    def write_vocab(self, slot: int, adapter: CachedAdapter) -> None:
        """Put ``adapter``'s vocabulary part (or none) in slot ``slot`` (serving.engine.layers.vocab_lora)."""
        if self.model.vocab_adapters is not None:
            with torch.no_grad():
                self.model.vocab_adapters.write(slot, adapter)

    def lora_pools(self) -> list[torch.Tensor]:
        """Every adapter row pool of the model (slot integrity sums them)."""
        return [t for layer in self.model.lora_layers() for t in (*layer.lora_A, *layer.lora_B)]

    def _allocate_kv_cache(self, num_blocks: int) -> int:
        attn = self.model.attention_layers()
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than one sequence of "
                f"max_model_len={self.max_model_len} needs; raise num_kv_blocks (or the memory it is sized from) "
                "or lower max_model_len"
            )
        # One page more than the block manager hands out: a graph replay's padding rows write there.
        shape = (2, len(attn), num_blocks + 1, self.block_size, attn[0].num_kv_heads, attn[0].head_dim)
        self.kv_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        for i, layer in enumerate(attn):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        return num_blocks

    def shutdown(self) -> None:
        """Nothing runs beside this process (a tensor-parallel rank 0 stops its ranks here)."""

    # ---- adapters -------------------------------------------------------------------------

    def write_rows(self, slot: int, row: int, adapter: CachedAdapter) -> CopyDone | None:
        """Copy ``adapter`` into rows ``row .. row + rank`` of every LoRA layer (untargeted modules
        zeroed) and point slot table entry ``slot`` at them. On CUDA the copies are queued on the copy
        stream and the returned event says when they have landed; on CPU they are done on return."""
        assert adapter.weights is not None
        by_layer: dict[MultiLoRALinear, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer_idx, module), pair in adapter.weights.items():
            layer = self.lora_modules.get((layer_idx, module))
            if layer is None:
                raise ValueError(f"adapter {adapter.digest[:12]} has weights for unknown module {module} of layer {layer_idx}")
            by_layer.setdefault(layer, {})[module] = pair
        stream = self._copy_stream
        if stream is not None:
            # The rows may still be read by work queued before (an evicted adapter's last step).
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer in self.model.lora_layers():
                layer.write_rows(row, adapter.rank, by_layer.get(layer, {}))
            self.lora_scaling[slot] = adapter.scaling
            self.lora_ranks[slot] = adapter.rank
            self.lora_rows[slot] = row
            return stream.record_event() if stream is not None else None

    def rows_checksum(self, adapter: CachedAdapter) -> int:
        """The raw-bit sum (lora.integrity) of what ``write_rows`` puts in this rank's rows: the
        adapter's own checksum, or under tensor parallelism that of this rank's part of it."""
        if self.tp.size == 1:
            return adapter.checksum
        assert adapter.weights is not None
        total = 0
        for (layer_idx, module), (A, Bt) in adapter.weights.items():
            a, bt = self.lora_modules[(layer_idx, module)].adapter_part(module, A, Bt)
            total += raw_sum(a) + raw_sum(bt)
        return total

    # ---- one step -------------------------------------------------------------------------

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV pages ``src -> dst`` in every layer (the block manager's copy-on-write of a
        shared partial block, before the step that writes into the copy)."""
        if not copies:
            return
        src = device_tensor([s for s, _ in copies], self.device)
        dst = device_tensor([d for _, d in copies], self.device)
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    def _forward_sampled(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                         row_slots: list[int] | None = None) -> torch.Tensor:
        """The logits of ``sample_rows`` (what a graph captures; the step context is set). ``row_slots``:
        their adapter slots, where a vocabulary adapter is on some (never in a graph)."""
        hidden = self.model(input_ids, positions).index_select(0, sample_rows)
        # Every rank of a tensor-parallel engine runs a flat step alike, so each gives its share.
        return self.model.compute_logits(hidden, every_rank=True, row_slots=row_slots)

    def _decode_splits(self, num_decode: int, max_context: int) -> int:
        if self.attention != "triton" or num_decode == 0:
            return 1
        from kernels.paged_attention import decode_splits

        return decode_splits(num_decode, self.model.attention_layers()[0].num_kv_heads, max_context)

    def runs_flat(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether ``execute`` lays ``scheduled`` out flat (serving.engine.decode_graphs) rather than
        eagerly (a step that records a prompt's logprobs runs eagerly)."""
        prefills = [s for s, n in scheduled if not (n == 1 and s.num_computed_tokens > 0)]
        if not prefills:  # a pure decode, most steps
            return True
        if any(_wants_prompt_logprobs(s) for s in prefills):
            return False
        return self.attention == "triton" and sum(n for _, n in scheduled) <= self.max_flat_tokens

    def execute(self, scheduled: list[tuple[Sequence, int]], *, flat: bool | None = None) -> StepResult:
        """Run one step and read its samples. ``flat``: the layout the caller chose (a
        tensor-parallel rank takes rank 0's, so that their all-reduces add up the same tokens);
        None: ``runs_flat`` decides."""
        return self.launch(scheduled, flat=flat).result()

    def launch(self, scheduled: list[tuple[Sequence, int]], *, flat: bool | None = None,
               feed: Feed | None = None) -> PendingStep:
        """Queue one step, its forward and its sampling (``forward``, ``sample``)."""
        return self.sample(self.forward(scheduled, flat=flat, feed=feed))

    @torch.inference_mode()
    def forward(self, scheduled: list[tuple[Sequence, int]], *, flat: bool | None = None,
                feed: Feed | None = None) -> StepLogits:
        """Queue one step's forward (``flat`` as for ``execute``) without waiting for it (a step
        that records prompt logprobs reads them on the host). ``feed``: the samples of the step in
        flight, which the tokens of ``scheduled`` still there are taken from, on the device."""
        if self.runs_flat(scheduled) if flat is None else flat:
            return self._execute_flat(flat_step(scheduled, self.block_size, feed))
        decodes = [(s, n) for s, n in scheduled if n == 1 and s.num_computed_tokens > 0]
        prefills = [(s, n) for s, n in scheduled if not (n == 1 and s.num_computed_tokens > 0)]
        # The prompt's own logits are computed on the eager path only (a flat step's graph keeps
        # the sampled rows' logits alone).
        prompt_logprobs = any(_wants_prompt_logprobs(s) for s, _ in prefills)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        token_slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        spans: list[tuple[int, int, Sequence]] = []
        fed = FedRows(feed)
        for seq, num in [*decodes, *prefills]:
            start = seq.num_computed_tokens
            row = len(input_ids)
            input_ids.extend(fed.ids(seq, start, num, row))
            positions.extend(range(start, start + num))
            slot_mapping.extend(self._cache_slot(seq, p) for p in range(start, start + num))
            token_slots.extend([seq.lora_slot] * num)
            spans.append((row, num, seq))
            if start + num >= seq.num_tokens:  # its last known token, or past it the one in flight
                sample_rows.append(row + num - 1)
                sampled.append(seq)

        device = self.device
        context = StepContext(
            slot_mapping=device_tensor(slot_mapping, device), attention=self.attention
        )
        if decodes:
            widest = max(len(s.block_table) for s, _ in decodes)
            tables = [s.block_table + [0] * (widest - len(s.block_table)) for s, _ in decodes]
            context.num_decode = len(decodes)
            context.decode_block_tables = device_tensor(tables, device)
            lens = [s.num_computed_tokens + 1 for s, _ in decodes]
            context.decode_context_lens = device_tensor(lens, device)
            context.decode_splits = self._decode_splits(len(decodes), max(lens))
        for row, num, seq in spans[len(decodes) :]:
            table = device_tensor(seq.block_table, device) if seq.num_computed_tokens else None
            context.prefills.append(PrefillSpan(row, num, seq.num_computed_tokens, table))
        lora = self.lora_meta is not None and any(s >= 0 for s in token_slots)
        vocab = self.model.vocab_adapters is not None and self.model.vocab_adapters.begin_step(token_slots)
        cold = self._saw("eager", len(input_ids), lora, len(input_ids))
        if lora and self.lora_meta is not None:
            context.lora = self.lora_meta.prepare(device_tensor(token_slots, device, torch.int32))

        ids = device_tensor(input_ids, device)
        fed.apply(ids)
        set_context(context)
        try:
            hidden = self.model(ids, device_tensor(positions, device))
        finally:
            reset_context()
        if prompt_logprobs:
            for row, num, seq in spans[len(decodes) :]:
                if _wants_prompt_logprobs(seq):
                    self._record_prompt_logprobs(seq, hidden[row : row + num])
        if not sampled:
            self._cold_done(cold)
            return StepLogits([], None)
        row_slots = [token_slots[row] for row in sample_rows] if vocab else None
        logits = self.model.compute_logits(hidden[device_tensor(sample_rows, device)], row_slots=row_slots)
        self._cold_done(cold)
        return self._logits_of(sampled, logits)

    def _record_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Append to ``seq.prompt_logprobs`` the logprob (rank, and the most likely tokens) of each
        prompt token that this chunk's positions predict: position ``p`` predicts token ``p + 1``.
        Positions already recorded (a prefill again after a preemption) are skipped."""
        assert seq.prompt_logprobs is not None
        start = seq.num_computed_tokens
        first = max(start, len(seq.prompt_logprobs) - 1)
        last = min(start + hidden.shape[0], seq.num_prompt_tokens - 1)
        if first >= last:
            return
        logits = self.model.compute_logits(hidden[first - start : last - start],
                                           row_slots=[seq.lora_slot] * (last - first))
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(seq.prompt_token_ids[first + 1 : last + 1], device=logp.device)
        chosen = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1
        num_top = seq.sampling_params.prompt_logprobs or 0
        top = logp.topk(num_top, dim=-1) if num_top else None
        top_ids = top.indices.tolist() if top is not None else [[] for _ in range(last - first)]
        top_lps = top.values.tolist() if top is not None else [[] for _ in range(last - first)]
        for token, lp, rank, ids, lps in zip(targets.tolist(), chosen.tolist(), ranks.tolist(), top_ids, top_lps):
            entry = {token: Logprob(lp, rank)}
            for place, (tid, tlp) in enumerate(zip(ids, lps), 1):
                entry.setdefault(tid, Logprob(tlp, place))
            seq.prompt_logprobs.append(entry)

    def _execute_flat(self, step: FlatStep) -> StepLogits:
        vocab = self.model.vocab_adapters
        # A step with rows of an adapter on the vocabulary modules runs eagerly: the graphs hold no
        # vocabulary step (its gathers are data-dependent: serving.engine.layers.vocab_lora).
        graphs_fit = not (vocab is not None and vocab.serves(step.rows[ADAPTER]))
        if self.graphs is not None and not self.enforce_eager and graphs_fit:
            size = self.graphs.size_for(step)
            if size is not None:
                cold = self._saw("graph", size, step.lora and self.lora_meta is not None, step.num_tokens)
                # The replay's logits stay in the graphs' buffer until the next replay, which is
                # queued only once these are sampled.
                replayed = self.graphs.replay(step, size)
                self._cold_done(cold)
                return self._logits_of(step.sampled, replayed)
        cold = self._saw("flat", step.num_tokens, step.lora and self.lora_meta is not None, step.num_tokens)
        row_slots = None
        if vocab is not None and vocab.begin_step(step.rows[ADAPTER]):
            row_slots = [step.rows[ADAPTER][row] for row in step.sample_rows]
        device = self.device
        inputs = to_device(host_tensor(step.rows), device)
        step.fed.apply(inputs[IDS])
        context = flat_context(
            inputs,
            to_device(host_tensor(step.tables), device),
            attention=self.attention,
            splits=self._decode_splits(step.num_tokens, step.max_context),
            lora=self.lora_meta if step.lora else None,
        )
        set_context(context)
        try:
            sample_rows = device_tensor(step.sample_rows, device)
            logits = self._forward_sampled(inputs[IDS], inputs[POS], sample_rows, row_slots)
        finally:
            reset_context()
        self._cold_done(cold)
        return self._logits_of(step.sampled, logits)

    def _saw(self, layout: str, tokens: int, lora: bool,
             step_tokens: int) -> tuple[tuple[str, int, bool], int, float] | None:
        """Record a step's shape for the warm-up. After it: a step whose kernels it never ran and no
        step before has run is cold; returns its kernels, ``step_tokens`` (its own token count;
        ``tokens`` is a graph's size) and its start, for ``_cold_done`` once it is queued."""
        if self.shape_log is not None:
            self.shape_log.add(StepShape(layout, tokens, lora))
            return None
        if self.warm_kernels is None:
            return None
        kernels = StepShape(layout, tokens, lora).kernels()
        if kernels in self.warm_kernels or kernels in self.cold_kernels:
            return None
        return kernels, step_tokens, time.perf_counter()

    def _cold_done(self, cold: tuple[tuple[str, int, bool], int, float] | None) -> None:
        """A cold step's forward is queued: wait for it (once per key, so its time is the step's own,
        compiles and first launches included), record it and say so."""
        if cold is None:
            return
        kernels, tokens, start = cold
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step = ColdStep(kernels, tokens, time.perf_counter() - start)
        self.cold_kernels[kernels] = step
        layout, size, lora = kernels
        what = f"graph of {size} tokens" if layout == "graph" else f"{layout} step (Triton key {size})"
        log.warning("cold step: a %s%s that the warm-up never ran; this one, of %d tokens, took %.1f ms", what,
                    " with LoRA" if lora else "", tokens, 1000 * step.seconds)

    def _logits_of(self, sampled: list[Sequence], logits: torch.Tensor) -> StepLogits:
        if not sampled or not self.tp.is_driver:
            return StepLogits([], None)
        if any(s.forks for s in sampled):
            # Sequences forked from one whose prompt completes now draw from its logits row.
            rows = [i for i, s in enumerate(sampled) for _ in range(1 + len(s.forks))]
            logits = logits.index_select(0, device_tensor(rows, logits.device))
            sampled = [t for s in sampled for t in (s, *s.forks)]
        return StepLogits(sampled, logits)

    @torch.inference_mode()
    def sample(self, step: StepLogits) -> PendingStep:
        """Queue the sampling of ``step``'s rows, reading each sequence's grammar, penalties and
        ``min_tokens`` as the host has them now, and start copying the samples to the host. A
        sequence that ended since its forward was queued samples without its grammar (whose
        matcher may have ended too): its token is dropped."""
        if step.logits is None:
            return PendingStep([], None)
        sampled = step.sampled
        finished = SequenceStatus.FINISHED
        guides = [None if s.status is finished else s.guide for s in sampled]
        samples = self.sampler.sample(step.logits, [s.sampling_params for s in sampled],
                                      [s.generator for s in sampled], guides, sampled)
        samples.start_copy()
        return PendingStep(sampled, samples)

    def _cache_slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    """``seq`` asks for its prompt's logprobs and some are still to record."""
    return seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens


def _read_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model directory's safetensors files (a pickled checkpoint is refused)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in model_dir.glob("*.bin")) or sorted(p.name for p in model_dir.iterdir())
        raise ValueError(
            f"{model_dir} has no *.safetensors weights (found: {', '.join(found) or 'nothing'}); "
            "pickled checkpoints are never loaded: convert them to safetensors"
        )
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
