"""A job's trainer on every rank: what rank 0 sends the others, and the entry point of a rank ≥ 1.

`trainer_base` gives a run its base and world: the process's shared base for one GPU (unchanged;
a QLoRA job's is the process's INT4 base instead, training.int4_base), or, for several, this run's
own copy of the base, with ranks 1…N-1 started (training.distributed) and sent the run's inputs
(`RunInputs`: the base's path, hyperparameters, seed, encoded examples, fingerprint). A rank ≥ 1
(`python -m training.ranks`) builds the same LoraTrainer with hooks that record nothing and runs it
until rank 0 ends the run; it needs no database and no storage.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.distributed import World, join, launch
from training.hyperparameters import Hyperparameters
from training.int4_base import load_int4_base
from training.int4_layout import INT4
from training.preference import TrainItem
from training.trainer import (LoadedBase, LoraTrainer, StepMetrics, TrainingInterrupted, TrainingStopped, load_base,
                              load_tokenizer)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInputs:
    """Everything a rank needs to run the same loop as rank 0 (all of it picklable)."""

    base_path: str
    hyperparameters: dict[str, Any]
    seed: int
    train: list[TrainItem]
    valid: list[TrainItem]
    fingerprint: str
    base_model_name: str
    checkpoint_every: int
    log_every: int

    def trainer(self, base: LoadedBase, hooks: Any, work_dir: Path, world: World | None, **options: Any) -> LoraTrainer:
        return LoraTrainer(base, Hyperparameters.from_dict(self.hyperparameters), seed=self.seed, train=self.train,
                           valid=self.valid, hooks=hooks, work_dir=work_dir, fingerprint=self.fingerprint,
                           base_model_name=self.base_model_name, checkpoint_every=self.checkpoint_every,
                           log_every=self.log_every, world=world, **options)


def world_size(gpus: int) -> int:
    """The ranks a job asking for `gpus` runs on: as many, or the GPUs this host has if fewer (a
    checkpoint resumes at any world size and the global batch is the same, so the adapter is too)."""
    return min(gpus, torch.cuda.device_count()) if torch.cuda.is_available() else gpus


def own_base(path: str, world: World) -> LoadedBase:
    """This run's copy of the base, left on the CPU for FSDP to move each rank's shard to its device."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return LoadedBase(model=model, tokenizer=load_tokenizer(path), path=path, device=world.device)


def shared_base(path: str, quantization: str) -> LoadedBase:
    """The process's one-GPU base, bf16 or INT4 (a job's `base_quantization`). A process holds one of the
    two at a time: the other is dropped first, so a worker's memory is one base's, whichever its jobs ask
    for (a job of the other kind loads its base again)."""
    if quantization == INT4:
        load_base.cache_clear()
        return load_int4_base(path)
    load_int4_base.cache_clear()
    return load_base(path)


@contextmanager
def trainer_base(inputs: RunInputs, size: int) -> Iterator[tuple[LoadedBase, World | None]]:
    """The base and world a run trains on (module docstring); the other ranks are ended on exit."""
    if size == 1:
        quantization = Hyperparameters.from_dict(inputs.hyperparameters).base_quantization
        yield shared_base(inputs.base_path, quantization), None
        return
    # The process's cached base would hold memory (cuda:0's on a GPU) beside rank 0's shard.
    load_base.cache_clear()
    load_int4_base.cache_clear()
    with launch(size) as world:
        world.broadcast(inputs)
        yield own_base(inputs.base_path, world), world


class _Silent:
    """A rank ≥ 1's hooks: rank 0 decides and records; this rank only computes."""

    def should_stop(self) -> bool:
        return False

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        return None

    def on_log(self, metrics: StepMetrics) -> None:
        return None

    def on_checkpoint(self, step: int, directory: Path, metrics: dict[str, Any]) -> None:
        return None


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    world = join()
    inputs: RunInputs = world.broadcast(None)
    # Never created: only rank 0 writes checkpoints and the adapter (so a killed rank leaves nothing).
    work_dir = Path(tempfile.gettempdir()) / f"loraplex-rank-{world.rank}-unused"
    trainer = inputs.trainer(own_base(inputs.base_path, world), _Silent(), work_dir, world)
    try:
        trainer.run()
    except (TrainingStopped, TrainingInterrupted) as ended:
        logger.info("Rank %s stops with rank 0: %s", world.rank, type(ended).__name__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
