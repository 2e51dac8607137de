"""The trainer's speed-ups change the speed, not what is computed: packed rows attended sequence by
sequence (training.packed_attention) give the loss and gradients of the mask they replace,
compiled decoder layers (training.compiled_layers) train the adapter eager layers train, and the
compiled loss (training.packing.compiled_loss) gives the eager one's values without its fp32 copies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model

from torch._dynamo.utils import counters

from training.compiled_layers import compile_wanted, compiled_layers, decoder_layers
from training.examples import IGNORE_INDEX
from training.hyperparameters import Hyperparameters
from training.packed_attention import PACKED_ATTENTION, use_packed_attention
from training.packing import Rows, compiled_loss, layout, target_logprobs, target_logprobs_and_hits
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


def test_compiled_layers_compile_each_decoder_layer_and_the_loss(base):
    logits, rows = loss_inputs(rows=1, width=6)
    torch._dynamo.reset()
    counters.clear()
    with compiled_layers(base.model, backend="aot_eager") as count:
        assert count == base.model.config.num_hidden_layers
        assert all(layer._compiled_call_impl is not None for layer in decoder_layers(base.model))
        target_logprobs(logits, rows)
        assert counters["stats"]["unique_graphs"] == 1
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(base.model))
    # Eager again: through the compiled loss, Dynamo (its cache reset on leaving) would capture it anew.
    target_logprobs(logits, rows)
    assert counters["stats"]["unique_graphs"] == 1


def loss_inputs(rows: int, width: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Rows]:
    """Logits of a 48-token vocabulary, requiring grad, and the labels of their rows: the first two
    tokens of every row are prompt (not trained), and so is the last row's tail; every other position
    predicts its next label (an argmax hit)."""
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    labels = torch.randint(0, 48, (rows, width), generator=generator)
    logits = 3 * torch.randn(rows, width, 48, generator=generator)
    logits[:, :-1:2].scatter_add_(-1, labels[:, 1::2].unsqueeze(-1), torch.full((rows, width // 2, 1), 20.0))
    logits = logits.to(dtype).requires_grad_()
    labels[:, :2] = IGNORE_INDEX
    labels[-1, -3:] = IGNORE_INDEX
    return logits, Rows(labels.clamp(min=0), labels, torch.zeros_like(labels), None, None)


def saved_for_backward(call):
    """What `call`'s autograd graph keeps for the backward, and `call`'s result."""
    saved: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        result = call()
    return saved, result


# inductor compiles its C++ kernels with gcc: processes of their own (e2e).
@pytest.mark.parametrize("backend", ["aot_eager_decomp_partition", pytest.param("inductor", marks=pytest.mark.e2e)])
def test_the_compiled_loss_gives_the_eager_values_and_keeps_no_fp32_logits(backend):
    """bf16 logits, as on CUDA. aot_eager_decomp_partition splits forward and backward as inductor does
    (the same decompositions and partitioner) without generating code; inductor then runs them."""
    logits, rows = loss_inputs(rows=3, width=21, dtype=torch.bfloat16)
    logits_size = logits[:, :-1].numel()
    eager_saved, expected = saved_for_backward(lambda: target_logprobs_and_hits(logits, rows))
    # The eager loss keeps an fp32 tensor of the logits' size for the backward (its log-softmax).
    assert any(t.dtype == torch.float32 and t.numel() >= logits_size for t in eager_saved)
    (expected_grad,) = torch.autograd.grad((expected[0] * expected[1]).sum(), logits)
    torch._dynamo.reset()
    try:
        with compiled_loss(backend):
            saved, got = saved_for_backward(lambda: target_logprobs_and_hits(logits, rows))
            (grad,) = torch.autograd.grad((got[0] * got[1]).sum(), logits)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2]) and got[2].any()
    # bf16 gradients of fp32 values that differ by rounding: one bf16 step apart at most.
    torch.testing.assert_close(grad, expected_grad)
    # Compiled, the only tensor of the logits' size kept is the bf16 logits themselves.
    large = [t for t in saved if t.numel() >= logits_size]
    assert large and all(t.dtype == torch.bfloat16 and t.data_ptr() == logits.data_ptr() for t in large), [
        (t.dtype, tuple(t.shape)) for t in large]


def test_the_eager_loss_is_the_log_softmax_of_each_next_token():
    logits, rows = loss_inputs(rows=2, width=9)
    logprobs, trained, hits = target_logprobs_and_hits(logits, rows)
    following = rows.labels[:, 1:]
    expected = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, following.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert torch.equal(trained, following != IGNORE_INDEX)
    torch.testing.assert_close(logprobs, expected * trained, rtol=0, atol=0)
    assert torch.equal(hits, (logits[:, :-1].argmax(dim=-1) == following) & trained) and hits.any()


def test_a_new_width_or_row_count_does_not_compile_the_loss_again():
    torch._dynamo.reset()
    counters.clear()
    try:
        with compiled_loss("eager"):
            for rows, width in ((2, 9), (2, 17), (3, 12), (5, 40)):
                target_logprobs_and_hits(*loss_inputs(rows, width))
    finally:
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1


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
