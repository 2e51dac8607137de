"""PEFT adapters on the vocabulary modules of a tiny model, for the engine's tests.

``save_vocab_adapter`` saves what PEFT saves for LoRA on ``embed_tokens`` / ``lm_head`` and for
``modules_to_save`` copies of them, with seeded non-zero values: PEFT starts LoRA's B (the
embedding's A) at zero and a copy equal to the base, either of which would make the adapter a
no-op. A copy's ``changed`` rows are the base's plus noise of ``row_scale``, every other row the
base's own, as a trained copy whose other rows were frozen would be (noise of ``row_scale`` times
the matrix's standard deviation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def save_vocab_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 4,
    lora_alpha: float = 8,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    modules_to_save: Sequence[str] = (),
    changed: dict[str, Sequence[int]] | None = None,
    row_scale: float = 3.0,
    init_scale: float = 0.5,
    seed: int = 0,
    save_embedding_layers: bool = False,
    trainable_tokens: dict[str, list[int]] | None = None,
) -> Path:
    """Save a PEFT adapter on ``base_dir``'s model: LoRA on ``target_modules`` (the vocabulary modules
    among them too), and a copy of each of ``modules_to_save`` whose ``changed[module]`` rows differ
    from the base's. ``save_embedding_layers``: PEFT also saves the base's two matrices whole (its
    default beside LoRA on them), as ``base_layer`` copies equal to the base. ``trainable_tokens``:
    PEFT's ``trainable_token_indices``, their rows the base's plus noise as a copy's changed rows."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                        modules_to_save=list(modules_to_save) or None, trainable_token_indices=trainable_tokens,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_embedding_B." in name:
                # The factor applied first: A on x [in], or the embedding's B on A's column [r].
                fan_in = param.shape[1] if ".lora_A." in name else r
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
            elif ".lora_B." in name or ".lora_embedding_A." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * init_scale / math.sqrt(r))
            elif ".trainable_tokens_delta." in name:
                # PEFT starts it as the listed tokens' base rows.
                param += torch.randn(param.shape, generator=generator) * row_scale * param.std()
            elif ".modules_to_save." in name:
                module = name.split(".modules_to_save.")[0].rpartition(".")[2]
                rows = torch.tensor(list((changed or {}).get(module, ())), dtype=torch.int64)
                noise = torch.randn(len(rows), *param.shape[1:], generator=generator)
                param[rows] += noise * row_scale * param.std()
    model.save_pretrained(str(out_dir), safe_serialization=True, save_embedding_layers=save_embedding_layers)
    return Path(out_dir)
