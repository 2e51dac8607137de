"""QLoRA (issue 41, item 3): LoRA trained over the base's projections in INT4 (training.int4_base).

The quantized projection computes the dequantized weight's product and its input gradient (the torch
path here and the Triton kernels interpreted; on CUDA in test_qlora_cuda.py); the quantized base holds no float
copy of a projection and nothing of it requires grad; a short job on the tiny model lowers the loss
and writes a PEFT adapter that loads on the unquantized base and lowers its loss too; what an INT4
base cannot train is refused before a job is queued, with the combination named.
"""

from __future__ import annotations

import gc
import json
import math
import weakref
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from kernels import int4
from serving.contracts.errors import InvalidInput
from training import conf, int4_layout
from training.examples import Example, encode_example
from training.hyperparameters import Hyperparameters, Limits, resolve_hyperparameters
from training.int4_base import Int4Linear, load_int4_base, quantize_projections
from training.memory_model import Setup, Shape, estimate
from training.ranks import shared_base
from training.trainer import LoraTrainer, TrainingSetupError, load_base, token_nll
from training_support import QA
from test_qlora_cuda import reference_weight, seeded_linear
from test_trainer import Hooks

LIMITS = Limits(max_rank=64, max_seq_length=4096)


def test_the_layouts_numbers_are_the_kernels():
    assert (int4_layout.MIN_GROUP, int4_layout.PACK) == (int4.MIN_GROUP, int4.PACK)


@pytest.mark.parametrize("in_features, group", [(4096, 128), (14336, 128), (64, 64), (96, 96), (48, 48),
                                                (160, 80), (100, None), (8, None)])
def test_group_is_128_or_the_largest_multiple_of_16_dividing_the_inputs(in_features, group):
    assert int4_layout.group_size_for(in_features) == group


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_input_gradient_equal_the_dequantized_weights(bias):
    layer = Int4Linear.quantized(seeded_linear(96, 40, bias), torch.device("cpu"))
    assert layer.group_size == 96 and layer.weight is None
    x = torch.randn(3, 5, 96, requires_grad=True)
    y = layer(x)
    weight = reference_weight(layer, torch.float32)
    expected = x.detach() @ weight + (layer.bias if bias else 0)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ weight.t(), rtol=0, atol=1e-6)
    assert all(tensor.grad is None for tensor in (layer.qweight, layer.qzeros, layer.scales))


@pytest.mark.parametrize("rows, in_features, out_features, group", [(1, 64, 40, 32), (37, 96, 72, 32),
                                                                     (5, 128, 200, 64), (20, 48, 24, 48)])
def test_the_triton_input_gradient_matches_the_reference(rows, in_features, out_features, group):
    """kernels.int4.matmul_t_triton, interpreted on the CPU: partial row and column tiles, groups of
    16 to 64 (a K tile of 16 for 48)."""
    from kernels.fp8 import INTERPRETED

    if not INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    generator = torch.Generator().manual_seed(rows)
    qweight, qzeros, scales = int4.quantize(torch.randn(out_features, in_features, generator=generator), group)
    dy = torch.randn(rows, out_features, generator=generator)
    torch.testing.assert_close(int4.matmul_t_triton(dy, qweight, qzeros, scales, group),
                               int4.matmul_t_torch(dy, qweight, qzeros, scales, group), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_features, out_features, group", [(64, 40, 32), (96, 72, 32), (128, 200, 64),
                                                              (48, 24, 48)])
def test_the_triton_dequantizer_is_the_reference_bit_for_bit(in_features, out_features, group):
    """kernels.int4.dequantize_triton (the backward's on CUDA), interpreted, in fp32: the interpreter rounds
    to bf16 its own way, so bf16 is checked on CUDA (below)."""
    from kernels.fp8 import INTERPRETED

    if not INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    packed = int4.quantize(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(5)), group)
    assert torch.equal(int4.dequantize_triton(*packed, group, torch.float32),
                       int4.dequantize(*packed, group, torch.float32))


def test_quantizing_keeps_no_float_copy_of_a_projection(base_model_dir):
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32).requires_grad_(False)
    linear_weights = [weakref.ref(module.weight) for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear) and ".layers." in name]
    assert quantize_projections(model, torch.device("cpu")) == len(linear_weights) == 14
    gc.collect()
    assert all(ref() is None for ref in linear_weights), "a projection's float weight is still alive"
    projections = [module for module in model.modules() if isinstance(module, torch.nn.Linear)
                   and module is not model.get_output_embeddings()]
    assert all(isinstance(module, Int4Linear) and module.weight is None for module in projections)


