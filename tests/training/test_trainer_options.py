"""The trainer's options on the tiny model: packing, gradient accumulation, schedules, weight decay,
gradient checkpointing, "auto" hyperparameters, and exact resume with them on."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from serving.contracts.errors import InvalidInput
from serving.engine.lora.reader import validate_adapter_dir
from training.examples import Example, encode_example
from training.hyperparameters import Hyperparameters, Limits, fit_to_dataset, resolve_hyperparameters
from training.packing import layout, target_logprobs
from training.schedules import lr_factor
from training.steps import train_step
from training.trainer import LoraTrainer, load_base, optimizer_groups
from training_support import QA
from test_trainer import Hooks, weights

LIMITS = Limits(max_rank=64, max_seq_length=4096)


@pytest.fixture(scope="module")
def base(base_model_dir):
    return load_base(str(base_model_dir))


@pytest.fixture(scope="module")
def examples(base):
    """Chat and text examples of different lengths (text trains every token, the first one too)."""
    chats = [encode_example(Example(format="chat", messages=(
        {"role": "user", "content": question, "weight": 1},
        {"role": "assistant", "content": answer, "weight": 1})), base.tokenizer) for question, answer in QA]
    texts = [encode_example(Example(format="text", text=answer * 3), base.tokenizer) for _, answer in QA[:4]]
    return chats + texts


def summed_nll(model, rows) -> float:
    with torch.no_grad():
        logprobs, trained = target_logprobs(model(**rows.model_inputs()).logits, rows)
    return -float((logprobs * trained).sum())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_give_the_loss_of_the_examples_one_per_row(base, examples, attention, one_thread):
    previous = base.model.config._attn_implementation
    base.model.set_attn_implementation(attention)
    try:
        pad = base.tokenizer.pad_token_id
        unpacked = layout(examples, pad_id=pad, device=base.device, packed=False, capacity=128)
        packed = layout(examples, pad_id=pad, device=base.device, packed=True, capacity=128)
        assert packed.input_ids.shape[0] < len(examples) // 3  # several examples share each row
        expected = summed_nll(base.model, unpacked)
        assert summed_nll(base.model, packed) == pytest.approx(expected, rel=1e-5)
        # The same rows with positions running on: every example attends to those before it (the
        # random tiny model's attention moves the loss little, but far beyond the tolerance above).
        leaking = dataclasses.replace(packed, position_ids=None)
        assert abs(summed_nll(base.model, leaking) - expected) > 10 * 1e-5 * expected
    finally:
        base.model.set_attn_implementation(previous)


def gradients(base, items, hp: Hyperparameters) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                  task_type="CAUSAL_LM", init_lora_weights=False))
    try:
        model.train()
        train_step(model, items, hp, pad_id=base.tokenizer.pad_token_id, device=base.device)
        return {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}
    finally:
        model.unload()
        if hasattr(base.model, "peft_config"):
            del base.model.peft_config


def test_k_micro_batches_give_the_gradient_of_one_batch_k_times_larger(base, examples, one_thread):
    one = gradients(base, examples, Hyperparameters(batch_size=12, max_seq_length=128))
    assert all(grad.abs().sum() > 0 for grad in one.values())
    for accumulated in (Hyperparameters(batch_size=12, gradient_accumulation_steps=4, max_seq_length=128),
                        Hyperparameters(batch_size=12, gradient_accumulation_steps=3, packing=True, max_seq_length=128)):
        got = gradients(base, examples, accumulated)
        for name, grad in one.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-7)


def test_schedules_follow_their_formulas():
    total, warmup_ratio = 100, 0.1  # 10 warm-up steps
    for schedule in ("linear", "cosine", "constant"):
        assert [lr_factor(schedule, step, total, warmup_ratio) for step in (0, 4, 9)] == [1 / 11, 5 / 11, 10 / 11]
        assert lr_factor(schedule, 10, total, warmup_ratio) == 1.0
    for step in (10, 37, 55, 99):
        progress = (step - 10) / 90
        assert lr_factor("linear", step, total, warmup_ratio) == pytest.approx(1 - progress)
        assert lr_factor("cosine", step, total, warmup_ratio) == pytest.approx(0.5 * (1 + math.cos(math.pi * progress)))
        assert lr_factor("constant", step, total, warmup_ratio) == 1.0
    assert lr_factor("cosine", 55, total, warmup_ratio) == pytest.approx(0.5)


def test_the_trainer_reports_the_cosine_schedules_rate(base, examples, tmp_path, one_thread):
    hp = Hyperparameters(n_epochs=2, batch_size=4, learning_rate=1e-3, max_seq_length=128, r=2, lora_alpha=4,
                         lora_dropout=0.0, warmup_ratio=0.25, lr_scheduler_type="cosine")
    hooks = Hooks(tmp_path)
    LoraTrainer(base, hp, seed=1, train=examples, valid=[], hooks=hooks, work_dir=tmp_path / "run", fingerprint="x",
                base_model_name="tiny-llama", checkpoint_every=100, log_every=1).run()
    # A step's metrics carry the rate of the next step (the scheduler has stepped).
    assert [log.learning_rate for log in hooks.logs] == pytest.approx(
        [1e-3 * lr_factor("cosine", log.step, 6, 0.25) for log in hooks.logs])
    assert len(hooks.logs) == 6 and hooks.logs[-1].learning_rate == 0.0


def test_weight_decay_shrinks_the_lora_matrices_and_spares_biases_and_norms(base, examples, tmp_path, one_thread):
    def one_step(decay: float) -> dict[str, torch.Tensor]:
        hp = Hyperparameters(n_epochs=1, batch_size=len(examples), learning_rate=0.1, max_seq_length=128, r=2,
                             lora_alpha=4, lora_dropout=0.0, warmup_ratio=0.0, weight_decay=decay)
        return weights(LoraTrainer(base, hp, seed=3, train=examples, valid=[], hooks=Hooks(tmp_path),
                                   work_dir=tmp_path / f"wd-{decay}", fingerprint="x", base_model_name="tiny-llama",
                                   checkpoint_every=100, log_every=1).run())

    plain, decayed = one_step(0.0), one_step(0.5)
    # B starts at zero, so the first step leaves A's gradient zero: A moves by the decay alone, lr × wd × A.
    lora_a = [name for name in plain if "lora_A" in name]
    assert lora_a and all(torch.allclose(decayed[name], plain[name] * (1 - 0.1 * 0.5)) for name in lora_a)

    module = torch.nn.Sequential()
    module.add_module("proj", torch.nn.Linear(4, 4))
    module.add_module("norm", torch.nn.LayerNorm(4))
    decay_group, exempt_group = optimizer_groups(module, 0.1)
    assert decay_group["weight_decay"] == 0.1 and [tuple(p.shape) for p in decay_group["params"]] == [(4, 4)]
    assert exempt_group["weight_decay"] == 0.0 and len(exempt_group["params"]) == 3  # proj.bias, norm.weight/bias


def test_gradient_checkpointing_trains_the_same_adapter_and_is_switched_off_after(base, examples, tmp_path,
                                                                                 one_thread):
    def run(checkpointing: bool) -> dict[str, torch.Tensor]:
        hp = Hyperparameters(n_epochs=1, batch_size=4, learning_rate=1e-2, max_seq_length=128, r=2, lora_alpha=4,
                             lora_dropout=0.1, gradient_checkpointing=checkpointing)
        return weights(LoraTrainer(base, hp, seed=5, train=examples, valid=[], hooks=Hooks(tmp_path),
                                   work_dir=tmp_path / f"gc-{checkpointing}", fingerprint="x",
                                   base_model_name="tiny-llama", checkpoint_every=100, log_every=1).run())

    plain, checkpointed = run(False), run(True)
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=1e-4, atol=1e-6)
    assert not base.model.is_activation_checkpointing


def test_use_dora_trains_a_dora_adapter_the_engine_reads_as_one(base, examples, tmp_path, one_thread):
    hp = resolve_hyperparameters({"n_epochs": 1, "batch_size": 4, "learning_rate": 1e-2, "max_seq_length": 128,
                                  "r": 2, "lora_alpha": 4, "use_dora": True}, LIMITS)
    assert hp.use_dora
    result = LoraTrainer(base, hp, seed=5, train=examples, valid=[], hooks=Hooks(tmp_path), work_dir=tmp_path / "dora",
                         fingerprint="x", base_model_name="tiny-llama", checkpoint_every=100, log_every=1).run()
    assert json.loads((result.adapter_dir / "adapter_config.json").read_text())["use_dora"] is True
    magnitudes = {name: t for name, t in weights(result).items() if name.endswith(".lora_magnitude_vector")}
    assert magnitudes, "a DoRA adapter saves a magnitude per adapted module"
    spec = validate_adapter_dir(result.adapter_dir, base_config=base.model.config, max_lora_rank=8)
    assert spec.kind == "dora" and spec.target_modules
    # The magnitudes were trained: PEFT starts them at the base weight's row norms.
    name, trained = next(iter(sorted(magnitudes.items())))
    module = name.removeprefix("base_model.model.").removesuffix(".lora_magnitude_vector")
    initial = base.model.get_submodule(module).weight.detach().float().norm(dim=1)
    assert not torch.allclose(trained.float(), initial)


def test_use_dora_must_be_a_switch():
    with pytest.raises(InvalidInput, match="use_dora"):
        resolve_hyperparameters({"use_dora": "yes"}, LIMITS)


def test_resume_with_accumulation_packing_and_cosine_gives_the_uninterrupted_weights(base, examples, tmp_path,
                                                                                     one_thread):
    hp = Hyperparameters(n_epochs=3, batch_size=6, gradient_accumulation_steps=3, packing=True,
                         lr_scheduler_type="cosine", weight_decay=0.01, learning_rate=1e-2, max_seq_length=128, r=4,
                         lora_alpha=8, lora_dropout=0.1)

    def trainer(hooks, name):
        return LoraTrainer(base, hp, seed=11, train=examples, valid=examples[:2], hooks=hooks,
                           work_dir=tmp_path / name, fingerprint="v1", base_model_name="tiny-llama",
                           checkpoint_every=3, log_every=2)

    straight = trainer(Hooks(tmp_path), "a").run()
    assert straight.steps == 6
    interrupted = Hooks(tmp_path, fail_after=4)
    with pytest.raises(RuntimeError, match="worker lost"):
        trainer(interrupted, "b").run()
    resumed = trainer(Hooks(tmp_path), "c").run(resume_from=interrupted.checkpoints[3])
    assert resumed.resumed_from_step == 3
    expected, got = weights(straight), weights(resumed)
    assert expected.keys() == got.keys() and all(torch.equal(expected[name], got[name]) for name in expected)


def test_auto_picks_epochs_batch_and_rate_from_the_number_of_examples():
    hp = resolve_hyperparameters({"n_epochs": "auto", "batch_size": "auto", "learning_rate": "auto"}, LIMITS)
    assert hp.auto == ["n_epochs", "batch_size", "learning_rate"]
    picks = {count: fit_to_dataset(hp, count, LIMITS) for count in (10, 16, 40, 1_000, 5_000, 20_000, 100_000)}
    assert [picks[count].n_epochs for count in (10, 16, 40, 1_000, 5_000, 20_000, 100_000)] == [10, 6, 3, 3, 3, 1, 1]
    assert [picks[count].batch_size for count in (10, 1_000, 5_000, 20_000, 100_000)] == [4, 4, 10, 40, 64]
    assert picks[5_000].learning_rate == pytest.approx(2e-4 * math.sqrt(10 / 4))
    assert all(not item.auto for item in picks.values())
    # A small set's rate is raised by 1000 / n, at most 10 ×: few steps move the adapter only at a higher rate.
    assert [picks[count].learning_rate for count in (10, 16, 40, 1_000)] == pytest.approx([2e-3, 2e-3, 2e-3, 2e-4])
    assert fit_to_dataset(hp, 500, LIMITS).learning_rate == pytest.approx(4e-4)
    # The demo's dataset (examples/demo-facts.jsonl, 36 examples): 3 epochs of batch 4 at 2e-3.
    demo = fit_to_dataset(hp, 36, LIMITS)
    assert (demo.n_epochs, demo.batch_size, demo.learning_rate) == (3, 4, pytest.approx(2e-3))
    # Only the names given as "auto" are picked; others keep what was given or their default.
    fixed = fit_to_dataset(resolve_hyperparameters({"n_epochs": "auto", "batch_size": 2}, LIMITS), 16, LIMITS)
    assert (fixed.n_epochs, fixed.batch_size, fixed.learning_rate) == (6, 2, 2e-4)
    assert fit_to_dataset(resolve_hyperparameters({}, LIMITS), 16, LIMITS).n_epochs == 3


def test_new_hyperparameters_are_checked():
    for raw, param in (({"lr_scheduler_type": "step"}, "lr_scheduler_type"), ({"packing": 1}, "packing"),
                       ({"batch_size": 2, "gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
                       ({"weight_decay": -0.1}, "weight_decay"), ({"beta": 0.2}, "beta")):
        with pytest.raises(InvalidInput) as raised:
            resolve_hyperparameters(raw, LIMITS)
        assert raised.value.param == f"hyperparameters.{param}", raw


def test_a_lora_models_parameters_are_one_optimizer_group_as_in_checkpoints_saved_before_weight_decay(base):
    model = get_peft_model(base.model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    try:
        [group] = optimizer_groups(model, 0.1)
        assert group["weight_decay"] == 0.1 and len(group["params"]) == 2 * base.model.config.num_hidden_layers
        # The optimizer state the trainer saved when it made a single group loads into this one.
        old = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], weight_decay=0.0)
        torch.optim.AdamW(optimizer_groups(model, 0.0)).load_state_dict(old.state_dict())
    finally:
        model.unload()
        if hasattr(base.model, "peft_config"):
            del base.model.peft_config
