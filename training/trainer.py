"""The LoRA trainer: a plain torch loop over the shared base model, resumable from a checkpoint.

The base model is loaded once per process (`load_base`) and reused by every job the process runs:
PEFT injects the LoRA layers into it for a job and `unload()` takes them out again, so the base
weights are never copied or changed (gradient checkpointing, when a job asks for it, is switched
off again too). Loss is taken only where the encoded example says (assistant replies,
completions; training.examples); a DPO job's on its pairs' replies (training.dpo). A step's
passes (accumulation, packing, autocast) are training.steps'; the schedule training.schedules'.
CPU runs in fp32, CUDA in bf16 with the LoRA weights in fp32 (PEFT's adapter autocast) under bf16
autocast; the code is the same.

Why our loop and not TRL's SFTTrainer/DPOTrainer: the exact resume below, the hooks (cancel,
pause, a worker's stop, checkpoints to blob storage) and one base shared by every job, and the
speed: with its decoder layers compiled and packed rows attended by their bounds
(training.compiled_layers, training.packed_attention), a fused AdamW and no read off the GPU per
step, it trained 1.96 × the tokens/s of transformers.Trainer + PEFT on an H100 (1.61 × on the H200
before the last two) at less peak memory (docs/benchmarks.md, "Trainer, H100").

A checkpoint holds everything the loop needs to continue exactly where it stopped: the LoRA
weights (PEFT's safetensors), the optimizer and scheduler state, the RNG states and the step, from
which the epoch and the position in that epoch's deterministic shuffle follow. Resuming from a
checkpoint gives the same weights as never having stopped.

Several ranks (a job's `gpus`, training.distributed): every rank runs this loop on its own copy
of the base, sharded by FSDP2; rank 0 decides before each step whether to stop and broadcasts it,
each rank passes its share of the step's batch, the LoRA gradients are summed over the ranks, and
only rank 0 writes checkpoints and the adapter (the same files as one process writes).

No Django here: the caller supplies hooks for progress, metrics, cancellation and checkpoint storage.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from training.checkpointing import disable_checkpointing, enable_checkpointing
from training.compiled_layers import compile_wanted, compiled_layers
from training.distributed import World, shard
from training.examples import EncodedExample
from training.hyperparameters import ALL_LINEAR, DPO, SUPPORTED_TARGET_MODULES, Hyperparameters
from training.pace import log_interval
from training.packed_attention import use_packed_attention
from training.schedules import lr_lambda
from training.preference import TrainItem
from training.steps import StepOutcome, evaluation_loss, summed_outcomes, train_step
from training.tokenizer import load_tokenizer

# The directory of a checkpoint: PEFT's two adapter files, then these (the state file is written
# last and marks the checkpoint complete).
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
MAX_GRAD_NORM = 1.0
# Embeddings are never adapted; "auto" would look the base model's name up on the Hugging Face Hub.
SAVE_OPTIONS = {"safe_serialization": True, "save_embedding_layers": False}


@dataclass(frozen=True)
class LoadedBase:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    path: str
    device: torch.device

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@lru_cache(maxsize=1)
def load_base(path: str) -> LoadedBase:
    """The base model and tokenizer at `path`, loaded once per process (bf16 on CUDA, fp32 on CPU)."""
    device = pick_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # transformers wraps PreTrainedModel.to in a decorator whose stub takes the model, not a device.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)  # type: ignore[arg-type]
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return LoadedBase(model=model, tokenizer=load_tokenizer(path), path=path, device=device)


@dataclass(frozen=True)
class StepMetrics:
    step: int
    total_steps: int
    epoch: float
    train_loss: float
    learning_rate: float
    trained_tokens: int
    valid_loss: float | None = None
    # Share of the trained tokens the model predicted exactly (argmax), over the logging window.
    train_mean_token_accuracy: float | None = None
    # DPO: share of the pairs whose chosen reply the adapter prefers more than the reference does.
    train_reward_accuracy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if value is not None}


@dataclass(frozen=True)
class TrainResult:
    adapter_dir: Path
    target_modules: list[str]
    steps: int
    trained_tokens: int
    train_loss: float | None
    valid_loss: float | None
    resumed_from_step: int | None


class TrainingStopped(Exception):
    """Raised when the hooks ask the loop to stop (cancellation) before the next step."""


class TrainingInterrupted(Exception):
    """Raised when the run is asked to give the job back (its worker is stopping), once the steps done
    are in a checkpoint: `step` is the step it holds, which the next run resumes from."""

    def __init__(self, step: int) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step = step


class TrainingSetupError(ValueError):
    """The job cannot train as configured on this base model (the message says what to change)."""


class CheckpointMismatch(ValueError):
    """A checkpoint was written for other data or hyperparameters than the run resuming from it."""


class TrainingHooks(Protocol):
    def should_stop(self) -> bool:
        """Checked before every step; True stops the run with TrainingStopped."""

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        """After every step (the hook decides how often to record it)."""

    def on_log(self, metrics: StepMetrics) -> None:
        """Every `log_every` steps (every step of a short job: training.pace) and after the last, with the
        mean train loss since the previous log."""

    def on_checkpoint(self, step: int, directory: Path, metrics: dict[str, Any]) -> None:
        """A complete checkpoint is in `directory`; store it (the directory is removed afterwards)."""


@dataclass(frozen=True)
class RunPlan:
    """How one job's steps are laid out: the same for the first run and for every resumed one."""

    num_examples: int
    batch_size: int
    n_epochs: int

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_examples / self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.n_epochs


