"""A Django process refuses to start on settings unsafe for a deployment, with an error naming the
setting: `manage.py check` in a process of its own, with the environment (or `.env`) an operator
would have (docs/operations.md, "Settings")."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import zygote

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# The suite's development mode (tests/suite_env.py) is what these processes must not inherit.
SUITE_CHOICES = ("DJANGO_DEBUG", "DJANGO_SECRET_KEY", "DJANGO_ALLOWED_HOSTS", "LORAPLEX_ENV_FILE")


def manage_check(env: dict[str, str], env_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python manage.py check` as `python -m manage check` (the same `main()`), forked from the suite's
    zygote (tests/zygote.py), its streams in files: Django and the libraries come preloaded, while the
    settings it refuses are the project's own modules, which the zygote never imports, so each child
    reads them from its environment and `.env` as a cold one does (0.3-1.1 s of CPU each cold)."""
    base = {key: value for key, value in os.environ.items() if key not in SUITE_CHOICES}
    base["LORAPLEX_ENV_FILE"] = str(env_file) if env_file else ""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = zygote.popen([sys.executable, "-m", "manage", "check"], cwd=ROOT, env={**base, **env},
                               stdout=stdout, stderr=stderr)
        try:
            returncode = process.wait(timeout=300)
        finally:
            process.kill()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(process.args, returncode, stdout.read().decode(errors="replace"),
                                           stderr.read().decode(errors="replace"))


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
