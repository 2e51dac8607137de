"""Rendering callers' own chat templates (`--trust-request-chat-template`) where they cannot hurt
the worker: in child processes (chat_template_child.py), each rendering one template at a time,
under Jinja's sandbox, an address-space cap, a bound on the rendered length and a deadline.

A template is code: a loop of 10,000 × 10,000 iterations or `'x' * 10**10` is a few characters.
Inside the worker it would hold the event loop or the process's memory; in a child it costs that
child, and a child past the deadline is killed and replaced, so the next caller gets a fresh one.
Without the flag the worker never gets here: a caller's template is a 400 (chat.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("chat_template_child.py")
# The child imports transformers once; that is not the template's time.
_STARTUP_TIMEOUT_S = 120.0
# Address space a template may use on top of what the child's imports mapped.
MEMORY_BYTES = 512 * 1024 * 1024


class TemplateRefused(Exception):
    """The caller's template failed, ran too long or too large; the message says which."""


class ChatTemplateSandbox:
    def __init__(self, *, timeout_s: float, max_chars: int, processes: int = 2) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._slots = asyncio.Semaphore(processes)
        self._idle: list[asyncio.subprocess.Process] = []
        self._all: set[asyncio.subprocess.Process] = set()

    async def render(self, template: str, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool, continue_final_message: bool, variables: dict[str, Any]) -> str:
        """The rendered prompt; TemplateRefused with the reason when the template cannot give one."""
        job = json.dumps({
            "template": template, "messages": messages, "tools": tools, "variables": variables,
            "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
        }).encode() + b"\n"
        async with self._slots:
            child = self._idle.pop() if self._idle else await self._spawn()
            try:
                child.stdin.write(job)  # type: ignore[union-attr]
                await child.stdin.drain()  # type: ignore[union-attr]
                line = await asyncio.wait_for(child.stdout.readline(), self.timeout_s)  # type: ignore[union-attr]
            except TimeoutError:
                await self._kill(child)
                raise TemplateRefused(f"it took longer than {self.timeout_s:g} s to render") from None
            except BaseException:
                await self._kill(child)
                raise
            if not line:
                await self._kill(child)
                raise TemplateRefused("the process rendering it died (out of memory or a crash)")
            self._idle.append(child)
        reply = json.loads(line)
        if "error" in reply:
            raise TemplateRefused(reply["error"])
        return str(reply["text"])

    async def _spawn(self) -> asyncio.subprocess.Process:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(_CHILD), str(MEMORY_BYTES), str(self.max_chars),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            # A reply holds the rendered prompt, JSON-escaped: up to 6 bytes a character.
            limit=6 * self.max_chars + 4096,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        self._all.add(child)
        try:
            ready = await asyncio.wait_for(child.stdout.readline(), _STARTUP_TIMEOUT_S)  # type: ignore[union-attr]
        except BaseException:
            await self._kill(child)
            raise
        if not ready:
            await self._kill(child)
            raise RuntimeError(f"the chat template renderer ({_CHILD.name}) did not start; see the worker's log")
        return child

    async def _kill(self, child: asyncio.subprocess.Process) -> None:
        self._all.discard(child)
        if child.returncode is None:
            child.kill()
        await child.wait()

    async def close(self) -> None:
        """Stop every child (the worker is stopping)."""
        self._idle.clear()
        for child in list(self._all):
            await self._kill(child)
