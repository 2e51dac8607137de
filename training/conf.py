"""The training pipeline's settings: a Django setting of the same name wins, else the environment.

Reading them through Django settings first lets tests override them with pytest-django's
`settings` fixture; the environment (documented in docs/training.md) configures web and workers,
read as the platform's settings read it (serving.wire.settings: the environment over `.env`).

| setting | default | meaning |
| --- | --- | --- |
| TRAINING_DATASET_MAX_BYTES | 100 MiB | largest dataset upload |
| TRAINING_DATASET_MAX_BYTES_BY_TIER | "" | per-tier overrides, `vip=1073741824,batch=52428800` |
| TRAINING_MAX_SEQ_LENGTH | 4096 | platform cap on max_seq_length (the base model's context also caps it) |
| TRAINING_MAX_WAITING_JOBS | 10 | jobs a tenant may have waiting, beyond its tier's concurrent jobs |
| TRAINING_DISPATCH_AHEAD | 1 | training tasks on the queue untaken at once; the next job is chosen, fairly between tenants, as one is taken |
| TRAINING_MAX_PENDING_UPLOADS | 10 | multi-part uploads (/v1/uploads) a tenant may have pending at once |
| TRAINING_CHECKPOINT_EVERY_STEPS | 100 | steps between checkpoints |
| TRAINING_CHECKPOINTS_KEPT | 2 | newest checkpoints kept per job |
| TRAINING_LOG_EVERY_STEPS | 10 | steps between metrics events |
| TRAINING_LEASE_SECONDS | 60 | a running job whose worker has not reported for this long is taken over (the sweep re-sends it after two) |
| TRAINING_VALIDATION_TIMEOUT_SECONDS | 600 | the time one dataset file's validation may take; past it, the file is invalid |
| TRAINING_SCRATCH_DIR | $TMPDIR/loraplex-training | where runs unpack their dataset and checkpoints (swept at worker start) |
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from django.conf import settings

from serving.wire.settings import platform_settings
from training.hyperparameters import Limits, default_max_seq_length

_DEFAULTS: dict[str, int] = {
    "TRAINING_DATASET_MAX_BYTES": 100 * 1024 * 1024,
    "TRAINING_MAX_SEQ_LENGTH": 4096,
    "TRAINING_MAX_WAITING_JOBS": 10,
    # More would choose jobs before a worker needs one, when fewer tenants are waiting (training.concurrency).
    "TRAINING_DISPATCH_AHEAD": 1,
    "TRAINING_MAX_PENDING_UPLOADS": 10,
    "TRAINING_CHECKPOINT_EVERY_STEPS": 100,
    "TRAINING_CHECKPOINTS_KEPT": 2,
    "TRAINING_LOG_EVERY_STEPS": 10,
    "TRAINING_LEASE_SECONDS": 60,
    # 100 MiB (the default upload limit) of short chat examples checks in about 5 minutes on the 2-core
    # host (0.33 MiB/s measured with the tiny tokenizer; longer examples check faster per byte).
    "TRAINING_VALIDATION_TIMEOUT_SECONDS": 600,
}


def _value(name: str) -> str | None:
    configured = getattr(settings, name, None)
    if configured is not None:
        return str(configured)
    return platform_settings().environ.get(name) or None


def setting_int(name: str) -> int:
    raw = _value(name)
    if raw is None:
        return _DEFAULTS[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def dataset_max_bytes(tier_name: str) -> int:
    """The largest dataset a tenant of this tier may upload."""
    overrides = _value("TRAINING_DATASET_MAX_BYTES_BY_TIER") or ""
    for item in overrides.split(","):
        tier, _, limit = item.partition("=")
        if tier.strip() == tier_name and limit.strip():
            return int(limit)
    return setting_int("TRAINING_DATASET_MAX_BYTES")


def scratch_dir() -> Path:
    """The directory training runs keep their local files in, one folder per run."""
    return Path(_value("TRAINING_SCRATCH_DIR") or Path(tempfile.gettempdir()) / "loraplex-training")


def _base_max_positions() -> int | None:
    try:
        config = json.loads((Path(settings.BASE_MODEL_PATH) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return positions if isinstance(positions, int) else None


def limits() -> Limits:
    """The platform's limits on hyperparameters: the settings', capped by the base model's context."""
    cap = setting_int("TRAINING_MAX_SEQ_LENGTH")
    positions = _base_max_positions()
    return Limits(max_rank=settings.MAX_LORA_RANK, max_seq_length=min(cap, positions) if positions else cap)


def max_seq_length_default() -> int:
    """The max_seq_length a job gets when it names none (validation counts tokens with it too)."""
    return default_max_seq_length(limits())
