"""Engine settings: one validated object that every part of the engine reads.

Names and defaults follow vLLM's engine arguments where vLLM has them (``max_loras``,
``max_cpu_loras``, ``max_lora_rank``, ``max_num_seqs``, ``max_num_batched_tokens``,
``block_size``, ``gpu_memory_utilization``), so a vLLM user can carry flags over unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.engine.grammar_pool import GrammarBudget

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class EngineConfig:
    """Everything the engine is built from.

    ``num_kv_blocks`` fixes the size of the paged KV cache; left ``None`` it is sized from
    ``gpu_memory_utilization`` on CUDA and from ``cpu_kv_cache_bytes`` on CPU.
    ``load_format="dummy"`` gives the base model small random weights instead of reading its
    safetensors (vLLM's option of that name), for benchmarks of shapes whose weights are not at hand.
    ``priority_aging_steps``: a waiting request gains one priority level (lower is served first)
    per this many engine steps, so low-priority work is delayed, never starved.
    ``fairness_prompt_weight`` and ``fairness_output_weight``: what a computed token and a sampled
    token cost a tenant's Virtual Token Counter (serving.engine.fairness; the paper's 1 and 2);
    within a priority tier the least-served tenant is admitted first. Both 0 turn tenant fairness
    off (admission by age alone).
    ``max_flat_tokens``: with the Triton attention backend a step of at most this many tokens runs
    flat, every token (prompt chunks' too) a row of one paged-attention launch, so its shapes
    depend on the token count alone; longer steps attend each prompt chunk in SDPA.
    ``enforce_eager`` (vLLM's flag): never replay CUDA graphs. Otherwise, on CUDA, the flat step's
    forward is captured at start for a ladder of token counts up to ``max_flat_tokens`` (up to
    ``max_num_seqs`` with the torch backend, where only pure-decode steps run flat;
    ``cuda_graph_sizes`` overrides the ladder) and each flat step replays the smallest that fits.
    ``attention_backend``: ``"triton"`` reads the paged KV cache in place, ``"torch"`` gathers
    pages and calls SDPA; ``"auto"`` picks Triton on CUDA and torch on CPU (Triton runs on CPU only
    under ``TRITON_INTERPRET=1``).

    Adapter memory (docs/adapter-memory.md) is a pool of rank rows, so an adapter costs its own rank:
    ``lora_memory_bytes`` fixes the pool's size; left ``None`` with ``max_loras`` given, the pool
    holds ``max_loras`` adapters of ``max_lora_rank`` (what fixed slots cost); with neither, on CUDA
    the pool takes what the KV cache leaves of ``gpu_memory_utilization`` once the KV cache has at
    most ``1 - lora_memory_fraction`` of it (and no more than ``max_num_seqs`` full-length sequences
    need), and on CPU ``cpu_lora_memory_bytes``. ``max_loras`` (vLLM's flag) is then only an upper
    bound on how many adapters are resident at once; unset, it is the pool's rows over
    ``min(8, max_lora_rank)``; 0 turns LoRA off. ``max_cpu_loras`` bounds the CPU cache's entries and
    ``cpu_lora_cache_bytes`` its bytes (default: twice the GPU pool's, at most a quarter of the
    host's memory).

    ``tensor_parallel_size`` (vLLM's flag): the model is sharded over this many processes, one per
    device (``cuda:0 .. cuda:N-1``; on CPU all of them on the host), which the engine spawns
    (serving.engine.distributed). Every rank sizes its KV cache and adapter pool alike (the
    smallest budget of them on CUDA). CUDA graphs are not captured at sizes above 1.
    ``distributed_executor_backend`` (vLLM's flag): ``"mp"`` runs the model through the
    tensor-parallel driver (serving.engine.distributed), ``"uni"`` through the plain runner in this
    process; unset, ``"mp"`` exactly when ``tensor_parallel_size`` > 1. ``"mp"`` at size 1 runs the
    driver's paths (its group, its step messages) on one device: how its CUDA path is checked on a
    machine with one GPU.

    ``enable_prefix_caching`` (vLLM's flag, on by default as in vLLM V1): a prompt's leading full
    KV blocks computed before for the same adapter (name and content) or for the base model are
    reused instead of prefilled again (serving.engine.block_manager; docs/serving-worker.md,
    "Prefix caching").

    ``async_scheduling`` (vLLM's flag; off by default): the next step is scheduled, its inputs
    built and its forward launched while the current step still runs on the device, each decode
    row taking its token id on the device from the step before (serving.engine.async_scheduling,
    which states what still runs a step at a time). Not under tensor parallelism.

    ``quantization`` (vLLM's flag; None by default): ``"fp8"`` stores the base projections' weights
    in FP8 e4m3 with per-output-channel scales once loaded, activations quantized per token at each
    call; embeddings, LM head, norms and adapters keep ``dtype`` (serving.engine.layers.fp8_linear,
    which says where it runs natively and where it is emulated). On CUDA it needs bf16. Its tokens
    agree with the unquantized model's to a measured rate, not exactly (docs/serving-worker.md,
    "FP8 base weights"). ``"awq"``: the checkpoint is AWQ INT4 (its ``config.json``'s
    ``quantization_config``), loaded as it is; set from the checkpoint when left None, as vLLM
    does, and refused on any other checkpoint (docs/quantized-bases.md; not under tensor
    parallelism, nor with ``load_format="dummy"``). A checkpoint quantized by another method is refused.

    ``enable_dora`` (on by default): DoRA adapters are served (docs/adapter-kinds.md). Each LoRA
    layer then holds a per-slot scale table ``[slots + 1, out]`` from the start, charged to the
    adapter pool (serving.engine.memory_plan), so the CUDA graphs capture DoRA's epilogue once and
    serve DoRA and plain adapters alike; off, the table and its multiply are gone and DoRA adapters
    are refused at load, saying so. ``dora_refusal`` says why an engine refuses them.

    ``borrow_kv_memory`` (off by default): the adapter row pool lives in a flex region at the end of
    the KV cache's tensor and the boundary between KV blocks and rank rows moves at run time: rows
    borrow idle KV blocks while adapters wait for room and give them back under KV pressure
    (serving.engine.lora.borrow; docs/adapter-memory.md, "Adapters that borrow idle KV memory").
    Not under tensor parallelism.

    ``decode_stall_target`` (None: off, by default): the adaptive token budget. A step that carries
    decodes holds at most as many tokens as a step-time model measured online
    (serving.engine.step_cost) says it may for its time to stay within this many times that of a
    decode-only step of the same batch (2.0: prompts streaming in at most double the running
    sequences' time per output token, Sarathi-Serve's stall-free batching);
    ``max_num_batched_tokens`` stays the ceiling, and a step with no decodes, or one taken before the
    model has enough distinct step sizes, gets all of it. ``decode_stall_max_wait_steps``: the TTFT
    guard; once the oldest prompt still without its first token (waiting, or in its prefill) has
    waited this many steps, the step gets the full budget, so prompts never queue without bound
    behind short steps (docs/serving-worker.md, "The token budget").

    ``lora_prefetch_groups`` (2 by default; 0: off): after each step's admissions the scheduler starts
    bringing up the adapters of the next this many waiting adapter groups that are not resident (the
    copy into the GPU pool, or the read into the CPU cache), evicting only idle adapters
    (serving.engine.scheduler; docs/adapter-memory.md, "Admission").

    ``grammar``: structured output's compile budget, pool and cache (serving.engine.grammar_pool's
    ``GrammarBudget``: time, nesting and size per constraint, compiling processes, a tenant's share
    of them, the per-tenant cache's bounds).
    """

    model: str
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_memory_bytes: int | None = None
    lora_memory_fraction: float = 0.2
    cpu_lora_memory_bytes: int = 64 << 20
    cpu_lora_cache_bytes: int | None = None
    lora_prefetch_groups: int = 2
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    load_format: str = "safetensors"
    priority_aging_steps: int = 64
    fairness_prompt_weight: int = 1
    fairness_output_weight: int = 2
    base_model_name: str | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    attention_backend: str = "auto"
    max_flat_tokens: int = 2048
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    quantization: str | None = None
    enable_dora: bool = True
    borrow_kv_memory: bool = False
    decode_stall_target: float | None = None
    decode_stall_max_wait_steps: int = 16
    grammar: GrammarBudget = field(default_factory=GrammarBudget)

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(f"model must be a local Hugging Face model directory; {self.model!r} is not a directory")
        _require(self.max_loras is None or self.max_loras >= 0, f"max_loras must be >= 0, got {self.max_loras}")
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= 1,
            f"max_cpu_loras must be >= 1, got {self.max_cpu_loras}",
        )
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _require(
            self.lora_memory_bytes is None or self.lora_memory_bytes >= 1,
            f"lora_memory_bytes must be >= 1, got {self.lora_memory_bytes}",
        )
        _require(
            0.0 < self.lora_memory_fraction < 1.0,
            f"lora_memory_fraction must be in (0, 1), got {self.lora_memory_fraction}",
        )
        _require(self.cpu_lora_memory_bytes >= 1, f"cpu_lora_memory_bytes must be >= 1, got {self.cpu_lora_memory_bytes}")
        _require(
            self.cpu_lora_cache_bytes is None or self.cpu_lora_cache_bytes >= 1,
            f"cpu_lora_cache_bytes must be >= 1, got {self.cpu_lora_cache_bytes}",
        )
        _require(self.lora_prefetch_groups >= 0,
                 f"lora_prefetch_groups must be >= 0 (0: off), got {self.lora_prefetch_groups}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(
            self.decode_stall_target is None
            or (math.isfinite(self.decode_stall_target) and self.decode_stall_target > 1.0),
            f"decode_stall_target must be None (off) or a number > 1 (how many times a decode-only step's time "
            f"a step carrying decodes may take), got {self.decode_stall_target}",
        )
        _require(self.decode_stall_max_wait_steps >= 1,
                 f"decode_stall_max_wait_steps must be >= 1, got {self.decode_stall_max_wait_steps}")
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(self.priority_aging_steps >= 1, f"priority_aging_steps must be >= 1, got {self.priority_aging_steps}")
        _require(self.fairness_prompt_weight >= 0,
                 f"fairness_prompt_weight must be >= 0, got {self.fairness_prompt_weight}")
        _require(self.fairness_output_weight >= 0,
                 f"fairness_output_weight must be >= 0, got {self.fairness_output_weight}")
        _require(
            self.dtype == "auto" or self.dtype in _DTYPES,
            f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}",
        )
        _require(
            self.load_format in ("safetensors", "dummy"),
            f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _require(
            self.cuda_graph_sizes is None or (bool(self.cuda_graph_sizes) and all(n >= 1 for n in self.cuda_graph_sizes)),
            f"cuda_graph_sizes must be a non-empty list of batch sizes >= 1, got {self.cuda_graph_sizes}",
        )
        _require(self.max_flat_tokens >= 1, f"max_flat_tokens must be >= 1, got {self.max_flat_tokens}")
        _require(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _require(self.distributed_executor_backend in (None, "uni", "mp"),
                 f"distributed_executor_backend must be None, 'uni' or 'mp', got {self.distributed_executor_backend!r}")
        _require(not (self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1),
                 "distributed_executor_backend='uni' runs one process: it cannot serve tensor_parallel_size > 1")
        _require(not (self.borrow_kv_memory and self.tensor_parallel_size > 1),
                 "borrow_kv_memory is not supported with tensor_parallel_size > 1 (each rank's KV cache and "
                 "row pool would have to move their boundary alike)")
        _require(not (self.borrow_kv_memory and self.distributed_executor_backend == "mp"),
                 "borrow_kv_memory is not supported under the tensor-parallel driver (distributed_executor_backend='mp')")
        _require(not (self.borrow_kv_memory and not self.lora_enabled),
                 "borrow_kv_memory needs LoRA on (max_loras=0 turns it off): there is no pool to lend to")
        _require(not (self.async_scheduling and self.tensor_parallel_size > 1),
                 "async_scheduling is not supported with tensor_parallel_size > 1 (the ranks take the step's "
                 "token ids from rank 0's host, which async scheduling does not wait for)")
        self.torch_device  # validates the device string early
        _require(self.quantization in (None, "fp8", "awq"),
                 f"quantization must be None, 'fp8' or 'awq', got {self.quantization!r}")
        self._check_checkpoint_quantization()
        _require(self.quantization != "fp8" or self.torch_device.type != "cuda" or self.torch_dtype == torch.bfloat16,
                 f"quantization='fp8' on CUDA needs dtype bfloat16 (torch._scaled_mm's rowwise scaling writes bf16), "
                 f"got {self.dtype!r}")
        if self.tensor_parallel_size > 1 and self.torch_device.type == "cuda":
            count = torch.cuda.device_count()
            _require(self.tensor_parallel_size <= count,
                     f"tensor_parallel_size={self.tensor_parallel_size} needs as many CUDA devices; torch sees {count}")

    def _check_checkpoint_quantization(self) -> None:
        """Match ``quantization`` with the checkpoint's own (its config.json's ``quantization_config``;
        the model's build validates the AWQ settings themselves, serving.engine.layers.int4_linear)."""
        config_file = Path(self.model) / "config.json"
        checkpoint = json.loads(config_file.read_text()) if config_file.is_file() else {}
        method = (checkpoint.get("quantization_config") or {}).get("quant_method")
        if method is None:
            _require(self.quantization != "awq",
                     f"quantization='awq' needs an AWQ checkpoint; {self.model}'s config.json has no quantization_config")
            return
        _require(method == "awq", f"{self.model} is quantized with quant_method {method!r}: the engine loads "
                                  "quantized checkpoints of quant_method 'awq' only (docs/quantized-bases.md)")
        _require(self.quantization in (None, "awq"), f"{self.model} is an AWQ INT4 checkpoint: "
                                                     f"quantization={self.quantization!r} cannot apply to it")
        self.quantization = "awq"
        _require(self.tensor_parallel_size == 1,
                 f"AWQ (INT4) bases are not served under tensor parallelism (tensor_parallel_size={self.tensor_parallel_size})")
        _require(self.load_format != "dummy", "load_format='dummy' makes bf16 weights, not AWQ's packed ones: "
                                              "bench/awq_checkpoint.py writes a random AWQ checkpoint")

    @property
    def lora_enabled(self) -> bool:
        return self.max_loras != 0

    @property
    def dora_refusal(self) -> str | None:
        """Why this engine refuses DoRA adapters (their loads fail saying so), None when it serves them."""
        if not self.enable_dora:
            return "DoRA is off on this engine (enable_dora=False)"
        if self.tensor_parallel_size > 1:
            # A row-parallel layer's norms would need their own all-reduce at every slot load.
            return f"not under tensor parallelism (tensor_parallel_size={self.tensor_parallel_size})"
        if self.quantization == "fp8":
            return "not over an FP8 base (quantization=\"fp8\"): the scale would need the dequantized weight's norms"
        if self.quantization is not None:
            return f"not over a quantized base (quantization={self.quantization!r}): the scale would need its weight's norms"
        return None

    @property
    def serves_dora(self) -> bool:
        """Whether adapters are on and DoRA ones are served: the LoRA layers then hold DoRA's scale tables."""
        return self.lora_enabled and self.dora_refusal is None

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        return device

    @property
    def attention(self) -> str:
        """The attention backend decode tokens run on: ``"triton"`` or ``"torch"``."""
        if self.attention_backend == "auto":
            return "triton" if self.torch_device.type == "cuda" else "torch"
        return self.attention_backend

    @property
    def uses_driver(self) -> bool:
        """Whether the engine runs its model through the tensor-parallel driver."""
        if self.distributed_executor_backend is None:
            return self.tensor_parallel_size > 1
        return self.distributed_executor_backend == "mp"

    def graph_sizes(self) -> list[int]:
        """Token counts whose flat step is captured (ascending; empty where graphs are off)."""
        if self.enforce_eager or self.torch_device.type != "cuda" or self.tensor_parallel_size > 1:
            # Not under tensor parallelism: the ranks' NCCL collectives inside captured graphs are
            # untried (no two-GPU machine yet; docs/serving-worker.md, "Tensor parallelism").
            return []
        flat_cap = self.max_flat_tokens if self.attention == "triton" else self.max_num_seqs
        return graph_ladder(min(flat_cap, self.max_num_batched_tokens), self.cuda_graph_sizes)

    @property
    def torch_dtype(self) -> torch.dtype:
        """bf16 on CUDA and fp32 on CPU unless asked otherwise."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def graph_ladder(cap: int, sizes: list[int] | None = None) -> list[int]:
    """Captured token counts up to ``cap``: ``sizes`` if given, else 1, 2, 4, 8, every 16 up to
    256 (vLLM's decode ladder), every 64 up to 1024 and every 256 beyond, and ``cap``: a step pads
    to at most 1.25 × its tokens past 256, where GEMM time grows with the padding (a serving step of
    a decode batch and a prompt or two lands at 300–700 tokens; every 128 cost a 319-token step 20 %)."""
    if sizes is not None:
        return sorted({n for n in sizes if n <= cap})
    steps = (1, 2, 4, 8, *range(16, 257, 16), *range(320, 1025, 64), *range(1280, cap + 1, 256))
    return sorted({n for n in (*steps, cap) if n <= cap})


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
