"""Encoding examples: loss only on assistant replies / completions, for any chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from training.examples import IGNORE_INDEX, Example, EncodingError, encode_example


@pytest.fixture(scope="module")
def tokenizer(base_model_dir):
    return AutoTokenizer.from_pretrained(base_model_dir)


CONVERSATION = (
    {"role": "system", "content": "Be brief.", "weight": 1},
    {"role": "user", "content": "What is the capital of Italy?", "weight": 1},
    {"role": "assistant", "content": "Rome.", "weight": 1},
    {"role": "user", "content": "And of France?", "weight": 1},
    {"role": "assistant", "content": "Paris, of course.", "weight": 1},
)


def trained_text(tokenizer, encoded) -> str:
    return tokenizer.decode([label for label in encoded.labels if label != IGNORE_INDEX])


def test_chat_mask_equals_the_templates_own_assistant_mask(tokenizer):
    encoded = encode_example(Example(format="chat", messages=CONVERSATION), tokenizer)
    plain = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    reference = tokenizer.apply_chat_template(plain, return_assistant_tokens_mask=True, return_dict=True)
    assert encoded.input_ids == reference["input_ids"]
    assert [label != IGNORE_INDEX for label in encoded.labels] == [bool(x) for x in reference["assistant_masks"]]
    assert trained_text(tokenizer, encoded) == "Rome.<|im_end|>Paris, of course.<|im_end|>"


def test_templates_without_generation_markers_give_the_same_mask(tokenizer, base_model_dir):
    plain_template = AutoTokenizer.from_pretrained(base_model_dir)
    plain_template.chat_template = (tokenizer.chat_template.replace("{%- generation %}", "")
                                    .replace("{%- endgeneration %}", ""))
    assert "% generation" not in plain_template.chat_template 
    assert plain_template.chat_template != tokenizer.chat_template
    ours = encode_example(Example(format="chat", messages=CONVERSATION), plain_template)
    marked = encode_example(Example(format="chat", messages=CONVERSATION), tokenizer)
    assert ours == marked


def test_weight_zero_replies_are_not_trained(tokenizer):
    messages = list(CONVERSATION)
    messages[2] = {**messages[2], "weight": 0}
    encoded = encode_example(Example(format="chat", messages=tuple(messages)), tokenizer)
    assert trained_text(tokenizer, encoded) == "Paris, of course.<|im_end|>"


def test_completion_trains_the_completion_and_eos_only(tokenizer):
    encoded = encode_example(Example(format="completion", prompt="Q: capital of Italy?", completion=" A: Rome."),
                             tokenizer)
    assert trained_text(tokenizer, encoded) == " A: Rome.<|im_end|>"
    assert encoded.input_ids[0] == tokenizer.bos_token_id


def test_text_trains_everything_and_truncation_is_reported(tokenizer):
    encoded = encode_example(Example(format="text", text="The quick brown fox jumps over the lazy dog."), tokenizer)
    assert all(label != IGNORE_INDEX for label in encoded.labels) and not encoded.truncated
    cut = encode_example(Example(format="text", text="The quick brown fox jumps over the lazy dog."), tokenizer, 4)
    assert len(cut.input_ids) == 4 and cut.truncated and cut.full_length == len(encoded.input_ids)


def test_a_tokenizer_without_chat_template_refuses_chat(base_model_dir):
    bare = AutoTokenizer.from_pretrained(base_model_dir)
    bare.chat_template = None
    with pytest.raises(EncodingError, match="no chat template"):
        encode_example(Example(format="chat", messages=CONVERSATION), bare)
