"""Training hyperparameters: defaults, validation against the platform's limits, and "auto".

A job stores the resolved set (defaults filled in), so what ran is always on record. A value
omitted takes its default. "auto" (OpenAI's spelling) takes the default too, except for
`n_epochs`, `batch_size` and `learning_rate_multiplier`: those are picked from the number of
training examples (`fit_to_dataset`, the rule in docs/training.md), once it is known; until then
the set names them in `auto`. The training method (`supervised` or `dpo`, with DPO's `beta`) is
part of the set, so the fingerprint a checkpoint is resumed by covers it. No Django here: the
caller passes the limits in.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from serving.contracts.errors import InvalidInput
from training.int4_layout import INT4

ALL_LINEAR = "all-linear"
# The projections the serving engine can apply LoRA to (design.md, Engine): an adapter on anything
# else could be trained but never served. qkv_proj and gate_up_proj are Phi-3's fused ones (its
# checkpoints have no q_proj ... up_proj); "all-linear" takes those a base has.
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                            "gate_up_proj")
# The vocabulary modules LoRA may also adapt, named in a list (never part of "all-linear", which
# leaves them out as PEFT's does): the engine serves them per row of a batch (docs/adapter-kinds.md,
# "Vocabulary modules") on bases that keep lm_head apart from embed_tokens.
VOCABULARY_MODULES = ("embed_tokens", "lm_head")
SUPERVISED = "supervised"
DPO = "dpo"
METHODS = (SUPERVISED, DPO)
SCHEDULES = ("linear", "cosine", "constant")
# The frozen base's precision: as loaded ("none": bf16 on CUDA, fp32 on CPU), or QLoRA's INT4 projections.
BASE_QUANTIZATIONS = ("none", INT4)
# The names "auto" picks from the dataset's size (OpenAI's three); any other "auto" is its default.
AUTO_NAMES = ("n_epochs", "batch_size", "learning_rate")
# Names set by the method (OpenAI's `method` object), not among a supervised job's hyperparameters.
METHOD_NAMES = ("method", "beta")


@dataclass(frozen=True)
class Limits:
    max_rank: int
    max_seq_length: int
    max_epochs: int = 50
    max_batch_size: int = 64
    # A job's ranks run on one host (training.distributed); the tenant's tier may allow fewer.
    max_gpus: int = 8
    # The SUPPORTED_TARGET_MODULES the base model has (training.conf.base_target_modules).
    target_modules: tuple[str, ...] = SUPPORTED_TARGET_MODULES
    # Why the base's projections cannot be held in INT4 (training.int4_layout); None: they can.
    int4_problem: str | None = None
    # Why adapters on the base's VOCABULARY_MODULES would not be served (training.conf); None: they would.
    vocabulary_problem: str | None = None


@dataclass(frozen=True)
class Hyperparameters:
    n_epochs: int = 3
    batch_size: int = 4
    learning_rate: float = 2e-4
    max_seq_length: int = 1024
    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    # "all-linear" or a list of SUPPORTED_TARGET_MODULES.
    target_modules: str | list[str] = field(default=ALL_LINEAR)
    # Linear warm-up over this share of the steps, then the schedule (training.schedules).
    warmup_ratio: float = 0.03
    lr_scheduler_type: str = "linear"
    # AdamW's decoupled decay, on the LoRA matrices only (never on biases or norms).
    weight_decay: float = 0.0
    # A step's batch_size examples go through the model in this many micro-batches (one optimizer step).
    gradient_accumulation_steps: int = 1
    # Recompute activations in the backward pass: far less memory for about a third more compute.
    gradient_checkpointing: bool = False
    # Several examples per row of up to max_seq_length tokens, each attending only to itself.
    packing: bool = False
    # DoRA (PEFT's use_dora, a Loraplex extension to OpenAI's API): each adapted projection also learns a
    # magnitude per output feature; the engine serves it beside plain LoRA (docs/adapter-kinds.md).
    use_dora: bool = False
    # QLoRA (a Loraplex extension): "int4" trains the adapter over the base's projections quantized to
    # INT4 (training.int4_base), a quarter of their memory; the adapter is the same PEFT artifact.
    base_quantization: str = "none"
    method: str = SUPERVISED
    # DPO's temperature: how far the adapter may move from the base (the reference) to fit the preferences.
    beta: float = 0.1
    # GPUs (ranks) the job trains on, within its tenant's tier's max_gpus_per_job (a Loraplex extension):
    # the same global batch split over them, so the adapter is the same to float rounding.
    gpus: int = 1
    # Names still to be picked from the dataset (fit_to_dataset); empty once the job's data is known.
    auto: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Hyperparameters":
        return cls(**values)

    @property
    def micro_batch_size(self) -> int:
        return math.ceil(self.batch_size / self.gradient_accumulation_steps)


def _number(name: str, value: Any, *, integer: bool, low: float, high: float, low_open: bool = False) -> Any:
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise InvalidInput(f"Hyperparameter '{name}' must be {kind}, got {value!r}.",
                           code="invalid_hyperparameter", param=f"hyperparameters.{name}")
    value = int(value) if integer else float(value)
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        low_text = f"greater than {low:g}" if low_open else f"at least {low:g}"
        raise InvalidInput(f"Hyperparameter '{name}' is {value:g}; it must be {low_text} and at most {high:g}.",
                           code="hyperparameter_out_of_range", param=f"hyperparameters.{name}")
    return value


def _target_modules(value: Any, limits: Limits, *, use_dora: bool) -> str | list[str]:
    """"all-linear", or the named modules: each a projection the serving engine supports and the base
    has (`limits.target_modules`), or a vocabulary module where the engine would serve it."""
    if value == ALL_LINEAR:
        return ALL_LINEAR
    supported = ", ".join(limits.target_modules)
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise InvalidInput(f"Hyperparameter 'target_modules' must be \"{ALL_LINEAR}\" or a non-empty list of "
                           f"module names ({supported}, {', '.join(VOCABULARY_MODULES)}).",
                           code="invalid_hyperparameter", param="hyperparameters.target_modules")
    known = SUPPORTED_TARGET_MODULES + VOCABULARY_MODULES
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise InvalidInput(f"Unsupported target module(s) {', '.join(unknown)}; the serving engine applies LoRA to "
                           f"{', '.join(known)}.", code="unsupported_target_module",
                           param="hyperparameters.target_modules")
    vocabulary = [module for module in VOCABULARY_MODULES if module in value]
    refusal = limits.vocabulary_problem if vocabulary else None
    if vocabulary and use_dora:
        # PEFT's DoRA on an embedding is not what the engine's DoRA epilogue computes.
        refusal = "use_dora (DoRA adapters are served on the projections only)"
    if refusal is not None:
        raise InvalidInput(f"LoRA on {', '.join(vocabulary)} cannot be trained here: {refusal}.",
                           code="unsupported_target_module", param="hyperparameters.target_modules")
    absent = sorted(set(value) - set(limits.target_modules) - set(VOCABULARY_MODULES))
    if absent:
        raise InvalidInput(f"The base model has no {', '.join(absent)}; its projections are {supported}.",
                           code="unsupported_target_module", param="hyperparameters.target_modules")
    return sorted(set(value), key=known.index)


# OpenAI's names for what a fine-tuning job takes; its `learning_rate_multiplier` scales our default rate.
OPENAI_NAMES = ("n_epochs", "batch_size", "learning_rate_multiplier")


def from_openai(raw: Any) -> dict[str, Any] | None:
    """OpenAI's `hyperparameters` in our names: `learning_rate_multiplier` × the default learning rate.

    Our own names (r, lora_alpha, target_modules, …) pass through as extra fields, to be checked by
    resolve_hyperparameters like any others; `learning_rate` and `learning_rate_multiplier`
    together are refused, as they would contradict each other.
    """
    if raw is None or not isinstance(raw, dict) or "learning_rate_multiplier" not in raw:
        return raw
    values = dict(raw)
    multiplier = values.pop("learning_rate_multiplier")
    if "learning_rate" in values:
        raise InvalidInput("Give either 'learning_rate_multiplier' or 'learning_rate', not both.",
                           code="invalid_hyperparameter", param="hyperparameters.learning_rate_multiplier")
    if multiplier is None:
        return values
    if multiplier == "auto":
        values["learning_rate"] = "auto"
        return values
    default = Hyperparameters.learning_rate
    # The platform's bounds on learning_rate (> 0, ≤ 1) apply, stated in the multiplier's terms.
    multiplier = _number("learning_rate_multiplier", multiplier, integer=False, low=0, high=1 / default,
                         low_open=True)
    values["learning_rate"] = multiplier * default
    return values


def to_openai(values: dict[str, Any]) -> dict[str, Any]:
    """A job's resolved hyperparameters in OpenAI's shape, with ours beside them ("auto" for a value
    still to be picked from the dataset); the method's own are in method_object."""
    pending = set(values.get("auto", ()))
    shown = {name: value for name, value in values.items()
             if name not in ("learning_rate", "auto", *METHOD_NAMES)}
    rate = values.get("learning_rate", Hyperparameters.learning_rate)
    multiplier = "auto" if "learning_rate" in pending else round(rate / Hyperparameters.learning_rate, 12)
    epochs, batch_size = shown.pop("n_epochs", None), shown.pop("batch_size", None)
    return {"n_epochs": "auto" if "n_epochs" in pending else epochs,
            "batch_size": "auto" if "batch_size" in pending else batch_size,
            "learning_rate_multiplier": multiplier, **shown}


