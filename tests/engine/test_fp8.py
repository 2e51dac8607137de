"""FP8 base weights (``quantization="fp8"``, serving.engine.layers.fp8_linear): a projection's
output stays within a stated relative error of the unquantized one's; widths _scaled_mm cannot take
are refused; the engine quantizes exactly the base projections (not embeddings, LM head, norms or
adapters); and its greedy tokens agree with the unquantized engine's, which on the CPU in fp32
equal PEFT's, at a measured top-1 rate over a fixed prompt set with adapters active.

Top-1 agreement is measured teacher-forced: each prompt followed by the reference's 16 greedy
tokens is scored by the FP8 engine (``prompt_logprobs``), and a position agrees where the
reference's token is the FP8 model's most likely one. (Free-running greedy runs part ways at the
first disagreement, after which their tokens answer different contexts and mean nothing.)

On the CPU the FP8 layers run the emulation (the same quantized weights and activations in fp32),
also at tensor-parallel size 2 (each rank quantizing its shard); the native call (``_scaled_mm``
with the Triton activation kernel) is checked against the emulation on the CPU too. On CUDA (gpu
mark) in bf16, natively on Hopper, with decode steps replayed from CUDA graphs.

The activations quantized by their producer (the norm's and SiLU·mul's kernels writing the FP8 rows
the next projection takes): a layer uses rows it is given, on the native path only; and an engine
gives the same greedy tokens and log-probabilities, to the bit, with the fusion as without it, and
quantizes in its layers only o_proj's input. On the CPU the layers are switched to the native path
(torch's CPU ``_scaled_mm``), where the torch chain stands in for the fused kernels (tests/kernels/
test_fused_ops.py holds those bit-equal to it); on CUDA (gpu mark) the kernels themselves, under
the CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match

import kernels.fp8 as fp8_kernel
import serving.engine.layers.fp8_linear as fp8_linear_module
from kernels.fp8 import QuantizedRows, quantize_rows
from serving.engine import LLM, EngineConfig, LoRARequest, SamplingParams
from serving.engine.context import StepContext, reset_context, set_context
from serving.engine.layers.fp8_linear import native_fp8
from serving.engine.outputs import Logprob
from serving.engine.layers.lora_linear import MultiLoRALinear, quantize_fp8
from serving.engine.server.cli import parse_args
from serving.engine.server.worker import engine_config

_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=_CUDA, id="cuda")]
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_SPECS = [  # (rank, alpha, target modules)
    (16, 32, ALL_MODULES),
    (8, 16, ("q_proj", "v_proj", "down_proj")),
    (4, 8, ("o_proj", "gate_proj", "up_proj")),
]
NUM_PROMPTS = 16
NEW_TOKENS = 16
# Top-1 agreement of FP8 with the unquantized engine over the fixed prompts, teacher-forced. Issue 22
# asks 99 % of a real model; the tiny random model's next-token distributions are nearly flat
# (median top-2 gap 0.034 nats), so e4m3's rounding flips near-ties: measured on the CPU 242 of 256
# (94.5 %), every flip where the reference's gap was under 0.024 nats; at TP 2, 239 of 256 (93.4 %),
# flips under 0.020 nats. (On the 8-layer "small" model: 84.8 %, flips under 0.137 nats, median gap
# 0.098.) So the bound here is the measured rate, and FP8 must keep every token the reference was
# decisive about. On CUDA both engines run in bf16, whose own rounding moves the near-ties further:
# measured on the H200 (2026-12-02) 234 of 256 (91.4 %), no flip where the reference was decisive.
MIN_AGREEMENT = {"cpu": 0.92, "cuda": 0.90}
MARGIN = 0.05  # nats between the reference's two most likely tokens
# The largest change FP8 makes to a reference token's log-probability (measured 0.047 nats).
MAX_LOGPROB_SHIFT = 0.1
# ||y_fp8 - y|| / ||y|| of one projection on Gaussian inputs: e4m3 rounds each weight and activation
# by up to 2^-4 relative; measured 3.8 % on the CPU (fp32), the smallest channels' 3.7 %.
MAX_RELATIVE_ERROR = 0.05

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(device: str, dtype: torch.dtype, in_features: int = 256, widths: tuple[int, ...] = (128, 64),
           bias: bool = True) -> MultiLoRALinear:  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    layer = MultiLoRALinear(in_features, [(f"s{i}", w) for i, w in enumerate(widths)], bias=bias, layer_idx=0,
                            device=torch.device(device), dtype=dtype)  # fmt: skip
    # Output channels of very different magnitudes: a single per-tensor scale would flush the small ones.
    magnitudes = torch.logspace(-3, 0, sum(widths)).unsqueeze(1)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(sum(widths), in_features, generator=generator) * magnitudes)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(sum(widths), generator=generator))
    return layer


def _forward(layer: MultiLoRALinear, x: torch.Tensor, x_fp8: QuantizedRows | None = None) -> torch.Tensor:
    """The layer's output for ``x`` outside an engine step (no adapters)."""
    set_context(StepContext(slot_mapping=torch.empty(0, dtype=torch.long)))
    try:
        with torch.no_grad():
            return layer(x, x_fp8)
    finally:
        reset_context()


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_layer_output_is_close_to_the_unquantized_layer(device: str) -> None:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = _layer(device, dtype, bias=False)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    expected = _forward(layer, x)
    quantize_fp8([layer])
    actual = _forward(layer, x)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (192, 256)
    assert layer.weight_scale is not None and layer.weight_scale.shape == (1, 192)
    assert layer.weight_scale.dtype == torch.float32
    assert actual.dtype == dtype and actual.shape == expected.shape
    error = _relative_error(actual, expected)
    assert 0 < error <= MAX_RELATIVE_ERROR, f"relative error {error:.4f}"
    # Per channel too: the smallest channels (1000 x below the largest) keep their own precision.
    small_error = _relative_error(actual[:, :16], expected[:, :16])
    assert small_error <= MAX_RELATIVE_ERROR, f"the smallest channels' relative error {small_error:.4f}"


