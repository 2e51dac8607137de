"""The offline API's shape and inputs, and adapter loading off the decode path."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from serving.engine import LLM, AdapterError, LLMEngine, LoRARequest, SamplingParams
from serving.engine.lora.reader import load_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_loras=2, max_lora_rank=16, device="cpu", max_model_len=64, num_kv_blocks=64)


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj", "down_proj"), seed=11, init_scale=0.5)


def test_prompts_as_text_or_token_ids_in_order(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    texts = ["Hello!", "The quick brown fox jumps", "Yes."]
    by_text = llm.generate(texts, GREEDY)
    by_ids = llm.generate([{"prompt_token_ids": tokenizer(t).input_ids} for t in texts], GREEDY)
    for text, a, b in zip(texts, by_text, by_ids):
        assert a.prompt == text and b.prompt is None
        assert a.prompt_token_ids == b.prompt_token_ids == tokenizer(text).input_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 8
        assert a.finished and a.outputs[0].text == tokenizer.decode(a.outputs[0].token_ids)


def test_lora_request_for_all_or_per_prompt(llm: LLM, adapter: Path) -> None:
    lora = LoRARequest("tuned", 1, str(adapter))  # vLLM's (name, int id, path) form
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("tuned", 1, str(adapter))
    prompts = ["Hello!", "Hello!"]
    both = llm.generate(prompts, GREEDY, lora_request=lora)
    mixed = llm.generate(prompts, GREEDY, lora_request=[None, LoRARequest("tuned", str(adapter))])
    base = llm.generate(prompts[0], GREEDY)[0]
    assert both[0].outputs[0].token_ids == both[1].outputs[0].token_ids == mixed[1].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids == base.outputs[0].token_ids != both[0].outputs[0].token_ids
    assert mixed[1].lora_request == LoRARequest("tuned", str(adapter)) and mixed[0].lora_request is None


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    two = llm.chat([messages, messages[1:]], GREEDY)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids and len(two) == 2


@pytest.mark.parametrize(
    "prompt,message",
    [
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ({"prompt_token_ids": [1, 99999]}, "outside the vocabulary"),
        ({"prompt_token_ids": list(range(3, 70))}, "the prompt is 67 tokens; the context is 64"),
        (42, "a prompt is a string or a dict"),
    ],
)
def test_bad_prompts_are_refused(llm: LLM, prompt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY)  # type: ignore[list-item]
    assert llm.generate("Hello!", GREEDY)[0].finished


def test_mismatched_lists_and_unknown_adapters_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 sampling_params"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(AdapterError, match="'ghost' is not loaded and the request gives no path"):
        llm.generate("Hello!", GREEDY, lora_request=LoRARequest("ghost"))
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_load_never_stalls_decoding_and_its_requests_wait(tiny_llama_dir: Path, adapter: Path, llm: LLM) -> None:
    want = llm.generate("Good morning", GREEDY, lora_request=LoRARequest("tuned", str(adapter)))[0].outputs[0].token_ids
    engine = LLMEngine(llm.llm_engine.config)
    gate = threading.Event()

    def held_load(*args: object, **kwargs: object):
        gate.wait(30)  # storage that answers only when the test says so
        return load_adapter(*args, **kwargs)

    assert engine.lora_cache is not None
    engine.lora_cache.load_fn = held_load
    engine.add_request("base", "Hello there", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("tuned", "Good morning", GREEDY, LoRARequest("tuned", str(adapter)))
    progress = []
    for _ in range(10):
        outputs = {o.request_id: o for o in engine.step()}
        progress.append(len(outputs["base"].outputs[0].token_ids))
        assert "tuned" not in outputs
    assert progress == list(range(2, 12)), "the base request decoded one token per step during the load"
    assert engine.stats().adapters_loading == 1 and engine.stats().num_waiting == 1
    gate.set()
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if engine.last_step_tokens == 0:
            engine.wait_for_loads(0.05)
    assert finished["tuned"].outputs[0].token_ids == want
    assert len(finished["base"].outputs[0].token_ids) == 40
    engine.shutdown()
