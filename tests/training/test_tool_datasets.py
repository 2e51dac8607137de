"""Chat datasets with tools (OpenAI's fine-tuning format): a line with `tools`, assistant
`tool_calls` and `tool` messages validates and renders through the base model's chat template
with its calls trained; each malformed part is that line's error with its code."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import AutoTokenizer

from training.examples import IGNORE_INDEX, EncodingError, encode_example, parse_example
from training.validation import validate_lines

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
LINE = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "assistant", "content": "Clear skies in Rome."},
    ],
    "parallel_tool_calls": False,
}


@pytest.fixture(scope="module")
def tokenizer(base_model_dir):
    return AutoTokenizer.from_pretrained(base_model_dir)


def with_messages(*replaced: tuple[int, dict | None], tools: object = None) -> dict:
    """LINE with messages replaced by index (None: removed), and other tools when given."""
    messages = list(LINE["messages"])
    for index, message in sorted(replaced, key=lambda pair: -pair[0]):
        if message is None:
            del messages[index]
        else:
            messages[index] = message
    return {**LINE, "messages": messages, **({"tools": tools} if tools is not None else {})}


def test_a_dataset_with_tools_and_tool_calls_validates_with_token_stats(tokenizer):
    report = validate_lines([json.dumps(LINE).encode()] * 3, tokenizer=tokenizer, max_seq_length=1024).to_dict()
    assert report["valid"], report["errors"]
    assert report["format"] == "chat" and report["num_examples"] == 3
    assert not report["warnings"][1:] and report["warnings"][0]["code"] == "few_examples"
    assert report["stats"]["total_tokens"] > report["stats"]["trained_tokens"] > 0


def test_malformed_tool_parts_are_line_errors_with_codes():
    call = CALL["function"]
    lines = [
        with_messages(tools=[WEATHER, {"type": "function", "function": {"name": "bad name!"}}]),
        with_messages(tools=[WEATHER, WEATHER]),
        with_messages(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}]),
        with_messages((2, {"role": "assistant", "tool_calls": [{**CALL, "function": {**call, "name": "launch"}}]})),
        with_messages((2, {"role": "assistant", "tool_calls": [{**CALL, "function": {**call, "arguments": "{oops"}}]})),
        with_messages((2, {"role": "assistant", "tool_calls": [{**CALL, "function": {**call, "arguments": '{"town": 1}'}}]})),
        with_messages((3, {"role": "tool", "tool_call_id": "call_9", "content": "x"})),
        with_messages((1, {"role": "user", "content": "Hi", "tool_calls": [CALL]})),
        with_messages((2, {"role": "assistant", "tool_calls": [{"id": "call_1", "function": "get_weather"}]})),
        with_messages((3, {"role": "tool", "tool_call_id": "call_1"})),
        {key: value for key, value in LINE.items() if key != "tools"},
    ]
    report = validate_lines([json.dumps(line).encode() for line in lines], tokenizer=None,
                            max_seq_length=512).to_dict()
    assert [(error["line"], error["code"]) for error in report["errors"]] == [
        (1, "invalid_tools"), (2, "invalid_tools"), (3, "invalid_tools"), (4, "tool_call_unknown_function"),
        (5, "invalid_tool_call_arguments"), (6, "invalid_tool_call_arguments"), (7, "invalid_tool_message"),
        (8, "invalid_tool_calls"), (9, "invalid_tool_calls"), (10, "invalid_tool_message"),
        (11, "tool_call_unknown_function"),
    ]
    messages = [error["message"] for error in report["errors"]]
    assert "messages[2].tool_calls[0] calls 'launch'" in messages[3] and "(get_weather)" in messages[3]
    assert "'town' was unexpected" in messages[5] or "'city' is a required property" in messages[5]
    assert "call_9" in messages[6]


@pytest.fixture
def recording_server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server that answers every GET with a schema and records the paths asked for."""
    requested: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            requested.append(self.path)
            body = json.dumps({"type": "object"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/schema+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requested
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_a_remote_ref_in_a_tool_schema_is_a_line_error_and_nothing_is_fetched(recording_server):
    """The attack of issue 37: a tool schema's `$ref` to a URL made the worker fetch it (SSRF; a tarpit
    held the worker 378 s) and the file failed without a line number. Now the line is refused, and
    no reference, however spelled, reaches the network: the server must see no request."""
    url, requested = recording_server

    def tool(parameters: dict) -> dict:
        return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}

    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    remote = [
        {"type": "object", "properties": {"city": {"$ref": f"{url}/city.json"}}},
        {"$id": f"{url}/root.json", "type": "object", "properties": {"city": {"$ref": "city.json"}}},
        {"$schema": f"{url}/meta.json", "type": "object", "$dynamicRef": f"{url}/dynamic.json"},
        {"type": "object", "allOf": [{"$ref": f"{url}/all.json#/x"}]},
    ]
    lines = [json.dumps(LINE).encode()]
    lines += [json.dumps(with_messages(tools=[tool(parameters)])).encode() for parameters in remote]
    # Local references still work, and one to a part the schema lacks is that line's error.
    local = {"$defs": {"city": {"type": "string"}}, "type": "object",
             "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"]}
    lines.append(json.dumps(with_messages(tools=[tool(local)])).encode())
    lines.append(json.dumps(with_messages(tools=[tool({**city, "properties": {"city": {"$ref": "#/$defs/no"}}})]))
                 .encode())

    report = validate_lines(lines, tokenizer=None, max_seq_length=512).to_dict()

    assert requested == []
    errors = [(error["line"], error["code"]) for error in report["errors"]]
    assert [line for line, code in errors if code == "invalid_tools"] == [2, 3, 4, 5]
    assert (7, "invalid_tool_call_arguments") in errors and all(line != 6 for line, _ in errors)
    first = next(error["message"] for error in report["errors"] if error["line"] == 2)
    assert first == (f"tools[0].function.parameters: remote $ref '{url}/city.json' is not allowed; only local "
                     "'#/…' references are.")
    dangling = next(error["message"] for error in report["errors"] if error["line"] == 7)
    assert "does not resolve" in dangling and report["num_examples"] == 2


