"""The worker's command-line defaults that are settings come from the typed settings: the
environment, then the .env file (runtime/settings.py), like every other process's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]
PRINT_DEFAULTS = (
    "from serving.engine.server.cli import build_parser; "
    "a = build_parser().parse_args(['--model', 'unused']); print(a.api_key, a.registry_token, a.redis_url)"
)


def defaults(env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("SERVING_WORKER_API_KEY", "REGISTRY_TOKEN", "REDIS_URL")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", PRINT_DEFAULTS], env={**clean, **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return done.stdout.split()


def test_a_dot_env_file_gives_the_worker_its_key_token_and_redis(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("SERVING_WORKER_API_KEY=from-dotenv\nREGISTRY_TOKEN=token-dotenv\nREDIS_URL=redis://h:1/2\n")
    assert defaults({"LORAPLEX_ENV_FILE": str(env_file)}) == ["from-dotenv", "token-dotenv", "redis://h:1/2"]
    assert defaults({"LORAPLEX_ENV_FILE": str(env_file), "SERVING_WORKER_API_KEY": "from-env"})[0] == "from-env", \
        "the environment wins over the file"
    assert defaults({"LORAPLEX_ENV_FILE": str(tmp_path / "absent")}) == ["None", "None", "None"]
