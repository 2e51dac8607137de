"""Requests that would stall a worker (docs/serving-worker.md, "What an operator must set", its last
paragraph), sent to real worker processes: a caller's own chat template is refused unless the
operator trusts them, and then renders in a sandboxed child with a deadline and a memory cap;
templating and tokenizing run off the event loop, so `/health` answers while they run; a body over
the bound is refused with 413 before it is read."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from transformers import AutoTokenizer

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# The slow template burns a core in its child for this long; the length is not what is tested (the
# other templates render in milliseconds), only that the deadline stops it while /health answers.
TEMPLATE_TIMEOUT_S = 1.5
# A bound in seconds, far above what a free event loop takes and below what a held one takes.
HEALTH_TIMEOUT_S = 2.0
BODY_BOUND = 64 * 1024


def chat(url: str, **extra) -> httpx.Response:
    body = {"model": "base", "messages": CHAT, "max_tokens": 2, "temperature": 0, "return_token_ids": True, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def health_while(work: Callable[[], httpx.Response], url: str) -> tuple[httpx.Response, list[int]]:
    """Runs `work` on a thread and polls /health until it is done: its response, and the statuses
    /health answered while it was still running."""
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    answers = []
    try:
        # Probed from the start and often: on a quiet machine the long prompt is tokenized in about
        # half a second, and a first probe after a fixed wait could come after the answer.
        while thread.is_alive():
            status = httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S).status_code
            if thread.is_alive():
                answers.append(status)
            time.sleep(0.05)
    finally:
        thread.join(timeout=120)
    return result[0], answers


def test_caller_chat_templates_are_refused_unless_the_operator_trusts_them(worker):
    for extra, param in (({"chat_template": "{{ 'owned' }}"}, "chat_template"),
                         ({"chat_template_kwargs": {"chat_template": SLOW}}, "chat_template_kwargs.chat_template")):
        response = chat(worker.url, model="tiny-base", **extra)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "--trust-request-chat-template" in error["message"]
    reserved = chat(worker.url, model="tiny-base", chat_template_kwargs={"tokenize": True, "truncation": True})
    assert reserved.status_code == 400
    assert "tokenize, truncation" in reserved.json()["error"]["message"]
    # Template variables stay allowed.
    assert chat(worker.url, model="tiny-base", chat_template_kwargs={"enable_thinking": False}).status_code == 200


@pytest.fixture(scope="module")
def trusting_worker(start_worker):
    """Trusts callers' chat templates and bounds request bodies: one worker start for the file's
    tests of either (the templates sent stay far under the bound)."""
    return start_worker("--served-model-name", "base", "--trust-request-chat-template",
                        "--chat-template-timeout", str(TEMPLATE_TIMEOUT_S), "--max-request-body-bytes", str(BODY_BOUND))


def test_a_trusted_template_renders_as_the_tokenizer_would(trusting_worker, tiny_model):
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[ASSISTANT] {{ style }}{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=False, add_generation_prompt=True,
                                         style="verse")
    for extra in ({"chat_template": template, "chat_template_kwargs": {"style": "verse"}},
                  {"chat_template_kwargs": {"chat_template": template, "style": "verse"}}):
        response = chat(trusting_worker.url, **extra)
        assert response.status_code == 200, response.text
        assert response.json()["prompt_token_ids"] == tokenizer(text, add_special_tokens=False).input_ids


def test_hostile_templates_are_stopped_and_health_answers_meanwhile(trusting_worker):
    url = trusting_worker.url
    chat(url, chat_template="{{ 'warm' }}")  # the renderer child is started; its start is not the template's time
    started = time.monotonic()
    slow, answers = health_while(lambda: chat(url, chat_template=SLOW), url)
    assert slow.status_code == 400, slow.text
    assert f"took longer than {TEMPLATE_TIMEOUT_S} s" in slow.json()["error"]["message"]
    assert time.monotonic() - started < TEMPLATE_TIMEOUT_S + 30
    assert len(answers) >= 3 and set(answers) == {200}, answers

    refusals = {
        "{{ 'x' * 10**10 }}": "memory",
        "{{ 'x' * 10**7 }}": "more than the",
        "{{ cycler.__init__.__globals__.os.system('id') }}": "unsafe",
        "{% for %}": "TemplateSyntaxError",
    }
    for template, reason in refusals.items():
        response = chat(url, chat_template=template)
        assert response.status_code == 400, (template, response.text)
        assert reason in response.json()["error"]["message"], (template, response.json())
    # The worker is whole: its own template still serves.
    assert chat(url).status_code == 200


def test_a_long_prompt_is_tokenized_off_the_event_loop(worker):
    # About 900 KB, under the 1 MiB body bound: the tiny tokenizer takes 0.4-0.5 s for it.
    prompt = "The quick brown fox jumps over the lazy dog. " * 20_000
    body = {"model": "tiny-base", "prompt": prompt, "max_tokens": 1}
    response, answers = health_while(
        lambda: httpx.post(f"{worker.url}/v1/completions", json=body, timeout=120), worker.url)
    assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]
    assert answers and set(answers) == {200}, answers


def _raw_exchange(port: int, head: bytes, body_parts: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _error_of(raw: bytes) -> tuple[int, dict]:
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        size, _, rest = payload.partition(b"\r\n")
        payload = rest[: int(size, 16)]
    return status, json.loads(payload)["error"]


def test_bodies_over_the_bound_get_413_before_they_are_read(trusting_worker):
    worker, bound = trusting_worker, BODY_BOUND
    # Declares 100 MB and sends 1 KB of it: the answer comes without the rest.
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 * 1024 * 1024}\r\n\r\n").encode()
    status, error = _error_of(_raw_exchange(worker.port, head, [b"{" + b" " * 1023]))
    assert status == 413 and error["code"] == "request_too_large" and str(bound) in error["message"]

    # Chunked, with no length declared: refused once past the bound.
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b" " * 16 * 1024
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 6
    status, error = _error_of(_raw_exchange(worker.port, head, parts))
    assert status == 413 and error["code"] == "request_too_large"

    assert httpx.post(f"{worker.url}/v1/completions", timeout=60,
                      json={"model": "base", "prompt": "x" * 1000, "max_tokens": 1}).status_code == 200
    assert httpx.get(f"{worker.url}/health").status_code == 200
