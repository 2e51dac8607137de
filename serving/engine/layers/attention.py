"""Attention over the paged KV cache.

Each step first writes the new tokens' keys and values into their cache slots (one indexed copy,
graph-capturable), then attends:

- decode tokens (one per sequence) in one batched call: with the ``"triton"`` backend (CUDA) the
  paged kernel of ``kernels.paged_attention`` reads each sequence's pages in place through its
  block table; with ``"torch"`` (CPU) every sequence's blocks are gathered into a padded
  ``[B, L]`` context and a mask hides what lies past each sequence's length;
- in a flat step (``StepContext.decode_row_seq`` set) every token is such a row, prompt chunks
  included, each attending causally up to its own position through its sequence's table (the Triton
  backend serves a chunk's rows as tiles of causal attention, ``kernels.paged_attention``'s runs);
- otherwise each prefill chunk on its own, in torch SDPA: a first chunk attends to its own keys causally
  (no gather), a later chunk gathers its sequence's cached context and uses an offset causal mask.

Per layer: the sliding window (Gemma alternates windowed and full layers), the score scale (Gemma's
``query_pre_attn_scalar``) and the logit soft-cap ``cap * tanh(score / cap)`` (Gemma 2). SDPA has no
soft-cap, so a capped layer's torch path computes the scores itself, as transformers' eager
attention does; the Triton kernel caps them in place (a constexpr flag).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.context import PrefillSpan, StepContext, get_context


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        *,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # [num_blocks, block_size, num_kv_heads, head_dim] each; views into the runner's cache.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, H, D]``, ``k``/``v [T, Hkv, D]`` → ``[T, H*D]``."""
        ctx = get_context()
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, ctx.slot_mapping, k)
        flat_v.index_copy_(0, ctx.slot_mapping, v)
        if not ctx.prefills:
            return self._decode(q, ctx).view(q.shape[0], -1)
        out = torch.empty_like(q)
        if ctx.num_decode:
            out[: ctx.num_decode] = self._decode(q[: ctx.num_decode], ctx)
        for span in ctx.prefills:
            rows = slice(span.start, span.start + span.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], span)
        return out.view(q.shape[0], -1)

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """``[B, num_blocks]`` block tables → ``[B, Hkv, num_blocks*block_size, D]`` context."""
        batch = block_tables.shape[0]
        # index_select over whole blocks: one contiguous copy per block (advanced indexing is slower on CPU)
        pages = cache.index_select(0, block_tables.view(-1))  # [B * nb, bs, Hkv, D]
        return pages.view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _decode(self, q: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        assert ctx.decode_block_tables is not None and ctx.decode_context_lens is not None
        if ctx.attention == "triton":
            # Imported here, as kernels.apply does: Triton compiles or interprets by the environment
            # at import time, and a CPU-only engine never needs it.
            from kernels.paged_attention import paged_decode_attention

            return paged_decode_attention(
                q, self.k_cache, self.v_cache, ctx.decode_block_tables, ctx.decode_context_lens,
                scale=self.scale, sliding_window=self.sliding_window, num_splits=ctx.decode_splits,
                row_seq=ctx.decode_row_seq, softcap=self.softcap,
            )  # fmt: skip
        tables = ctx.decode_block_tables
        if ctx.decode_row_seq is not None:
            tables = tables.index_select(0, ctx.decode_row_seq)
        keys = self._gather(self.k_cache, tables)
        values = self._gather(self.v_cache, tables)
        mask = ctx.decode_mask(keys.shape[2], self.sliding_window)
        return self._attend(q.unsqueeze(2), keys, values, mask=mask).squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
        total = span.num_computed + span.length
        window_bites = self.sliding_window is not None and total > self.sliding_window
        if span.num_computed == 0 and not window_bites:
            return self._attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True).transpose(0, 1)
        if span.num_computed == 0:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            if span.block_table is None:
                raise ValueError(f"a chunk after {span.num_computed} cached tokens needs their block table")
            table = span.block_table.unsqueeze(0)
            keys = self._gather(self.k_cache, table)[0, :, :total]
            values = self._gather(self.v_cache, table)[0, :, :total]
        query_pos = torch.arange(span.num_computed, total, device=q.device).unsqueeze(1)
        key_pos = torch.arange(total, device=q.device).unsqueeze(0)
        mask = key_pos <= query_pos
        if self.sliding_window is not None:
            mask &= key_pos > query_pos - self.sliding_window
        return self._attend(q.transpose(0, 1), keys, values, mask=mask).transpose(0, 1)

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """``q [..., H, Tq, D]`` over ``keys``/``values [..., Hkv, Tk, D]``; ``mask`` (True: seen)
        broadcasts to ``[..., Tq, Tk]``, ``causal`` puts the last query at the last key."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
        group = q.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
        # As transformers' eager attention: scores in the model's dtype, capped, softmax in fp32.
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            length_q, length_k = scores.shape[-2:]
            mask = torch.ones(length_q, length_k, dtype=torch.bool, device=q.device).tril(length_k - length_q)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)
