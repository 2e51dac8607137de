"""The engine's `SamplingParams` of an HTTP request body, every value checked: what the worker
refuses (`refused_fields`), the structured-output constraint, the context's room for `max_tokens`,
`logit_bias`'s token ids, and how many sequences a request may fork (`n`, `best_of`). Each bad
value is a 400 that names its field."""

from __future__ import annotations

import re

from serving.engine import SamplingParams
from serving.engine.guided import GuidedDecodingParams
from serving.engine.server.errors import bad_request
from serving.contracts.protocol import SamplingFields


def check_supported(body: SamplingFields) -> None:
    """The first field `body` sets to something this worker refuses, as a 400 naming it."""
    refused = body.refused_fields()
    if refused:
        param, reason = refused[0]
        raise bad_request(reason, param=param)


def guided_decoding(body: SamplingFields) -> GuidedDecodingParams | None:
    """The structured-output constraint `body` asks for, if any; a 400 naming the field for two
    constraints or one that is malformed (one the grammar library refuses is found when compiled)."""
    constraints = body.constraints()
    if not constraints:
        return None
    if len(constraints) > 1:
        names = [name for name, _ in constraints]
        raise bad_request(f"{' and '.join(names)} each constrain the output; send one of them", param=names[1])
    name, fields = constraints[0]
    try:
        return GuidedDecodingParams(**fields)
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from exc


def logit_bias(body: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as strings) as the engine's; a key that is not a token id
    of this model is a 400 naming logit_bias. Values are clamped to [-100, 100] by the engine."""
    if not body.logit_bias:
        return None
    bias = {}
    for key, value in body.logit_bias.items():
        token = int(key) if key.strip().isdigit() else None
        if token is None or token >= vocab_size:
            raise bad_request(f"logit_bias keys must be token ids of this model (0..{vocab_size - 1}), got {key!r}",
                              param="logit_bias")
        bias[token] = value
    return bias


def sampling_params(body: SamplingFields, *, prompt_len: int, max_model_len: int, vocab_size: int,
                    max_num_seqs: int, logprobs: int | None, best_of: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams for `body`; every invalid value is a 400 that names it."""
    max_tokens = _max_tokens(body.max_tokens, prompt_len, max_model_len)
    n = body.n or 1
    sequences = max(n, best_of or n)
    if sequences > max_num_seqs:
        raise bad_request(f"{'best_of' if sequences > n else 'n'} is {sequences}; this worker runs at most "
                          f"{max_num_seqs} sequences at once (max_num_seqs), and all of a request's must fit",
                          param="best_of" if sequences > n else "n")
    guided = guided_decoding(body)
    try:
        return SamplingParams(
            n=n,
            best_of=best_of,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=logit_bias(body, vocab_size),
            min_tokens=body.min_tokens,
            max_tokens=max_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            guided_decoding=guided,
        )
    except (ValueError, TypeError) as exc:
        message = str(exc)
        raise bad_request(message, param=next((f for f in _PARAMS if re.match(rf"{f}\b", message)), None)) from exc


# The fields SamplingParams names first in its errors (the others are checked before it).
_PARAMS = ("min_tokens", "best_of", "n", "logit_bias", "stop_token_ids", "stop", "ignore_eos")


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """As asked if it fits the context; everything left if not asked (as vLLM); else a 400 with the
    figures, in OpenAI's wording."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{prompt_len} tokens, which leaves no room for a completion. Please shorten the prompt.",
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens", code="context_length_exceeded",
        )
    return requested
