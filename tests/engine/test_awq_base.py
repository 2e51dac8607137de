"""An AWQ INT4 base under LoRA adapters (serving.engine.layers.int4_linear): a tiny model's
projections are quantized here into AutoAWQ's GEMM layout (kernels.int4's packer) and written as a
checkpoint directory whose config.json says ``quant_method: awq``; the engine loads it as it is.

- the engine holds the checkpoint's packed tensors unchanged, and their dequantization equals the
  reference dequantization of the checkpoint, exactly;
- greedy tokens of a batch mixing two adapters and the base equal PEFT's over a plain transformers
  model holding the same dequantized weights (fp32 on the CPU: the INT4 layer multiplies exactly
  those weights, so only summation order differs, and the oracle's tie rule covers that);
- the engine's ``quantization`` follows the checkpoint (``"awq"`` from its config.json);
- what is not supported is refused, naming it: another quant_method, FP8 on top, tensor
  parallelism, dummy weights, a DoRA adapter.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match
from safetensors.torch import load_file, save_file

import kernels.fp8 as fp8
from bench.awq_checkpoint import write_random_awq
from kernels import int4
from serving.engine import LLM, EngineConfig, LoRARequest, SamplingParams
from serving.engine.distributed.parallel import SINGLE
from serving.engine.layers.int4_linear import AWQSpec, awq_spec, int4_linear
from serving.engine.layers.lora_linear import MultiLoRALinear
from serving.engine.server.cli import parse_args
from serving.engine.server.worker import engine_config

GROUP = 32
PROJECTION = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)\.weight$")
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}  # fmt: skip
NEW_TOKENS = 12
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=_CUDA, id="cuda")]

pytestmark = pytest.mark.usefixtures("one_thread")


def _write(base_dir: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict[str, object] | None) -> Path:
    """A copy of ``base_dir`` (config, tokenizer) with ``tensors`` as its weights."""
    shutil.copytree(base_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(out / "model.safetensors"))
    if quantization is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = quantization
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(awq_dir, dequantized_dir)``: the tiny Llama's projections in AWQ's layout, and a plain
    checkpoint holding their reference dequantization (everything else as in the base)."""
    (source,) = tiny_llama_dir.glob("*.safetensors")
    awq: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(source)).items():
        projection = PROJECTION.match(name)
        if projection is None:
            awq[name] = dequantized[name] = tensor
            continue
        qweight, qzeros, scales = int4.quantize(tensor, GROUP)
        prefix = projection.group(1)
        awq |= {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}
        dequantized[name] = int4.dequantize(qweight, qzeros, scales, GROUP, tensor.dtype).t().contiguous()
    root = tmp_path_factory.mktemp("awq")
    return _write(tiny_llama_dir, root / "awq", awq, AWQ_CONFIG), _write(tiny_llama_dir, root / "plain", dequantized, None)


