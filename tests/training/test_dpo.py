"""DPO in this process: its loss against the formula on fixed log-probabilities, the preference
format's line errors, and the trainer on the tiny model (it learns the preferences, keeps no second
copy of the base, and resumes exactly)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import pytest
import torch

from training.dpo import dpo_losses
from training.hyperparameters import DPO, Hyperparameters
from training.preference import encode, iter_valid_pairs, parse
from training.steps import evaluation_loss
from training.trainer import LoraTrainer, load_base
from training.validation import validate_lines
from training_support import QA
from test_trainer import Hooks, weights


def preference_lines(repeat: int = 1) -> list[dict]:
    """Each question's preferred answer is its own; the other is the next question's answer."""
    return [{"input": {"messages": [{"role": "system", "content": "Answer briefly."},
                                    {"role": "user", "content": question}]},
             "preferred_output": [{"role": "assistant", "content": answer}],
             "non_preferred_output": [{"role": "assistant", "content": QA[(index + 1) % len(QA)][1]}]}
            for _ in range(repeat) for index, (question, answer) in enumerate(QA)]


def raw(rows: list) -> list[bytes]:
    return [json.dumps(row).encode() if not isinstance(row, bytes) else row for row in rows]


def test_the_loss_is_minus_log_sigmoid_of_beta_times_the_log_ratio_margin():
    policy_chosen = torch.tensor([-10.0, -4.0, -30.0])
    policy_rejected = torch.tensor([-12.0, -3.0, -30.0])
    reference_chosen = torch.tensor([-11.0, -5.0, -29.0])
    reference_rejected = torch.tensor([-11.0, -5.0, -31.0])
    got = dpo_losses(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=0.5)
    # margins: 0.5·((1) − (−1)) = 1; 0.5·((1) − (2)) = −0.5; 0.5·((−1) − (1)) = −1
    expected = [math.log1p(math.exp(-margin)) for margin in (1.0, -0.5, -1.0)]
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    same = dpo_losses(policy_chosen, policy_rejected, policy_chosen, policy_rejected, beta=0.1)
    assert same.tolist() == pytest.approx([math.log(2)] * 3)  # the policy is the reference: log 2


def test_a_malformed_preference_line_is_a_line_error(base):
    lines = preference_lines()[:3]
    lines[1] = {**lines[1], "non_preferred_output": {"role": "assistant", "content": "Not a list."}}
    lines[2] = {**lines[2], "input": {"messages": [{"role": "robot", "content": "Hi"}]}}
    report = validate_lines(raw(lines) + [b"{\"messages\": []}", b"[1"], tokenizer=base.tokenizer, max_seq_length=64)
    assert report.format == "preference" and report.num_examples == 1
    assert [(problem.line, problem.code) for problem in report.errors] == [
        (2, "invalid_non_preferred_output"), (3, "unrecognized_role"), (4, "mixed_formats"), (5, "invalid_json")]
    assert "'non_preferred_output' must be a list of exactly one assistant message" in report.errors[0].message
    # A pair counts both sequences' tokens.
    good = validate_lines(raw(preference_lines()), tokenizer=base.tokenizer, max_seq_length=256)
    assert good.is_valid and good.stats["trained_tokens"] > 0 and good.stats["num_examples"] == len(QA)


@pytest.mark.parametrize("output", ["preferred_output", "non_preferred_output"])
def test_an_output_of_two_assistant_messages_is_refused_not_truncated(output):
    line = preference_lines()[0]
    line[output] = [{"role": "assistant", "content": "First."}, {"role": "assistant", "content": "Second."}]
    example, errors, _ = parse(line)
    assert example is None
    assert [problem.code for problem in errors] == [f"invalid_{output}"]
    assert f"'{output}' must be a list of exactly one assistant message" in errors[0].message
    line[output] = []
    assert [problem.code for problem in parse(line)[1]] == [f"invalid_{output}"]


@pytest.fixture(scope="module")
def base(base_model_dir):
    return load_base(str(base_model_dir))


@pytest.fixture(scope="module")
def pairs(base):
    return [encode(example, base.tokenizer, 128) for example in iter_valid_pairs(raw(preference_lines(2)))]


HP = Hyperparameters(method=DPO, beta=0.5, n_epochs=10, batch_size=4, gradient_accumulation_steps=2, packing=True,
                     learning_rate=1e-2, max_seq_length=128, r=4, lora_alpha=8, lora_dropout=0.1,
                     lr_scheduler_type="cosine", gradient_checkpointing=True)


# Resuming needs no learning, only a run that crosses epochs after its checkpoint: 12 steps (three epochs
# of four), interrupted after 7 and resumed from 5, cost a third of HP's 40.
RESUME_HP = dataclasses.replace(HP, n_epochs=3)


def dpo_trainer(base, pairs, hooks, work_dir, hp: Hyperparameters = HP) -> LoraTrainer:
    return LoraTrainer(base, hp, seed=2, train=pairs, valid=pairs[:4], hooks=hooks, work_dir=work_dir,
                       fingerprint="prefs-v1", base_model_name="tiny-llama", checkpoint_every=5, log_every=1)


@pytest.mark.slow
def test_dpo_learns_the_preferences_without_touching_the_base(base, pairs, tmp_path, one_thread):
    before = {name: tensor.clone() for name, tensor in base.model.state_dict().items()}
    hooks = Hooks(tmp_path)
    result = dpo_trainer(base, pairs, hooks, tmp_path / "run").run()
    assert result.steps == 40
    # At the first step the adapter is the base (B = 0): the loss is log 2; it falls from there.
    assert hooks.logs[0].train_loss == pytest.approx(math.log(2), abs=1e-4)
    losses = [log.train_loss for log in hooks.logs]
    assert sum(losses[-4:]) / 4 < math.log(2) - 0.2, losses
    assert hooks.logs[-1].train_reward_accuracy == 1.0 and hooks.logs[-1].train_mean_token_accuracy is None
    assert result.valid_loss is not None and result.valid_loss < math.log(2)
    after = base.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    # With the adapter gone, the base's own DPO loss against itself is log 2 again.
    unadapted = evaluation_loss(_Unadapted(base.model), pairs[:4], HP, pad_id=base.tokenizer.pad_token_id,
                                device=base.device)
    assert unadapted == pytest.approx(math.log(2), abs=1e-6)


class _Unadapted(torch.nn.Module):
    """The base as a DPO policy with no adapter: disable_adapter() is a no-op, so policy = reference."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs)

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@pytest.mark.slow
def test_a_resumed_dpo_run_gives_the_weights_of_an_uninterrupted_one(base, pairs, tmp_path, one_thread):
    straight = dpo_trainer(base, pairs, Hooks(tmp_path), tmp_path / "a", RESUME_HP).run()
    assert straight.steps == 12
    interrupted = Hooks(tmp_path, fail_after=7)
    with pytest.raises(RuntimeError, match="worker lost"):
        dpo_trainer(base, pairs, interrupted, tmp_path / "b", RESUME_HP).run()
    resumed = dpo_trainer(base, pairs, Hooks(tmp_path), tmp_path / "c", RESUME_HP).run(
        resume_from=interrupted.checkpoints[5])
    assert resumed.resumed_from_step == 5
    expected, got = weights(straight), weights(resumed)
    assert expected.keys() == got.keys() and all(torch.equal(expected[name], got[name]) for name in expected)