def test_the_bias_is_added_after_the_fp8_product() -> None:
    layer = _layer("cpu", torch.float32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    quantize_fp8([layer])
    assert layer.bias is not None and layer.bias.dtype == torch.float32, "the bias stays in the compute dtype"
    with_bias = _forward(layer, x)
    bias, layer.bias = layer.bias, None
    torch.testing.assert_close(with_bias, _forward(layer, x) + bias)


@pytest.mark.parametrize("device", DEVICES)
def test_the_native_path_matches_the_emulation(device: str) -> None:
    """``_scaled_mm`` (with the Triton activation kernel) and the emulation multiply the same
    quantized values: they differ only in accumulation order and where bf16 rounds. On the CPU the
    native path runs too (torch's CPU ``_scaled_mm`` takes rowwise scales; the kernel interpreted),
    which checks the call's layouts and scales where no Hopper is at hand."""
    if device == "cuda" and not native_fp8(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU (compute capability 9.x)")
    if device == "cpu" and not fp8_kernel.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    layer = _layer(device, torch.bfloat16)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=torch.bfloat16)
    quantize_fp8([layer])
    assert layer.fp8_native == (device == "cuda")
    layer.fp8_native = False
    emulated = _forward(layer, x)
    layer.fp8_native = True
    native = _forward(layer, x)
    assert native.dtype == torch.bfloat16
    assert _relative_error(native, emulated) <= 1e-2


def test_the_native_path_takes_the_rows_it_is_given() -> None:
    """Rows quantized by the producer are used as they are (not quantized again from ``x``), by the
    native path only: the emulation, and a layer with the fusion switched off, quantize ``x``."""
    if not fp8_kernel.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    layer = _layer("cpu", torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    x, other = (torch.randn(9, 256, generator=generator).to(torch.bfloat16) for _ in range(2))
    assert not layer.takes_fp8_rows, "an unquantized layer takes no rows"
    quantize_fp8([layer])
    assert not layer.takes_fp8_rows, "nor does the emulation"
    emulated = _forward(layer, x)
    assert torch.equal(_forward(layer, x, quantize_rows(other)), emulated)
    layer.fp8_native = True
    assert layer.takes_fp8_rows
    native = _forward(layer, x)
    assert torch.equal(_forward(layer, x, quantize_rows(x)), native), "its own rows: the same product"
    # Another tensor's rows give that tensor's product: the rows are read, x is not quantized.
    assert torch.equal(_forward(layer, x, quantize_rows(other)), _forward(layer, other))
    assert not torch.equal(native, _forward(layer, other))
    layer.fp8_rows_from_producer = False
    assert not layer.takes_fp8_rows
    assert torch.equal(_forward(layer, x, quantize_rows(other)), native)


def test_widths_not_multiples_of_16_are_refused() -> None:
    layer = _layer("cpu", torch.float32, in_features=24, widths=(32,))
    with pytest.raises(ValueError, match=r"multiples of 16.*\[32, 24\]"):
        quantize_fp8([layer])
    assert layer.weight.dtype == torch.float32 and layer.weight_scale is None, "a refused layer stays as it was"


def test_only_the_base_projections_are_quantized(tiny_llama_dir: Path) -> None:
    plain = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=1, max_lora_rank=8)
    fp8 = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=1, max_lora_rank=8, quantization="fp8")
    before = dict(plain.llm_engine.runner.model.named_parameters())
    model = fp8.llm_engine.runner.model
    projections = {id(layer.weight) for layer in model.lora_layers()}
    assert projections and len(projections) == 4 * len(list(model.decoder_layers()))
    for name, param in model.named_parameters():
        if id(param) in projections:
            assert param.dtype == torch.float8_e4m3fn and param.shape == before[name].shape, name
            assert param.element_size() == before[name].element_size() // 4, "1 byte a weight, from fp32's 4"
        else:  # embeddings, LM head, norms, biases
            assert param.dtype == torch.float32 and torch.equal(param, before[name]), name
    for layer in model.lora_layers():
        assert all(t.dtype == torch.float32 for t in (*layer.lora_A, *layer.lora_B)), "adapter pools keep the dtype"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(quantization="int8"), "quantization must be None, 'fp8' or 'awq'"),
])  # fmt: skip
def test_unknown_quantization_is_refused(tiny_llama_dir: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_llama_dir), device="cpu", **kwargs)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_on_cuda_needs_bf16(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32", quantization="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantizing_hands_the_weights_memory_back() -> None:
    """The memory plan reads torch.cuda.mem_get_info after loading: the bf16 weights freed by
    quantization must show as free there, not stay in torch's cache."""
    layers = [_layer("cuda", torch.bfloat16, in_features=4096, widths=(4096,), bias=False) for _ in range(8)]
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    quantize_fp8(layers)
    torch.cuda.synchronize()
    freed = torch.cuda.mem_get_info()[0] - free_before
    fp8_weight = 4096 * 4096
    half = 8 * fp8_weight  # bf16's 2 bytes a weight down to 1
    # Less what the caching allocator keeps: the first FP8 weight takes a segment of its own (no bf16
    # weight is freed yet), and the others fill the freed bf16 segments two to one, the last of them
    # perhaps half. Measured on the H200: 112 of 128 MiB (one FP8 weight short).
    expected = half - 2 * fp8_weight
    assert freed >= expected, f"{freed / 2**20:.0f} MiB came back, expected at least {expected / 2**20:.0f}"


def test_the_worker_flag_reaches_the_engine_config(tiny_llama_dir: Path) -> None:
    assert engine_config(parse_args(["--model", str(tiny_llama_dir), "--quantization", "fp8"])).quantization == "fp8"
    assert engine_config(parse_args(["--model", str(tiny_llama_dir)])).quantization is None
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tiny_llama_dir), "--quantization", "int8"])


