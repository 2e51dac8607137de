"""The LoRA trainer on the tiny model: it learns, resumes exactly, stops on request, leaves the base clean."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training.examples import Example, encode_example
from training.hyperparameters import Hyperparameters
from training.trainer import CheckpointMismatch, LoraTrainer, TrainingStopped, load_base, token_nll
from training_support import QA

HP = Hyperparameters(n_epochs=4, batch_size=4, learning_rate=1e-2, max_seq_length=128, r=4, lora_alpha=8,
                     lora_dropout=0.1)


@pytest.fixture(scope="module")
def base(base_model_dir):
    return load_base(str(base_model_dir))


@pytest.fixture(scope="module")
def examples(base):
    return [encode_example(Example(format="chat", messages=(
        {"role": "user", "content": question, "weight": 1},
        {"role": "assistant", "content": answer, "weight": 1})), base.tokenizer) for question, answer in QA]


class Hooks:
    def __init__(self, root: Path, fail_after: int | None = None, stop_after: int | None = None) -> None:
        self.keep = Path(tempfile.mkdtemp(dir=root))
        self.fail_after, self.stop_after = fail_after, stop_after
        self.step, self.logs, self.checkpoints = 0, [], {}

    def should_stop(self) -> bool:
        return self.stop_after is not None and self.step >= self.stop_after

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        self.step = step
        if self.fail_after is not None and step > self.fail_after:
            raise RuntimeError("worker lost")

    def on_log(self, metrics) -> None:
        self.logs.append(metrics)

    def on_checkpoint(self, step: int, directory: Path, metrics: dict) -> None:
        self.checkpoints[step] = shutil.copytree(directory, self.keep / f"checkpoint-{step}")


def trainer(base, examples, hooks, work_dir, fingerprint="data-v1") -> LoraTrainer:
    return LoraTrainer(base, HP, seed=11, train=examples, valid=examples[:2], hooks=hooks, work_dir=work_dir,
                       fingerprint=fingerprint, base_model_name="tiny-llama", checkpoint_every=3, log_every=2)


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.adapter_dir / "adapter_model.safetensors")


def test_resuming_from_a_checkpoint_gives_the_weights_of_an_uninterrupted_run(base, examples, tmp_path, one_thread):
    before = {name: tensor.clone() for name, tensor in base.model.state_dict().items()}
    straight = trainer(base, examples, Hooks(tmp_path), tmp_path / "a").run()
    assert straight.steps == 8 and straight.resumed_from_step is None

    interrupted = Hooks(tmp_path, fail_after=4)
    with pytest.raises(RuntimeError, match="worker lost"):
        trainer(base, examples, interrupted, tmp_path / "b").run()
    assert sorted(interrupted.checkpoints) == [3]
    resumed = trainer(base, examples, Hooks(tmp_path), tmp_path / "c").run(resume_from=interrupted.checkpoints[3])
    assert resumed.resumed_from_step == 3 and resumed.trained_tokens == straight.trained_tokens

    expected, got = weights(straight), weights(resumed)
    assert expected.keys() == got.keys() and all(torch.equal(expected[name], got[name]) for name in expected)
    after = base.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[name], after[name]) for name in before)
    assert not hasattr(base.model, "peft_config")


def test_training_lowers_the_loss_of_the_training_completions(base, examples, tmp_path, one_thread):
    base_nll = token_nll(base.model, examples, base.tokenizer.pad_token_id, base.device)
    hooks = Hooks(tmp_path)
    result = trainer(base, examples, hooks, tmp_path / "run").run()
    # log_every=2, but a job this short logs every step (training.pace.log_interval).
    assert [log.step for log in hooks.logs] == list(range(1, result.steps + 1))
    assert hooks.logs[-1].train_loss < hooks.logs[0].train_loss
    accuracies = [log.train_mean_token_accuracy for log in hooks.logs]
    assert all(0 <= value <= 1 for value in accuracies) and accuracies[-1] > accuracies[0], accuracies
    assert result.valid_loss is not None and result.valid_loss < base_nll
    config = (result.adapter_dir / "adapter_config.json").read_text()
    assert '"tiny-llama"' in config and set(result.target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_stop_request_ends_the_run_before_the_next_step(base, examples, tmp_path, one_thread):
    hooks = Hooks(tmp_path, stop_after=2)
    with pytest.raises(TrainingStopped):
        trainer(base, examples, hooks, tmp_path / "run").run()
    assert hooks.step == 2
    assert not any("lora" in name for name, _ in base.model.named_modules())


def test_a_checkpoint_of_other_data_is_refused(base, examples, tmp_path, one_thread):
    kept = Hooks(tmp_path, fail_after=3)
    with pytest.raises(RuntimeError):
        trainer(base, examples, kept, tmp_path / "a").run()
    with pytest.raises(CheckpointMismatch):
        trainer(base, examples, Hooks(tmp_path), tmp_path / "b", fingerprint="data-v2").run(
            resume_from=kept.checkpoints[3])
