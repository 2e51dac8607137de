"""A memory model of one LoRA training step: the peak bytes `training.trainer.LoraTrainer` allocates
on a Llama-shaped base, from the shape, the precision, the adapter and the batch (issue 25: predict
the full Llama-3-70B from runs of the same shape cut to a few layers, bench/trainer_70b.py).

What a step holds at its peak, term by term (T = rows × width tokens of the micro-batch, `a` the
activation bytes: 2 on the CUDA bf16 path, 4 on the CPU fp32 one):

- **base**: every weight of the frozen base in its dtype (bf16 on CUDA): the embedding, the head
  (unless tied), the final norm and L decoder layers of q, k, v, o, gate, up, down and two norms.
  A QLoRA job's base (`int4_base`, training.int4_base) holds the seven projections in AWQ's INT4
  instead: half a byte a weight, plus an fp16 scale and a 4-bit zero per group of input rows
  (training.int4_layout.int4_bytes). Its forward dequantizes tiles in registers; its backward
  dequantizes one projection at a time for cuBLAS, a transient of the largest projection in the
  activation dtype, counted in the layer's backward (recompute below).
- **lora**: 12 bytes a LoRA parameter: the weight and AdamW's two moments, all fp32 (PEFT keeps
  adapter weights in fp32 on a bf16 base; AdamW keeps its states in the parameters' dtype). The
  fp32 gradients (4 bytes more) exist only from the layers' backward on: the trainer sets them to
  None after each step, so at the loss's backward they are not there yet. Without checkpointing
  autograd also keeps autocast's bf16 copy of each LoRA weight (a bytes more) for the backward.
- **layer inputs** (gradient checkpointing on): L × T × hidden × a, the one tensor a checkpointed
  decoder layer keeps; off, every layer keeps its whole `layer_activation` instead.
- **layer activation**: what autograd saves inside one decoder layer a token: the two norms'
  fp32 inputs (2 × 4 × hidden), the attention kernel's roped q, roped k, v and output (and its
  log-sum-exp, 4 × heads), the MLP's gate, SiLU(gate) and up (3 × intermediate), and for each
  adapted projection a copy of its input (PEFT's cast to the LoRA dtype and autocast's back: the
  frozen projection itself keeps no input) and its rank-r A output. With checkpointing one layer's
  is live again while the backward recomputes it, beside two intermediate-sized gradients and the LoRA gradients.
- **loss**: the head's logits (T × vocab × a) and, in the loss's backward, cross-entropy's fp32
  log-softmax, its gradient and the logits' fp32 gradient (12 bytes an element): training.packing
  upcasts the logits to fp32 for the loss. With a 128k vocabulary this is the largest transient.
- **head**: the final norm's fp32 input and output (T × hidden × (4 + a)).
- **workspace**: a constant for cuBLAS's and the attention kernels' scratch (CUDA only).

peak = base + lora + workspace + inputs + max(loss + head, recompute + LoRA gradients), where
recompute = layer_activation + the layer's backward gradients (and the INT4 backward's dequantized
projection); without checkpointing,
peak = base + lora + workspace + L × layer_activation + LoRA casts + loss + head.
(H200 runs of 2026-12-02, bench/trainer_70b.py on the 70B shape cut to 2-64 layers, with and
without checkpointing, at 1,024-4,096 tokens and ranks 16 and 64, read 0.993-1.000 of this at every
cut; docs/benchmarks.md.)

`fsdp_peak` is the per-GPU peak under training.distributed's FSDP2 sharding of the frozen base over
N GPUs: the base's share (base / N), plus what is gathered whole at once (the root's embedding, head
and final norm, kept for the step, and two decoder layers: the one running and the one prefetched),
the LoRA states whole on every rank, and the activations of the rank's own micro-batch.

Pure arithmetic (no torch, no Django): tests check it against hand-computed bytes and against the
parameters torch builds; bench/trainer_70b.py against `torch.cuda.max_memory_allocated`. It lives in
training/ rather than beside the benchmark because it is a fact about this trainer's step (its
precision, its loss, its checkpointing), and the platform is where it would be used next: to tell a
job before it starts how many GPUs its base needs (a job's GPU count is the tenant's today).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from training.int4_layout import int4_bytes

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RESIDENT_BYTES = 12  # fp32 weight, AdamW exp_avg and exp_avg_sq
LORA_GRAD_BYTES = 4  # fp32 gradient, from the layers' backward to the optimizer step
LOSS_FP32_BYTES = 12  # log-softmax output, its gradient and the logits' fp32 gradient, each fp32
CUDA_WORKSPACE_BYTES = 64 * 2**20
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder (the fields of its Hugging Face config the memory depends on)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any], layers: int | None = None) -> Shape:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(hidden=hidden, intermediate=int(config["intermediate_size"]),
                   layers=int(config["num_hidden_layers"]) if layers is None else layers, heads=heads,
                   kv_heads=int(config["num_key_value_heads"]), vocab=int(config["vocab_size"]),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   tied_embeddings=bool(config.get("tie_word_embeddings", False)))

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(fan_in, fan_out) of each linear projection of one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        """One decoder layer's weights: its projections and two RMSNorm weights (Llama has no biases)."""
        return sum(fan_in * fan_out for fan_in, fan_out in self.projection_shapes().values()) + 2 * self.hidden

    @property
    def outer_params(self) -> int:
        """The weights outside the decoder layers: embedding, head (unless tied) and final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.outer_params + self.layers * self.layer_params

    def base_bytes(self, dtype_bytes: int, int4: bool) -> int:
        """The frozen base's bytes: every weight in `dtype_bytes`, or with the projections in INT4."""
        if not int4:
            return self.params * dtype_bytes
        projections = sum(int4_bytes(fan_out, fan_in) for fan_in, fan_out in self.projection_shapes().values())
        norms = 2 * self.hidden * dtype_bytes
        return self.outer_params * dtype_bytes + self.layers * (projections + norms)


