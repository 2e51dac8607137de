"""Training hyperparameters: defaults, and validation against the platform's limits.

A job stores the resolved set (defaults filled in), so what ran is always on record. Each value may
be omitted or given as "auto" (OpenAI's spelling) for its default. No Django here: the caller
passes the limits in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from serving.wire.errors import InvalidInput

ALL_LINEAR = "all-linear"
# The projections the serving engine can apply LoRA to (design.md, Engine): an adapter on anything
# else could be trained but never served. qkv_proj and gate_up_proj are Phi-3's fused ones (its
# checkpoints have no q_proj ... up_proj); "all-linear" takes those a base has.
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                            "gate_up_proj")


@dataclass(frozen=True)
class Limits:
    max_rank: int
    max_seq_length: int
    max_epochs: int = 50
    max_batch_size: int = 64


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
    # Linear warm-up over this share of the steps, then linear decay to zero.
    warmup_ratio: float = 0.03

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Hyperparameters":
        return cls(**values)


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


def _target_modules(value: Any) -> str | list[str]:
    if value == ALL_LINEAR:
        return ALL_LINEAR
    supported = ", ".join(SUPPORTED_TARGET_MODULES)
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise InvalidInput(f"Hyperparameter 'target_modules' must be \"{ALL_LINEAR}\" or a non-empty list of "
                           f"module names ({supported}).", code="invalid_hyperparameter",
                           param="hyperparameters.target_modules")
    unknown = sorted(set(value) - set(SUPPORTED_TARGET_MODULES))
    if unknown:
        raise InvalidInput(f"Unsupported target module(s) {', '.join(unknown)}; the serving engine applies LoRA to "
                           f"{supported}.", code="unsupported_target_module", param="hyperparameters.target_modules")
    return sorted(set(value), key=SUPPORTED_TARGET_MODULES.index)


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
    if multiplier is None or multiplier == "auto":
        return values
    default = Hyperparameters.learning_rate
    # The platform's bounds on learning_rate (> 0, ≤ 1) apply, stated in the multiplier's terms.
    multiplier = _number("learning_rate_multiplier", multiplier, integer=False, low=0, high=1 / default,
                         low_open=True)
    values["learning_rate"] = multiplier * default
    return values


def to_openai(values: dict[str, Any]) -> dict[str, Any]:
    """A job's resolved hyperparameters in OpenAI's shape, with ours beside them."""
    shown = {name: value for name, value in values.items() if name != "learning_rate"}
    rate = values.get("learning_rate", Hyperparameters.learning_rate)
    return {"n_epochs": shown.pop("n_epochs", None), "batch_size": shown.pop("batch_size", None),
            "learning_rate_multiplier": round(rate / Hyperparameters.learning_rate, 12), **shown}


def default_max_seq_length(limits: Limits) -> int:
    return min(Hyperparameters.max_seq_length, limits.max_seq_length)


def resolve_hyperparameters(raw: dict[str, Any] | None, limits: Limits) -> Hyperparameters:
    """The hyperparameters with defaults filled in; InvalidInput naming the first bad value."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidInput("'hyperparameters' must be an object.", param="hyperparameters")
    defaults = Hyperparameters()
    known = set(defaults.to_dict())
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidInput(f"Unknown hyperparameter(s) {', '.join(unknown)}; known ones are "
                           f"{', '.join(sorted(known))}.", code="unknown_hyperparameter",
                           param=f"hyperparameters.{unknown[0]}")
    given = {name: value for name, value in raw.items() if value is not None and value != "auto"}
    values = defaults.to_dict() | given
    # Defaults adapt to tighter limits (a shorter context, a lower max rank); given values are checked.
    if "max_seq_length" not in given:
        values["max_seq_length"] = default_max_seq_length(limits)
    if "r" not in given:
        values["r"] = min(defaults.r, limits.max_rank)
    return Hyperparameters(
        n_epochs=_number("n_epochs", values["n_epochs"], integer=True, low=1, high=limits.max_epochs),
        batch_size=_number("batch_size", values["batch_size"], integer=True, low=1, high=limits.max_batch_size),
        learning_rate=_number("learning_rate", values["learning_rate"], integer=False, low=0, high=1, low_open=True),
        max_seq_length=_number("max_seq_length", values["max_seq_length"], integer=True, low=8,
                               high=limits.max_seq_length),
        r=_number("r", values["r"], integer=True, low=1, high=limits.max_rank),
        lora_alpha=_number("lora_alpha", values["lora_alpha"], integer=False, low=0, high=4096, low_open=True),
        lora_dropout=_number("lora_dropout", values["lora_dropout"], integer=False, low=0, high=0.5),
        target_modules=_target_modules(values["target_modules"]),
        warmup_ratio=_number("warmup_ratio", values["warmup_ratio"], integer=False, low=0, high=0.5),
    )
