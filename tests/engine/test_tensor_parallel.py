"""The engine at tensor-parallel size 2 over gloo (two processes on the CPU) generates what PEFT
generates, for a batch mixing three adapters and the base, on tiny Llama and Qwen2 models whose
KV heads split evenly (2 over 2 ranks), on one whose single KV head is replicated (and whose
vocabulary, 515, leaves the second rank's half padded), on Phi-3 (fused qkv_proj and gate_up_proj,
one LoRA slice each, cut per rank part by part) and on Gemma 2 (the LM head tied to the
vocabulary-parallel embedding, soft-capped logits). Two GPU slots for three adapters make the
cache evict and reload, so rank 0's writes must reach the other rank in order. A rank killed
mid-service ends the engine with an error naming it, at once and on every later step, and leaves
no process behind, whether it died between steps or while rank 0 waited on it inside one; head counts the size cannot split are refused, naming them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match
from transformers import AutoConfig, AutoModelForCausalLM

from serving.engine import LLM, EngineConfig, LoRARequest, SamplingParams
from serving.engine.distributed.driver import DriverRunner
from serving.engine.distributed.parallel import RankFailedError, TensorParallel
from serving.engine.layers.parallel_linear import split_heads

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time",
    "and then it runs away into the forest and the fox",
    "Hello there, little house",
    "The lazy dog sleeps",
]
ADAPTER_SPECS = [  # (rank, alpha, target modules): column- and row-parallel, split and not
    (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (4, 8, ("v_proj", "down_proj")),
    (16, 32, ("k_proj", "o_proj", "up_proj")),
]
# Phi-3 stores (and PEFT adapts) q/k/v and gate/up fused.
PHI3_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                "up_proj": "gate_up_proj"}
MAX_TOKENS = 6
ENGINE = dict(max_loras=2, max_lora_rank=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96,
              block_size=4, num_kv_blocks=64, device="cpu", dtype="float32", tensor_parallel_size=2)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread", "tp_ranks_forked")]


@pytest.fixture(scope="module")
def kv1_model_dir(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shape with one KV head (fewer than the ranks) and a vocabulary of 515 rows
    (the tokenizer's 512 and three unused), random weights of its own."""
    base = tiny_model_factory("llama")
    out = tmp_path_factory.mktemp("models") / "tiny-llama-kv1"
    out.mkdir()
    for path in base.iterdir():
        if path.name != "config.json" and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    config = AutoConfig.from_pretrained(base)
    config.num_key_value_heads = 1
    config.vocab_size = 515
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    return out


@pytest.fixture(params=["llama", "qwen2", "llama-kv1", "phi3", "gemma2"])
def model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    if request.param == "llama-kv1":
        return request.getfixturevalue("kv1_model_dir")
    return tiny_model_factory(request.param)


