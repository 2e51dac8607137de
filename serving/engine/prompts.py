"""What a prompt is to the engine: its token ids (from text or given), checked against what the
engine can serve, and the token ids that end a sequence (EOS) for a model.

Free functions of the tokenizer and the model's configuration, so the engine's request path
(``LLMEngine.add_request``) and the API's early checks (``LLM.generate``, ``AsyncEngine``: every
prompt of a call checked before any is queued) read one definition.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from serving.engine.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


def eos_token_ids(hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, model: str) -> frozenset[int]:
    """Every id that ends a sequence: the config's, the tokenizer's and generation_config.json's."""
    ids: set[int] = set()
    candidates: list[Any] = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        candidates.append(GenerationConfig.from_pretrained(model).eos_token_id)
    except OSError:
        pass  # no generation_config.json: the config's and tokenizer's EOS are all there is
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptType) -> tuple[str | None, list[int]]:
    """``(prompt text or None, token ids)`` of a string or ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, str):
        return prompt, list(tokenizer(prompt).input_ids)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"], list(tokenizer(prompt["prompt"]).input_ids)
    raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'), got {type(prompt).__name__}")


def validate_prompt(token_ids: list[int], params: SamplingParams, *, vocab: int, max_model_len: int,
                    max_num_seqs: int) -> None:
    """Reject a prompt the engine cannot serve, with the reason."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt is {len(token_ids)} tokens; the context is {max_model_len}, "
            "which leaves no room for a completion"
        )
    bad = next((t for t in params.logit_bias or () if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})")
    if params.num_sequences > max_num_seqs:
        raise ValueError(f"best_of/n of {params.num_sequences} sequences exceeds max_num_seqs "
                         f"({max_num_seqs}), which all of a request's sequences must fit in")