def test_the_engine_holds_the_checkpoint_and_dequantizes_it_exactly(checkpoints: tuple[Path, Path]) -> None:
    awq_dir, plain_dir = checkpoints
    llm = LLM(str(awq_dir), device="cpu", dtype="float32", max_loras=1, max_lora_rank=8)
    stored = load_file(str(awq_dir / "model.safetensors"))
    reference = load_file(str(plain_dir / "model.safetensors"))
    model = llm.llm_engine.runner.model
    layers = [(i, layer) for i, decoder in enumerate(model.decoder_layers())
              for layer in (decoder.self_attn.qkv_proj, decoder.self_attn.o_proj, decoder.mlp.gate_up_proj,
                            decoder.mlp.down_proj)]  # fmt: skip
    assert len(layers) == 8
    for i, layer in layers:
        assert layer.weight is None and layer.awq == AWQSpec(GROUP)
        block = "self_attn" if layer.slice_names[0] in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        names = [f"model.layers.{i}.{block}.{module}" for module in layer.slice_names]
        # The checkpoint's packed words and fp16 scales, unchanged, fused slices side by side.
        for kind in ("qweight", "qzeros", "scales"):
            assert torch.equal(getattr(layer, kind), torch.cat([stored[f"{n}.{kind}"] for n in names], dim=1)), kind
        engine_weight = int4.dequantize(layer.qweight, layer.qzeros, layer.scales, GROUP, torch.float32).t()
        assert torch.equal(engine_weight, torch.cat([reference[f"{n}.weight"] for n in names])), names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_mixed_adapters_over_the_int4_base_match_peft_on_the_dequantized_weights(
    device: str, checkpoints: tuple[Path, Path], tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    awq_dir, plain_dir = checkpoints
    adapters = {
        "all": make_adapter(tiny_llama_dir, r=16, lora_alpha=32, seed=1, init_scale=0.5,
                            target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        "qv": make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=2, init_scale=0.5),
    }  # fmt: skip
    # On CUDA the projections run the Triton kernel (fp32, IEEE dot), decode steps from CUDA graphs.
    llm = LLM(str(awq_dir), device=device, dtype="float32", max_loras=2, max_lora_rank=16, max_num_seqs=4,
              max_model_len=64)  # fmt: skip
    prompts = ["the cat sat on", "a quick brown fox", "once upon a time there", "hello world", "we went to the"]
    loras = [LoRARequest("all", str(adapters["all"])), LoRARequest("qv", str(adapters["qv"])), None,
             LoRARequest("qv", str(adapters["qv"])), LoRARequest("all", str(adapters["all"]))]  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           lora_request=loras)  # fmt: skip
    reference = PeftReference(plain_dir, adapters)
    tokenizer = llm.get_tokenizer()
    changed = 0
    for prompt, lora, output in zip(prompts, loras, outputs):
        ids = tokenizer(prompt).input_ids
        name = lora.lora_name if lora else None
        assert_greedy_match(output.outputs[0].token_ids, reference.generate(ids, name, NEW_TOKENS), f"{name} {prompt!r}")
        if name is not None:
            changed += output.outputs[0].token_ids != reference.generate(ids, None, NEW_TOKENS).token_ids
    assert changed >= 2, "the adapters must change what the INT4 base generates"


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq'.*'awq' only"),
    ({**AWQ_CONFIG, "bits": 8}, "8 bits are not supported"),
    ({**AWQ_CONFIG, "version": "gemv"}, "version 'gemv' is not supported"),
    ({**AWQ_CONFIG, "zero_point": False}, "without zero points"),
    ({**AWQ_CONFIG, "group_size": 24}, "multiple of 16"),
    ({**AWQ_CONFIG, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, "leave projections unquantized"),
])  # fmt: skip
def test_unsupported_quantization_configs_are_refused(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        awq_spec(config)


def test_a_gptq_checkpoint_is_refused_at_load(tiny_llama_dir: Path, tmp_path: Path) -> None:
    (source,) = tiny_llama_dir.glob("*.safetensors")
    gptq_dir = _write(tiny_llama_dir, tmp_path / "gptq", load_file(str(source)), {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        LLM(str(gptq_dir), device="cpu", dtype="float32", max_loras=1)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(quantization="fp8"), "AWQ INT4 checkpoint: quantization='fp8' cannot apply"),
    (dict(tensor_parallel_size=2), "not served under tensor parallelism"),
    (dict(load_format="dummy"), "bench/awq_checkpoint.py writes a random AWQ checkpoint"),
])  # fmt: skip
def test_settings_an_awq_base_cannot_take_are_refused(checkpoints: tuple[Path, Path], kwargs: dict[str, object],
                                                      message: str) -> None:  # fmt: skip
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(checkpoints[0]), device="cpu", **kwargs)  # type: ignore[arg-type]


def test_the_quantization_follows_the_checkpoint(checkpoints: tuple[Path, Path]) -> None:
    awq_dir, plain_dir = checkpoints
    assert EngineConfig(model=str(awq_dir), device="cpu").quantization == "awq", "set from config.json, as vLLM does"
    assert EngineConfig(model=str(awq_dir), device="cpu", quantization="awq").quantization == "awq"
    with pytest.raises(ValueError, match="quantization='awq' needs an AWQ checkpoint"):
        EngineConfig(model=str(plain_dir), device="cpu", quantization="awq")


