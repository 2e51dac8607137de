"""Hugging Face's `transformers.Trainer` + PEFT on the same model and data as bench/trainer.py's
run of our `LoraTrainer`: the other side of the comparison issue 25 asks for (tokens/s and peak
memory, in one process, one after the other on the same base).

The base is shared with our trainer's run: PEFT injects the LoRA layers for this run and
`unload()` takes them out, as our trainer does. The same rank, alpha, target modules, batch, sequence
length, learning rate, gradient checkpointing and precision (bf16 autocast on CUDA: `bf16=True`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Collection, Sequence
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from training.checkpointing import checkpointing_argument, disable_checkpointing
from training.examples import EncodedExample
from training.hyperparameters import SUPPORTED_TARGET_MODULES


class _Examples(torch.utils.data.Dataset):
    def __init__(self, examples: Sequence[EncodedExample]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        example = self.examples[index]
        return {"input_ids": torch.tensor(example.input_ids), "labels": torch.tensor(example.labels)}


class _Stamps(TrainerCallback):
    """The time and trained tokens at every step's end, as bench/trainer.py's hooks record ours: the
    GPU is waited for only at ``sync_steps`` (the stamps a figure divides by), as there, so neither
    loop is stalled where training does not stall it."""

    def __init__(self, tokens_per_step: int, sync_steps: Collection[int]) -> None:
        self.tokens_per_step = tokens_per_step
        self.stamps: list[tuple[float, int]] = []
        self.sync_steps = frozenset(sync_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step in self.sync_steps and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append((time.perf_counter(), state.global_step * self.tokens_per_step))


def run_hf_trainer(model: Any, examples: Sequence[EncodedExample], *, batch: int, rank: int, learning_rate: float,
                   gradient_checkpointing: bool, warmup_steps: int) -> dict[str, float]:
    """tokens/s (after `warmup_steps`) and peak GPU memory (GiB) of transformers.Trainer + PEFT."""
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                        target_modules=[name for name in SUPPORTED_TARGET_MODULES if name in present])
    peft_model = get_peft_model(model, config)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    stamps = _Stamps(sum(example.num_trained_tokens for example in examples[:batch]),
                     sync_steps=(warmup_steps, len(examples) // batch))
    try:
        with tempfile.TemporaryDirectory() as output:
            args = TrainingArguments(
                output_dir=output, per_device_train_batch_size=batch, max_steps=len(examples) // batch,
                learning_rate=learning_rate, lr_scheduler_type="linear", warmup_steps=int(0.03 * (len(examples) // batch)), bf16=cuda,
                logging_steps=10, save_strategy="no", report_to=[],
                remove_unused_columns=False, dataloader_num_workers=0, seed=0, max_grad_norm=1.0,
                use_cpu=not cuda, **checkpointing_argument(gradient_checkpointing))
            Trainer(model=peft_model, args=args, train_dataset=_Examples(examples), callbacks=[stamps]).train()
    finally:
        if gradient_checkpointing:
            disable_checkpointing(model)
        peft_model.unload()
        if hasattr(model, "peft_config"):
            del model.peft_config
    (t0, tokens0), (t1, tokens1) = stamps.stamps[warmup_steps - 1], stamps.stamps[-1]
    return {"tokens_per_s": (tokens1 - tokens0) / (t1 - t0),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