def resolve_target_modules(model: torch.nn.Module, requested: str | Sequence[str]) -> list[str]:
    """The module names to adapt: "all-linear" is every supported projection the model has; a list may
    also name the vocabulary modules (embed_tokens, an Embedding; lm_head)."""
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))}
    wanted = SUPPORTED_TARGET_MODULES if requested == ALL_LINEAR else tuple(requested)
    resolved = [name for name in wanted if name in present]
    missing = sorted(set(wanted) - present) if requested != ALL_LINEAR else []
    if missing or not resolved:
        raise TrainingSetupError(
            f"The base model has no module(s) {', '.join(missing) or ', '.join(wanted)} to adapt; choose "
            "target_modules among its projections.")
    return resolved


def _epoch_order(seed: int, epoch: int, num_examples: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def token_nll(model: torch.nn.Module, examples: Sequence[EncodedExample], pad_id: int, device: torch.device,
              batch_size: int = 8) -> float:
    """Mean negative log-likelihood per trained token over the examples (eval mode, no grad)."""
    longest = max(len(example.input_ids) for example in examples)
    hp = Hyperparameters(batch_size=batch_size, max_seq_length=longest)
    return evaluation_loss(model, examples, hp, pad_id=pad_id, device=device)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in AdamW's groups: weight decay on matrices, none on biases and norms."""
    decayed: list[torch.nn.Parameter] = []
    kept: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            exempt = param.ndim < 2 or "bias" in name or "norm" in name
            (kept if exempt else decayed).append(param)
    # Only groups with parameters: a LoRA-only model has one, as every optimizer state saved before
    # the groups existed has, so those checkpoints still resume.
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


class LoraTrainer:
    """Trains one adapter on a loaded base. Use once per job: `run()` always unloads the LoRA layers."""

    def __init__(self, base: LoadedBase, hp: Hyperparameters, *, seed: int, train: Sequence[TrainItem],
                 valid: Sequence[TrainItem], hooks: TrainingHooks, work_dir: Path, fingerprint: str,
                 base_model_name: str, checkpoint_every: int, log_every: int,
                 should_interrupt: Callable[[], bool] = lambda: False, world: World | None = None,
                 compile_layers: bool | None = None, compile_backend: str = "inductor",
                 packed_attention: bool = True) -> None:
        """`should_interrupt` is checked before every step, as the hooks' `should_stop` is: True saves a
        checkpoint of the steps done (unless the last checkpoint holds them) and raises TrainingInterrupted.
        With a `world` the base is this run's own copy (sharded, never given back) and rank 0's hooks decide.
        `compile_layers` (default: on one CUDA device without checkpointing) compiles the decoder layers (training.compiled_layers)
        with `compile_backend`, and `packed_attention` attends packed rows by their sequences' bounds
        (training.packed_attention): both change the speed, not what is computed."""
        if not train:
            raise TrainingSetupError("There are no training examples with tokens to learn from.")
        self.base = base
        self.hp = hp
        self.seed = seed
        self.train_examples = list(train)
        self.valid_examples = list(valid)
        self.hooks = hooks
        self.work_dir = Path(work_dir)
        self.fingerprint = fingerprint
        self.base_model_name = base_model_name
        self.checkpoint_every = max(1, checkpoint_every)
        self.should_interrupt = should_interrupt
        self.world = world
        self.compile_layers = (compile_wanted(base.device, world is not None, hp.gradient_checkpointing, hp.use_dora)
                               if compile_layers is None else compile_layers)
        self.compile_backend = compile_backend
        self.packed_attention = packed_attention
        # Only rank 0 writes checkpoints and the adapter.
        self.writes = world is None or world.rank == 0
        self.plan = RunPlan(len(self.train_examples), hp.batch_size, hp.n_epochs)
        # A short job logs every step, so its chart fills as it runs (training.pace).
        self.log_every = log_interval(max(1, log_every), self.plan.total_steps)
        tokenizer = base.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(self, resume_from: Path | None = None) -> TrainResult:
        """Trains to the end; with a world, rank 0's `resume_from` is every rank's (one host, one scratch folder)."""
        if self.world is not None:
            resume_from = self.world.broadcast(resume_from)
        torch.manual_seed(self.seed)
        target_modules = resolve_target_modules(self.base.model, self.hp.target_modules)
        # PEFT scales by lora_alpha / r and takes any number; its annotation says int.
        config = LoraConfig(r=self.hp.r, lora_alpha=self.hp.lora_alpha,  # type: ignore[arg-type]
                            lora_dropout=self.hp.lora_dropout, target_modules=target_modules, bias="none",
                            task_type="CAUSAL_LM", use_dora=self.hp.use_dora)
        model = get_peft_model(self.base.model, config)
        if self.world is not None:
            shard(model, self.base.model, self.world)
        if self.hp.gradient_checkpointing:
            # Reentrant checkpointing needs an input that requires grad (the base's embeddings do not).
            enable_checkpointing(self.base.model, use_reentrant=True)
            model.enable_input_require_grads()
        try:
            with contextlib.ExitStack() as speedups:
                if self.hp.packing and self.packed_attention:
                    speedups.enter_context(use_packed_attention(self.base.model))
                if self.compile_layers:
                    speedups.enter_context(compiled_layers(self.base.model, backend=self.compile_backend))
                return self._train(model, target_modules, resume_from)
        finally:
            if self.world is None:
                self._give_base_back(model)

    def _give_base_back(self, model: Any) -> None:
        """The shared base as it was before the job (LoRA layers out, checkpointing off, eval mode)."""
        if self.hp.gradient_checkpointing:
            self.base.model.disable_input_require_grads()
            disable_checkpointing(self.base.model)
        model.unload()
        if hasattr(self.base.model, "peft_config"):
            # PEFT leaves its config on the base; the next job must find a plain model.
            del self.base.model.peft_config
        self.base.model.eval()

    def _train(self, model: Any, target_modules: list[str], resume_from: Path | None) -> TrainResult:
        params = [param for param in model.parameters() if param.requires_grad]
        # fused: one kernel a step for all the LoRA tensors. The default (foreach on CUDA) launched
        # a chain of small kernels per chunk of tensors: about 10 ms of the 8B shape's ~140 ms step
        # on an H100 (docs/benchmarks.md, "Trainer"), where the fused step takes well under one.
        optimizer = torch.optim.AdamW(optimizer_groups(model, self.hp.weight_decay), lr=self.hp.learning_rate,
                                      fused=True)  # fmt: skip
        total = self.plan.total_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(self.hp.lr_scheduler_type, total, self.hp.warmup_ratio))
        step, trained_tokens = 0, 0
        if resume_from is not None:
            step, trained_tokens = self._restore(model, optimizer, scheduler, resume_from)
        resumed_from = step if resume_from is not None else None
        if self.world is not None:
            # The fresh LoRA init is the same on every rank (one seed); rank 0's, to be certain.
            self.world.broadcast_params(params)
        # The newest step a checkpoint holds (a fresh run's step 0 needs none).
        saved_step = step

        model.train()
        # The steps since the last log, their loss and counts where the steps left them (on the GPU:
        # training.steps), read once the loop needs the numbers.
        window: list[StepOutcome] = []
        last_train_loss: float | None = None
        valid_loss: float | None = None
        orders: dict[int, list[int]] = {}
        while step < total:
            stop = self.hooks.should_stop()
            interrupt = not stop and self.should_interrupt()
            if self.world is not None:
                stop, interrupt = self.world.agree(stop, interrupt)
            if stop:
                raise TrainingStopped()
            if interrupt:
                if step > saved_step and self.writes:
                    try:
                        self._checkpoint(model, optimizer, scheduler, step, trained_tokens,
                                         {"step": step, "train_loss": last_train_loss, "valid_loss": None,
                                          "train_mean_token_accuracy": None})
                    except Exception as error:
                        # Not saved (storage away): the next run resumes from the newest one that was.
                        raise TrainingInterrupted(saved_step) from error
                raise TrainingInterrupted(step)
            epoch, position = divmod(step, self.plan.steps_per_epoch)
            order = orders.setdefault(epoch, _epoch_order(self.seed, epoch, self.plan.num_examples))
            picked = order[position * self.hp.batch_size:(position + 1) * self.hp.batch_size]
            batch_examples = [self.train_examples[index] for index in picked]
            window.append(self._step(model, params, batch_examples, step))
            # The total norm it returns stays on the device: reading it would wait for the GPU.
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            step += 1
            trained_tokens += sum(example.num_trained_tokens for example in batch_examples)
            epoch_progress = step / self.plan.steps_per_epoch
            self.hooks.on_step(step, total, epoch_progress, trained_tokens)
            checkpoint_due = step % self.checkpoint_every == 0 and step < total
            if step % self.log_every == 0 or step == total or checkpoint_due:
                window_loss, window_correct, window_counted = summed_outcomes(window)
                last_train_loss = window_loss / len(window)
                accuracy = window_correct / window_counted if window_counted else None
                window = []
                evaluate = self.valid_examples and (checkpoint_due or step == total)
                valid_loss = self._valid_loss(model) if evaluate else None
                accuracy_name = "train_reward_accuracy" if self.hp.method == DPO else "train_mean_token_accuracy"
                metrics = StepMetrics(step=step, total_steps=total, epoch=round(epoch_progress, 4),
                                      train_loss=last_train_loss, valid_loss=valid_loss,
                                      learning_rate=float(scheduler.get_last_lr()[0]), trained_tokens=trained_tokens,
                                      **{accuracy_name: accuracy})
                self.hooks.on_log(metrics)
            if checkpoint_due and self.writes:
                self._checkpoint(model, optimizer, scheduler, step, trained_tokens,
                                 {"step": step, "train_loss": last_train_loss, "valid_loss": valid_loss,
                                  accuracy_name: accuracy})
                saved_step = step

        adapter_dir = self.work_dir / "adapter"
        if self.writes:
            self._save(model, adapter_dir)
        return TrainResult(adapter_dir=adapter_dir, target_modules=target_modules, steps=step,
                           trained_tokens=trained_tokens, train_loss=last_train_loss, valid_loss=valid_loss,
                           resumed_from_step=resumed_from)

    def _step(self, model: Any, params: list[torch.nn.Parameter], batch: list[TrainItem], step: int) -> StepOutcome:
        """One step's passes; with a world, this rank's share, the gradients and the outcome summed over the ranks."""
        if self.world is None:
            return train_step(model, batch, self.hp, pad_id=self.pad_id, device=self.base.device)
        self.world.seed_step(self.seed, step)
        outcome = train_step(model, batch, self.hp, pad_id=self.pad_id, device=self.base.device,
                             rank=self.world.rank, world_size=self.world.size)
        self.world.reduce_gradients(params)
        # Read and summed over the ranks every step: the host already waits for the GPU every step
        # with several ranks (`agree` reads rank 0's broadcast decision before each step).
        summed = self.world.sum(summed_outcomes([outcome]))
        # The ranks' mean losses summed are the step's mean loss: divided by one.
        return StepOutcome(torch.tensor(summed, dtype=torch.float64), 1)

    def _save(self, model: Any, directory: Path) -> None:
        """PEFT's adapter files of the model's LoRA weights in `directory`."""
        model.peft_config["default"].base_model_name_or_path = self.base_model_name
        # With several ranks, the model's state_dict() would reshard rank 0's base alone (FSDP's
        # pre-hook), and its next all-gather would no longer match the other ranks': PEFT is given
        # the LoRA weights, whole on every rank, instead.
        given = ({} if self.world is None else
                 {"state_dict": {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}})
        model.save_pretrained(directory, **SAVE_OPTIONS, **given)

    def _valid_loss(self, model: Any) -> float:
        return evaluation_loss(model, self.valid_examples, self.hp, pad_id=self.pad_id, device=self.base.device)

    def _checkpoint(self, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, step: int,
                    trained_tokens: int, metrics: dict[str, Any]) -> None:
        directory = self.work_dir / f"checkpoint-{step}"
        self._save(model, directory)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": _rng_state(self.base.device)}, directory / OPTIMIZER_FILE)
        state = {"step": step, "total_steps": self.plan.total_steps, "trained_tokens": trained_tokens,
                 "fingerprint": self.fingerprint, "saved_at": time.time()}
        (directory / STATE_FILE).write_text(json.dumps(state))
        try:
            self.hooks.on_checkpoint(step, directory, metrics)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def resumable(self, directory: Path) -> bool:
        """Whether the checkpoint in `directory` was written by this job's data and hyperparameters
        (checked before a run: with several ranks, a mismatch found inside one would strand the others)."""
        state = json.loads((directory / STATE_FILE).read_text())
        return bool(state.get("fingerprint") == self.fingerprint and state.get("total_steps") == self.plan.total_steps)

    def _restore(self, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                 directory: Path) -> tuple[int, int]:
        if not self.resumable(directory):
            raise CheckpointMismatch("The checkpoint was written for different data or hyperparameters.")
        state = json.loads((directory / STATE_FILE).read_text())
        set_peft_model_state_dict(model, load_file(directory / ADAPTER_WEIGHTS_FILE, device=str(self.base.device)))
        # Only tensors and plain containers: weights_only refuses anything that would run code.
        # load_state_dict moves the optimizer's tensors to their parameters' device.
        saved = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        _restore_rng(saved["rng"], self.base.device)
        return int(state["step"]), int(state["trained_tokens"])

