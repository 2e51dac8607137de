"""DoRA adapters served beside plain LoRA ones and the base, in one batch, generate what PEFT
generates: for three families (Llama; Qwen2, whose q/k/v biases must stay outside DoRA's scale;
Gemma 2), each prompt's greedy tokens and their log-probabilities equal PEFT's for that prompt
alone with its adapter. With one slot for two adapters the DoRA one and the LoRA one take turns in
it, so a slot's scale row left from the adapter before would show. What the engine cannot serve
DoRA under is refused at load, naming why."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match

from safetensors.torch import load_file, save_file

from kernels import use_backend

from serving.engine import LLM, LoRARequest, SamplingParams

PROMPTS = ["Once upon a time there was a little house at the edge of the forest", "Hello!", "The sky is"]
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4
# On CUDA (gpu mark) the same runs in fp32 through the Triton kernels, against PEFT on the CPU, and
# replays the decode graphs (captured with the DoRA scale tables in place) while the DoRA adapter is resident.
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytestmark = pytest.mark.usefixtures("one_thread")


def _with_random_biases(base: Path, out: Path) -> Path:
    """A copy of ``base`` whose biases (Qwen2's q/k/v) are random: a fresh model's are zero, and
    zero biases would hide a bias wrongly scaled by DoRA's magnitude."""
    shutil.copytree(base, out)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    generator = torch.Generator().manual_seed(11)
    biases = [name for name in tensors if name.endswith(".bias")]
    assert biases, f"{base.name} has no biases to randomise"
    for name in biases:
        tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 0.5
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
@pytest.mark.parametrize("max_loras", [2, 1], ids=["slots-for-both", "one-slot-shared"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.slow
def test_dora_and_lora_in_one_batch_match_peft(arch: str, max_loras: int, device: str,
                                               tiny_model_factory: Callable[..., Path],
                                               make_adapter: Callable[..., Path], tmp_path: Path) -> None:
    _assert_dora_serves_like_peft(arch, max_loras, device, tiny_model_factory, make_adapter, tmp_path)


@pytest.mark.slow  # Triton's interpreter
def test_the_triton_kernels_epilogue_serves_dora_like_peft(tiny_model_factory: Callable[..., Path],
                                                           make_adapter: Callable[..., Path], tmp_path: Path) -> None:
    """The same through the Triton kernels on the CPU (the interpreter): the scale is applied in the
    expand kernel's epilogue there, after the torch backend's gather-and-multiply above."""
    import kernels.triton_lora

    if not kernels.triton_lora.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    with use_backend("triton"):
        # One prompt and two tokens (a prompt's step and a decode's, each through the epilogue): the
        # interpreter runs each kernel program in Python, and each further token is one more step.
        _assert_dora_serves_like_peft("qwen2", 2, "cpu", tiny_model_factory, make_adapter, tmp_path,
                                      prompts=PROMPTS[2:], max_tokens=2)


def _assert_dora_serves_like_peft(arch: str, max_loras: int, device: str, tiny_model_factory: Callable[..., Path],
                                  make_adapter: Callable[..., Path], tmp_path: Path, *,
                                  prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS) -> None:
    base = tiny_model_factory(arch)
    if arch == "qwen2":
        base = _with_random_biases(base, tmp_path / "qwen2-biased")
    adapters = {
        "dora": make_adapter(base, r=8, lora_alpha=16, target_modules=SPLIT, seed=3, init_scale=0.5, use_dora=True),
        "plain": make_adapter(base, r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=4, init_scale=0.5),
    }
    llm = LLM(str(base), max_loras=max_loras, max_lora_rank=8, device=device, dtype="float32", max_model_len=128,
              block_size=4, num_kv_blocks=96)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    names: list[str | None] = ["dora", "plain", None]
    inputs = [{"prompt_token_ids": tokenizer(p).input_ids} for p in prompts for _ in names]
    loras = [LoRARequest(n, str(adapters[n])) if n else None for _ in prompts for n in names]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(inputs, greedy, lora_request=loras)
    assert {info.name: info.kind for info in llm.llm_engine.list_loras()} == {"dora": "dora", "plain": "lora"}
    reference = PeftReference(base, adapters)
    tokens: dict[str | None, list[list[int]]] = {}
    for prompt, lora, output in zip(inputs, loras, outputs):
        name = lora.lora_name if lora else None
        ours = output.outputs[0]
        ref = reference.generate(prompt["prompt_token_ids"], name, max_tokens)
        label = f"{arch} {name or 'base'} ({len(prompt['prompt_token_ids'])} prompt tokens)"
        assert_greedy_match(ours.token_ids, ref, label)
        assert ours.logprobs is not None
        for step, (token, theirs) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if token != theirs:
                break
            expected = float(ref.logits[step].log_softmax(-1)[token])
            assert math.isclose(ours.logprobs[step][token].logprob, expected, abs_tol=LOGPROB_TOLERANCE), (
                f"{label}: token {step}'s log-probability {ours.logprobs[step][token].logprob} is not PEFT's {expected}")
        tokens.setdefault(name, []).append(list(ours.token_ids))
    # The magnitudes matter: the DoRA adapter's tokens are not those of its LoRA part alone or the base's.
    assert tokens["dora"] != tokens[None] and tokens["dora"] != tokens["plain"]
    graphs = llm.llm_engine.runner.graphs
    if graphs is not None:
        # On CUDA a DoRA adapter's decode steps replay the graphs captured with the scale tables.
        before = graphs.replays
        again = llm.generate(inputs[:1], greedy, lora_request=loras[:1])[0]
        assert graphs.replays > before and not llm.llm_engine.runner.enforce_eager
        assert list(again.outputs[0].token_ids) == tokens["dora"][0]


def test_dora_under_fp8_is_refused_naming_why(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> None:
    adapter = make_adapter(tiny_llama_dir, r=4, lora_alpha=8, seed=5, use_dora=True)
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=8, device="cpu", dtype="float32", max_model_len=64,
              block_size=4, num_kv_blocks=32, quantization="fp8")  # fmt: skip
    with pytest.raises(Exception, match=r"DoRA adapters \(use_dora\) are not served here: not over an FP8 base"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2), lora_request=LoRARequest("d", str(adapter)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slots_scale_row_is_the_magnitude_over_the_merged_weights_row_norms(dtype: torch.dtype) -> None:
    """The expansion the layer computes the norms by equals PEFT's norm of the merged matrix, and a
    slot's row goes back to ones when a plain LoRA adapter takes the slot."""
    from serving.engine.layers.lora_linear import MultiLoRALinear

    generator = torch.Generator().manual_seed(0)
    layer = MultiLoRALinear(48, [("q_proj", 32), ("k_proj", 16)], bias=False, layer_idx=0,
                            device=torch.device("cpu"), dtype=dtype)  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 48, generator=generator) * 0.1)
    slots = torch.zeros(3, dtype=torch.int32)
    layer.allocate_rows(8, scaling=torch.zeros(3), ranks=slots, rows=slots.clone(), max_rank=4, dora=True)
    assert layer.dora_scale is not None and layer.dora_scale.shape == (4, 48)
    table = layer.dora_scale
    A, Bt = torch.randn(4, 48, generator=generator), torch.randn(4, 16, generator=generator) * 0.2
    magnitude = torch.rand(16, generator=generator) + 0.5
    layer.write_dora_scale(1, scaling=2.0, parts={"k_proj": (A, Bt, magnitude)})
    # Written in place: the kernels (and a captured graph) keep reading the table allocated with the rows.
    assert layer.dora_scale is table and layer.dora_scale.dtype == dtype
    merged = layer.weight[32:].float() + 2.0 * Bt.t().to(dtype).float() @ A.to(dtype).float()
    expected = magnitude / torch.linalg.norm(merged, dim=1)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(layer.dora_scale[2, 32:].float(), expected, **tolerance)
    ones = torch.ones(48, dtype=dtype)
    for row in (0, 1, 3):  # no adapter, other slots
        assert torch.equal(layer.dora_scale[row], ones)
    assert torch.equal(layer.dora_scale[2, :32], torch.ones(32, dtype=dtype))  # the slice it does not adapt
    layer.write_dora_scale(1, scaling=1.0, parts={})
    assert torch.equal(layer.dora_scale[2], ones)


def test_a_layer_without_a_scale_table_refuses_a_dora_adapter_and_ignores_a_plain_one() -> None:
    from serving.engine.layers.lora_linear import MultiLoRALinear

    layer = MultiLoRALinear(8, [("q_proj", 8)], bias=False, layer_idx=3, device=torch.device("cpu"), dtype=torch.float32)
    slots = torch.zeros(2, dtype=torch.int32)
    layer.allocate_rows(4, scaling=torch.zeros(2), ranks=slots, rows=slots.clone(), max_rank=4)
    assert layer.dora_scale is None
    layer.write_dora_scale(0, scaling=1.0, parts={})
    assert layer.dora_scale is None
    with pytest.raises(ValueError, match="layer 3 has no DoRA scale table"):
        layer.write_dora_scale(0, scaling=1.0, parts={"q_proj": (torch.ones(2, 8), torch.ones(2, 8), torch.ones(8))})


def test_scale_tables_are_there_from_the_start_and_a_slot_load_computes_its_scales_once(
        tiny_llama_dir: Path, make_adapter: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables exist before any adapter (so CUDA graphs captured at start read them), stay the same
    tensors while DoRA adapters come, and the engine never falls back to eager steps for them. A
    DoRA adapter's norms are computed once per module when it enters its slot, not at each step:
    two generations of several steps each cost one computation per adapted module in all."""
    from serving.engine.layers.lora_linear import MultiLoRALinear

    adapter = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=SPLIT, seed=3, init_scale=0.5,
                           use_dora=True)  # fmt: skip
    modules = sum(name.endswith("lora_magnitude_vector") for name in load_file(adapter / "adapter_model.safetensors"))
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=8, device="cpu", dtype="float32", max_model_len=64,
              block_size=4, num_kv_blocks=48)  # fmt: skip
    runner = llm.llm_engine.runner
    layers = list(runner.model.lora_layers())
    tables = [layer.dora_scale for layer in layers]
    assert all(t is not None and t.shape == (2, layer.dora_row_elements) and bool((t == 1).all())
               for t, layer in zip(tables, layers))
    computed: list[int] = []
    real = MultiLoRALinear._delta_row_norms

    def counted(self: MultiLoRALinear, *args: object) -> torch.Tensor:
        computed.append(self.layer_idx)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(MultiLoRALinear, "_delta_row_norms", counted)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):
        llm.generate(PROMPTS, greedy, lora_request=LoRARequest("dora", str(adapter)))
        assert not runner.enforce_eager
    assert len(computed) == modules
    assert [layer.dora_scale for layer in layers] == tables
    assert any(not bool((t[1] == 1).all()) for t in tables if t is not None), "the adapter's slot row holds its scales"


def test_an_engine_with_dora_off_has_no_tables_and_refuses_dora_adapters(
        tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> None:
    adapter = make_adapter(tiny_llama_dir, r=4, lora_alpha=8, seed=5, use_dora=True)
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=8, device="cpu", dtype="float32", max_model_len=64,
              block_size=4, num_kv_blocks=32, enable_dora=False)  # fmt: skip
    assert all(layer.dora_scale is None for layer in llm.llm_engine.runner.model.lora_layers())
    with pytest.raises(Exception, match=r"DoRA adapters \(use_dora\) are not served here: DoRA is off on this engine"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2), lora_request=LoRARequest("d", str(adapter)))
