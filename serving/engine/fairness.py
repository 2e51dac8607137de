"""Fairness between tenants: the Virtual Token Counter (VTC) of "Fairness in Serving Large
Language Models" (Sheng et al., OSDI '24).

Each client (a tenant: ``Sequence.fairness_client``) has a counter of the weighted service it has
received: ``prompt_weight`` for every token the engine computes for it, except that a token whose
step samples the next one (a decode, or a prefill's last chunk) costs ``output_weight`` instead,
so a request served whole costs about ``prompt tokens × w_p + output tokens × w_q`` (the paper's
w_p = 1, w_q = 2: an output token costs a decode step, a prompt token a share of a batched
prefill). Tokens recomputed after a preemption are charged again: they are work done for the
client. The scheduler admits, within the highest priority tier waiting, the client with the
smallest counter, so a tenant flooding requests gets its share of the batch, not the batch.

A client that becomes active again (a sequence of it enters the engine while none is there) is
lifted to the smallest counter of the active clients, or, when none is, to the counter of the
last client that left: idling banks no credit, so a returning client cannot crowd out the others
with service it did not ask for while it was away. Counters only grow, and so does that lift
target, which lets an idle client's counter be dropped once it is no higher than the target (it
would be lifted there anyway): only clients that left over-served are remembered.

Every operation is O(1) except the lift and the leave, O(active clients), on a client's arrival
and departure only.
"""

from __future__ import annotations

Client = str | None


class VirtualTokenCounter:
    def __init__(self, prompt_weight: int, output_weight: int) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self._counters: dict[Client, int] = {}
        self._active: dict[Client, int] = {}  # client -> its sequences in the engine (waiting or running)
        self._floor = 0  # the lift target while no client is active: the last one to leave's counter

    def counter(self, client: Client) -> int:
        return self._counters.get(client, 0)

    def is_active(self, client: Client) -> bool:
        return client in self._active

    def join(self, client: Client) -> None:
        """A sequence of ``client`` enters the engine (queued, or forked from one running)."""
        count = self._active.get(client, 0)
        if count == 0:
            self._counters[client] = max(self.counter(client), self._lift_target())
        self._active[client] = count + 1

    def leave(self, client: Client) -> None:
        """A sequence of ``client`` leaves the engine (finished, aborted or failed)."""
        count = self._active[client] - 1
        if count:
            self._active[client] = count
            return
        del self._active[client]
        counter = self.counter(client)
        if not self._active:
            self._floor = max(self._floor, counter)
        if counter <= self._lift_target():
            self._counters.pop(client, None)

    def charge(self, client: Client, num_tokens: int, samples: bool) -> None:
        """``client`` is served ``num_tokens`` computed tokens in a step; ``samples``: the step
        samples a token after the last of them."""
        if samples:
            cost = (num_tokens - 1) * self.prompt_weight + self.output_weight
        else:
            cost = num_tokens * self.prompt_weight
        self._counters[client] = self.counter(client) + cost

    def _lift_target(self) -> int:
        if not self._active:
            return self._floor
        return min(self.counter(client) for client in self._active)