@dataclass(frozen=True)
class Setup:
    """How the shape is trained: precision, adapter, micro-batch and checkpointing."""

    rank: int = 16
    targets: Sequence[str] = PROJECTIONS
    tokens: int = 2048  # rows × width of one micro-batch
    base_bytes: int = 2  # the frozen base's dtype (bf16 on CUDA, fp32 on CPU)
    activation_bytes: int = 2  # autocast's dtype on CUDA; fp32 on CPU
    gradient_checkpointing: bool = True
    workspace: int = CUDA_WORKSPACE_BYTES
    int4_base: bool = False  # the projections in INT4 (a QLoRA job: base_quantization "int4")


@dataclass(frozen=True)
class Estimate:
    """The predicted peak, term by term (bytes); `peak` is what max_memory_allocated should read."""

    base: int
    lora: int
    lora_grads: int
    workspace: int
    kept_activations: int
    loss: int
    head: int
    layer_activation: int
    recompute: int
    peak: int

    def to_dict(self) -> dict[str, float]:
        return {f"{name}_gib": value / GIB for name, value in asdict(self).items()}


def lora_params(shape: Shape, setup: Setup) -> int:
    """The LoRA parameters on every layer: rank × (fan_in + fan_out) for each adapted projection."""
    shapes = shape.projection_shapes()
    unknown = set(setup.targets) - set(shapes)
    if unknown:
        raise ValueError(f"no such projection(s): {sorted(unknown)}")
    return shape.layers * sum(setup.rank * sum(shapes[name]) for name in setup.targets)


def layer_activation_per_token(shape: Shape, setup: Setup) -> int:
    """Bytes autograd saves inside one decoder layer for one token (module docstring)."""
    a = setup.activation_bytes
    shapes = shape.projection_shapes()
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if a < 4:
        # PEFT casts an adapted projection's input to the fp32 LoRA weight's dtype and autocast casts it
        # back: every LoRA A keeps its own copy of its input (the frozen projection keeps none).
        inputs = sum(shapes[name][0] for name in setup.targets)
    else:
        # In fp32 those casts return the same tensor: the first norm's output, the second's, the product.
        inputs = (shape.hidden * bool({"q_proj", "k_proj", "v_proj"} & set(setup.targets))
                  + shape.hidden * bool({"gate_proj", "up_proj"} & set(setup.targets))
                  + shape.intermediate * ("down_proj" in setup.targets))
    lora = setup.rank * len(setup.targets)  # each adapted projection's A output
    attention = 2 * q + 2 * kv  # the attention kernel's roped q, roped k, v and output
    mlp = 3 * shape.intermediate  # gate (SiLU's input), SiLU(gate) and up (the product's inputs)
    norms_fp32 = 2 * 4 * shape.hidden + 2 * 4  # two RMSNorm inputs upcast to fp32, and their rsqrt
    log_sum_exp = 4 * shape.heads
    return a * (inputs + lora + attention + mlp) + norms_fp32 + log_sum_exp


def estimate(shape: Shape, setup: Setup) -> Estimate:
    """The predicted peak of one training step on one device."""
    tokens, a = setup.tokens, setup.activation_bytes
    base = shape.base_bytes(setup.base_bytes, setup.int4_base)
    adapter = lora_params(shape, setup)
    lora, lora_grads = adapter * LORA_RESIDENT_BYTES, adapter * LORA_GRAD_BYTES
    layer_activation = tokens * layer_activation_per_token(shape, setup)
    # The backward of a layer: the gradients of two intermediate-sized tensors and of the layer's input.
    recompute = layer_activation + tokens * a * (2 * shape.intermediate + 2 * shape.hidden)
    if setup.int4_base:
        # The one projection the INT4 backward dequantizes for cuBLAS at a time.
        recompute += a * max(fan_in * fan_out for fan_in, fan_out in shape.projection_shapes().values())
    loss = tokens * shape.vocab * (a + LOSS_FP32_BYTES)
    head = tokens * shape.hidden * (4 + a)
    if setup.gradient_checkpointing:
        kept = shape.layers * tokens * shape.hidden * a
        transient = max(loss + head, recompute + lora_grads)
    else:
        # Autocast's low-precision copies of the LoRA weights, saved for the backward (none in fp32).
        casts = adapter * a if a < 4 else 0
        kept = shape.layers * layer_activation + casts
        transient = loss + head
    return Estimate(base=base, lora=lora, lora_grads=lora_grads, workspace=setup.workspace, kept_activations=kept,
                    loss=loss, head=head, layer_activation=layer_activation, recompute=recompute,
                    peak=base + lora + setup.workspace + kept + transient)


def fsdp_peak(shape: Shape, setup: Setup, gpus: int) -> int:
    """The per-GPU peak with the frozen base sharded over `gpus` by FSDP2 (module docstring)."""
    one = estimate(shape, setup)
    gathered = shape.outer_params * setup.base_bytes + 2 * shape.layer_params * setup.base_bytes
    return one.peak - one.base + one.base // gpus + gathered


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (intercept, slope) of y on x: measured peak against the layer count."""
    n = len(points)
    if n < 2:
        raise ValueError("a line needs two points")
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        raise ValueError("a line needs two different x")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope
