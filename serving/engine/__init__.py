"""The serving engine: one shared base model, hot-swappable LoRA slots, continuous batching.

Public API (vLLM's shapes; stable)::

    from serving.engine import LLM, SamplingParams, LoRARequest

    llm = LLM(model=PATH, **engine_config_fields)   # EngineConfig's fields, defaults there: max_loras,
                                                     # lora_memory_bytes, max_lora_rank, max_num_seqs, ...
    llm.generate(prompts, SamplingParams(...), lora_request=LoRARequest(name, path) | [...] | None,
                 *, priority=None) -> list[RequestOutput]
    llm.chat(messages | [messages, ...], SamplingParams(...), lora_request=None) -> list[RequestOutput]

    SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=None, max_tokens=16, stop=None,
                   stop_token_ids=None, ignore_eos=False, include_stop_str_in_output=False,
                   logprobs=None, skip_special_tokens=True)
    LoRARequest(lora_name, lora_path) or LoRARequest(lora_name, lora_int_id, lora_path)

    RequestOutput: request_id, prompt, prompt_token_ids, finished, lora_request, error,
        outputs[0]: CompletionOutput(text, token_ids, finish_reason ("stop" | "length" | "abort"),
                    stop_reason, cumulative_logprob, logprobs: list[dict[token_id, Logprob]] | None)

The asyncio engine (for the HTTP server; one engine thread, any number of callers)::

    engine = AsyncEngine(EngineConfig(model=PATH, ...))   # or AsyncEngine.from_args(PATH, ...)
    async for out in engine.generate(prompt, sampling_params, request_id,
                                     lora_request=None, priority=0):  # cumulative outputs
        ...                       # raises ValueError (bad prompt / id in use) or AdapterError
    await engine.abort(request_id)                       # the stream ends with "abort"
    await engine.add_lora(LoRARequest(name, path), load_inplace=False) -> LoRAInfo
    await engine.prefetch_lora(LoRARequest(name, path), to_gpu=True) -> "gpu" | "cpu"
                                                         # prewarm: never evicts a pinned/busy slot
    await engine.remove_lora(name)                       # AdapterNotFoundError if unknown
    await engine.list_loras() -> list[LoRAInfo]
    await engine.get_stats() -> EngineStats
    engine.tokenizer, engine.model_name, engine.max_model_len, engine.is_running
    engine.shutdown()

``ProcessEngine(EngineConfig(...), on_dead=...)`` has the same face (``EngineClient``) with the
engine core in a spawned child process, so its steps never contend with the caller's event loop
for the interpreter lock (serving.engine.process_engine; the worker's ``--engine-process``).

Lower priority values are served first (vLLM's convention). Adapters are keyed by content digest;
a name only points at one. Adapter problems raise ``AdapterError`` with a message naming them; a
request stopped because its GPU slot failed its checksum raises ``SlotCorruptedError``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names _LAZY imports, for the type checker
    from serving.engine.async_engine import AsyncEngine
    from serving.engine.engine_client import EngineClient, EngineDeadError
    from serving.engine.config import EngineConfig
    from serving.engine.llm import LLM
    from serving.engine.llm_engine import LLMEngine
    from serving.engine.lora.cache import AdapterNotFoundError
    from serving.engine.lora.integrity import SlotCorruptedError
    from serving.engine.lora.reader import AdapterError
    from serving.engine.lora.request import LoRARequest
    from serving.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from serving.engine.process_engine import ProcessEngine
    from serving.engine.sampling_params import SamplingParams
    from serving.engine.stats import EngineStats, LoRAInfo

# Imported on first use (PEP 562): Django processes import serving.contracts.artifact and
# serving.engine.lora.reader for upload checks, and must not pay for torch and the engine.
_LAZY = {
    "AdapterError": "serving.engine.lora.reader",
    "AsyncEngine": "serving.engine.async_engine",
    "EngineClient": "serving.engine.engine_client",
    "EngineDeadError": "serving.engine.engine_client",
    "EngineConfig": "serving.engine.config",
    "LLM": "serving.engine.llm",
    "LLMEngine": "serving.engine.llm_engine",
    "AdapterNotFoundError": "serving.engine.lora.cache",
    "LoRARequest": "serving.engine.lora.request",
    "CompletionOutput": "serving.engine.outputs",
    "Logprob": "serving.engine.outputs",
    "RequestOutput": "serving.engine.outputs",
    "ProcessEngine": "serving.engine.process_engine",
    "SamplingParams": "serving.engine.sampling_params",
    "SlotCorruptedError": "serving.engine.lora.integrity",
    "EngineStats": "serving.engine.stats",
    "LoRAInfo": "serving.engine.stats",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'serving.engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLM",
    "AdapterError",
    "AdapterNotFoundError",
    "AsyncEngine",
    "CompletionOutput",
    "EngineClient",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "LoRAInfo",
    "LoRARequest",
    "Logprob",
    "ProcessEngine",
    "RequestOutput",
    "SamplingParams",
    "SlotCorruptedError",
]
