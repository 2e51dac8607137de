"""The engine's commands: what a client asks of ``EngineCore``, one frozen dataclass per command.

Both drivers carry these and nothing else: ``AsyncEngine`` hands them to the core on its thread,
``ProcessEngine`` pickles them down the pipe to the engine-core process, and on either side
``EngineCore.handle`` runs the one method that owns each (serving.engine.engine_core). Dataclasses
with slots and no behaviour: an ``AddRequest`` of a 200-token prompt pickles and unpickles in
56 µs against 42 µs as the tuple it replaced (2-core development machine; its SamplingParams is
most of either), once per request, never per step.

A client waits for the answer to most commands: the value, or the error, the core's method gave.
``AddRequest``, ``DropRequest`` and ``Shutdown`` are sent without waiting: a request's failure to
start reaches its stream instead.

What comes back from the engine-core process stays plain tuples, chosen for speed: a step's outputs
cross once per step, as deltas (serving.engine.output_deltas), and a tuple pickles several times
cheaper than a dataclass. serving.engine.engine_core_child lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from serving.engine.lora.request import LoRARequest
from serving.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request whose prompt the client encoded and checked. ``cache_salt``: the prompt's
    (the gateway sets one per tenant: it partitions the prefix cache, and names the tenant for
    fairness and for the grammar pool), None when the prompt had none."""

    request_id: str
    params: SamplingParams
    encoded: tuple[str | None, list[int]]
    lora_request: LoRARequest | None = None
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class DropRequest:
    """Abort a request whose caller left: nobody reads its output, so none is sent."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request; its stream ends with ``finish_reason="abort"`` before the answer comes."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AddLora:
    """Load an adapter into the CPU cache; answered with its LoRAInfo once the load completes."""

    lora_request: LoRARequest
    load_inplace: bool = False
    background: bool = False


@dataclass(frozen=True, slots=True)
class PrefetchLora:
    """Bring an adapter up ahead of its traffic; answered with its Placement once it is there."""

    lora_request: LoRARequest
    to_gpu: bool
    keep: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RemoveLora:
    name: str


@dataclass(frozen=True, slots=True)
class ListLoras:
    names: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class VerifySlots:
    pass


@dataclass(frozen=True, slots=True)
class GetStats:
    pass


@dataclass(frozen=True, slots=True)
class WarmUp:
    """Run every kind of step once before traffic (serving.engine.warmup), with the adapters named
    at launch; answered with the WarmupReport."""

    adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort every request (each stream ends with ``"abort"``) and end the loop."""


EngineCommand: TypeAlias = (AddRequest | DropRequest | AbortRequest | AddLora | PrefetchLora | RemoveLora | ListLoras
                            | VerifySlots | GetStats | WarmUp | Shutdown)