def method_object(values: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `method` of a job: its type and that type's hyperparameters (DPO's with its beta)."""
    shown = to_openai(values)
    if values.get("method", SUPERVISED) == DPO:
        return {"type": DPO, DPO: {"hyperparameters": {**shown, "beta": values.get("beta", Hyperparameters.beta)}}}
    return {"type": SUPERVISED, SUPERVISED: {"hyperparameters": shown}}


def default_max_seq_length(limits: Limits) -> int:
    return min(Hyperparameters.max_seq_length, limits.max_seq_length)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidInput(f"Hyperparameter '{name}' is {value!r}; it must be one of {', '.join(choices)}.",
                           code="invalid_hyperparameter", param=f"hyperparameters.{name}")
    return str(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"Hyperparameter '{name}' must be true or false, got {value!r}.",
                           code="invalid_hyperparameter", param=f"hyperparameters.{name}")
    return value


def _base_quantization(value: Any, *, use_dora: bool, gpus: int, limits: Limits) -> str:
    """The job's base_quantization, refused (naming why) with what an INT4 base cannot train."""
    quantization = _choice("base_quantization", value, BASE_QUANTIZATIONS)
    if quantization != INT4:
        return quantization
    refusals = []
    if use_dora:
        # PEFT's DoRA takes the norm of W0 + BA, which needs the base weight in floats, and the engine
        # refuses DoRA adapters on quantized bases.
        refusals.append("use_dora (DoRA needs the base weights in floats; train DoRA on the bf16 base)")
    if gpus != 1:
        refusals.append(f"gpus {gpus} (a QLoRA job trains on one GPU: the sharded several-GPU base is bf16)")
    if limits.int4_problem is not None:
        refusals.append(f"this base model ({limits.int4_problem})")
    if refusals:
        raise InvalidInput(f"base_quantization \"int4\" (QLoRA) cannot be combined with {'; '.join(refusals)}.",
                           code="unsupported_base_quantization", param="hyperparameters.base_quantization")
    return quantization


