"""A mixed batch of many adapters and the base, under pressure, generates what PEFT generates.

For each architecture: 14 prompts of different lengths (one long enough to be prefilled in
chunks) over 5 PEFT-saved adapters (ranks 4 to 64, different target modules and alphas) and the
base model, with fewer sequence slots than prompts, fewer GPU slots and CPU cache entries than
adapters, and a KV cache small enough to force preemption. Every prompt's greedy tokens must equal
PEFT's for that prompt alone with its adapter. On the CPU it runs through both paths of the torch
reference (the grid, and each group alone); on CUDA (gpu mark) the same runs in fp32 through the
Triton kernels, against PEFT on the CPU, with decode steps replayed from CUDA graphs and eagerly
(``enforce_eager``); adapters swap slots between replays, so a replay reading a stale or
half-written slot would show as a token mismatch. The "-async" runs schedule each step while the
one before is in flight (``async_scheduling``): decode rows take their token on the device from
the step before, through preemptions, chunked prefills and slot swaps, and must still match PEFT.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, Reference, assert_greedy_match

import kernels.cpu_lora
from serving.engine import LLM, LoRARequest, SamplingParams

ADAPTER_SPECS = [  # (rank, alpha, target modules)
    (4, 8, ("q_proj", "v_proj")),
    (16, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (64, 32, ("gate_proj", "up_proj", "down_proj")),
    (8, 64, ("k_proj", "o_proj")),
    (32, 16, ("v_proj", "down_proj")),
]
WORDS = "The quick brown fox jumps over the lazy dog and then it runs away into the forest".split()
LONG = " ".join(WORDS * 2)
MAX_TOKENS = 12
# "cpu-loop": the CPU path with every adapter group run alone at its own rank (the torch reference's
# other path; plain "cpu" takes the grid its cost model picks for these tiny shapes).
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [
    pytest.param("cpu", True, False, id="cpu"),
    # The fast tier keeps the plain CPU path; the loop kernels and async scheduling are `slow`.
    pytest.param("cpu-loop", True, False, marks=pytest.mark.slow, id="cpu-loop"),
    pytest.param("cpu", True, True, marks=pytest.mark.slow, id="cpu-async"),
    pytest.param("cuda", False, False, marks=_CUDA, id="cuda-graphs"),
    pytest.param("cuda", True, False, marks=_CUDA, id="cuda-eager"),
    pytest.param("cuda", False, True, marks=_CUDA, id="cuda-graphs-async"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def peft_generate() -> Callable[[Path, dict[str, Path], list[int], str | None], Reference]:
    """PEFT's greedy generation of one prompt with one adapter (or the base), computed once a module:
    the CPU variants of an architecture (plain, loop kernels, async) run the same workload on the same
    adapters, so PEFT's answer is the same for each; it is the engine that differs."""
    references: dict[tuple[Path, tuple[tuple[str, Path], ...]], PeftReference] = {}
    made: dict[tuple[object, tuple[int, ...], str | None], Reference] = {}

    def generate(base_dir: Path, adapters: dict[str, Path], ids: list[int], name: str | None) -> Reference:
        model = (base_dir, tuple(adapters.items()))
        if model not in references:
            references[model] = PeftReference(base_dir, adapters)
        key = (model, tuple(ids), name)
        if key not in made:
            made[key] = references[model].generate(ids, name, MAX_TOKENS)
        return made[key]

    return generate


@pytest.fixture(scope="module")
def adapters_for(make_adapter: Callable[..., Path]) -> Callable[[Path], dict[str, Path]]:
    made: dict[Path, dict[str, Path]] = {}

    def build(base_dir: Path) -> dict[str, Path]:
        if base_dir not in made:
            made[base_dir] = {
                f"ad{i}": make_adapter(base_dir, r=r, lora_alpha=alpha, target_modules=mods, seed=i, init_scale=0.5)
                for i, (r, alpha, mods) in enumerate(ADAPTER_SPECS)
            }
        return made[base_dir]

    return build


def _workload(adapters: dict[str, Path]) -> tuple[list[str], list[LoRARequest | None]]:
    prompts = [" ".join(WORDS[: 2 + (i * 3) % 14]) for i in range(13)] + [LONG]
    names = list(adapters)
    loras: list[LoRARequest | None] = []
    for i in range(len(prompts)):
        if i % 6 == 5:
            loras.append(None)
        else:
            name = names[i % len(names)]
            loras.append(LoRARequest(name, str(adapters[name])))
    return prompts, loras


@pytest.mark.parametrize(("device", "enforce_eager", "async_scheduling"), DEVICES)
def test_mixed_batch_matches_peft(
    device: str,
    enforce_eager: bool,
    async_scheduling: bool,
    tiny_model_dir: Path,
    adapters_for: Callable[[Path], dict[str, Path]],
    peft_generate: Callable[[Path, dict[str, Path], list[int], str | None], Reference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if device == "cpu-loop":
        monkeypatch.setattr(kernels.cpu_lora, "DENSE_MAX_MACS", 0)
        device = "cpu"
    adapters = adapters_for(tiny_model_dir)
    prompts, loras = _workload(adapters)
    llm = LLM(
        str(tiny_model_dir),
        max_loras=2,
        max_cpu_loras=3,
        max_lora_rank=64,
        max_num_seqs=5,
        max_num_batched_tokens=32,
        max_model_len=128,
        block_size=4,
        num_kv_blocks=40,
        # The prompts are prefixes of one another: shared cached blocks would relieve the memory
        # pressure sized here to force preemption (prefix caching's own tests preempt with it).
        enable_prefix_caching=False,
        device=device,
        dtype="float32",
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=loras)
    graphs = llm.llm_engine.runner.graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.replays > 0, "decode steps must replay the captured graphs"

    stats = llm.llm_engine.stats()
    assert stats.peak_waiting > 5, "more prompts than max_num_seqs must queue"
    assert stats.num_preemptions > 0, "the KV cache was sized to force preemption"
    assert stats.slot_evictions > 0 and stats.slot_waits > 0, "5 adapters over 2 GPU slots must swap"
    assert stats.cpu_evictions > 0, "5 adapters over 3 CPU cache entries must evict"
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0

    tokenizer = llm.get_tokenizer()
    changed = 0
    for prompt, lora, output in zip(prompts, loras, outputs):
        ids = tokenizer(prompt).input_ids
        assert output.prompt_token_ids == ids
        assert output.outputs[0].finish_reason == "length"
        name = lora.lora_name if lora else None
        ref = peft_generate(tiny_model_dir, adapters, ids, name)
        assert_greedy_match(output.outputs[0].token_ids, ref, f"{tiny_model_dir.name} {name} {prompt[:30]!r}")
        if name is not None:
            changed += output.outputs[0].token_ids != peft_generate(tiny_model_dir, adapters, ids, None).token_ids
    assert changed >= 8, f"only {changed} adapter prompts differ from the base: adapters seem not applied"
