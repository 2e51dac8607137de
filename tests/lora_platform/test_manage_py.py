"""`manage.py` run by hand on settings it refuses says why in one message, not a traceback (issue
39, item 5), and on the .env `make up` writes it runs (tests/lora_platform/test_env_example.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_a_refused_setting_is_one_message_and_no_traceback(tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items()
           if name not in ("DJANGO_DEBUG", "DJANGO_SECRET_KEY", "DJANGO_SETTINGS_MODULE")}
    env.update(LORAPLEX_ENV_FILE="", LORAPLEX_VAR_DIR=str(tmp_path / "var"))
    done = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("Loraplex refuses to start: DJANGO_SECRET_KEY is the development default")
    assert "Traceback" not in done.stderr and ".env" in done.stderr