def resolve_hyperparameters(raw: dict[str, Any] | None, limits: Limits) -> Hyperparameters:
    """The hyperparameters with defaults filled in; InvalidInput naming the first bad value.

    "auto" for one of AUTO_NAMES leaves it to fit_to_dataset (named in `auto`, its default meanwhile).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidInput("'hyperparameters' must be an object.", param="hyperparameters")
    defaults = Hyperparameters()
    known = set(defaults.to_dict()) - {"auto"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidInput(f"Unknown hyperparameter(s) {', '.join(unknown)}; known ones are "
                           f"{', '.join(sorted(known - set(METHOD_NAMES)))}.", code="unknown_hyperparameter",
                           param=f"hyperparameters.{unknown[0]}")
    given = {name: value for name, value in raw.items() if value is not None and value != "auto"}
    values = defaults.to_dict() | given
    # Defaults adapt to tighter limits (a shorter context, a lower max rank); given values are checked.
    if "max_seq_length" not in given:
        values["max_seq_length"] = default_max_seq_length(limits)
    if "r" not in given:
        values["r"] = min(defaults.r, limits.max_rank)
    method = _choice("method", values["method"], METHODS)
    if method != DPO and "beta" in given:
        raise InvalidInput("'beta' is a hyperparameter of DPO; give it in method.dpo.hyperparameters with method "
                           "type \"dpo\".", code="invalid_hyperparameter", param="hyperparameters.beta")
    batch_size = _number("batch_size", values["batch_size"], integer=True, low=1, high=limits.max_batch_size)
    accumulation = _number("gradient_accumulation_steps", values["gradient_accumulation_steps"], integer=True, low=1,
                           high=limits.max_batch_size)
    if accumulation > batch_size and raw.get("batch_size") != "auto":
        raise InvalidInput(f"gradient_accumulation_steps ({accumulation}) splits a step's batch_size ({batch_size}) "
                           "examples into micro-batches; it must be at most batch_size.",
                           code="hyperparameter_out_of_range", param="hyperparameters.gradient_accumulation_steps")
    use_dora = _flag("use_dora", values["use_dora"])
    gpus = _number("gpus", values["gpus"], integer=True, low=1, high=limits.max_gpus)
    base_quantization = _base_quantization(values["base_quantization"], use_dora=use_dora, gpus=gpus, limits=limits)
    return Hyperparameters(
        n_epochs=_number("n_epochs", values["n_epochs"], integer=True, low=1, high=limits.max_epochs),
        batch_size=batch_size,
        learning_rate=_number("learning_rate", values["learning_rate"], integer=False, low=0, high=1, low_open=True),
        max_seq_length=_number("max_seq_length", values["max_seq_length"], integer=True, low=8,
                               high=limits.max_seq_length),
        r=_number("r", values["r"], integer=True, low=1, high=limits.max_rank),
        lora_alpha=_number("lora_alpha", values["lora_alpha"], integer=False, low=0, high=4096, low_open=True),
        lora_dropout=_number("lora_dropout", values["lora_dropout"], integer=False, low=0, high=0.5),
        target_modules=_target_modules(values["target_modules"], limits, use_dora=use_dora),
        warmup_ratio=_number("warmup_ratio", values["warmup_ratio"], integer=False, low=0, high=0.5),
        lr_scheduler_type=_choice("lr_scheduler_type", values["lr_scheduler_type"], SCHEDULES),
        weight_decay=_number("weight_decay", values["weight_decay"], integer=False, low=0, high=1),
        gradient_accumulation_steps=accumulation,
        gradient_checkpointing=_flag("gradient_checkpointing", values["gradient_checkpointing"]),
        packing=_flag("packing", values["packing"]),
        use_dora=use_dora,
        base_quantization=base_quantization,
        method=method,
        beta=_number("beta", values["beta"], integer=False, low=0, high=100, low_open=True),
        gpus=gpus,
        auto=[name for name in AUTO_NAMES if raw.get(name) == "auto"],
    )


# OpenAI's rule for n_epochs (its fine-tuning data-preparation guide): about 3 epochs, but at least
# 100 and at most 25,000 examples seen in all, within 1–25 epochs.
TARGET_EPOCHS = 3
MIN_TARGET_EXAMPLES = 100
MAX_TARGET_EXAMPLES = 25_000
MAX_AUTO_EPOCHS = 25
# batch_size: about 0.2 % of the examples (OpenAI's), never under our default of 4 (smaller batches
# leave a GPU idle and make LoRA's steps noisy); the learning rate grows as √(batch / 4).
AUTO_BATCH_SHARE = 0.002
MIN_AUTO_BATCH = 4
# A small set trains in few steps (36 examples: 27), too few for the default rate to move the
# adapter: the demo's 36 facts taught 0 of 6 held-out facts at 2e-4 and 6 of 6 at 10 × (measured,
# docs/training.md). So under SMALL_SET_EXAMPLES the rate is raised by SMALL_SET_EXAMPLES / n, at
# most SMALL_SET_MAX_BOOST (10 × from 100 examples down, 1 × from 1,000 up).
SMALL_SET_EXAMPLES = 1_000
SMALL_SET_MAX_BOOST = 10.0


def fit_to_dataset(hp: Hyperparameters, num_examples: int, limits: Limits) -> Hyperparameters:
    """`hp` with the names in its `auto` picked for `num_examples` training examples (docs/training.md)."""
    if not hp.auto:
        return hp
    picked: dict[str, Any] = {}
    count = max(1, num_examples)
    if "n_epochs" in hp.auto:
        epochs = TARGET_EPOCHS
        if count * TARGET_EPOCHS < MIN_TARGET_EXAMPLES:
            epochs = min(MAX_AUTO_EPOCHS, MIN_TARGET_EXAMPLES // count)
        elif count * TARGET_EPOCHS > MAX_TARGET_EXAMPLES:
            epochs = max(1, MAX_TARGET_EXAMPLES // count)
        picked["n_epochs"] = min(epochs, limits.max_epochs)
    batch_size = hp.batch_size
    if "batch_size" in hp.auto:
        batch_size = min(limits.max_batch_size, max(MIN_AUTO_BATCH, round(count * AUTO_BATCH_SHARE)))
        picked["batch_size"] = batch_size
    if "learning_rate" in hp.auto:
        small_set_boost = min(SMALL_SET_MAX_BOOST, max(1.0, SMALL_SET_EXAMPLES / count))
        picked["learning_rate"] = (Hyperparameters.learning_rate * math.sqrt(batch_size / MIN_AUTO_BATCH)
                                   * small_set_boost)
    return replace(hp, auto=[], **picked)
