"""docker-compose.yml keeps the serving worker private (docs/security.md): no published port, and the
web app and the serving worker run with one generated key. No Docker here, so the file is read and
its key-sharing shell snippets are run with sh exactly as the containers would run them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def unescape(argument: str) -> str:
    """Compose's `$$` is a literal `$` for the shell."""
    return argument.replace("$$", "$")


def run_with_worker_key(service: str, env: dict[str, str], secrets: Path) -> subprocess.CompletedProcess:
    entrypoint = [unescape(part).replace("/secrets/", f"{secrets}/") for part in SERVICES[service]["entrypoint"]]
    return subprocess.run([*entrypoint, "sh", "-c", 'printf %s "$SERVING_WORKER_API_KEY"'],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)


def test_no_serving_worker_port_is_published_and_only_the_web_app_is_reachable() -> None:
    published = {name for name, service in SERVICES.items() if service.get("ports")}
    assert "serving-worker" not in published
    assert "web" in published


def test_setup_generates_the_keys_once_with_owner_only_access(tmp_path: Path) -> None:
    command = SERVICES["setup"]["command"][-1]
    generate = unescape(re.search(r"\(umask 077 && for secret in .*?; done\)", command).group(0))
    generate = generate.replace("/secrets/", f"{tmp_path}/").replace("python ", "python3 ")
    subprocess.run(["sh", "-c", generate], check=True, timeout=30)
    files = [tmp_path / name for name in ("serving-worker-api-key", "django-secret-key", "registry-token")]
    keys = [file.read_text().strip() for file in files]
    assert all(len(key) >= 50 for key in keys) and len(set(keys)) == 3
    assert all(file.stat().st_mode & 0o777 == 0o600 for file in files)
    subprocess.run(["sh", "-c", generate], check=True, timeout=30)
    assert [file.read_text().strip() for file in files] == keys  # a second `up` keeps them


def test_no_secret_has_a_publicly_known_fallback() -> None:
    """The Django key and the registry token are the environment's or the files setup generated
    (runtime.settings reads `<NAME>_FILE` where `<NAME>` is unset), never a default written here."""
    environment = COMPOSE["x-app"]["environment"]
    for name, file in (("DJANGO_SECRET_KEY", "django-secret-key"), ("REGISTRY_TOKEN", "registry-token")):
        assert environment[name] == f"${{{name}:-}}"
        assert environment[f"{name}_FILE"] == f"/secrets/{file}" and file in SERVICES["setup"]["command"][-1]


def test_web_and_serving_worker_share_the_generated_key_or_the_operators(tmp_path: Path) -> None:
    (tmp_path / "serving-worker-api-key").write_text("generated-key\n")
    for service in ("web", "serving-worker"):
        assert SERVICES[service]["volumes"] == ["models:/models", "secrets:/secrets"]
        shared = run_with_worker_key(service, {}, tmp_path)
        assert shared.returncode == 0 and shared.stdout == "generated-key"
        chosen = run_with_worker_key(service, {"SERVING_WORKER_API_KEY": "operator-key"}, tmp_path)
        assert chosen.stdout == "operator-key"


def test_without_a_key_the_serving_worker_does_not_start_open(tmp_path: Path) -> None:
    refused = run_with_worker_key("serving-worker", {}, tmp_path)  # no key file, none in the environment
    assert refused.returncode != 0 and refused.stdout == ""


def test_the_hosts_origins_and_proxies_are_the_operators_to_set() -> None:
    """A deployment behind its own host name and TLS proxy sets these in its shell or .env, not in
    this file: the web container gets each (the defaults keep a local `docker compose up` working)."""
    environment = COMPOSE["x-app"]["environment"]
    assert environment["DJANGO_ALLOWED_HOSTS"] == "${DJANGO_ALLOWED_HOSTS:-localhost,127.0.0.1,web}"
    assert environment["DJANGO_CSRF_TRUSTED_ORIGINS"] == "${DJANGO_CSRF_TRUSTED_ORIGINS:-}"
    assert SERVICES["web"]["environment"]["TRUSTED_PROXIES"] == "${TRUSTED_PROXIES:-}"


@pytest.mark.parametrize(("base_model", "prepared"), [("/models/base", True), ("Qwen/Qwen2.5-7B-Instruct", False)])
def test_setup_prepares_the_demo_model_only_for_the_default_directory(tmp_path: Path, base_model: str,
                                                                      prepared: bool) -> None:
    command = unescape(SERVICES["setup"]["command"][-1])
    step = re.search(r'\(test "\$BASE_MODEL" != /models/base .*\)$', command).group(0)
    step = re.sub(r"python -m lora_platform\.demo_model .*\)$", f"touch {tmp_path}/prepared)", step)
    step = step.replace("/models/base/config.json", f"{tmp_path}/config.json")
    subprocess.run(["sh", "-c", step], env={"PATH": "/usr/bin:/bin", "BASE_MODEL": base_model}, check=True, timeout=30)
    assert (tmp_path / "prepared").exists() == prepared