def test_the_int4_base_is_frozen_and_its_bytes_are_the_memory_models(base_model_dir):
    base = load_int4_base(str(base_model_dir))
    assert not any(param.requires_grad for param in base.model.parameters())
    held = sum(tensor.numel() * tensor.element_size() for tensor in base.model.parameters())
    held += sum(tensor.numel() * tensor.element_size() for module in base.model.modules()
                if isinstance(module, Int4Linear) for tensor in (module.qweight, module.qzeros, module.scales))
    shape = Shape.from_config(json.loads((base_model_dir / "config.json").read_text()))
    size = base.model.dtype.itemsize  # fp32 on the CPU, bf16 on CUDA
    assert held == shape.base_bytes(size, int4=True) < shape.base_bytes(size, int4=False)
    setup = Setup(base_bytes=size, activation_bytes=size, workspace=0)
    assert estimate(shape, setup).peak - estimate(shape, Setup(**{**setup.__dict__, "int4_base": True})).peak == (
        shape.base_bytes(size, int4=False) - held)


def test_int4_bytes_by_hand():
    # 4096 x 4096 at group 128: 8 MiB of words, 32 groups x 4096 columns of fp16 scales and 4-bit zeros.
    assert int4_layout.int4_bytes(4096, 4096) == 4096 * 4096 // 2 + 32 * 4096 * 2 + 32 * 4096 // 2


def test_a_worker_holds_one_base_at_a_time(base_model_dir):
    path = str(base_model_dir)
    quantized = shared_base(path, "int4")
    assert isinstance(quantized.model.model.layers[0].self_attn.q_proj, Int4Linear)
    assert load_base.cache_info().currsize == 0
    plain = shared_base(path, "none")
    assert type(plain.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert load_int4_base.cache_info().currsize == 0


def _chats(tokenizer):
    return [encode_example(Example(format="chat", messages=(
        {"role": "user", "content": question, "weight": 1},
        {"role": "assistant", "content": answer, "weight": 1})), tokenizer) for question, answer in QA] * 2


def test_a_qlora_job_lowers_the_loss_and_its_adapter_loads_on_the_unquantized_base(base_model_dir, tmp_path,
                                                                                    one_thread):
    base = load_int4_base(str(base_model_dir))
    examples = _chats(base.tokenizer)
    pad = base.tokenizer.pad_token_id
    hp = resolve_hyperparameters({"n_epochs": 4, "batch_size": 4, "learning_rate": 1e-2, "r": 4, "lora_alpha": 8,
                                  "lora_dropout": 0.0, "base_quantization": "int4"}, LIMITS)
    before = token_nll(base.model, examples, pad, base.device)
    hooks = Hooks(tmp_path)
    result = LoraTrainer(base, hp, seed=3, train=examples, valid=[], hooks=hooks, work_dir=tmp_path / "run",
                         fingerprint="qlora", base_model_name="tiny-llama", checkpoint_every=100, log_every=1).run()
    assert hooks.logs[-1].train_loss < hooks.logs[0].train_loss
    # The shared INT4 base is given back as it was: no LoRA layer left, still frozen.
    assert isinstance(base.model.model.layers[0].self_attn.q_proj, Int4Linear)
    assert token_nll(base.model, examples, pad, base.device) == pytest.approx(before)

    # The artifact is PEFT's for the unquantized base: it loads there with PEFT and lowers that base's loss too.
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-llama" and config["r"] == 4
    plain = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=base.model.dtype).to(base.device).eval()
    plain_nll = token_nll(plain, examples, pad, base.device)
    adapted = PeftModel.from_pretrained(plain, result.adapter_dir).eval()
    assert token_nll(adapted, examples, pad, base.device) < plain_nll - 0.5


def test_the_run_fails_naming_a_projection_int4_cannot_hold():
    model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.proj = seeded_linear(100, 16, False)
    model.layers = torch.nn.ModuleList([layer])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("training.int4_base.decoder_layers", lambda _: list(model.layers))
        with pytest.raises(TrainingSetupError, match="proj has 100 input features, not a multiple of 16"):
            quantize_projections(model, torch.device("cpu"))
    assert type(layer.proj) is torch.nn.Linear, "nothing is changed when one projection cannot be held"


@pytest.mark.parametrize("given, named", [
    ({"use_dora": True}, "use_dora"),
    ({"gpus": 2}, "gpus 2"),
    ({"base_quantization": "nf4"}, None),
])
def test_unsupported_combinations_are_refused_naming_them(given, named):
    with pytest.raises(InvalidInput) as refused:
        resolve_hyperparameters({"base_quantization": "int4", **given}, LIMITS)
    assert refused.value.param == "hyperparameters.base_quantization"
    if named is not None:
        assert refused.value.code == "unsupported_base_quantization"
        assert named in str(refused.value) and "int4" in str(refused.value)


def test_the_default_is_the_unquantized_base_and_int4_trains_dpo_too():
    assert resolve_hyperparameters({}, LIMITS).base_quantization == "none"
    hp = resolve_hyperparameters({"base_quantization": "int4", "method": "dpo", "gradient_checkpointing": True}, LIMITS)
    assert (hp.base_quantization, hp.method) == ("int4", "dpo")
    assert Hyperparameters.from_dict({k: v for k, v in hp.to_dict().items() if k != "base_quantization"}
                                     ).base_quantization == "none", "a job stored before the option trains as it did"


@pytest.fixture
def odd_base(tmp_path: Path, settings) -> Path:
    """A base whose q_proj has 100 inputs (headers are all the web process reads)."""
    directory = tmp_path / "odd-base"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 100),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(100, 64),
               "model.layers.0.input_layernorm.weight": torch.zeros(100)}, directory / "model.safetensors")
    settings.BASE_MODEL_PATH = directory
    return directory


def test_a_base_int4_cannot_hold_is_named_from_its_headers(odd_base):
    problem = conf.base_int4_problem()
    assert problem == "down_proj has 100 output features, not a multiple of 8 (eight 4-bit columns a word); " \
                      "q_proj has 100 input features, not a multiple of 16 (the INT4 group)"
    with pytest.raises(InvalidInput, match="q_proj has 100 input features") as refused:
        resolve_hyperparameters({"base_quantization": "int4"}, conf.limits())
    assert refused.value.code == "unsupported_base_quantization"
    assert resolve_hyperparameters({}, conf.limits()).base_quantization == "none"


@pytest.mark.django_db
def test_the_openai_api_refuses_it_with_a_400_and_queues_nothing(openai_a):
    from openai import APIStatusError

    from test_openai_finetuning_api import upload
    from training.models import TrainingJob
    from training_support import BASE_MODEL_NAME, chat_lines, error_of

    training = upload(openai_a, chat_lines())
    method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "base_quantization": "int4",
                                                                       "use_dora": True}}}
    with pytest.raises(APIStatusError) as refused:
        openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id, method=method)
    assert refused.value.status_code == 400
    error = error_of(refused)
    assert (error["code"], error["param"]) == ("unsupported_base_quantization", "hyperparameters.base_quantization")
    assert "use_dora" in error["message"] and "int4" in error["message"]
    assert not TrainingJob.objects.exists()

    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id,
                                           hyperparameters={"n_epochs": 1, "base_quantization": "int4"})
    assert job.hyperparameters.base_quantization == "int4"
    assert TrainingJob.objects.get().hyperparameters["base_quantization"] == "int4"


@pytest.mark.slow
def test_dpo_with_checkpointing_trains_over_the_int4_base(base_model_dir, tmp_path, one_thread):
    """The reference of a QLoRA DPO job is the INT4 base itself (the adapter disabled): at the first step
    the loss is log 2, and it falls; reentrant checkpointing recomputes the INT4 products."""
    from test_dpo import preference_lines, raw
    from training.preference import encode, iter_valid_pairs

    base = load_int4_base(str(base_model_dir))
    pairs = [encode(example, base.tokenizer, 128) for example in iter_valid_pairs(raw(preference_lines(1)))]
    hp = resolve_hyperparameters({"method": "dpo", "beta": 0.5, "n_epochs": 10, "batch_size": 4, "learning_rate": 1e-2,
                                  "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "gradient_checkpointing": True,
                                  "packing": True, "base_quantization": "int4"}, LIMITS)
    hooks = Hooks(tmp_path)
    LoraTrainer(base, hp, seed=2, train=pairs, valid=[], hooks=hooks, work_dir=tmp_path / "run",
                fingerprint="prefs", base_model_name="tiny-llama", checkpoint_every=100, log_every=1).run()
    losses = [log.train_loss for log in hooks.logs]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)
    assert sum(losses[-2:]) / 2 < math.log(2) - 0.1, losses


@pytest.mark.django_db
def test_a_qlora_job_runs_through_the_workers_path_and_registers_a_version(platform, tenant_a, one_thread):
    """The Celery task's body in-process: the run takes the process's INT4 base (training.ranks.shared_base)
    and publishes a version like any job's."""
    from serving.contracts.artifact import manifest_verify
    from serving.registry.storage import get_storage
    from training import concurrency, datasets, jobs, run
    from training.models import TrainingJob
    from training_support import chat_lines, jsonl

    created = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="t.jsonl")
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    job = jobs.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="qlora-bot", seed=1,
                                   hyperparameters={"n_epochs": 1, "batch_size": 4, "r": 4, "lora_alpha": 8,
                                                    "base_quantization": "int4"})
    concurrency.training_jobs_dispatch()
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED, job.error
    assert load_int4_base.cache_info().currsize == 1 and load_base.cache_info().currsize == 0
    get_storage().download_prefix(
        f"adapters/{tenant_a.tenant.slug}/qlora-bot/{job.adapter_version.version}", platform.parent / "artifact")
    manifest = manifest_verify(platform.parent / "artifact")
    assert manifest["peft"]["kind"] == "lora" and manifest["peft"]["r"] == 4
