"""The training pipeline's settings: one pydantic model, `TrainingSettings`, each field naming its
variable and default once (runtime.env.EnvModel, the gateway's style).

They are read from the environment as the platform's settings read it (runtime.settings: the
environment over `.env`), with a Django setting of the same name winning, so that tests override
one with pytest-django's `settings` fixture; .env.example documents every variable with the default
written below (tests/training/test_conf.py holds the two together), docs/training.md what each does.
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from django.conf import settings
from pydantic import field_validator
from safetensors import SafetensorError, safe_open

from runtime.env import EnvModel, env
from runtime.settings import platform_settings
from training.hyperparameters import SUPPORTED_TARGET_MODULES, Limits, default_max_seq_length
from training.int4_layout import layout_problem


class TrainingSettings(EnvModel):
    """Every training setting; each field is its variable without TRAINING_, lower-case."""

    # Largest dataset upload in bytes (enforced while it streams), and per-tier overrides written
    # as tier=bytes pairs (`vip=1073741824,batch=52428800`).
    dataset_max_bytes: int = env(100 * 1024 * 1024, "TRAINING_DATASET_MAX_BYTES")
    dataset_max_bytes_by_tier: dict[str, int] = env({}, "TRAINING_DATASET_MAX_BYTES_BY_TIER")
    # Platform cap on a job's max_seq_length (the base model's context caps it too).
    max_seq_length: int = env(4096, "TRAINING_MAX_SEQ_LENGTH")
    # Jobs a tenant may have waiting, beyond its tier's concurrent jobs.
    max_waiting_jobs: int = env(10, "TRAINING_MAX_WAITING_JOBS")
    # Training tasks on the queue untaken at once; the next job is chosen, fairly between tenants, as
    # one is taken. More would choose jobs before a worker needs one, when fewer tenants are waiting
    # (training.concurrency).
    dispatch_ahead: int = env(1, "TRAINING_DISPATCH_AHEAD")
    # Multi-part uploads (/v1/uploads) a tenant may have pending at once.
    max_pending_uploads: int = env(10, "TRAINING_MAX_PENDING_UPLOADS")
    checkpoint_every_steps: int = env(100, "TRAINING_CHECKPOINT_EVERY_STEPS")
    checkpoints_kept: int = env(2, "TRAINING_CHECKPOINTS_KEPT")
    log_every_steps: int = env(10, "TRAINING_LOG_EVERY_STEPS")
    # A running job whose worker has not reported for this long is taken over (the sweep re-sends it
    # after two).
    lease_seconds: int = env(60, "TRAINING_LEASE_SECONDS")
    # The time one dataset file's validation may take; past it, the file is invalid. 100 MiB (the
    # default upload limit) of short chat examples checks in about 5 minutes on the 2-core host
    # (0.33 MiB/s measured with the tiny tokenizer; longer examples check faster per byte).
    validation_timeout_seconds: int = env(600, "TRAINING_VALIDATION_TIMEOUT_SECONDS")
    # Where runs unpack their dataset and checkpoints, one folder per run (swept at worker start);
    # None: $TMPDIR/loraplex-training.
    scratch_dir: Path | None = env(None, "TRAINING_SCRATCH_DIR")

    @field_validator("dataset_max_bytes_by_tier", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        pairs = [item.partition("=") for item in value.split(",") if item.strip()]
        return {tier.strip(): limit.strip() for tier, _, limit in pairs if limit.strip()}


def training_settings() -> TrainingSettings:
    """The settings now: Django's setting of a variable's name over the platform's environment
    (read on each call, so a test's override counts)."""
    environ = dict(platform_settings().environ)
    for name, _ in TrainingSettings.variables():
        configured = getattr(settings, name, None)
        if configured is not None:
            environ[name] = str(configured)
    return TrainingSettings.from_environ(environ)


def setting_int(name: str) -> int:
    """The integer setting of variable `name` (TRAINING_LEASE_SECONDS is the field lease_seconds)."""
    value = getattr(training_settings(), name.removeprefix("TRAINING_").lower())
    if not isinstance(value, int):
        raise TypeError(f"{name} is not an integer setting")
    return value


def dataset_max_bytes(tier_name: str) -> int:
    """The largest dataset a tenant of this tier may upload."""
    read = training_settings()
    return read.dataset_max_bytes_by_tier.get(tier_name, read.dataset_max_bytes)


def scratch_dir() -> Path:
    """The directory training runs keep their local files in, one folder per run."""
    return training_settings().scratch_dir or Path(tempfile.gettempdir()) / "loraplex-training"


def _base_config() -> dict[str, Any]:
    """The base model's config.json ({} when it cannot be read: the trainer then says what is wrong)."""
    try:
        config = json.loads((Path(settings.BASE_MODEL_PATH) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _base_max_positions() -> int | None:
    positions = _base_config().get("max_position_embeddings")
    return positions if isinstance(positions, int) else None


def base_vocabulary_problem() -> str | None:
    """Why LoRA on the base's embed_tokens / lm_head would not be served (serving.engine.lora.reader
    refuses it where the two matrices are one); None where it would."""
    if _base_config().get("tie_word_embeddings"):
        return ("the base model ties lm_head to embed_tokens (tie_word_embeddings), and adapters on the "
                "vocabulary modules are served only on bases that keep them apart")
    return None


def _weight_files(model_dir: Path) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((str(path), path.stat().st_mtime) for path in model_dir.glob("*.safetensors")))


@lru_cache(maxsize=4)
def _modules_of(files: tuple[tuple[str, float], ...]) -> tuple[str, ...]:
    """The SUPPORTED_TARGET_MODULES among the weights' names (`model.layers.0.self_attn.q_proj.weight`):
    read from the files' headers only, so the web process needs neither torch nor the model."""
    present: set[str] = set()
    for name, _ in files:
        with safe_open(name, framework="numpy") as reader:
            present.update(key.rsplit(".", 2)[-2] for key in reader.keys() if key.count(".") >= 2)
    return tuple(module for module in SUPPORTED_TARGET_MODULES if module in present)


def base_target_modules() -> tuple[str, ...]:
    """The projections of the base model that LoRA may target (the trainer's "all-linear" takes these).
    A base without safetensors weights (or unreadable ones) is not checked here: every supported name,
    and the trainer says at setup which the model lacks."""
    files = _weight_files(Path(settings.BASE_MODEL_PATH))
    try:
        found = _modules_of(files) if files else ()
    except (OSError, ValueError, SafetensorError):
        found = ()
    return found or SUPPORTED_TARGET_MODULES


@lru_cache(maxsize=4)
def _projection_shapes(files: tuple[tuple[str, float], ...]) -> dict[str, tuple[int, int]]:
    """{projection name: (out, in)} of the decoder layers' 2-D weights (`model.layers.0.mlp.up_proj.weight`),
    from the files' headers only."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, _ in files:
        with safe_open(name, framework="numpy") as reader:
            for key in reader.keys():
                if ".layers." in key and key.endswith(".weight"):
                    shape = reader.get_slice(key).get_shape()
                    if len(shape) == 2:
                        shapes[key.rsplit(".", 2)[-2]] = (int(shape[0]), int(shape[1]))
    return shapes


def base_int4_problem() -> str | None:
    """Why the base's projections cannot be quantized for a QLoRA job (training.int4_layout); None when
    they can, or when the base has no readable safetensors (the trainer then checks as it quantizes)."""
    files = _weight_files(Path(settings.BASE_MODEL_PATH))
    try:
        shapes = _projection_shapes(files) if files else {}
    except (OSError, ValueError, SafetensorError):
        shapes = {}
    return layout_problem(shapes)


def limits() -> Limits:
    """The platform's limits on hyperparameters: the settings', capped by the base model's context and
    its projections (which also say whether a QLoRA job can quantize them)."""
    cap = training_settings().max_seq_length
    positions = _base_max_positions()
    return Limits(max_rank=settings.MAX_LORA_RANK, max_seq_length=min(cap, positions) if positions else cap,
                  target_modules=base_target_modules(), int4_problem=base_int4_problem(),
                  vocabulary_problem=base_vocabulary_problem())


def max_seq_length_default() -> int:
    """The max_seq_length a job gets when it names none (validation counts tokens with it too)."""
    return default_max_seq_length(limits())