def test_tool_calls_render_through_the_template_and_only_the_replies_are_trained(tokenizer):
    example, errors, _ = parse_example(LINE, "chat")
    assert example is not None and not errors
    encoded = encode_example(example, tokenizer)
    rendered = [{key: value for key, value in message.items() if key != "weight"} for message in example.messages]
    reference = tokenizer.apply_chat_template(rendered, tools=[WEATHER], return_assistant_tokens_mask=True,
                                              return_dict=True)
    assert encoded.input_ids == reference["input_ids"]
    assert [label != IGNORE_INDEX for label in encoded.labels] == [bool(x) for x in reference["assistant_masks"]]
    trained = tokenizer.decode([label for label in encoded.labels if label != IGNORE_INDEX])
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'
                       "Clear skies in Rome.<|im_end|>")
    prompt = tokenizer.decode(encoded.input_ids)
    assert '"name": "get_weather", "description": "The weather in a city now."' in prompt
    assert "<tool_response>\n{\"sky\": \"clear\"}\n</tool_response>" in prompt


def test_the_same_mask_without_generation_markers(tokenizer, base_model_dir):
    plain_template = AutoTokenizer.from_pretrained(base_model_dir)
    plain_template.chat_template = (tokenizer.chat_template.replace("{%- generation %}", "")
                                    .replace("{%- endgeneration %}", ""))
    example, _, _ = parse_example(LINE, "chat")
    assert example is not None
    assert encode_example(example, plain_template) == encode_example(example, tokenizer)


def test_a_calls_arguments_reach_the_template_as_an_object(base_model_dir):
    # The tiny model's template (like Qwen2.5's) writes string arguments verbatim, so arguments
    # passed on as OpenAI's JSON text render the same there. Templates that write
    # `arguments | tojson` unconditionally (Llama 3.1's, Mistral's) would double-encode them
    # ("{\"city\": …}"), and the adapter would learn calls the worker cannot read back.
    example, errors, _ = parse_example(LINE, "chat")
    assert example is not None and not errors
    assert example.messages[2]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
    strict = AutoTokenizer.from_pretrained(base_model_dir)
    lenient = "call['arguments'] if call['arguments'] is string else call['arguments'] | tojson"
    assert lenient in strict.chat_template
    strict.chat_template = strict.chat_template.replace(lenient, "call['arguments'] | tojson")
    encoded = encode_example(example, strict)
    trained = strict.decode([label for label in encoded.labels if label != IGNORE_INDEX])
    assert trained.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def test_a_template_that_ignores_tools_refuses_tool_examples(base_model_dir):
    chatml = AutoTokenizer.from_pretrained(base_model_dir)
    chatml.chat_template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '')"
        " + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    example, _, _ = parse_example(LINE, "chat")
    assert example is not None
    with pytest.raises(EncodingError, match="does not render tools"):
        encode_example(example, chatml)
    without_tools, _, _ = parse_example({"messages": LINE["messages"]}, "chat")
    assert without_tools is None  # calls need the line's tools


@pytest.mark.slow
def test_an_adapter_trained_on_tool_calls_writes_calls_the_worker_reads(base_model_dir, tmp_path, one_thread):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from serving.engine.server.tool_parsers import HERMES, parse
    from training.hyperparameters import Hyperparameters
    from training.trainer import LoraTrainer, load_base

    base = load_base(str(base_model_dir))
    cities = ["Rome", "Paris", "Oslo", "Lima"]
    rows = [{"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                                   "arguments": json.dumps({"city": city})}}]}]}
        for city in cities]
    examples = []
    for row in rows:
        example, errors, _ = parse_example(row, "chat")
        assert example is not None, errors
        examples.append(encode_example(example, base.tokenizer))

    class Hooks:
        def should_stop(self) -> bool:
            return False

        def on_step(self, *_: object) -> None: ...

        def on_log(self, *_: object) -> None: ...

        def on_checkpoint(self, *_: object) -> None: ...

    # Batches of one: 160 updates for the CPU of 40 batches of four (150 batches of four took 2.3x the CPU).
    # 40 and 45 epochs learn under seeds 1 to 3 (35 under seed 1; 50 under seed 2 missed one city of
    # four: what is learnt is not monotonic in the epochs, so the count is checked, not extrapolated).
    hp = Hyperparameters(n_epochs=40, batch_size=1, learning_rate=1e-2, max_seq_length=512, r=8, lora_alpha=16,
                         lora_dropout=0.0)
    result = LoraTrainer(base, hp, seed=1, train=examples, valid=[], hooks=Hooks(), work_dir=tmp_path / "run",
                         fingerprint="tools", base_model_name="tiny-llama", checkpoint_every=1000, log_every=50).run()

    tokenizer = base.tokenizer
    plain = AutoModelForCausalLM.from_pretrained(base_model_dir)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model_dir), result.adapter_dir)

    def reply(model, city: str) -> str:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Weather in {city}?"}], tools=[WEATHER],
                                               tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=80, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    for city in cities:
        calls = parse(HERMES, reply(tuned, city)).calls
        assert [call.name for call in calls] == ["get_weather"]
        assert json.loads(calls[0].arguments)["city"] in cities
        assert not parse(HERMES, reply(plain, city)).calls
