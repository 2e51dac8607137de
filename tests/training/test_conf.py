"""training/conf.py's TrainingSettings: one model, each default written once as its field's;
.env.example lists exactly its TRAINING_* variables with those defaults; a Django setting of a
variable's name wins over the environment (tests' overrides)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training import conf
from training.conf import TrainingSettings

ROOT = Path(__file__).resolve().parents[2]


def _documented() -> dict[str, str]:
    text = (ROOT / ".env.example").read_text()
    return dict(re.findall(r"^#? ?(TRAINING_[A-Z_]+)=(\S*)$", text, re.MULTILINE))


def test_env_example_lists_exactly_the_training_variables_with_their_defaults() -> None:
    documented = _documented()
    assert sorted(documented) == sorted(name for name, _ in TrainingSettings.variables())
    # TRAINING_SCRATCH_DIR's line is an example path (commented out); the others are the defaults.
    documented.pop("TRAINING_SCRATCH_DIR")
    assert TrainingSettings.from_environ(documented) == TrainingSettings()


def test_a_django_setting_wins_over_the_environment(settings, monkeypatch) -> None:
    monkeypatch.setitem(conf.platform_settings().environ, "TRAINING_LEASE_SECONDS", "7")  # type: ignore[index]
    assert conf.setting_int("TRAINING_LEASE_SECONDS") == 7
    settings.TRAINING_LEASE_SECONDS = 3
    assert conf.setting_int("TRAINING_LEASE_SECONDS") == 3


def test_per_tier_dataset_limits_and_a_bad_value_names_its_variable(settings) -> None:
    settings.TRAINING_DATASET_MAX_BYTES = 1000
    settings.TRAINING_DATASET_MAX_BYTES_BY_TIER = "vip=5000, batch=300,"
    assert (conf.dataset_max_bytes("vip"), conf.dataset_max_bytes("batch"), conf.dataset_max_bytes("free")) == \
        (5000, 300, 1000)
    settings.TRAINING_DATASET_MAX_BYTES_BY_TIER = "vip=lots"
    with pytest.raises(ValueError, match="TRAINING_DATASET_MAX_BYTES_BY_TIER"):
        conf.dataset_max_bytes("vip")
    settings.TRAINING_DATASET_MAX_BYTES_BY_TIER = ""
    settings.TRAINING_CHECKPOINTS_KEPT = "two"
    with pytest.raises(ValueError, match="TRAINING_CHECKPOINTS_KEPT must be an integer, got 'two'"):
        conf.setting_int("TRAINING_CHECKPOINTS_KEPT")
