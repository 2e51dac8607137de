"""An adapter on the vocabulary modules through the worker's OpenAI API: loaded at run time, it
answers ``/v1/completions`` token for token as the offline engine does (which
tests/engine/test_vocab_adapters_served.py holds to PEFT) and ``/v1/chat/completions`` too; one whose
copy of lm_head is a full copy is refused at load with the reason, and the worker keeps serving."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoConfig

from serving.engine import LoRARequest, SamplingParams
from serving.engine.lora.reader import MAX_CHANGED_ROWS_DIVISOR
from tests.engine.server.conftest import WorkerProcess
from tests.engine.vocab_adapters import save_vocab_adapter

PROMPT = "Good morning, everyone. Today we will learn"
MAX_TOKENS = 12


def test_a_vocabulary_adapter_serves_through_the_api_and_a_full_copy_is_refused(
        worker: WorkerProcess, offline: object, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("vocab-api")
    adapter = save_vocab_adapter(tiny_model, root / "vocab", target_modules=("q_proj", "lm_head"),
                                 modules_to_save=("embed_tokens",), changed={"embed_tokens": range(40, 60)}, seed=21)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    generate = offline.generate  # type: ignore[attr-defined]
    expected = generate(PROMPT, greedy, LoRARequest("vocab-offline", str(adapter)))[0]
    base = generate(PROMPT, greedy)[0]
    assert list(expected.outputs[0].token_ids) != list(base.outputs[0].token_ids)
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "vocab", "lora_path": str(adapter)})
        assert loaded.status_code == 200, loaded.text
        completion = http.post("/v1/completions", json={"model": "vocab", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0, "return_token_ids": True})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids)
        chat = http.post("/v1/chat/completions", json={"model": "vocab", "max_tokens": 4, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "Hello!"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 4

        vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
        whole = save_vocab_adapter(tiny_model, root / "whole", target_modules=("q_proj",), modules_to_save=("lm_head",),
                                   changed={"lm_head": range(vocab // MAX_CHANGED_ROWS_DIVISOR + 1)}, seed=22)
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "whole", "lora_path": str(whole)})
        assert refused.status_code == 400, refused.text
        assert "rows differ from the base model's, more than 1/8 of the vocabulary" in refused.text
        assert "lm_head" in refused.text
        again = http.post("/v1/completions", json={"model": "vocab", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0, "return_token_ids": True})
        assert again.json()["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids)
        http.post("/v1/unload_lora_adapter", json={"lora_name": "vocab"})
