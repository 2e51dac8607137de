"""Reading a PEFT LoRA adapter into CPU tensors, validated against the base model.

An adapter is a directory in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`,
optionally the artifact's `manifest.json`), given as a local path, a `file://` URI or an
`s3://bucket/prefix` (downloaded through the platform's own blob storage, runtime.s3, honouring
`S3_ENDPOINT_URL` and the usual `AWS_*` variables). Only safetensors is read; a pickled `.bin` is refused without being opened.

`validate_adapter_dir` checks everything that can be checked without reading the weights (the
config, the manifest digests, the tensor names, dtypes and shapes from the safetensors header): the
registry uses it on uploads. `load_adapter` does the same, then reads the tensors as fp32.

Every problem raises `AdapterError` with a message naming it. Supported: LoRA (`peft_type`
"LORA") on q/k/v/o/gate/up/down projections (Phi-3: the fused qkv_proj and gate_up_proj, which
its checkpoints and PEFT name whole) with one rank and alpha for all modules, optionally
rsLoRA, DoRA (`use_dora`: every adapted module also has its `lora_magnitude_vector`, one value
per output feature; docs/adapter-kinds.md) and `layers_to_transform` (layers without tensors get
no LoRA).

The vocabulary modules (`embed_tokens`, `lm_head`; docs/adapter-kinds.md, "Vocabulary modules"):
LoRA on them (PEFT's `lora_embedding_A [r, vocab]` / `lora_embedding_B [hidden, r]` on the
embedding, a plain `lora_A` / `lora_B` pair on the head) is read as it is. A full copy of one
(`modules_to_save`, or the `base_layer.weight` PEFT saves beside LoRA on them with
`save_embedding_layers`) is never kept whole: `load_adapter` compares it with the base's matrix
(`base_vocab`) and keeps only the rows that differ, with their token ids (`VocabDelta`), and refuses
the adapter when more than 1/`MAX_CHANGED_ROWS_DIVISOR` of the vocabulary's rows differ (then it
is a full copy, which the engine does not hold per adapter). PEFT's trainable tokens
(`trainable_token_indices`: the listed tokens' rows, `trainable_tokens_delta`) are such rows as
saved, under the same bound. Refused too, naming why: a copy or LoRA of another vocabulary size
(resized embeddings, new tokens), any of them on a base that ties `lm_head` to `embed_tokens`, DoRA
on them, and `vocab_refusal` (why an engine serves none, e.g. under tensor parallelism).
`validate_adapter_dir` (no weights, no base matrices) checks their names and shapes only (the
trainable tokens' bound too); the changed-row bound of a copy is `load_adapter`'s.

Refused, each naming what it is: trained biases, `modules_to_save` of any other module (a
classifier, a norm: whole copies of base modules), `rank_pattern`/`alpha_pattern`,
`fan_in_fan_out`, trainable tokens beyond the base's vocabulary (new tokens).

Base model check: when `base_model_name` is given, the config's `base_model_name_or_path` must
name the same model, compared by last path component, case-insensitively
(`/models/tiny-llama/` matches `tiny-llama`; `meta-llama/Llama-3-8B` matches `llama-3-8b`). A config
that names no base is accepted: the shape check still guards against a wrong base.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import unquote, urlparse

from botocore.exceptions import BotoCoreError, ClientError
from safetensors import safe_open

from serving.contracts.artifact import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_KINDS,
    MANIFEST_NAME,
    AdapterError,
    adapter_digest,
    manifest_verify,
    read_adapter_config,
)
from serving.contracts.errors import ServiceError
from runtime.s3 import S3Storage
from runtime.settings import platform_settings

# torch is imported where tensors are read (load_adapter), not here: the web process imports this
# module for validate_adapter_dir (the upload check), which reads only the safetensors header, and
# torch would cost every web process seconds of start-up (tests/test_import_graph.py holds it).
if TYPE_CHECKING:
    import torch

__all__ = [
    "SUPPORTED_MODULES",
    "AdapterError",
    "AdapterSpec",
    "BaseShapes",
    "LoadedAdapter",
    "MAX_CHANGED_ROWS_DIVISOR",
    "VOCABULARY_MODULES",
    "VocabDelta",
    "download_s3_prefix",
    "load_adapter",
    "validate_adapter_dir",
]

WEIGHTS_NAME = "adapter_model.safetensors"
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                     "gate_up_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "qkv_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "down_proj": "mlp"}
# Bases whose checkpoints hold q/k/v and gate/up fused (qkv_proj, gate_up_proj): what PEFT adapts there.
_FUSED_MODEL_TYPES = ("phi3",)
# head_dim where a config leaves it out and its transformers class's default is not hidden / heads.
_DEFAULT_HEAD_DIM = {"gemma2": 256, "gemma3_text": 256}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Keyed by str(torch.dtype), so that this table needs no torch at import.
_DTYPE_CODES = {"torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32",
                "torch.float64": "F64"}
_FLOAT_DTYPES = set(_DTYPE_CODES.values())
# PEFT's save_pretrained names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_LORA_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)"
    r"\.lora_(?P<which>[AB])\.weight$"
)
# DoRA's magnitude: base_model.model.model.layers.3.self_attn.q_proj.lora_magnitude_vector
_MAGNITUDE_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)"
    r"\.lora_magnitude_vector$"
)
_ANY_LORA_KEY = re.compile(r"(?:^|\.)(?P<module>\w+)\.lora_\w+")
# The vocabulary modules: LoRA on them and their full copies (modules_to_save) are served as deltas
# on the base's matrices (docs/adapter-kinds.md).
VOCABULARY_MODULES = ("embed_tokens", "lm_head")
# PEFT's names for them: LoRA on the embedding (no ".weight"), LoRA on the head, and a full copy
# (modules_to_save's, or save_embedding_layers' base_layer beside LoRA on the module).
_VOCAB_LORA_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(?P<embed>embed_tokens)\.lora_embedding_(?P<embed_which>[AB])"
    r"|(?P<head>lm_head)\.lora_(?P<head_which>[AB])\.weight)$"
)
_VOCAB_COPY_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(?P<embed>embed_tokens)|(?P<head>lm_head))(?:\.base_layer)?\.weight$"
)
# PEFT's trainable tokens (trainable_token_indices): the rows of the listed token ids, in the config's order.
_VOCAB_TOKENS_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(?P<embed>embed_tokens)|(?P<head>lm_head))\.token_adapter\.trainable_tokens_delta$"
)
# A full copy may differ from the base in at most vocab // this many rows: beyond, it is a copy of
# the matrix (1/8 of Llama-3-8B's is 131 MB in bf16, 1.6 rank-16 adapters on all projections).
MAX_CHANGED_ROWS_DIVISOR = 8

# (layer index, module name) -> (A[r, in], B[out, r]): fp32 as read, the model's dtype once the
# loader has converted them for a slot copy.
Weights: TypeAlias = "dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]"
# (layer index, module name) -> DoRA's magnitude [out], fp32: one entry per adapted module of a DoRA adapter.
Magnitudes: TypeAlias = "dict[tuple[int, str], torch.Tensor]"


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the layer count and each target module's (in, out) features."""

    num_layers: int
    modules: Mapping[str, tuple[int, int]]
    # The vocabulary matrices' shape [vocab_size, hidden_size] (0: not known, every vocabulary tensor
    # is refused) and whether lm_head is embed_tokens' matrix.
    vocab_size: int = 0
    hidden_size: int = 0
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, config: Any) -> BaseShapes:
        """From a transformers config (or its config.json's fields) of any architecture the engine
        serves: the Llama family, Gemma (head_dim of its own) and Phi-3 (fused projections)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        model_type = getattr(config, "model_type", None)
        head_dim = getattr(config, "head_dim", None) or _DEFAULT_HEAD_DIM.get(str(model_type)) or hidden // heads
        inter = config.intermediate_size
        q, kv = heads * head_dim, kv_heads * head_dim
        if model_type in _FUSED_MODEL_TYPES:
            attention = {"qkv_proj": (hidden, q + 2 * kv)}
            mlp = {"gate_up_proj": (hidden, 2 * inter)}
        else:
            attention = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
            mlp = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
        return cls(
            num_layers=config.num_hidden_layers,
            modules={**attention, "o_proj": (q, hidden), **mlp, "down_proj": (inter, hidden)},
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter's settings and layout, validated without reading its weights."""

    rank: int
    lora_alpha: float
    scaling: float
    use_rslora: bool
    target_modules: frozenset[str]
    layers: frozenset[int]
    base_model_name_or_path: str | None
    weights_bytes: int
    use_dora: bool = False
    # Vocabulary modules the adapter keeps a full copy of (modules_to_save, or save_embedding_layers'):
    # served as the rows that differ from the base's.
    vocab_copies: frozenset[str] = frozenset()
    # trainable_token_indices by module: the token ids whose rows the adapter replaces.
    trainable_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """One of ADAPTER_KINDS: "dora" or "lora"."""
        return ADAPTER_KINDS[1] if self.use_dora else ADAPTER_KINDS[0]


