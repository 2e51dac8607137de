"""Activation (gradient) checkpointing across the transformers versions we meet.

transformers 5.2x renamed ``gradient_checkpointing_enable``/``_disable`` and ``TrainingArguments``'s
``gradient_checkpointing`` to ``activation_checkpointing…`` and deprecates the old names (a
FutureWarning until v6); the GPU machine's 5.17 has only the old ones. The trainer and the benches
call these three instead of either spelling.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments


def enable_checkpointing(model: Any, **kwargs: Any) -> None:
    """Checkpoint ``model``'s decoder layers; ``kwargs`` go to ``torch.utils.checkpoint``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: Any) -> None:
    """Undo :func:`enable_checkpointing`."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def checkpointing_argument(enabled: bool) -> dict[str, bool]:
    """``TrainingArguments``' keyword for checkpointing, in this version's spelling."""
    fields = TrainingArguments.__dataclass_fields__
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": enabled}
