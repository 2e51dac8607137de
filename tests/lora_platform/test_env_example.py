"""`.env.example` lists exactly the settings the models define, each with its default, so the two
cannot drift: PlatformSettings (runtime/settings.py), the gateway's GatewaySettings and
training's TrainingSettings; the only other names are those read from the environment by others
(docs/operations.md, "Settings": boto3's AWS_*, prometheus_client's, OpenMP's) and the serving
worker's flags (SERVING_WORKER_*, serving.engine.server.cli), of which it lists those an operator
most often needs (issue 39, item 5), each with a value the worker takes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest

from serving.engine.server.cli import build_parser, env_variables
from serving.gateway.config import GatewaySettings
from runtime.settings import PlatformSettings, platform_settings, settings_read
from training.conf import TrainingSettings

ROOT = Path(__file__).resolve().parents[2]
NOT_SETTINGS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "PROMETHEUS_MULTIPROC_DIR",
                "OMP_NUM_THREADS"}


def _lines() -> list[tuple[bool, str, str]]:
    """(commented out, NAME, value) of every variable line."""
    text = (ROOT / ".env.example").read_text()
    return [(bool(hash_), name, value) for hash_, name, value in
            re.findall(r"^(# ?)?([A-Z][A-Z0-9_]*)=(.*)$", text, re.MULTILINE)]


def _defined() -> set[str]:
    platform = {name.upper() for name in PlatformSettings.model_fields}
    return platform | {name for name, _ in GatewaySettings.variables()} | {name for name, _ in TrainingSettings.variables()}


def test_env_example_names_every_setting_once_and_nothing_else() -> None:
    names = [name for _, name, _ in _lines()]
    assert len(names) == len(set(names)), "a variable listed twice"
    assert not sorted(_defined() - set(names)), "settings .env.example does not list"
    assert not sorted(set(names) - _defined() - NOT_SETTINGS - set(env_variables())), "variables nobody reads"


def test_the_worker_settings_an_operator_needs_are_listed_with_values_its_flags_take(
        monkeypatch: pytest.MonkeyPatch) -> None:
    listed = {name: value for _, name, value in _lines() if name.startswith("SERVING_WORKER_")}
    for name in ("LORA_MEMORY_BYTES", "MAX_LORAS", "CPU_LORA_CACHE_BYTES", "TOOL_CALL_PARSER", "MAX_NUM_SEQS",
                 "MAX_MODEL_LEN", "GPU_MEMORY_UTILIZATION"):
        assert "SERVING_WORKER_" + name in listed, name
    for name, value in listed.items():
        if value:
            monkeypatch.setenv(name, value)
    platform_settings.cache_clear()
    try:
        parser = build_parser()  # a value it cannot take stops it, naming the variable
    finally:
        monkeypatch.undo()
        platform_settings.cache_clear()
    assert parser.get_default("lora_memory_bytes") == int(listed["SERVING_WORKER_LORA_MEMORY_BYTES"])
    assert parser.get_default("tool_call_parser") == listed["SERVING_WORKER_TOOL_CALL_PARSER"]


def test_an_uncommented_platform_line_holds_the_fields_default() -> None:
    fields = PlatformSettings.model_fields
    for commented, name, value in _lines():
        field = name.lower()
        if commented or field not in fields:
            continue
        read = getattr(cast(Any, PlatformSettings)(_env_file=None, **{field: value}), field)
        default = fields[field].default
        assert read == default or (value == "" and default in ("", [], None)), f"{name}={value}, default {default!r}"


@pytest.mark.e2e  # runs make
def test_the_env_file_make_up_writes_is_development_mode_that_manage_py_accepts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 39, item 5: manage.py run by hand reads the .env `make up` wrote, so it needs nothing more.
    for name in ("DJANGO_DEBUG", "DJANGO_SECRET_KEY", "LOG_FORMAT", "LORAPLEX_EMBEDDED_REDIS_PERSIST",
                 "LORAPLEX_DEMO_MODEL", "BASE_MODEL", "BASE_MODEL_PATH"):
        monkeypatch.delenv(name, raising=False)  # the environment wins over the file: only the file here
    for name in ("Makefile", ".env.example"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    subprocess.run(["make", "--no-print-directory", ".env"], cwd=tmp_path, check=True, capture_output=True)
    written = settings_read(tmp_path / ".env")
    assert written.django_debug and written.log_format == "text" and written.loraplex_embedded_redis_persist
    assert written.unsafe_for_deployment() == []
    assert written.loraplex_demo_model == "smollm2" and written.base_model_is_demo