def test_the_worker_takes_an_awq_checkpoint_with_or_without_the_flag(checkpoints: tuple[Path, Path]) -> None:
    awq_dir = str(checkpoints[0])
    assert engine_config(parse_args(["--model", awq_dir])).quantization == "awq"
    assert engine_config(parse_args(["--model", awq_dir, "--quantization", "awq"])).quantization == "awq"


def test_fp8_on_an_awq_layer_is_refused() -> None:
    """Below the engine's settings too: the layer holds no bf16 weight to quantize."""
    layer = MultiLoRALinear(64, [("o_proj", 64)], bias=False, layer_idx=0, device=torch.device("cpu"),
                            dtype=torch.float32, awq=AWQSpec(GROUP))  # fmt: skip
    with pytest.raises(ValueError, match="cannot be quantized to FP8"):
        layer.quantize_fp8()


def test_a_dora_adapter_over_the_int4_base_is_refused(checkpoints: tuple[Path, Path], tiny_llama_dir: Path,
                                                      make_adapter: Callable[..., Path]) -> None:  # fmt: skip
    """DoRA's magnitude needs the base's row norms: refused at load (EngineConfig.dora_refusal), and the
    engine serves on. (Should a DoRA adapter reach a slot anyway, the layer refuses it too.)"""
    dora = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, seed=3, use_dora=True)
    llm = LLM(str(checkpoints[0]), device="cpu", dtype="float32", max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=r"DoRA adapters \(use_dora\) are not served here: not over a quantized base"):
        llm.generate(["hello world"], params, lora_request=[LoRARequest("dora", str(dora))])
    assert len(llm.generate(["hello world"], params)[0].outputs[0].token_ids) == 3


def test_the_layers_triton_path_matches_its_torch_path(checkpoints: tuple[Path, Path]) -> None:
    """The kernel (interpreted here) behind the layer's own forward, bias included, against the reference."""
    if not fp8.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")
    stored = load_file(str(checkpoints[0] / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"
    qweight, qzeros, scales = (stored[f"{prefix}.{kind}"] for kind in ("qweight", "qzeros", "scales"))
    x = torch.randn(3, qweight.shape[0], generator=torch.Generator().manual_seed(0))
    bias = torch.randn(qweight.shape[1] * 8, generator=torch.Generator().manual_seed(1))
    kernel = int4_linear(x, qweight, qzeros, scales, GROUP, bias, triton=True)
    torch.testing.assert_close(kernel, int4_linear(x, qweight, qzeros, scales, GROUP, bias, triton=False))
    torch.testing.assert_close(kernel, x @ int4.dequantize(qweight, qzeros, scales, GROUP, torch.float32) + bias)


def test_tensor_parallel_awq_layers_are_refused() -> None:
    class TwoRanks:
        size = 2

    with pytest.raises(ValueError, match="not served under tensor parallelism"):
        MultiLoRALinear(64, [("o_proj", 64)], bias=False, layer_idx=0, device=torch.device("cpu"),
                        dtype=torch.float32, tp=TwoRanks(), awq=AWQSpec(GROUP))  # type: ignore[arg-type]  # fmt: skip
    layer = MultiLoRALinear(64, [("o_proj", 64)], bias=False, layer_idx=0, device=torch.device("cpu"),
                            dtype=torch.float32, tp=SINGLE, awq=AWQSpec(GROUP))  # fmt: skip
    assert layer.qweight.shape == (64, 8) and layer.scales.shape == (2, 64)


def test_the_benchs_random_awq_checkpoint_loads(tmp_path: Path) -> None:
    """bench/awq_checkpoint.py (the GPU benchmarks' INT4 base) writes what the engine loads as it is."""
    out = write_random_awq(tmp_path / "awq", "tiny", group_size=32, seed=0)
    llm = LLM(str(out), device="cpu", dtype="float32", max_loras=1, max_lora_rank=8)
    layer = next(iter(llm.llm_engine.runner.model.lora_layers()))
    assert layer.awq == AWQSpec(32)
    stored = load_file(str(out / "model.safetensors"))
    assert torch.equal(layer.qweight[:, :8], stored["model.layers.0.self_attn.q_proj.qweight"])
    assert bool((int4.unpack(layer.qzeros) == 8).all())
    tokens = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
    assert len(tokens) == 4