@dataclass(frozen=True)
class VocabDelta:
    """An adapter's part on the vocabulary modules, none of it a copy of a base matrix.

    ``embed_lora`` ``(A [r, vocab], B [hidden, r])``: the embedding of token ``t`` gains
    ``scaling * B @ A[:, t]`` (PEFT's ``lora_embedding_A`` / ``_B``). ``head_lora`` ``(A [r, hidden],
    B [vocab, r])``: the logits gain ``scaling * B @ A @ h``. ``embed_rows`` / ``head_rows``
    ``(token ids [k] int64 ascending, rows [k, hidden])``: the rows of a full copy that differ from
    the base's, or the trainable tokens' rows, which replace the base's rows for this adapter's tokens (the embedding of those
    tokens; those logits, ``rows @ h``)."""

    embed_lora: tuple[torch.Tensor, torch.Tensor] | None = None
    head_lora: tuple[torch.Tensor, torch.Tensor] | None = None
    embed_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    head_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in (self.embed_lora, self.head_lora, self.embed_rows, self.head_rows)
                if part is not None for t in part]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def converted(self, dtype: torch.dtype, *, pin_memory: bool) -> VocabDelta:
        """The same with its float tensors in ``dtype`` (pinned on CUDA for the copy into a slot);
        token ids stay int64."""

        def convert(part: tuple[torch.Tensor, torch.Tensor] | None, *,
                    ids: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
            if part is None:
                return None
            out = tuple(t if ids and i == 0 else t.to(dtype) for i, t in enumerate(part))
            return tuple(t.pin_memory() if pin_memory else t for t in out)  # type: ignore[return-value]

        return VocabDelta(convert(self.embed_lora, ids=False), convert(self.head_lora, ids=False),
                          convert(self.embed_rows, ids=True), convert(self.head_rows, ids=True))


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter in CPU memory: `weights[(layer, module)] = (A[r, in], B[out, r])`, fp32.

    The LoRA output of a module is `scaling * (x @ A.T) @ B.T`. A DoRA adapter also has
    `magnitudes[(layer, module)]` (`m [out]`): its module computes `m / ||W0 + scaling * B @ A||`
    (the norm of each output row, over the input features, as PEFT's DoRA layer defines it) times
    `(W0 + scaling * B @ A) @ x`, plus the base's bias. `digest` is the artifact's content digest
    (serving.contracts.artifact.adapter_digest); caches key adapters by it.
    """

    digest: str
    rank: int
    lora_alpha: float
    scaling: float
    target_modules: frozenset[str]
    weights: Weights
    nbytes: int
    use_rslora: bool = False
    magnitudes: Magnitudes | None = None
    vocab: VocabDelta | None = None  # its part on embed_tokens / lm_head, if any

    @property
    def use_dora(self) -> bool:
        return self.magnitudes is not None


def validate_adapter_dir(
    adapter_dir: Path,
    *,
    base_config: Any,
    max_lora_rank: int,
    base_model_name: str | Iterable[str] | None = None,
    dora_refusal: str | None = None,
    vocab_refusal: str | None = None,
) -> AdapterSpec:
    """Check a local adapter directory against the base without reading its tensors.

    `base_config` is a transformers config or a `BaseShapes`; `base_model_name` the accepted base
    name(s) (module docstring); `dora_refusal`, when given, is why this server refuses DoRA adapters
    (the error says it); `vocab_refusal` likewise for adapters on embed_tokens / lm_head. Verifies
    manifest.json when present. Raises AdapterError.
    """
    adapter_dir = Path(adapter_dir)
    shapes = _shapes(base_config)
    if not adapter_dir.is_dir():
        raise AdapterError(f"adapter directory {adapter_dir} does not exist")
    if (adapter_dir / MANIFEST_NAME).exists():
        manifest_verify(adapter_dir)
    config = read_adapter_config(adapter_dir)
    rank, alpha, use_rslora, config_modules = _check_config(config, max_lora_rank)
    use_dora = bool(config.get("use_dora"))
    if use_dora and dora_refusal is not None:
        raise AdapterError(f"{ADAPTER_CONFIG_NAME}: DoRA adapters (use_dora) are not served here: {dora_refusal}")
    base_name = config.get("base_model_name_or_path") or None
    _check_base_model(base_name, base_model_name)
    weights_path = _weights_path(adapter_dir)
    try:
        # The header only (names, shapes, dtypes): numpy's framework reads it without torch.
        with safe_open(weights_path, framework="numpy") as reader:
            header = {name: reader.get_slice(name) for name in reader.keys()}
            layout = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in header.items()}
    except Exception as exc:  # safetensors raises its own error types for every malformed file
        raise AdapterError(f"{WEIGHTS_NAME} is not a valid safetensors file: {exc}") from None
    found = _check_layout(layout, rank=rank, shapes=shapes, use_dora=use_dora)
    tokens = _trainable_tokens(config, found, shapes)
    _check_vocabulary(found, config, shapes, vocab_refusal)
    modules = frozenset(module for _, module in found.pairs) | frozenset(found.vocab_lora)
    if config_modules is not None and not modules <= config_modules:
        raise AdapterError(
            f"{WEIGHTS_NAME} has tensors for {', '.join(sorted(modules - config_modules))}, "
            f"which {ADAPTER_CONFIG_NAME}'s target_modules does not name"
        )
    return AdapterSpec(
        rank=rank,
        lora_alpha=alpha,
        scaling=alpha / math.sqrt(rank) if use_rslora else alpha / rank,
        use_rslora=use_rslora,
        target_modules=modules,
        layers=frozenset(layer for layer, _ in found.pairs),
        base_model_name_or_path=base_name,
        weights_bytes=weights_path.stat().st_size,
        use_dora=use_dora,
        vocab_copies=frozenset(found.vocab_copies),
        trainable_tokens=tokens,
    )


def load_adapter(
    source: str | Path,
    *,
    base_config: Any,
    max_lora_rank: int,
    base_model_name: str | Iterable[str] | None = None,
    dora_refusal: str | None = None,
    vocab_refusal: str | None = None,
    base_vocab: Callable[[str], torch.Tensor] | None = None,
) -> LoadedAdapter:
    """Validate (as `validate_adapter_dir`) and read an adapter into fp32 CPU tensors.

    `source`: a local directory, `file://` URI or `s3://bucket/prefix`. `base_vocab(module)`: the
    base's `[vocab, hidden]` matrix of "embed_tokens" or "lm_head" (on any device, in the dtype the
    engine serves), which a full copy of that module is compared with; without it such an adapter
    is refused. Raises AdapterError.
    """
    import torch
    from safetensors.torch import load_file

    with _local_copy(source) as adapter_dir:
        spec = validate_adapter_dir(
            adapter_dir,
            base_config=base_config,
            max_lora_rank=max_lora_rank,
            base_model_name=base_model_name,
            dora_refusal=dora_refusal,
            vocab_refusal=vocab_refusal,
        )
        digest = adapter_digest(adapter_dir)
        try:
            tensors = load_file(adapter_dir / WEIGHTS_NAME, device="cpu")
        except Exception as exc:  # safetensors raises its own error types for every malformed file
            raise AdapterError(f"{WEIGHTS_NAME} is not a valid safetensors file: {exc}") from None
    shapes = _shapes(base_config)
    # Checked again on what was read: the file may have changed since its header was validated.
    layout = {name: (tuple(t.shape), _dtype_code(t.dtype)) for name, t in tensors.items()}
    found = _check_layout(layout, rank=spec.rank, shapes=shapes, use_dora=spec.use_dora)
    weights: Weights = {}
    for (layer, module), (a_name, b_name) in sorted(found.pairs.items()):
        weights[layer, module] = (_finite(tensors, a_name), _finite(tensors, b_name))
    vocab = _read_vocabulary(found, tensors, shapes, base_vocab, spec.trainable_tokens)
    magnitudes: Magnitudes | None = None
    if spec.use_dora:
        magnitudes = {}
        for key, name in sorted(found.magnitudes.items()):
            m = tensors[name].to(torch.float32).contiguous()
            if not torch.isfinite(m).all():
                raise AdapterError(f"tensor {name} contains NaN or infinite values")
            magnitudes[key] = m
    return LoadedAdapter(
        digest=digest,
        rank=spec.rank,
        lora_alpha=spec.lora_alpha,
        scaling=spec.scaling,
        target_modules=spec.target_modules,
        weights=weights,
        nbytes=sum(a.nbytes + b.nbytes for a, b in weights.values()) + (vocab.nbytes if vocab is not None else 0),
        use_rslora=spec.use_rslora,
        magnitudes=magnitudes,
        vocab=vocab,
    )


def _finite(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Tensor ``name`` as contiguous fp32, refused if it holds a NaN or an infinity."""
    import torch

    tensor = tensors[name].to(torch.float32).contiguous()
    # A NaN or an infinity makes the sum non-finite; only then is every element looked at (an fp32
    # sum of finite values can overflow): the full check costs a load 10x the sum.
    if not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
        raise AdapterError(f"tensor {name} contains NaN or infinite values")
    return tensor


def _read_vocabulary(found: _Layout, tensors: Mapping[str, torch.Tensor], shapes: BaseShapes,
                     base_vocab: Callable[[str], torch.Tensor] | None,
                     tokens: Mapping[str, tuple[int, ...]]) -> VocabDelta | None:
    """The adapter's ``VocabDelta``: its LoRA on the vocabulary modules as read, of each full copy the
    rows that differ from the base's (refused past the bound), and its trainable tokens' rows."""
    import torch

    if not found.vocab_lora and not found.vocab_copies and not found.vocab_tokens:
        return None
    lora = {module: (_finite(tensors, names["A"]), _finite(tensors, names["B"]))
            for module, names in found.vocab_lora.items()}
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, name in found.vocab_copies.items():
        if base_vocab is None:
            raise AdapterError(
                f"tensor {name} is a full copy of {module}; this engine cannot compare it with the base's matrix, "
                "so it does not serve it"
            )
        ids, changed = _changed_rows(name, module, _finite(tensors, name), base_vocab(module), shapes.vocab_size)
        if ids.numel():  # a copy equal to the base (save_embedding_layers' beside LoRA) costs nothing
            rows[module] = (ids, changed)
    for module, (name, _) in found.vocab_tokens.items():
        # PEFT's index_copy of the rows into the matrix: the ids sorted, their rows with them.
        ids, order = torch.sort(torch.tensor(tokens[module], dtype=torch.int64))
        rows[module] = (ids, _finite(tensors, name).index_select(0, order).contiguous())
    if not lora and not rows:
        return None
    return VocabDelta(embed_lora=lora.get("embed_tokens"), head_lora=lora.get("lm_head"),
                      embed_rows=rows.get("embed_tokens"), head_rows=rows.get("lm_head"))


def _changed_rows(name: str, module: str, copy: torch.Tensor, base: torch.Tensor,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids, rows)`` of ``copy`` that differ from ``base`` once in the base's dtype (the
    precision the engine serves it at), compared by blocks of rows so that no second full matrix
    is made on the base's device; refused when more than 1/MAX_CHANGED_ROWS_DIVISOR of them do."""
    import torch

    changed = []
    for start in range(0, vocab_size, 4096):
        block = base[start:start + 4096].to("cpu")
        differs = (copy[start:start + 4096].to(block.dtype) != block).any(dim=1)
        changed.append(differs.nonzero().squeeze(1) + start)
    ids = torch.cat(changed)
    bound = vocab_size // MAX_CHANGED_ROWS_DIVISOR
    if ids.numel() > bound:
        raise AdapterError(
            f"tensor {name}: {ids.numel()} of {module}'s {vocab_size} rows differ from the base model's, more than "
            f"1/{MAX_CHANGED_ROWS_DIVISOR} of the vocabulary ({bound} rows): that is a full copy of the matrix, "
            f"which the engine does not hold per adapter; train LoRA on {module} instead, or change fewer rows "
            "(docs/adapter-kinds.md)"
        )
    return ids, copy.index_select(0, ids).contiguous()


