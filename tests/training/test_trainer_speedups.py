"""The trainer's speed-ups change the speed, not what is computed: packed rows attended sequence by
sequence (training.packed_attention) give the loss and gradients of the mask they replace, and
compiled decoder layers (training.compiled_layers) train the adapter eager layers train."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model

from training.compiled_layers import compile_wanted, compiled_layers, decoder_layers
from training.hyperparameters import Hyperparameters
from training.packed_attention import PACKED_ATTENTION, use_packed_attention
from training.packing import layout, target_logprobs
from training.trainer import LoraTrainer
from test_trainer import Hooks, weights
# The tiny base and its chat and text examples, the options' tests' own (module-scoped fixtures).
from test_trainer_options import base, examples  # noqa: F401


def loss_and_gradients(base, rows) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                  task_type="CAUSAL_LM", init_lora_weights=False))
    try:
        logprobs, trained = target_logprobs(model(**rows.model_inputs()).logits, rows)
        loss = -(logprobs * trained).sum()
        loss.backward()
        return loss.item(), {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}
    finally:
        model.unload()
        if hasattr(base.model, "peft_config"):
            del base.model.peft_config


def test_packed_rows_carry_their_sequences_bounds(base, examples):
    rows = layout(examples[:3], pad_id=base.tokenizer.pad_token_id, device=base.device, packed=True, capacity=10_000)
    lengths = [len(item.input_ids) for item in examples[:3]]
    assert rows.input_ids.shape == (1, sum(lengths))
    assert rows.bounds.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert rows.longest == max(lengths)
    padded = layout(examples[:3], pad_id=base.tokenizer.pad_token_id, device=base.device, packed=False, capacity=128)
    assert padded.bounds is None and "cu_seq_lens_q" not in padded.model_inputs()


def test_packed_attention_gives_the_masks_loss_and_gradients(base, examples, one_thread):
    pad = base.tokenizer.pad_token_id
    packed = layout(examples, pad_id=pad, device=base.device, packed=True, capacity=128)
    # Rows of several examples and a padding tail: the tail is a sequence of its own in the bounds.
    assert packed.input_ids.shape[0] < len(examples) // 3 and int(packed.bounds[-1]) == packed.input_ids.numel()
    unpacked = layout(examples, pad_id=pad, device=base.device, packed=False, capacity=128)
    expected_loss, expected = loss_and_gradients(base, unpacked)
    mask_loss, _ = loss_and_gradients(base, packed)
    assert mask_loss == pytest.approx(expected_loss, rel=1e-5)
    with use_packed_attention(base.model) as switched:
        assert switched and base.model.config._attn_implementation == PACKED_ATTENTION
        loss, got = loss_and_gradients(base, packed)
    assert base.model.config._attn_implementation == "sdpa"
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)


def test_packed_attention_attends_within_each_sequence_only(base, examples, one_thread):
    """Bounds that join the first two sequences change the second one's logits and no other's: the
    bounds, not a mask, decide what is attended."""
    pad = base.tokenizer.pad_token_id
    packed = layout(examples[:4], pad_id=pad, device=base.device, packed=True, capacity=10_000)
    edges = packed.bounds.tolist()
    joined = dataclasses.replace(packed, bounds=torch.tensor([0, *edges[2:]], dtype=torch.int32))
    with torch.no_grad():
        mask = base.model(**packed.model_inputs()).logits[0]
        with use_packed_attention(base.model):
            right = base.model(**packed.model_inputs()).logits[0]
            wrong = base.model(**joined.model_inputs()).logits[0]
    torch.testing.assert_close(right, mask, rtol=1e-5, atol=1e-5)
    first, second = slice(edges[0], edges[1]), slice(edges[1], edges[2])
    assert torch.equal(wrong[first], right[first]) and torch.equal(wrong[edges[2]:], right[edges[2]:])
    assert (wrong[second] - right[second]).abs().max() > 1e-3


def test_unpacked_rows_and_eager_models_keep_their_attention(base, examples, one_thread):
    pad = base.tokenizer.pad_token_id
    unpacked = layout(examples, pad_id=pad, device=base.device, packed=False, capacity=128)
    expected_loss, _ = loss_and_gradients(base, unpacked)
    with use_packed_attention(base.model):
        # Padded rows carry no bounds: SDPA with its padding mask, as before.
        assert loss_and_gradients(base, unpacked)[0] == pytest.approx(expected_loss, rel=1e-6)
    base.model.set_attn_implementation("eager")
    try:
        with use_packed_attention(base.model) as switched:
            assert not switched and base.model.config._attn_implementation == "eager"
    finally:
        base.model.set_attn_implementation("sdpa")


@pytest.mark.slow
def test_compiled_layers_train_the_eager_layers_adapter_and_are_undone(base, examples, tmp_path, one_thread):
    # One step of every example: each new width is another compilation, seconds each on a CPU. Padded
    # rows, not packed ones: on a CPU packed attention reads its bounds with .tolist() (CUDA's varlen
    # kernel takes them whole), a graph break that tripled the frames Dynamo traced (4.4 s, not 1.5 s);
    # packed attention's own tests are above, and the layers compile only on CUDA (compile_wanted).
    hp = Hyperparameters(n_epochs=1, batch_size=len(examples), learning_rate=1e-2, max_seq_length=128, r=4,
                         lora_alpha=8, lora_dropout=0.0, packing=False)

    def run(compile_layers: bool) -> dict[str, torch.Tensor]:
        # Dynamo captures the layers (guards, graph breaks around PEFT's modules) and the captured graphs
        # run eagerly: what compilation changes about the call, without the code generation (slow on a CPU);
        # inductor's kernels ran on the H200 (docs/benchmarks.md).
        return weights(LoraTrainer(base, hp, seed=7, train=examples, valid=[], hooks=Hooks(tmp_path),
                                   work_dir=tmp_path / f"compiled-{compile_layers}", fingerprint="x",
                                   base_model_name="tiny-llama", checkpoint_every=100, log_every=1,
                                   compile_layers=compile_layers, compile_backend="eager").run())

    from torch._dynamo.utils import counters

    eager = run(False)
    counters.clear()
    compiled = run(True)
    assert counters["stats"]["unique_graphs"] > 0, "the compiled run captured no graph"
    assert eager.keys() == compiled.keys()
    for name, tensor in eager.items():
        torch.testing.assert_close(compiled[name], tensor, rtol=1e-4, atol=1e-6)
    layers = decoder_layers(base.model)
    assert layers and all(layer._compiled_call_impl is None for layer in layers)


def test_layers_are_compiled_by_default_only_on_one_cuda_device_without_checkpointing():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_wanted(cuda, distributed=False, checkpointing=False)
    assert not compile_wanted(cpu, distributed=False, checkpointing=False)
    assert not compile_wanted(cuda, distributed=True, checkpointing=False)
    assert not compile_wanted(cuda, distributed=False, checkpointing=True)
    assert not compile_wanted(cuda, distributed=False, checkpointing=False, dora=True)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.slow
def test_dynamo_captures_a_lora_layer_whole_and_breaks_up_a_dora_one(base, use_dora):
    """Why a DoRA job's layers stay eager (training.compiled_layers): Dynamo breaks PEFT's DoRA
    module's graph, so each decoder layer would compile as several graphs; a LoRA layer is one.
    Captured with the eager backend (no code generation): the breaks are Dynamo's, whatever the backend.
    Should PEFT's DoRA ever trace whole, this fails, and compile_wanted can compile DoRA jobs too."""
    from torch._dynamo.utils import counters

    model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                  task_type="CAUSAL_LM", use_dora=use_dora))
    torch._dynamo.reset()
    counters.clear()
    try:
        # The first layer shows it; the others would only recompile the same code (their cost, not the point).
        with compiled_layers(base.model, backend="eager"), torch._dynamo.config.patch(recompile_limit=1):
            model(input_ids=torch.tensor([[1, 2, 3, 4, 5]], device=base.device))
        breaks = sum(counters["graph_break"].values())
    finally:
        model.unload()
        if hasattr(base.model, "peft_config"):
            del base.model.peft_config
        torch._dynamo.reset()
    assert (breaks > 0) == use_dora, f"{breaks} graph breaks: {dict(counters['graph_break'])}"


def test_compiled_layers_compile_each_decoder_layer(base):
    with compiled_layers(base.model, backend="aot_eager") as count:
        assert count == base.model.config.num_hidden_layers
        assert all(layer._compiled_call_impl is not None for layer in decoder_layers(base.model))
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(base.model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_varlen_attention_matches_causal_attention_per_sequence():
    """On CUDA the bounds go to PyTorch's variable-length flash kernel in one launch: it must give what
    causal SDPA gives on each sequence alone (grouped-query heads, bf16, forward and backward)."""
    from training import packed_attention

    if packed_attention._VARLEN is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    lengths = [512, 300, 700, 536]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    query = torch.randn(sum(lengths), 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    key = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    value = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flash = packed_attention._causal_varlen(query, key, value, bounds, max(lengths), 128**-0.5)
    flash_grads = torch.autograd.grad(flash.float().square().sum(), (query, key, value))
    edges = bounds.tolist()
    reference = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            query[a:b].transpose(0, 1), key[a:b].transpose(0, 1), value[a:b].transpose(0, 1), is_causal=True,
            scale=128**-0.5, enable_gqa=True).transpose(0, 1) for a, b in zip(edges, edges[1:])])
    reference_grads = torch.autograd.grad(reference.float().square().sum(), (query, key, value))
    torch.testing.assert_close(flash, reference, rtol=2e-2, atol=2e-2)
    # bf16 gradients summed in another order: a few of two million elements differ by a few bf16 ulps
    # (0.08 at most on the H200), so the gradients are compared by their relative error as a whole.
    for got, expected in zip(flash_grads, reference_grads):
        assert float((got - expected).float().norm() / expected.float().norm()) < 1e-2
