"""The worker's command-line defaults that are settings come from the typed settings: the
environment, then the .env file (runtime/settings.py), like every other process's. Read in this
process again for each environment (`platform_settings.cache_clear()`), as a new worker process
reads them at its start, rather than in three interpreters started cold (4 s of CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.settings import platform_settings
from serving.engine.server.cli import build_parser


def defaults(env: dict[str, str]) -> list[str | None]:
    """The worker's --api-key, --registry-token and --redis-url defaults under `env` (the three
    variables unset but for what `env` gives)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("SERVING_WORKER_API_KEY", "REGISTRY_TOKEN", "REDIS_URL"):
            patch.delenv(name, raising=False)
        for name, value in env.items():
            patch.setenv(name, value)
        platform_settings.cache_clear()
        try:
            args = build_parser().parse_args(["--model", "unused"])
        finally:
            platform_settings.cache_clear()  # read again, from this process's own environment, by whoever is next
    return [args.api_key, args.registry_token, args.redis_url]


def test_a_dot_env_file_gives_the_worker_its_key_token_and_redis(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("SERVING_WORKER_API_KEY=from-dotenv\nREGISTRY_TOKEN=token-dotenv\nREDIS_URL=redis://h:1/2\n")
    assert defaults({"LORAPLEX_ENV_FILE": str(env_file)}) == ["from-dotenv", "token-dotenv", "redis://h:1/2"]
    assert defaults({"LORAPLEX_ENV_FILE": str(env_file), "SERVING_WORKER_API_KEY": "from-env"})[0] == "from-env", \
        "the environment wins over the file"
    assert defaults({"LORAPLEX_ENV_FILE": str(tmp_path / "absent")}) == [None, None, None]
