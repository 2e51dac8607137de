"""The process that renders callers' chat templates (see chat_template_sandbox.py); run by path as
`python -I chat_template_child.py MEMORY_BYTES MAX_CHARS`, so it imports nothing of this project.

It reads one JSON job per line on stdin and answers one JSON line on stdout: `{"text": …}` or
`{"error": …}`. Rendering is transformers' own (`render_jinja_template`: Jinja's immutable sandbox,
the filters and globals chat templates expect), so a caller's template renders as
`tokenizer.apply_chat_template(…, chat_template=…)` would. Its address space is capped at what the
imports mapped plus MEMORY_BYTES, so `{{ 'x' * 10**10 }}` is a MemoryError here, not in the worker.
"""

import ctypes
import json
import resource
import signal
import sys
from typing import Any, cast

from transformers.utils.chat_template_utils import render_jinja_template


_PR_SET_PDEATHSIG = 1


def _die_with_the_worker() -> None:
    """A worker killed outright cannot kill its children: the kernel does it for them (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _mapped_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _render(job: dict[str, Any], max_chars: int) -> dict[str, Any]:
    try:
        # Annotated `-> str`, it returns (the rendered conversations, their generation indices).
        rendered, _ = cast(tuple[list[str], list[Any]], render_jinja_template(
            conversations=[job["messages"]],
            chat_template=job["template"],
            tools=job["tools"],
            add_generation_prompt=job["add_generation_prompt"],
            continue_final_message=job["continue_final_message"],
            **job["variables"],
        ))
    except MemoryError:
        return {"error": "rendering it needed more memory than a caller's template may use"}
    except Exception as exc:  # whatever the template's Jinja code raises
        return {"error": f"{type(exc).__name__}: {exc}"}
    text = rendered[0]
    if len(text) > max_chars:
        return {"error": f"it rendered {len(text)} characters, more than the {max_chars} allowed"}
    return {"text": text}


def main() -> None:
    _die_with_the_worker()
    memory_bytes, max_chars = int(sys.argv[1]), int(sys.argv[2])
    limit = _mapped_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            reply = _render(json.loads(line), max_chars)
        except MemoryError:
            reply = {"error": "rendering it needed more memory than a caller's template may use"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
