"""Reading adapters from storage off the decode path; each read in flight is a ``records.PendingLoad``.

A read (``load_adapter``: download, validate, digest, then conversion to the model's dtype and, on
CUDA, pinned memory so the copy into a slot is one transfer) takes from milliseconds to seconds, so
it runs on loader threads and the engine thread only ever looks at finished futures. Reads are
started only while the CPU cache has room for their result; the others wait in order (``queued``)
until the cache says there is room, so a burst of loads cannot overflow it.

A prefetch's read (``background``, predictive prewarm) runs on a thread of its own, so a request
that waits for a read never queues behind one: the prewarm loop reads ahead all the time, and on
the shared threads it held one of the two (bench/prewarm.py: TTFT p99 421 ms against plain LRU's
287 ms in the same run, with fewer requests waiting for reads).

Loads come in two kinds. A *first load* of a name is what requests for a name nobody has loaded
wait on (one per name, so a hundred requests for a new adapter read it once). Every other read —
a second ``add_lora`` of a name with another path, a re-read of an adapter whose CPU copy was
evicted — is kept beside them. Every method runs on the engine's thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch

from serving.engine.lora.integrity import raw_sum
from serving.engine.lora.reader import LoadedAdapter, Weights, load_adapter
from serving.engine.lora.records import LoadResult, PendingLoad


class AdapterLoader:
    def __init__(
        self,
        *,
        base_config: object,
        base_model_name: str | None,
        max_lora_rank: int,
        dtype: torch.dtype,
        pin_memory: bool,
        on_done: Callable[[], None],
        dora_refusal: str | None = None,
        vocab_refusal: str | None = None,
        base_vocab: Callable[[str], torch.Tensor] | None = None,
    ) -> None:
        """``vocab_refusal`` / ``base_vocab``: as ``load_adapter``'s (why adapters on embed_tokens /
        lm_head are refused here; the base's matrices their full copies are compared with)."""
        self._base_config = base_config
        self._dora_refusal = dora_refusal
        self._vocab_refusal = vocab_refusal
        self._base_vocab = base_vocab
        self._base_model_name = base_model_name
        self._max_lora_rank = max_lora_rank
        self._dtype = dtype
        self._pin = pin_memory
        # Wakes the engine thread when a read finishes, so an idle engine takes it in at once.
        self._on_done = on_done
        self._first: dict[str, PendingLoad] = {}  # first loads, by name
        self._others: list[PendingLoad] = []  # re-reads, and adds beside a first load
        self._queued: list[PendingLoad] = []  # waiting for room in the CPU cache
        # Reads are mostly torch and hashing work that releases the GIL: a worker starting with a
        # thousand adapters spreads them over up to four cores.
        self._executor = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="lora-load")
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-prefetch")
        # What reads an adapter from storage (runs on a loader thread). Tests wrap it to hold a
        # load in flight while they watch the engine keep decoding.
        self.load_fn: Callable[..., LoadedAdapter] = load_adapter

    def first_load(self, name: str) -> PendingLoad | None:
        """The first load of ``name`` in flight, which new requests for the name wait on."""
        return self._first.get(name)

    def submit(self, load: PendingLoad, *, start_now: bool) -> PendingLoad:
        """Track ``load``; read it now when the CPU cache has room (``start_now``), else queue it."""
        if load.reload_of is None and load.name not in self._first:
            self._first[load.name] = load
        else:
            self._others.append(load)
        if start_now:
            self._read(load)
        else:
            self._queued.append(load)
        return load

    def start_queued(self, has_room: Callable[[], bool]) -> None:
        """Start queued reads, oldest first, while the CPU cache has room for them."""
        while self._queued and has_room():
            self._read(self._queued.pop(0))

    def finished(self) -> list[PendingLoad]:
        """Take out the loads whose read ended (well or not): first loads, then the others."""
        done = [load for load in self._first.values() if load.future is not None and load.future.done()]
        for load in done:
            del self._first[load.name]
        others = [load for load in self._others if load.future is not None and load.future.done()]
        self._others = [load for load in self._others if load not in others]
        return done + others

    @property
    def num_loading(self) -> int:
        """Loads in flight or queued."""
        return len(self._first) + len(self._others)

    @property
    def num_reading(self) -> int:
        """Reads started and not yet taken in: their results will need a place in the CPU cache."""
        return sum(1 for load in [*self._first.values(), *self._others] if load.future is not None)

    def wait(self, timeout: float) -> None:
        """Block until some read finishes (or ``timeout``); for callers with nothing else to do."""
        futures = [load.future for load in [*self._first.values(), *self._others] if load.future is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._background.shutdown(wait=False, cancel_futures=True)

    def _read(self, load: PendingLoad) -> None:
        load.future = (self._background if load.background else self._executor).submit(self._load, load.path)
        load.future.add_done_callback(lambda _: self._on_done())

    def _load(self, path: str) -> LoadResult:
        """Loader thread: read, validate and digest; convert to the model dtype for the slot copy."""
        start = time.perf_counter()
        loaded = self.load_fn(
            path,
            base_config=self._base_config,
            max_lora_rank=self._max_lora_rank,
            base_model_name=self._base_model_name,
            dora_refusal=self._dora_refusal,
            vocab_refusal=self._vocab_refusal,
            base_vocab=self._base_vocab,
        )
        # One buffer for the whole adapter, each tensor a view of it: on CUDA it is pinned, and one
        # pinned allocation (cudaHostAlloc, serialised in the driver) replaces two per tensor (a
        # worker reading 1,024 8B-shape adapters on four threads took 196 s where the CPU work is
        # ~70 ms each); the tensors' two conversion copies each become one copy into their view.
        buffer = torch.empty(sum(a.numel() + b.numel() for a, b in loaded.weights.values()), dtype=self._dtype,
                             pin_memory=self._pin)
        weights: Weights = {}
        offset = 0
        for key, (a, b) in loaded.weights.items():
            views = []
            # B transposed: the pool keeps an adapter's B as contiguous rows, one per rank index.
            for source in (a, b.t()):
                view = buffer[offset:offset + source.numel()].view(source.shape)
                view.copy_(source.contiguous())  # transposing in fp32 first, then converting, is the faster order
                views.append(view)
                offset += source.numel()
            weights[key] = (views[0], views[1])
        # DoRA's magnitudes stay fp32 (the per-row scale is computed from them once, at slot load) and
        # outside the buffer: they never enter the pool's rows, whose checksum is the buffer's.
        magnitudes = loaded.magnitudes
        # The vocabulary part (LoRA on embed_tokens / lm_head, changed rows) is copied per slot as tensors
        # of its own (serving.engine.layers.vocab_lora), also outside the buffer, in the model's dtype.
        vocab = loaded.vocab.converted(self._dtype, pin_memory=self._pin) if loaded.vocab is not None else None
        nbytes = (buffer.nbytes + sum(m.nbytes for m in (magnitudes or {}).values())
                  + (vocab.nbytes if vocab is not None else 0))
        # The raw-bit sum is a sum of integers, so the buffer's is the sum of its tensors'.
        return LoadResult(loaded, weights, time.perf_counter() - start, nbytes, raw_sum(buffer), magnitudes, vocab)
