"""A Django process refuses to start on settings unsafe for a deployment, with an error naming the
setting: `manage.py check` in a process of its own, with the environment (or `.env`) an operator
would have (docs/operations.md, "Settings")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# The suite's development mode (tests/suite_env.py) is what these processes must not inherit.
SUITE_CHOICES = ("DJANGO_DEBUG", "DJANGO_SECRET_KEY", "DJANGO_ALLOWED_HOSTS", "LORAPLEX_ENV_FILE")


def manage_check(env: dict[str, str], env_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    base = {key: value for key, value in os.environ.items() if key not in SUITE_CHOICES}
    base["LORAPLEX_ENV_FILE"] = str(env_file) if env_file else ""
    return subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("env", "named"), [
    ({}, "DJANGO_SECRET_KEY is the development default"),
    ({"DJANGO_DEBUG": "false", "DJANGO_SECRET_KEY": "loraplex-insecure-development-key-change-me"},
     "DJANGO_SECRET_KEY is the development default"),
    ({"DJANGO_DEBUG": "true", "DJANGO_ALLOWED_HOSTS": "localhost,loraplex.example.com"},
     "DJANGO_DEBUG is true while DJANGO_ALLOWED_HOSTS names hosts others can reach (loraplex.example.com)"),
    ({"DJANGO_SECRET_KEY": "a-key-of-this-deployment", "DJANGO_ALLOWED_HOSTS": "*"},
     "DJANGO_ALLOWED_HOSTS contains '*'"),
    ({"DJANGO_DEBUG": "perhaps"}, "DJANGO_DEBUG: Input should be a valid boolean"),
], ids=["debug-unset-default-key", "default-key", "debug-public-host", "any-host", "unparsable"])
def test_the_process_refuses_to_start_naming_the_setting(env: dict[str, str], named: str) -> None:
    result = manage_check(env)
    assert result.returncode != 0
    assert named in result.stderr, result.stderr[-3000:]


def test_dot_env_is_read_and_the_environment_wins_over_it(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("DJANGO_SECRET_KEY=a-key-of-this-deployment\nDJANGO_ALLOWED_HOSTS=*\n")
    refused = manage_check({}, env_file)
    assert refused.returncode != 0 and "DJANGO_ALLOWED_HOSTS contains '*'" in refused.stderr, refused.stderr[-3000:]
    # The key comes from .env (no refusal of the default), the hosts from the environment.
    accepted = manage_check({"DJANGO_ALLOWED_HOSTS": "loraplex.example.com"}, env_file)
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert "System check identified no issues" in accepted.stdout
