"""The asyncio face of the engine, for the HTTP server: many concurrent callers, one engine thread.

A background thread owns the ``LLMEngine`` and runs its steps back to back while there is work
(serving.engine.engine_core, the loop the engine-core process runs too).
Callers never touch the engine's state: every call is a command (serving.engine.engine_messages)
that the engine thread's ``EngineCore`` runs between two steps, and outputs and answers travel back
to each caller's event loop (serving.engine.engine_client, shared with ``ProcessEngine``, which
carries the same commands to a child process). This module is that transport and nothing more.
Adapter loads run on loader threads, so a load never pauses the steps of other requests.

A step that fails fails its requests and the engine goes on, except when a tensor-parallel rank
died (``RankFailedError``): no step can run again, so from then on the engine is not running,
every request fails at once, and ``on_dead`` tells the owner (the worker goes not-ready).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from transformers import PreTrainedTokenizerBase

from serving.engine.config import EngineConfig
from serving.engine.engine_client import EngineClient, EngineDeadError, settle_from_thread
from serving.engine.engine_core import EngineCore
from serving.engine.engine_messages import EngineCommand, Shutdown
from serving.engine.prompts import PromptType
from serving.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig, *, on_dead: Callable[[Exception], None] = lambda error: None) -> None:
        """``on_dead(error)`` is called once, on the engine thread, if the engine can run no more."""
        super().__init__()
        self._core = EngineCore(config, emit_step=self._deliver_step, emit=self._deliver, on_dead=on_dead)
        self.engine = self._core.engine
        self._thread = threading.Thread(target=self._core.run, name="engine-core", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str, **kwargs: Any) -> AsyncEngine:
        """``AsyncEngine.from_args(PATH, max_loras=..., ...)``: any ``EngineConfig`` field."""
        return cls(EngineConfig(model=model, **kwargs))

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return int(self.engine.hf_config.vocab_size)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._core.stopping and self._core.dead is None

    # ---- requests -------------------------------------------------------------------------

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.engine.encode(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(token_ids, params)

    # ---- life cycle -----------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (their streams end with ``"abort"``) and stop the engine thread."""
        if not self._thread.is_alive():
            return
        self._core.submit(Shutdown())
        self._thread.join(timeout)
        self.engine.shutdown()

    # ---- commands onto the engine thread ----------------------------------------------------

    def _submit(self, command: EngineCommand) -> None:
        self._core.submit(command)

    async def _call(self, command: EngineCommand) -> Any:
        """Run ``command`` on the engine thread between steps and return its answer here."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        result: asyncio.Future[Any] = loop.create_future()
        self._core.submit(command, partial(settle_from_thread, loop, result))
        return await result

    def _check_alive(self) -> None:
        if not self.is_running:
            dead = self._core.dead
            raise EngineDeadError(f"the engine has stopped: {dead}" if dead else "the engine is shut down")