def _shapes(base_config: Any) -> BaseShapes:
    if isinstance(base_config, BaseShapes):
        return base_config
    return BaseShapes.from_config(base_config)


def _check_config(
    config: dict[str, Any], max_lora_rank: int
) -> tuple[int, float, bool, frozenset[str] | None]:
    """(rank, alpha, use_rslora, target modules or None for a regex); refuses what can't serve."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(
            f"{ADAPTER_CONFIG_NAME} has peft_type {peft_type!r}; only LoRA adapters (\"LORA\") "
            "are supported"
        )
    saved = [str(module) for module in config.get("modules_to_save") or []]
    others = [module for module in saved if module not in VOCABULARY_MODULES]
    if others:
        raise AdapterError(
            f"{ADAPTER_CONFIG_NAME}: modules_to_save ({', '.join(others)}) is not supported: the adapter would carry "
            "whole copies of those modules of the shared base model; only embed_tokens and lm_head are served, as "
            "the rows that differ from the base's (docs/adapter-kinds.md)"
        )
    refusals = {
        "rank_pattern": "rank_pattern is not supported: save the adapter with one rank for all "
        "modules",
        "alpha_pattern": "alpha_pattern is not supported: save the adapter with one lora_alpha "
        "for all modules",
        "fan_in_fan_out": "fan_in_fan_out is not supported (it is for GPT-2-style Conv1D layers)",
        "lora_bias": "lora_bias is not supported: the adapter must not train biases",
        "target_parameters": "target_parameters is not supported: only target_modules",
    }
    for key, message in refusals.items():
        if config.get(key):
            raise AdapterError(f"{ADAPTER_CONFIG_NAME}: {message}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(
            f"{ADAPTER_CONFIG_NAME} has bias {bias!r}; only bias \"none\" is supported "
            "(the adapter must not train biases of the shared base model)"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{ADAPTER_CONFIG_NAME} has r={rank!r}; it must be a positive integer")
    if rank > max_lora_rank:
        raise AdapterError(
            f"adapter rank {rank} exceeds max_lora_rank {max_lora_rank}; retrain with r <= "
            f"{max_lora_rank} or raise max_lora_rank"
        )
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{ADAPTER_CONFIG_NAME} has lora_alpha={alpha!r}; it must be a number")
    target_modules = config.get("target_modules")
    if isinstance(target_modules, str):
        modules = None
    elif isinstance(target_modules, list) and all(isinstance(m, str) for m in target_modules):
        modules = frozenset(target_modules)
        unsupported = sorted(modules - set(SUPPORTED_MODULES) - set(VOCABULARY_MODULES))
        if unsupported:
            raise AdapterError(
                f"unsupported target module(s) {', '.join(unsupported)}; supported: "
                f"{', '.join(SUPPORTED_MODULES + VOCABULARY_MODULES)}"
            )
    else:
        raise AdapterError(
            f"{ADAPTER_CONFIG_NAME} has target_modules={target_modules!r}; it must be a list of "
            "module names or a regex"
        )
    return rank, float(alpha), bool(config.get("use_rslora")), modules


def _trainable_tokens(config: Mapping[str, Any], found: _Layout, shapes: BaseShapes) -> dict[str, tuple[int, ...]]:
    """``trainable_token_indices`` by module (a bare list is embed_tokens', as PEFT takes it), checked
    against the tensors: one row per id, ids inside the base's vocabulary, none twice, at most
    1/MAX_CHANGED_ROWS_DIVISOR of it, and no module with a full copy as well."""
    given = config.get("trainable_token_indices") or {}
    indices = {"embed_tokens": given} if isinstance(given, list) else given
    if not isinstance(indices, dict):
        raise AdapterError(f"{ADAPTER_CONFIG_NAME} has trainable_token_indices={given!r}; it must be a list of token "
                           "ids or a mapping of module to token ids")
    others = sorted(set(map(str, indices)) - set(VOCABULARY_MODULES))
    if others:
        raise AdapterError(f"{ADAPTER_CONFIG_NAME}: trainable_token_indices on {', '.join(others)} is not supported; "
                           f"only {' and '.join(VOCABULARY_MODULES)}")
    tokens: dict[str, tuple[int, ...]] = {}
    for module, ids in indices.items():
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise AdapterError(f"{ADAPTER_CONFIG_NAME}'s trainable_token_indices for {module} must be token ids")
        if module not in found.vocab_tokens:
            raise AdapterError(f"{ADAPTER_CONFIG_NAME}'s trainable_token_indices names {module}, but {WEIGHTS_NAME} "
                               "holds no trainable_tokens_delta for it")
        if module in found.vocab_copies:
            raise AdapterError(f"{module} has both a full copy and trainable tokens; PEFT trains one or the other")
        name, rows = found.vocab_tokens[module]
        outside = sorted(t for t in ids if not 0 <= t < shapes.vocab_size)
        if outside:
            raise AdapterError(
                f"trainable_token_indices for {module} has token id {outside[0]}, outside the base model's vocabulary "
                f"of {shapes.vocab_size}: adapters that add tokens to the vocabulary are not served"
            )
        if len(set(ids)) != len(ids):
            raise AdapterError(f"trainable_token_indices for {module} names a token twice")
        if rows != len(ids):
            raise AdapterError(f"tensor {name} has {rows} rows, but trainable_token_indices names {len(ids)} tokens")
        bound = shapes.vocab_size // MAX_CHANGED_ROWS_DIVISOR
        if len(ids) > bound:
            raise AdapterError(
                f"trainable_token_indices for {module} names {len(ids)} tokens, more than 1/{MAX_CHANGED_ROWS_DIVISOR} "
                f"of the vocabulary ({bound}): the engine does not hold that many rows per adapter"
            )
        tokens[module] = tuple(ids)
    for module, (name, _) in found.vocab_tokens.items():
        if module not in tokens:
            raise AdapterError(f"tensor {name} holds trainable tokens, but {ADAPTER_CONFIG_NAME}'s "
                               f"trainable_token_indices does not name {module}")
    return tokens


def _check_vocabulary(found: _Layout, config: Mapping[str, Any], shapes: BaseShapes, refusal: str | None) -> None:
    """An adapter with tensors on embed_tokens / lm_head is served only where the engine serves such
    adapters and the base keeps the two matrices apart; modules_to_save must name what it copies."""
    modules = sorted(set(found.vocab_lora) | set(found.vocab_copies) | set(found.vocab_tokens))
    for module in config.get("modules_to_save") or []:
        if module not in found.vocab_copies:
            raise AdapterError(f"{ADAPTER_CONFIG_NAME}'s modules_to_save names {module}, but {WEIGHTS_NAME} holds "
                               "no copy of it")
    if not modules:
        return
    what = ", ".join(modules)
    if config.get("use_dora") and found.vocab_lora:
        raise AdapterError(f"DoRA on {', '.join(sorted(found.vocab_lora))} is not served: DoRA adapters are served on "
                           f"the projections ({', '.join(SUPPORTED_MODULES)}) only")
    if refusal is not None:
        raise AdapterError(f"adapters on the vocabulary modules ({what}) are not served here: {refusal}")
    if shapes.tied_embeddings:
        raise AdapterError(
            f"the adapter adapts {what}, but the base model ties lm_head to embed_tokens (tie_word_embeddings): "
            "adapters on the vocabulary modules are served on bases that keep them apart (docs/adapter-kinds.md)"
        )


def _name_key(name: str) -> str:
    return PurePosixPath(name.replace("\\", "/").rstrip("/")).name.lower()


def _check_base_model(adapter_base: str | None, accepted: str | Iterable[str] | None) -> None:
    if accepted is None or adapter_base is None:
        return
    names = [accepted] if isinstance(accepted, str) else list(accepted)
    if _name_key(adapter_base) not in {_name_key(name) for name in names}:
        raise AdapterError(
            f"adapter was trained for base model {adapter_base!r}, but this engine serves "
            f"{' or '.join(repr(name) for name in names)}"
        )


def _weights_path(adapter_dir: Path) -> Path:
    path = adapter_dir / WEIGHTS_NAME
    if path.is_file():
        return path
    pickled = sorted(p.name for p in adapter_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise AdapterError(
            f"{', '.join(pickled)} is a pickled checkpoint, which is never loaded (unpickling can "
            f"run code); save the adapter with safetensors ({WEIGHTS_NAME}, PEFT's default)"
        )
    raise AdapterError(f"{WEIGHTS_NAME} is missing in {adapter_dir}")


def _dtype_code(dtype: torch.dtype) -> str:
    return _DTYPE_CODES.get(str(dtype), str(dtype))


@dataclass(frozen=True)
class _Layout:
    """An adapter file's tensors by role: ``pairs`` (layer, module) → (A name, B name); ``magnitudes``
    (layer, module) → DoRA magnitude name; ``vocab_lora`` module → {"A": name, "B": name};
    ``vocab_copies`` module → the name of its full copy; ``vocab_tokens``: of its trainable tokens' rows."""

    pairs: dict[tuple[int, str], tuple[str, str]]
    magnitudes: dict[tuple[int, str], str]
    vocab_lora: dict[str, dict[str, str]]
    vocab_copies: dict[str, str]
    vocab_tokens: dict[str, tuple[str, int]]  # module -> (its trainable_tokens_delta's name, rows)


def _check_vocab_tensor(name: str, module: str, shape: tuple[int, ...], dtype: str, shapes: BaseShapes,
                        want: tuple[int, ...], vocab_axis: int | None) -> None:
    """One tensor on a vocabulary module: a float dtype, ``want``'s shape; a vocabulary axis
    (``vocab_axis``, if it has one) of another length is a resized vocabulary, refused as such."""
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(f"tensor {name} has dtype {dtype}; adapter weights must be floating point")
    if vocab_axis is not None and len(shape) == len(want) and shape[vocab_axis] != shapes.vocab_size and all(
            s == w for i, (s, w) in enumerate(zip(shape, want)) if i != vocab_axis):
        raise AdapterError(
            f"tensor {name} has a vocabulary of {shape[vocab_axis]} tokens, but the base model's {module} has "
            f"{shapes.vocab_size}: adapters that resize the vocabulary (new tokens) are not served; add the tokens "
            "to the base model's vocabulary, or train on its own tokens"
        )
    if tuple(shape) != want:
        raise AdapterError(f"tensor {name} has shape {tuple(shape)}, but the base model expects {want}")


def _check_layout(
    layout: Mapping[str, tuple[tuple[int, ...], str]], *, rank: int, shapes: BaseShapes, use_dora: bool = False
) -> _Layout:
    """The tensors by role (``_Layout``), after checking every tensor's name, dtype and shape; a DoRA
    adapter (``use_dora``) has one magnitude per (A, B) pair, any other none."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    magnitudes: dict[tuple[int, str], str] = {}
    vocab_lora: dict[str, dict[str, str]] = {}
    vocab_copies: dict[str, str] = {}
    vocab_tokens: dict[str, tuple[str, int]] = {}
    vocab, hidden = shapes.vocab_size, shapes.hidden_size
    for name, (shape, dtype) in sorted(layout.items()):
        lora = _VOCAB_LORA_KEY.match(name)
        if lora is not None:
            module = lora["embed"] or lora["head"]
            which = lora["embed_which"] or lora["head_which"]
            # Embedding: A [r, vocab], B [hidden, r]; head: A [r, hidden], B [vocab, r].
            want, axis = {("embed_tokens", "A"): ((rank, vocab), 1), ("embed_tokens", "B"): ((hidden, rank), None),
                          ("lm_head", "A"): ((rank, hidden), None), ("lm_head", "B"): ((vocab, rank), 0)}[module, which]
            _check_vocab_tensor(name, module, shape, dtype, shapes, want, axis)
            vocab_lora.setdefault(module, {})[which] = name
            continue
        trained = _VOCAB_TOKENS_KEY.match(name)
        if trained is not None:
            module = trained["embed"] or trained["head"]
            rows = shape[0] if len(shape) == 2 else 0
            _check_vocab_tensor(name, module, shape, dtype, shapes, (rows, hidden), None)
            vocab_tokens[module] = (name, rows)
            continue
        copy = _VOCAB_COPY_KEY.match(name)
        if copy is not None:
            module = copy["embed"] or copy["head"]
            if module in vocab_copies:
                raise AdapterError(f"{WEIGHTS_NAME} holds two copies of {module}: {vocab_copies[module]} and {name}")
            _check_vocab_tensor(name, module, shape, dtype, shapes, (vocab, hidden), 0)
            vocab_copies[module] = name
            continue
        magnitude = _MAGNITUDE_KEY.match(name)
        if magnitude is not None and _PARENT.get(magnitude["module"]) == magnitude["parent"]:
            key = (int(magnitude["layer"]), magnitude["module"])
            if not use_dora:
                raise AdapterError(
                    f"tensor {name} is a DoRA magnitude, but {ADAPTER_CONFIG_NAME} does not set use_dora"
                )
            _check_tensor(name, key, shape, dtype, shapes, expected=lambda _in, out: (out,))
            magnitudes[key] = name
            continue
        match = _LORA_KEY.match(name)
        if match is None or _PARENT.get(match["module"]) != match["parent"]:
            loose = _ANY_LORA_KEY.search(name)
            if loose is not None and loose["module"] not in SUPPORTED_MODULES:
                raise AdapterError(
                    f"unsupported target module {loose['module']} (tensor {name}); supported: "
                    f"{', '.join(SUPPORTED_MODULES)}"
                )
            raise AdapterError(
                f"unexpected tensor {name} in {WEIGHTS_NAME}; expected PEFT's "
                "base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight"
            )
        layer, module, which = int(match["layer"]), match["module"], match["which"]
        _check_tensor(name, (layer, module), shape, dtype, shapes,
                      expected=lambda in_, out: (rank, in_) if which == "A" else (out, rank), rank=rank)
        found.setdefault((layer, module), {})[which] = name
    if not found and not vocab_lora and not vocab_copies and not vocab_tokens:
        raise AdapterError(f"{WEIGHTS_NAME} holds no LoRA weights")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            present = "A" if missing == "B" else "B"
            raise AdapterError(f"layer {layer} {module} has lora_{present} but no lora_{missing}")
    for module, pair in vocab_lora.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise AdapterError(f"{module} has LoRA {'A' if missing == 'B' else 'B'} but no LoRA {missing}")
    if use_dora:
        for layer, module in sorted(set(found) - set(magnitudes)):
            raise AdapterError(
                f"layer {layer} {module} has LoRA weights but no lora_magnitude_vector, which a DoRA adapter "
                "(use_dora) has for every adapted module"
            )
        for layer, module in sorted(set(magnitudes) - set(found)):
            raise AdapterError(f"layer {layer} {module} has a lora_magnitude_vector but no LoRA weights")
    return _Layout({key: (pair["A"], pair["B"]) for key, pair in found.items()}, magnitudes, vocab_lora, vocab_copies,
                   vocab_tokens)


def _check_tensor(
    name: str,
    key: tuple[int, str],
    shape: tuple[int, ...],
    dtype: str,
    shapes: BaseShapes,
    *,
    expected: Callable[[int, int], tuple[int, ...]],
    rank: int | None = None,
) -> None:
    """One tensor of module ``key``: a module and layer the base has, a float dtype, ``expected(in, out)``'s shape."""
    layer, module = key
    if module not in shapes.modules:
        raise AdapterError(
            f"tensor {name} adapts {module}, which the base model does not have; its projections are "
            f"{', '.join(shapes.modules)}"
        )
    if layer >= shapes.num_layers:
        raise AdapterError(f"tensor {name} is for layer {layer}, but the base model has {shapes.num_layers} layers")
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(f"tensor {name} has dtype {dtype}; adapter weights must be floating point")
    want = expected(*shapes.modules[module])
    if tuple(shape) != want:
        with_rank = f" with r={rank}" if rank is not None else ""
        raise AdapterError(f"tensor {name} has shape {tuple(shape)}, but the base model{with_rank} expects {want}")


@contextmanager
def _local_copy(source: str | Path) -> Iterator[Path]:
    """The adapter as a local directory: the path itself, or a temporary download of s3://."""
    text = str(source)
    if text.startswith("s3://"):
        with tempfile.TemporaryDirectory(prefix="loraplex-adapter-") as scratch:
            yield download_s3_prefix(text, Path(scratch) / "adapter")
        return
    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise AdapterError(f"{text}: file:// URIs must name a local path")
        yield Path(unquote(parsed.path))
        return
    if "://" in text:
        raise AdapterError(f"unsupported adapter location {text}; use a path, file:// or s3://")
    yield Path(source)


def download_s3_prefix(uri: str, dest_dir: Path) -> Path:
    """Download the objects under `s3://bucket/prefix/` into `dest_dir`, whole or not at all.

    The blob storage's own download (runtime.s3): a sibling temporary directory renamed to
    `dest_dir`, which must not exist. Artifacts are flat: a nested key is refused before anything
    is fetched. Uses `S3_ENDPOINT_URL` when set; credentials come from boto3's usual sources.
    """
    try:
        storage, prefix = S3Storage.at(uri, endpoint_url=platform_settings().s3_endpoint_url)
    except ServiceError as exc:
        raise AdapterError(f"{uri} does not name an adapter artifact: {exc.message}") from None
    dest_dir = Path(dest_dir)
    if dest_dir.exists():
        raise AdapterError(f"download target {dest_dir} already exists")
    try:
        storage.download_prefix(prefix, dest_dir, flat=True)
    except ServiceError as exc:
        if exc.code == "storage_prefix_not_found":
            raise AdapterError(f"no adapter at {uri}: no objects under that prefix") from None
        if exc.code == "nested_object":
            raise AdapterError(f"{exc.message}; an adapter artifact is a flat directory") from None
        raise AdapterError(f"cannot download the adapter at {uri}: {exc.message}") from None
    except (BotoCoreError, ClientError) as exc:
        raise AdapterError(f"cannot download the adapter at {uri}: {exc}") from None
    return dest_dir