def test_tp2_mixed_adapters_match_peft(model_dir: Path, make_adapter: Callable[..., Path]) -> None:
    fused = json.loads((model_dir / "config.json").read_text())["model_type"] == "phi3"
    adapters = {}
    for i, (r, alpha, mods) in enumerate(ADAPTER_SPECS):
        targets = sorted({PHI3_MODULES.get(m, m) for m in mods}) if fused else mods
        adapters[f"ad{i}"] = make_adapter(model_dir, r=r, lora_alpha=alpha, target_modules=targets, seed=10 + i,
                                          init_scale=0.5)  # fmt: skip
    names = [*adapters, None]
    loras = [None if (name := names[i % len(names)]) is None else LoRARequest(name, str(adapters[name]))
             for i in range(len(PROMPTS))]  # fmt: skip
    llm = LLM(str(model_dir), **ENGINE)
    try:
        runner = llm.llm_engine.runner
        assert isinstance(runner, DriverRunner) and runner.tp.size == 2
        kv_heads = runner.model.config.num_key_value_heads
        attention = runner.model.attention_layers()[0]
        assert attention.num_kv_heads == max(1, kv_heads // 2), "each rank's KV cache holds its KV heads alone"
        assert runner.kv_cache.shape[-2] == attention.num_kv_heads
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               lora_request=loras)  # fmt: skip
        assert llm.llm_engine.stats().slot_evictions > 0, "three adapters over two slots must swap"
    finally:
        llm.llm_engine.shutdown()
    assert all(p.poll() is not None for p in runner._ranks.values()), "shutdown stops every rank"

    reference = PeftReference(model_dir, adapters)
    tokenizer = llm.get_tokenizer()
    changed = 0
    for prompt, lora, output in zip(PROMPTS, loras, outputs):
        ids = tokenizer(prompt).input_ids
        name = lora.lora_name if lora else None
        ref = reference.generate(ids, name, MAX_TOKENS)
        assert_greedy_match(output.outputs[0].token_ids, ref, f"{model_dir.name} {name} {prompt[:20]!r}")
        if name is not None:
            changed += output.outputs[0].token_ids != reference.generate(ids, None, MAX_TOKENS).token_ids
    assert changed >= 2, f"only {changed} adapter prompts differ from the base: adapters seem not applied"


def test_killed_rank_ends_the_engine(tiny_model_factory: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_model_factory("llama")), **{**ENGINE, "max_loras": 0})
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    runner = llm.llm_engine.runner
    assert isinstance(runner, DriverRunner)
    try:
        assert len(llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) == 3
        os.kill(runner.rank_pids[1], signal.SIGKILL)
        with pytest.raises(RankFailedError, match=r"tensor-parallel rank 1 exited .*killed by SIGKILL.*stopped"):
            llm.generate(PROMPTS[:1], params)
        with pytest.raises(RankFailedError, match="rank 1"):  # and every step after it
            llm.llm_engine.runner.execute([])
    finally:
        llm.llm_engine.shutdown()
    assert all(p.poll() is not None for p in runner._ranks.values())
    assert not torch.distributed.is_initialized(), "the group is left, so a new engine can start"


def test_a_rank_dying_while_rank_0_waits_on_it_ends_the_step(tiny_model_factory: Callable[..., Path]) -> None:
    """Rank 1 stopped (SIGSTOP), rank 0's step waits in a collective with it; once rank 1 is
    killed the collective fails at once (its sockets close) and the step ends with the error."""
    llm = LLM(str(tiny_model_factory("llama")), **{**ENGINE, "max_loras": 0})
    runner = llm.llm_engine.runner
    assert isinstance(runner, DriverRunner)
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    try:
        os.kill(runner.rank_pids[1], signal.SIGSTOP)
        step = threading.Thread(target=generate)
        step.start()
        step.join(2)
        assert step.is_alive(), "rank 0 cannot finish a step without rank 1"
        os.kill(runner.rank_pids[1], signal.SIGKILL)
        step.join(60)
        assert not step.is_alive(), "the step ended"
    finally:
        llm.llm_engine.shutdown()
    assert len(errors) == 1 and isinstance(errors[0], RankFailedError), errors
    assert re.search(r"rank 1 exited (during a step|between steps) \(killed by SIGKILL\)", str(errors[0]))


def test_head_counts_the_size_cannot_split_are_refused() -> None:
    tp = TensorParallel(rank=1, size=2)
    assert split_heads(4, 1, tp).first_kv_head == 0  # both ranks read the one KV head
    assert split_heads(8, 2, TensorParallel(rank=3, size=4)).first_kv_head == 1
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by tensor_parallel_size=2"):
        split_heads(4, 3, tp)
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
        split_heads(3, 1, tp)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is not a multiple of num_key_value_heads=3"):
        split_heads(12, 3, TensorParallel(rank=0, size=4))



def test_a_size_below_one_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(model=str(tiny_model_factory("llama")), tensor_parallel_size=0)