# ---- greedy tokens: top-1 agreement over a fixed prompt set -------------------------------------


def _prompts(vocab_size: int) -> list[list[int]]:
    """The fixed prompt set: 16 prompts of 6 to 21 token ids, drawn once from a seeded generator."""
    generator = torch.Generator().manual_seed(22)
    return [torch.randint(3, vocab_size, (6 + i,), generator=generator).tolist() for i in range(NUM_PROMPTS)]


def _greedy(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return [out.outputs[0].token_ids for out in outputs]


@dataclass(frozen=True)
class Scored:
    """How a model scores one reference token given everything before it."""

    rank: int  # 1: the reference's token is the model's most likely one
    logprob: float  # the reference token's
    gap: float  # the model's top-1 minus top-2 log-probability


def score(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
          reference: list[list[int]]) -> list[Scored]:  # fmt: skip
    """``llm``'s score of every reference token, each prompt followed by its reference tokens
    (teacher-forced: one prefill per prompt, ``prompt_logprobs``)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, reference)], params,
                           lora_request=loras)  # fmt: skip
    scored = []
    for out, prompt, tokens in zip(outputs, prompts, reference):
        assert out.prompt_logprobs is not None
        entries = out.prompt_logprobs[len(prompt) :]
        assert len(entries) == len(tokens)
        for entry, token in zip(entries, tokens):
            assert entry is not None
            top = sorted((lp for lp in entry.values() if lp.rank <= 2), key=lambda lp: lp.rank)
            scored.append(Scored(entry[token].rank, entry[token].logprob, top[0].logprob - top[1].logprob))
    return scored


@pytest.mark.e2e
@pytest.mark.usefixtures("tp_ranks_forked")
@pytest.mark.parametrize(("device", "tp"), [
    pytest.param("cpu", 1, id="cpu"),
    # Each rank quantizes its shard: the row-parallel layers' scales span its input columns only.
    pytest.param("cpu", 2, id="cpu-tp2"),
    pytest.param("cuda", 1, marks=_CUDA, id="cuda"),
])  # fmt: skip
def test_fp8_greedy_tokens_agree_with_the_unquantized_engine(
    device: str, tp: int, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    adapters = {f"ad{i}": make_adapter(tiny_llama_dir, r=r, lora_alpha=alpha, target_modules=mods, seed=i, init_scale=0.5)
                for i, (r, alpha, mods) in enumerate(ADAPTER_SPECS)}  # fmt: skip
    names = list(adapters)
    # Three prompts in four with an adapter, every adapter on several.
    loras = [None if i % 4 == 3 else LoRARequest(names[i % 3], str(adapters[names[i % 3]])) for i in range(NUM_PROMPTS)]
    engine = dict(device=device, dtype="bfloat16" if device == "cuda" else "float32", max_loras=3, max_lora_rank=16,
                  max_num_seqs=8, max_model_len=128, enable_prefix_caching=False)  # fmt: skip
    plain = LLM(str(tiny_llama_dir), **engine)  # type: ignore[arg-type]
    prompts = _prompts(plain.get_tokenizer().vocab_size)
    reference = _greedy(plain, prompts, loras)
    if device == "cpu":
        # In fp32 the unquantized engine is PEFT's greedy decoding (up to ties): the reference is PEFT's.
        peft = PeftReference(tiny_llama_dir, adapters)
        for prompt, lora, tokens in zip(prompts, loras, reference):
            assert_greedy_match(tokens, peft.generate(prompt, lora.lora_name if lora else None, NEW_TOKENS), str(prompt))
    ours = score(plain, prompts, loras, reference)
    decisive = [s.gap >= MARGIN for s in ours]
    # The measure itself: the reference engine, teacher-forced, picks its own greedy tokens.
    assert all(s.rank == 1 for s, d in zip(ours, decisive) if d or device == "cpu")
    del plain

    fp8 = LLM(str(tiny_llama_dir), quantization="fp8", tensor_parallel_size=tp, **engine)  # type: ignore[arg-type]
    try:
        theirs = score(fp8, prompts, loras, reference)
        agreeing = sum(s.rank == 1 for s in theirs)
        rate = agreeing / len(theirs)
        shift = max(abs(a.logprob - b.logprob) for a, b in zip(ours, theirs))
        print(f"\nFP8 top-1 agreement on {device}, TP {tp}: {agreeing}/{len(theirs)} = {rate:.4f}; "
              f"{sum(decisive)} positions decisive (gap >= {MARGIN}); largest log-prob shift {shift:.4f}")  # fmt: skip
        missed = [(i, round(a.gap, 4)) for i, (a, b, d) in enumerate(zip(ours, theirs, decisive)) if d and b.rank != 1]
        assert not missed, f"FP8 changed the top-1 token where the reference was decisive (position, gap): {missed}"
        bound = MIN_AGREEMENT[device]
        assert rate >= bound, f"top-1 agreement {agreeing}/{len(theirs)} = {rate:.4f} < {bound}"
        assert shift <= MAX_LOGPROB_SHIFT
        # Free-running, on the decode path (CUDA graphs on CUDA): it runs, and its first token is the
        # reference's wherever the reference was decisive about it.
        generated = _greedy(fp8, prompts, loras)
        assert all(len(tokens) == NEW_TOKENS for tokens in generated)
        firsts = [tokens[0] == ref[0] for tokens, ref, d in zip(generated, reference, decisive[::NEW_TOKENS]) if d]
        assert firsts and all(firsts)
        graphs = fp8.llm_engine.runner.graphs
        assert device == "cpu" or (graphs is not None and graphs.replays > 0), "decode steps must replay the graphs"
    finally:
        # A tensor-parallel engine holds this process's torch.distributed group until shut down: the
        # next engine with ranks on this xdist worker (test_tensor_parallel) would be refused.
        fp8.llm_engine.shutdown()


# ---- the activations quantized by their producer: same tokens, same log-probabilities ----------


FusionRun = tuple[list[list[int]], list[list[dict[int, Logprob] | None]], int]


def _fusion_run(model: Path, adapters: list[Path], device: str, *, fused: bool) -> FusionRun:
    """One FP8 engine's greedy tokens and log-probabilities (of the generated and of the prompt
    tokens) over mixed adapter and base prompts, with its projections taking their inputs' FP8 rows
    from the producer kernels (``fused``) or quantizing them themselves, and how many times the
    layers quantized an input in those steps. On the CPU the layers run natively (``_scaled_mm``)."""
    with pytest.MonkeyPatch.context() as patch:
        # On the class, before the engine is built: on CUDA its graphs are captured with the choice.
        patch.setattr(MultiLoRALinear, "fp8_rows_from_producer", fused)
        llm = LLM(str(model), device=device, dtype="bfloat16" if device == "cuda" else "float32", quantization="fp8",
                  max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64,
                  enable_prefix_caching=False)  # fmt: skip
        try:
            layers = list(llm.llm_engine.runner.model.lora_layers())
            if device == "cpu":
                for layer in layers:
                    layer.fp8_native = True
            assert all(layer.takes_fp8_rows == fused for layer in layers)
            prompts = _prompts(llm.get_tokenizer().vocab_size)[:4]
            loras = [None if i % 3 == 2 else LoRARequest(f"a{i % 2}", str(adapters[i % 2])) for i in range(len(prompts))]
            # Both adapters resident first: loads run on threads, and a prompt waiting for one would
            # change which rows share a step, and with them the last bit of some log-probabilities.
            llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=1), lora_request=loras[:2])
            calls = 0
            quantize = fp8_linear_module.quantize_rows_triton

            def counted(x: torch.Tensor) -> QuantizedRows:
                nonlocal calls
                calls += 1
                return quantize(x)

            patch.setattr(fp8_linear_module, "quantize_rows_triton", counted)
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
            assert device == "cpu" or (llm.llm_engine.runner.graphs is not None
                                       and llm.llm_engine.runner.graphs.replays > 0)  # fmt: skip
        finally:
            llm.llm_engine.shutdown()
    tokens = [out.outputs[0].token_ids for out in outputs]
    logprobs: list[list[dict[int, Logprob] | None]] = []
    for out in outputs:
        assert out.outputs[0].logprobs is not None and out.prompt_logprobs is not None
        logprobs.append([*out.prompt_logprobs, *out.outputs[0].logprobs])
    return tokens, logprobs, calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_fused_activation_quantization_changes_no_token_or_logprob(
    device: str, arch: str, tiny_model_factory: Callable[..., Path], make_adapter: Callable[..., Path]
) -> None:
    """Llama's wiring (SiLU·mul fused before down) and Gemma's (four norms a layer, GELU: its down
    projection quantizes its own input on CUDA), with adapters on every projection, so the LoRA path
    must read the same bf16 activations as before."""
    if device == "cpu" and not fp8_kernel.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    if device == "cuda" and not native_fp8(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU (compute capability 9.x): elsewhere nothing is fused")
    model = tiny_model_factory(arch)
    adapters = [make_adapter(model, r=8, lora_alpha=16, target_modules=ALL_MODULES, seed=i, init_scale=0.5)
                for i in range(2)]  # fmt: skip
    tokens, logprobs, unfused_calls = _fusion_run(model, adapters, device, fused=False)
    fused_tokens, fused_logprobs, fused_calls = _fusion_run(model, adapters, device, fused=True)
    assert fused_tokens == tokens
    assert fused_logprobs == logprobs, "every log-probability to the bit"
    # Unfused, each of a layer's four projections quantized its input; fused, o_proj alone (and, on
    # CUDA, Gemma's down_proj: GELU has no kernel of ours). Graph replays run no Python: on CUDA
    # only the eager steps count, alike in both runs.
    own = 2 if device == "cuda" and arch == "gemma2" else 1
    assert unfused_calls * own == fused_calls * 4
    assert device == "cuda" or fused_calls > 0
