"""OpenAI's `method` of a fine-tuning job, and which dataset format each method trains on.

    "method": {"type": "supervised", "supervised": {"hyperparameters": {...}}}
    "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, ...}}}

The legacy top-level `hyperparameters` keep working (for either type). The method becomes part of
the job's hyperparameters (`method`, and `beta` for DPO; training.hyperparameters), so the job
records it and its checkpoints' fingerprint covers it. A supervised job trains on a chat,
completion or text file; a DPO job on a preference file (training.preference). No Django here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from serving.contracts.errors import InvalidInput
from training.examples import encode_example
from training.hyperparameters import DPO, METHODS, SUPERVISED, Hyperparameters
from training.preference import PREFERENCE, TrainItem, encode, iter_valid_pairs
from training.validation import iter_valid_examples


def requested_hyperparameters(body: dict[str, Any]) -> Any:
    """The job's raw hyperparameters (OpenAI's names) from `hyperparameters` and `method`, with the method's own."""
    method = body.get("method")
    given = body.get("hyperparameters")
    if method is None:
        return given
    if not isinstance(method, dict):
        raise InvalidInput("'method' must be an object like {\"type\": \"supervised\", \"supervised\": {…}}.",
                           param="method")
    kind = method.get("type")
    if kind not in METHODS:
        raise InvalidInput(f"method.type {kind!r} is not offered; use one of {', '.join(METHODS)} (LoRA on the base "
                           "model).", code="unsupported_method", param="method.type")
    extra = sorted(set(method) - {"type", kind})
    if extra:
        raise InvalidInput(f"Unrecognized field(s) in 'method' of type {kind!r}: {', '.join(extra)}.",
                           code="unknown_parameter", param=f"method.{extra[0]}")
    settings = method.get(kind) or {}
    if not isinstance(settings, dict) or set(settings) - {"hyperparameters"}:
        raise InvalidInput(f"'method.{kind}' takes only 'hyperparameters'.", code="unknown_parameter",
                           param=f"method.{kind}")
    nested = settings.get("hyperparameters")
    if nested is not None and given is not None and nested != given:
        raise InvalidInput(f"Give the hyperparameters once: in 'method.{kind}.hyperparameters' or in "
                           "'hyperparameters'.", param="hyperparameters")
    chosen = nested if nested is not None else given
    if chosen is not None and not isinstance(chosen, dict):
        raise InvalidInput("'hyperparameters' must be an object.", param=f"method.{kind}.hyperparameters")
    if chosen is not None and "method" in chosen:
        raise InvalidInput("The method is 'method.type', not a hyperparameter.", code="unknown_hyperparameter",
                           param="hyperparameters.method")
    if kind == SUPERVISED:
        return chosen
    return {**(chosen or {}), "method": DPO}


def dataset_problem(method: str, dataset_format: str) -> str | None:
    """Why a file of `dataset_format` cannot train a job of `method`; None when it can."""
    if method == DPO and dataset_format != PREFERENCE:
        return (f"A DPO job trains on a preference file ({{\"input\", \"preferred_output\", \"non_preferred_output\"}} "
                f"lines), not a {dataset_format} file.")
    if method != DPO and dataset_format == PREFERENCE:
        return "A preference file trains a DPO job (method type \"dpo\"), not a supervised one."
    return None


def encode_lines(lines: Iterable[bytes], dataset_format: str, hp: Hyperparameters, tokenizer: Any) -> list[TrainItem]:
    """A validated file's examples encoded for the job's method: sequences, or DPO's pairs. ValueError
    (or training.examples.EncodingError) when the file cannot train the job."""
    problem = dataset_problem(hp.method, dataset_format)
    if problem is not None:
        raise ValueError(problem)
    if hp.method == DPO:
        return [encode(example, tokenizer, hp.max_seq_length) for example in iter_valid_pairs(lines)]
    return [encode_example(example, tokenizer, hp.max_seq_length)
            for example in iter_valid_examples(lines, dataset_format)]
