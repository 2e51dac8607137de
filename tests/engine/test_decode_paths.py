"""The engine's decode paths agree: the paged-attention kernel against the page gather + SDPA, and
on CUDA graph replay against eager steps, token for token on a mixed batch of adapters and base.

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
when there is no CUDA device); on CUDA (gpu mark) compiled, in fp32, with graphs on and off (steps
with prompt chunks replayed too: every step runs flat there). Async scheduling (each step launched
while the one before is in flight, decode rows fed its tokens on the device) gives the same tokens
on the flat paths: Triton's on the CPU, and the graphs' on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from serving.engine import LLM, EngineConfig, LoRARequest, SamplingParams
from serving.engine.config import graph_ladder

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA = torch.cuda.is_available()
PROMPTS = ["the quick brown fox", "a b c d e f g h i j k l m n o p q r s t", "jumps", "over the lazy dog again"]


def _generate(model: Path, adapters: list[Path], max_tokens: int = 10, **config: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        str(model), max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=96, block_size=4, dtype="float32",
        **config,
    )  # fmt: skip
    loras = [LoRARequest(f"a{i % 2}", str(adapters[i % 2])) if i != 2 else None for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def mistral_with_adapters(
    tiny_model_factory: Callable[..., Path], make_adapter: Callable[..., Path]
) -> tuple[Path, list[Path]]:
    model = tiny_model_factory("mistral")
    return model, [make_adapter(model, r=8, lora_alpha=16, seed=i, init_scale=0.5) for i in range(2)]


@pytest.mark.slow
def test_triton_attention_matches_torch(mistral_with_adapters: tuple[Path, list[Path]]) -> None:
    import kernels.paged_attention as paged

    device = "cuda" if CUDA else "cpu"
    if device == "cpu" and not paged.INTERPRETED:
        pytest.skip("Triton's interpreter is off")
    model, adapters = mistral_with_adapters
    # Five tokens: every sequence's decodes cross a page (block_size 4) and async scheduling keeps
    # steps in flight; the interpreter's cost is per decode row, so more tokens test nothing more.
    tokens = 5
    torch_tokens, _ = _generate(model, adapters, tokens, device=device, attention_backend="torch", enforce_eager=True)
    triton_tokens, _ = _generate(model, adapters, tokens, device=device, attention_backend="triton", enforce_eager=True)
    assert triton_tokens == torch_tokens
    overlapped, _ = _generate(model, adapters, tokens, device=device, attention_backend="triton", enforce_eager=True,
                              async_scheduling=True)
    assert overlapped == torch_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_graphs_match_eager(mistral_with_adapters: tuple[Path, list[Path]], async_scheduling: bool) -> None:
    model, adapters = mistral_with_adapters
    eager, _ = _generate(model, adapters, device="cuda", enforce_eager=True)
    graphed, llm = _generate(model, adapters, device="cuda", cuda_graph_sizes=[1, 2, 4, 128],
                             async_scheduling=async_scheduling)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.memory_bytes >= 0
    assert graphs.chunk_replays > 0, "steps with prompt chunks must replay the captured graphs too"
    assert graphed == eager


def test_graph_ladder() -> None:
    assert graph_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_ladder(3) == [1, 2, 3]
    assert graph_ladder(64, [48, 8, 100]) == [8, 48]
    ladder = graph_ladder(2048)
    assert ladder[:4] == [1, 2, 4, 8] and {256, 384, 1024, 1280, 2048} <= set(ladder) and 2304 not in ladder
    assert all(b <= 1.25 * (a + 1) for a, b in zip(ladder, ladder[1:]) if a >= 256), "padding past 256 stays under 1.25 ×"


def test_no_graphs_on_cpu_or_when_eager(tiny_llama_dir: Path) -> None:
    assert EngineConfig(model=str(tiny_llama_dir), device="cpu").graph_sizes() == []
    assert EngineConfig(model=str(tiny_llama_dir), device="cpu").attention == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model=str(tiny_llama_dir), attention_backend="flash")
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(model=str(tiny_llama_dir), cuda_graph_sizes=[0])
