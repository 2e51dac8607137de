"""Model architectures the engine runs (their forward passes over the paged KV cache), one module
per family, and the model_type each serves; any other model_type is refused at start."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from serving.engine.distributed.parallel import SINGLE, TensorParallel
from serving.engine.models.common import CausalLM
from serving.engine.models.gemma import GEMMA_MODEL_TYPES, GemmaForCausalLM
from serving.engine.models.llama import LLAMA_MODEL_TYPES, LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM | GemmaForCausalLM]] = {
    **dict.fromkeys(LLAMA_MODEL_TYPES, LlamaForCausalLM),
    **dict.fromkeys(GEMMA_MODEL_TYPES, GemmaForCausalLM),
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES)


def build_model(config: PretrainedConfig, *, max_positions: int, device: torch.device, dtype: torch.dtype,
                tp: TensorParallel = SINGLE) -> CausalLM:  # fmt: skip
    """The model of ``config.model_type`` (this rank's share of it under tensor parallelism), its
    weights uninitialised; a ValueError names an unsupported one, or a size its heads cannot split."""
    model_class = MODEL_CLASSES.get(config.model_type)
    if model_class is None:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; the engine serves {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_class(config, max_positions=max_positions, device=device, dtype=dtype, tp=tp)
