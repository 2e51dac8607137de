"""Adapters on the vocabulary modules (``embed_tokens``, ``lm_head``), applied per row of a batch.

The base's two vocabulary matrices exist once. What an adapter changes of them
(``reader.VocabDelta``) is small beside them: LoRA on either (``r x (vocab + hidden)`` each) and
the rows of a full copy (``modules_to_save``) that differ from the base's, or its trainable tokens'
rows (``trainable_token_indices``), with their token ids.
When the adapter enters a slot (``write``), those tensors are copied to the device for that slot;
a step then applies, for the rows of each slot that has some (docs/adapter-kinds.md):

- to the embedding output, before anything else sees it: the slot's changed rows replace the
  base's for the tokens they cover (a search of the sorted token ids), and LoRA adds
  ``scaling * B^T[t]`` gathered through ``A^T``: ``F.embedding(t, A^T) @ B^T * s``, PEFT's own order;
- to the logits of the sampled rows: LoRA adds ``s * (h @ A^T) @ B^T``, and the changed rows'
  logits are ``h @ rows^T`` in their columns.

These are torch steps after the base's lookup and head product, on CPU and CUDA alike (no Triton
kernel carries them). Which rows belong to which slot is read from the step's host-side slots
(``begin_step``), so nothing waits for the device; the row gathers are data-dependent, so the CUDA
graphs never capture them: a step with a row of such an adapter runs eagerly (the model runner
checks ``serves``), and every other step, plain LoRA and base rows however many vocabulary
adapters are resident, replays its graph as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serving.engine.lora.records import CachedAdapter


@dataclass(frozen=True)
class _SlotVocab:
    """One slot's vocabulary part on the device, laid out for the step: ``embed_At [vocab, r]`` (rows
    gathered by token id), ``embed_Bt [r, hidden]``, ``head_At [hidden, r]``, ``head_Bt [r, vocab]``;
    ``*_ids`` ascending token ids and ``*_rows [k, hidden]`` their rows."""

    adapter: CachedAdapter  # whose part it is: once it has left the slot, the part goes too
    scaling: float
    embed_At: torch.Tensor | None
    embed_Bt: torch.Tensor | None
    head_At: torch.Tensor | None
    head_Bt: torch.Tensor | None
    embed_ids: torch.Tensor | None
    embed_rows: torch.Tensor | None
    head_ids: torch.Tensor | None
    head_rows: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.embed_At, self.embed_Bt, self.head_At, self.head_Bt, self.embed_ids,
                                      self.embed_rows, self.head_ids, self.head_rows) if t is not None)


class VocabAdapters:
    """The resident adapters' vocabulary parts, by slot, and the steps that apply them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: dict[int, _SlotVocab] = {}
        # This step's rows of each slot that has a vocabulary part (``begin_step``), on the device.
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Device bytes the resident adapters' vocabulary parts take."""
        return sum(part.nbytes for part in self._slots.values())

    def write(self, slot: int, adapter: CachedAdapter) -> None:
        """Slot ``slot`` now holds ``adapter``: copy its vocabulary part (from its CPU copy) to the device,
        or drop the slot's previous one when it has none. Queued on the current stream."""
        self._slots.pop(slot, None)
        vocab = adapter.vocab
        if vocab is None:
            return

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device, non_blocking=True).contiguous()

        embed_lora, head_lora = vocab.embed_lora or (None, None), vocab.head_lora or (None, None)
        embed_rows, head_rows = vocab.embed_rows or (None, None), vocab.head_rows or (None, None)
        # A [r, vocab] and B [hidden, r] on the embedding; A [r, hidden] and B [vocab, r] on the head.
        self._slots[slot] = _SlotVocab(
            adapter=adapter,
            scaling=adapter.scaling,
            embed_At=put(None if embed_lora[0] is None else embed_lora[0].t()),
            embed_Bt=put(None if embed_lora[1] is None else embed_lora[1].t()),
            head_At=put(None if head_lora[0] is None else head_lora[0].t()),
            head_Bt=put(None if head_lora[1] is None else head_lora[1].t()),
            embed_ids=put(embed_rows[0]),
            embed_rows=put(embed_rows[1]),
            head_ids=put(head_rows[0]),
            head_rows=put(head_rows[1]),
        )

    def serves(self, slots: Sequence[int]) -> bool:
        """Whether any of these (a step's rows' slots) holds a vocabulary part."""
        return bool(self._slots) and any(slot in self._slots for slot in set(slots))

    def begin_step(self, token_slots: Sequence[int]) -> bool:
        """Take a step's token slots (host-side, in row order) before its forward; whether it has rows
        that ``embed`` changes. A step that never calls this (a captured graph) changes none. Parts
        whose adapter has left its slot (freed, nothing placed there since) are dropped here."""
        for slot in [s for s, part in self._slots.items() if part.adapter.slot != s]:
            del self._slots[slot]
        self._rows = self._rows_of(token_slots)
        return bool(self._rows)

    def embed(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Apply this step's rows' embedding parts to ``hidden`` (the base's lookup of ``input_ids``), in place."""
        for slot, rows in self._rows.items():
            part = self._slots[slot]
            ids = input_ids.index_select(0, rows).long()
            if part.embed_ids is not None and part.embed_rows is not None:
                hit, where = _lookup(part.embed_ids, ids)
                # A select, not a masked write: a boolean index would wait for the device.
                mine = torch.where(hit.unsqueeze(1), part.embed_rows.index_select(0, where).to(hidden.dtype),
                                   hidden.index_select(0, rows))
                hidden.index_copy_(0, rows, mine)
            if part.embed_At is not None and part.embed_Bt is not None:
                delta = (part.embed_At.index_select(0, ids) @ part.embed_Bt) * part.scaling
                hidden.index_add_(0, rows, delta.to(hidden.dtype))

    def logits(self, logits: torch.Tensor, hidden: torch.Tensor, row_slots: Sequence[int]) -> None:
        """Apply the head parts to ``logits`` (the base's, of ``hidden``'s rows, whose slots are
        ``row_slots``), in place."""
        for slot, rows in self._rows_of(row_slots).items():
            part = self._slots[slot]
            h = hidden.index_select(0, rows)
            if part.head_ids is not None and part.head_rows is not None:
                replaced = (h @ part.head_rows.t()).to(logits.dtype)
                logits[rows.unsqueeze(1), part.head_ids.unsqueeze(0)] = replaced
            if part.head_At is not None and part.head_Bt is not None:
                delta = ((h @ part.head_At) @ part.head_Bt) * part.scaling
                logits.index_add_(0, rows, delta.to(logits.dtype))

    def _rows_of(self, slots: Sequence[int]) -> dict[int, torch.Tensor]:
        """The rows of each slot with a vocabulary part, as device index tensors (made from the host's list)."""
        if not self._slots:
            return {}
        rows: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot in self._slots:
                rows.setdefault(slot, []).append(row)
        return {slot: torch.tensor(r, dtype=torch.int64).to(self.device, non_blocking=True) for slot, r in rows.items()}


def _lookup(sorted_ids: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hit, where)``: which of ``ids`` are in ``sorted_ids`` (ascending), and at which index."""
    where = torch.searchsorted(sorted_ids, ids).clamp_max(sorted_ids.numel() - 1)
    return sorted_ids.index_select(0, where) == ids, where
