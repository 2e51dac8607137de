"""The offline API, in vLLM's shape: ``LLM(model=PATH, ...).generate(prompts, SamplingParams(...),
lora_request=...)`` runs a batch of prompts to completion and returns one output per prompt."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from serving.engine.config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.engine.prompts import PromptType
from serving.engine.lora.request import LoRARequest
from serving.engine.outputs import RequestOutput
from serving.engine.sampling_params import SamplingParams

# A chat message: role and content, and an assistant's `tool_calls` (a list) or a tool's `tool_call_id`.
Message = dict[str, Any]
# How long generate() blocks waiting for an adapter load when nothing else can run.
_LOAD_WAIT_S = 0.05


class LLM:
    """One base model with many adapters, for batch generation in this process.

    Keyword arguments are ``EngineConfig`` fields (``max_loras``, ``max_cpu_loras``,
    ``max_lora_rank``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``block_size``, ``num_kv_blocks``, ``dtype``, ``device``, ``seed``, ...).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        # The defaults are EngineConfig's, written there once.
        config = EngineConfig(model=str(model), **kwargs)
        self.llm_engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the prompts' order.

        ``sampling_params`` and ``lora_request`` are one for all prompts or one per prompt
        (``None``: the base model). An adapter that cannot be loaded raises AdapterError after the
        batch's other requests are aborted; the engine stays usable.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        engine = self.llm_engine
        encoded = [engine.encode(p) for p in prompts]
        for (_, ids), p in zip(encoded, params):
            engine.validate(ids, p)
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        results: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, enc, p, lora, prio in zip(request_ids, prompts, encoded, params, loras, priorities):
                engine.add_request(rid, prompt, p, lora, prio, encoded=enc)
            while len(results) < len(request_ids):
                for output in engine.step():
                    if output.error is not None:
                        raise output.error
                    if output.finished:
                        results[output.request_id] = output
                if engine.last_step_tokens == 0 and len(results) < len(request_ids):
                    engine.wait_for_loads(_LOAD_WAIT_S)
        finally:
            for rid in request_ids:
                if rid not in results:
                    engine.abort_request(rid)
        return [results[rid] for rid in request_ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat
        template (which writes its own special tokens, so none are added when encoding). `tools`
        (OpenAI's tool objects) are rendered by the template as the serving worker renders a
        request's; a message's `tool_calls` carry their arguments as objects."""
        # The first element tells one conversation from several (which the type checker cannot narrow).
        if messages and isinstance(messages[0], dict):
            conversations = [cast(Sequence[Message], messages)]
        else:
            conversations = list(cast(Sequence[Sequence[Message]], messages))
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                # (a list of apply_chat_template's own element type: list is invariant)
                tools=None if tools is None else list[dict[Any, Any] | Callable[..., Any]](tools),
            )
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, lora_request)


def _per_prompt(value: Any, count: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{count} prompts but {len(value)} {what}")
        return list(value)
    return [value] * count
