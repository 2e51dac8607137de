"""A linear layer of the base model that also adds every adapter of the batch to its output.

The base weight exists once. Beside it, per output slice (q/k/v of a fused attention projection,
gate/up of a fused MLP one, or a single slice), the layer holds two *row pools*
(docs/adapter-memory.md): ``A [rows, in]``, one row per rank row of some adapter's A, and
``Bt [rows, out_slice]``, B transposed, so an adapter's rows are contiguous in both and it costs its
own rank, not ``max_lora_rank``. An adapter resident in the pools owns rows ``row .. row + rank``
of every slice of every layer (the model runner places it, ``write_rows``); the slot table the
kernels index (``scaling``, ``ranks``, ``rows``, shared by all layers) says which rows each slot
reads. The forward adds ``scaling[s] * Bt[rows_s]^T @ A[rows_s] @ x`` for each token's slot ``s``
through ``kernels.lora_apply_weights``, reading the step's LoRA metadata from the per-step context.

Under tensor parallelism (``split``, serving.engine.layers.parallel_linear) the widths are this
rank's, checkpoint tensors and adapters are cut to them as they come in, and a row-parallel
layer all-reduces its output (the LoRA part with it) before adding its bias.

``quantize_fp8`` (``EngineConfig.quantization="fp8"``, once the weights are in) turns the base
weight into float8_e4m3fn with per-output-channel scales (serving.engine.layers.fp8_linear); the
bias, the row pools and the LoRA path stay in the compute dtype. Where the native FP8 path runs
(``takes_fp8_rows``), the forward takes ``x_fp8``, its input already quantized by the kernel that
wrote it, and the LoRA path still reads ``x``.

``awq`` (an AWQ checkpoint, read from its ``config.json``): the layer holds no ``weight``
but the checkpoint's ``qweight``, ``qzeros`` and ``scales`` (fused slices side by side along the
output columns, as the bf16 weight's rows are), and the base product is
serving.engine.layers.int4_linear's; the LoRA path is unchanged.

DoRA (docs/adapter-kinds.md): a DoRA adapter's module computes ``m / ||W0 + s B A||_row`` times
``(W0 + s B A) x``, plus the bias. The fraction is one scale per output feature per adapter,
computed once when the adapter enters its slot (``write_dora_scale``) into ``dora_scale
[slots + 1, out]`` (row 0: ones, for tokens without an adapter; a plain LoRA adapter's row: ones).
The LoRA kernels multiply each token's output columns by its slot's scale row in the expand's
epilogue (``kernels.LoRAWeights(dora_scale=)``; the torch backend: one gather and one multiply
after the adds), and the layer adds the bias after them. The table is allocated with the row pools
(``allocate_rows(dora=True)``, where ``EngineConfig.serves_dora``), before the CUDA graphs are
captured, so they replay the scaled path for any mix of DoRA, plain and base rows (a plain row's
scale is one); an engine with DoRA off has no table and runs as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import LoRAWeights, lora_apply_weights
from kernels.fp8 import QuantizedRows
from serving.engine.context import get_context
from serving.engine.distributed.parallel import SINGLE, TensorParallel
from serving.engine.layers.fp8_linear import fp8_linear, native_fp8, quantize_weight
from serving.engine.layers.int4_linear import AWQSpec, int4_linear
from serving.engine.layers.parallel_linear import Split
from serving.engine.lora.records import CachedAdapter


class MultiLoRALinear(nn.Module):
    # Whether a natively run FP8 layer takes its input quantized by the kernel before it (the norm's or
    # SiLU·mul's, serving.engine.models.common) rather than quantizing it itself. Off only to measure or
    # test the unfused path (per layer, or on the class before an engine captures its graphs).
    fp8_rows_from_producer = True

    def __init__(
        self,
        in_features: int,
        slices: list[tuple[str, int]],
        *,
        bias: bool,
        layer_idx: int,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        split: Split | None = None,
        awq: AWQSpec | None = None,
    ) -> None:
        """``slices`` and ``in_features`` are this rank's widths; ``split`` says how they were cut
        (None: the whole projection); ``awq``: the base weight is an AWQ checkpoint's INT4."""
        super().__init__()
        self.layer_idx = layer_idx
        self.dtype = dtype  # the compute dtype: activations, bias, adapters (the weight's until quantized)
        self.tp = tp
        self.split = split
        self.in_features = in_features
        self.slice_names = [name for name, _ in slices]
        widths = [width for _, width in slices]
        self.slice_offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.slice_widths = widths
        out_features = sum(widths)
        self.device = device
        self.awq = awq
        self.weight: nn.Parameter | None = None
        if awq is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                       requires_grad=False)  # fmt: skip
        else:
            if tp.size > 1:
                # Each rank would need its share of the packed words and of the groups' rows.
                raise ValueError(f"AWQ (INT4) bases are not served under tensor parallelism (size {tp.size})")
            if in_features % awq.group_size or any(width % 8 for width in widths):
                raise ValueError(
                    f"layer {layer_idx} {'/'.join(self.slice_names)}: AWQ needs in_features ({in_features}) a multiple "
                    f"of the group size {awq.group_size} and output widths {widths} multiples of 8"
                )
            groups = in_features // awq.group_size

            def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
                return nn.Parameter(torch.zeros(*shape, device=device, dtype=dtype), requires_grad=False)

            # The checkpoint's names and layout (kernels.int4): [in, out / 8], [groups, out / 8], [groups, out].
            self.qweight = frozen(in_features, out_features // 8, dtype=torch.int32)
            self.qzeros = frozen(groups, out_features // 8, dtype=torch.int32)
            self.scales = frozen(groups, out_features, dtype=torch.float16)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )
        # Set by quantize_fp8: the weight's per-output-channel scales [1, out] (fp32), and whether
        # torch._scaled_mm runs them (else the emulation).
        self.weight_scale: torch.Tensor | None = None
        self.fp8_native = False
        # The row pools, allocated once the model runner knows how many rows memory allows.
        self.lora_A: list[torch.Tensor] = []
        self.lora_B: list[torch.Tensor] = []  # transposed: [rows, out_slice]
        self.lora_weights: LoRAWeights | None = None
        # DoRA's per-slot output scales (row 0 for no adapter), allocated with the row pools where
        # DoRA is served; and the base weight's squared row norms (fp32), computed at the first
        # DoRA adapter's write_dora_scale, once.
        self.dora_scale: torch.Tensor | None = None
        self._base_row_sq: torch.Tensor | None = None

    @property
    def dora_row_elements(self) -> int:
        """Elements one slot's row of the DoRA scale table costs in this layer (one per output feature)."""
        return sum(self.slice_widths)

    @property
    def row_elements(self) -> int:
        """Elements one rank row costs in this layer, every slice's A and Bt together."""
        return len(self.slice_widths) * self.in_features + sum(self.slice_widths)

    def slice_of(self, name: str) -> tuple[int, int]:
        """``(offset, width)`` of slice ``name``'s rows in the fused weight."""
        i = self.slice_names.index(name)
        return self.slice_offsets[i], self.slice_widths[i]

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether the forward uses ``x_fp8`` (so its producer should write it): native FP8 only; the
        emulation, the INT4 and the unquantized layers quantize nothing or quantize ``x`` themselves."""
        return self.fp8_native and self.fp8_rows_from_producer

    def forward(self, x: torch.Tensor, x_fp8: QuantizedRows | None = None) -> torch.Tensor:
        """The base product plus the step's adapters; ``x_fp8``: ``x`` quantized per row by its
        producer, bit-equal to ``kernels.fp8.quantize_rows(x)`` (used where ``takes_fp8_rows``)."""
        reduces = self.split is not None and self.split.reduces
        lora = get_context().lora
        dora = lora is not None and self.dora_scale is not None
        # The bias comes after the all-reduce (once, not per rank) and after DoRA's scale, which the
        # LoRA kernels apply (PEFT scales W0 x + s B A x, not the bias). DoRA is refused under tensor
        # parallelism, where a row-parallel layer's scale would have to wait for the all-reduce.
        late_bias = reduces or dora
        bias = None if late_bias else self.bias
        if self.awq is not None:
            y = int4_linear(x, self.qweight, self.qzeros, self.scales, self.awq.group_size, bias, triton=x.is_cuda)
        elif self.weight_scale is not None:
            assert self.weight is not None
            y = fp8_linear(x, self.weight, self.weight_scale, bias, native=self.fp8_native,
                           x_fp8=x_fp8 if self.takes_fp8_rows else None)  # fmt: skip
        else:
            assert self.weight is not None
            y = F.linear(x, self.weight, bias)
        if lora is not None and self.lora_weights is not None:
            lora_apply_weights(y, x, self.lora_weights, lora)
        if reduces:
            self.tp.all_reduce(y)
        if late_bias and self.bias is not None:
            y += self.bias
        return y

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its FP8 form and per-channel scales, freeing the original."""
        if self.weight is None:
            raise ValueError("an AWQ (INT4) layer cannot be quantized to FP8 as well")
        weight, scale = quantize_weight(self.weight.data, f"layer {self.layer_idx} {'/'.join(self.slice_names)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = scale
        self.fp8_native = native_fp8(weight.device)

    def checkpoint(self, slice_name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor of slice ``slice_name`` (``kind``: weight or bias)."""
        return tensor if self.split is None else self.split.checkpoint(slice_name, kind, tensor)

    def adapter_part(self, slice_name: str, A: torch.Tensor, Bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's ``(A, Bt)`` on slice ``slice_name``."""
        return (A, Bt) if self.split is None else self.split.adapter(slice_name, A, Bt)

    def allocate_rows(self, num_rows: int, *, scaling: torch.Tensor, ranks: torch.Tensor, rows: torch.Tensor,
                      max_rank: int, dora: bool = False,
                      pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        """Allocate ``num_rows`` zeroed rows per slice and bind the slot table the model's layers
        share (``scaling``, ``ranks``, ``rows``: one entry per slot); the kernels check them once.
        ``dora``: also DoRA's scale table, ``[slots + 1, out]`` of ones, which the kernels then
        apply at every step with an adapter (module docstring). ``pools``: the A and Bt pools given
        instead (views into the KV cache's flex region: serving.engine.lora.flex)."""
        device, dtype = self.device, self.dtype
        if pools is not None:
            self.lora_A, self.lora_B = pools
        else:
            self.lora_A = [torch.zeros(num_rows, self.in_features, device=device, dtype=dtype)
                           for _ in self.slice_widths]
            self.lora_B = [torch.zeros(num_rows, width, device=device, dtype=dtype) for width in self.slice_widths]
        self.dora_scale = (
            torch.ones(scaling.shape[0] + 1, self.dora_row_elements, device=device, dtype=dtype) if dora else None
        )
        self.lora_weights = LoRAWeights(
            self.lora_A, self.lora_B, scaling, self.slice_offsets, ranks=ranks, rows=rows, max_rank=max_rank,
            dora_scale=self.dora_scale,
        )

    def write_rows(self, row: int, rank: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one adapter's ``(A [rank, in], Bt [rank, out])`` per slice name into rows
        ``row .. row + rank``; a slice the adapter does not target gets zeros there (the rows held
        another adapter before). Whole adapters come in; each rank keeps its part. Copies are
        queued on the current stream, never waited for."""
        end = row + rank
        for name, A, B in zip(self.slice_names, self.lora_A, self.lora_B):
            pair = weights.get(name)
            if pair is None:
                A[row:end].zero_()
                B[row:end].zero_()
            else:
                a, bt = self.adapter_part(name, *pair)
                A[row:end].copy_(a, non_blocking=True)
                B[row:end].copy_(bt, non_blocking=True)


    def write_dora_scale(self, slot: int, scaling: float,
                         parts: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Set slot ``slot``'s DoRA scale row: per slice in ``parts`` (``A [r, in]``, ``Bt [r, out]``,
        magnitude ``m [out]``) ``m / ||W0 + scaling * Bt^T A||`` per output row, ones elsewhere. A
        plain LoRA adapter passes no parts: its row becomes ones (the slot may have held a DoRA
        adapter). Where DoRA is off there is no table, and a DoRA adapter is refused at load before
        it gets here (``EngineConfig.dora_refusal``)."""
        if self.dora_scale is None:
            if parts:
                raise ValueError(f"layer {self.layer_idx} has no DoRA scale table: this engine does not serve DoRA")
            return
        scale = self.dora_scale[slot + 1]
        scale.fill_(1)
        for name, (A, Bt, magnitude) in parts.items():
            offset, width = self.slice_of(name)
            norm = self._delta_row_norms(offset, width, A, Bt, scaling)
            scale[offset:offset + width] = (magnitude.to(norm.device, torch.float32) / norm).to(self.dtype)

    def _delta_row_norms(self, offset: int, width: int, A: torch.Tensor, Bt: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """``||W0 + s Bt^T A||`` of each output row of one slice, fp32, without forming the matrix:
        ``||W0_j||^2 + 2 s (W0 A^T)_j . B_j + s^2 B_j (A A^T) B_j`` (a rank-r GEMM, not an out x in one)."""
        if self.weight is None:
            raise ValueError("DoRA is not served over an AWQ (INT4) base: its norms need the dequantized weight")
        device = self.weight.device
        # One copy of each from the CPU (pinned on CUDA, queued like write_rows'), converted on the device.
        A_dev = A.to(device, non_blocking=True)
        A32 = A_dev.float()
        Bt32 = Bt.to(device, non_blocking=True).float()
        W = self.weight[offset:offset + width]
        if self._base_row_sq is None:
            # By blocks of rows: an fp32 copy of the whole weight is 470 MB for an 8B gate/up projection,
            # outside the memory plan.
            self._base_row_sq = torch.cat([rows.float().square().sum(dim=1) for rows in torch.split(self.weight, 1024)])
        base_sq = self._base_row_sq[offset:offset + width]
        WA = F.linear(A_dev.to(self.weight.dtype), W).float()  # [r, width]
        cross = (WA * Bt32).sum(dim=0)
        quad = ((A32 @ A32.t() @ Bt32) * Bt32).sum(dim=0)
        return (base_sq + 2 * scaling * cross + scaling * scaling * quad).clamp_min(0).sqrt()


def write_dora_scales(layers: dict[tuple[int, str], MultiLoRALinear], slot: int, adapter: CachedAdapter) -> None:
    """Set every layer's DoRA scale row of ``slot`` for ``adapter`` (``layers``: by ``(layer index,
    module)``), from its CPU copy: a DoRA adapter's scales, or ones for a plain LoRA adapter where
    a table exists. Queued on the current stream, after any step that still reads the slot's old row."""
    assert adapter.weights is not None
    parts: dict[MultiLoRALinear, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    if adapter.magnitudes is not None:
        for key, magnitude in adapter.magnitudes.items():
            A, Bt = adapter.weights[key]
            parts.setdefault(layers[key], {})[key[1]] = (A, Bt, magnitude)
    with torch.no_grad():
        for layer in dict.fromkeys(layers.values()):
            layer.write_dora_scale(slot, adapter.scaling, parts.get(layer, {}))


def quantize_fp8(layers: Iterable[MultiLoRALinear]) -> None:
    """Quantize every layer's base weight to FP8 (``MultiLoRALinear.quantize_fp8``), then hand the
    freed weights' CUDA memory back, so a memory plan measured after this sees the smaller weights."""
    cuda = False
    for layer in layers:
        layer.quantize_fp8()
        cuda = cuda or layer.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
