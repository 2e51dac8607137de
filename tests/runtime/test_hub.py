"""Base models by Hugging Face id (runtime.hub), offline, on a hub cache laid out on disk with a
tiny model: ids and pinned revisions resolve to the cache's snapshot and its commit, a local directory
is used as it is, what is not there is refused naming it, and the settings and the worker's --model
go through the same resolver. No test reaches the network: HF_HUB_OFFLINE is set for each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from serving.engine.server.cli import parse_args
from serving.engine.tiny import build_tiny_model
from runtime import hub
from runtime.settings import SettingsError, settings_read
from tests.hub_cache import cache_model

ROOT = Path(__file__).resolve().parents[2]
MAIN = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "fedcba9876543210fedcba9876543210fedcba98"
REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", arch="llama")


@pytest.fixture
def hf_home(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME with the tiny model cached as REPO: `main` at MAIN, tag `v1` at TAGGED; offline."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache_model(cache, REPO, model_dir, MAIN, refs=("main",))
    cache_model(cache, REPO, model_dir, TAGGED, refs=("v1",))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads both once, at import: this process imported it long ago.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return home


def test_an_id_resolves_to_its_cached_snapshot_and_commit(hf_home: Path) -> None:
    resolved = hub.resolve_model(REPO)
    assert resolved.path == hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / MAIN
    assert (resolved.repo_id, resolved.revision, resolved.name) == (REPO, MAIN, REPO)
    assert (resolved.path / "config.json").is_file()


def test_a_pinned_revision_a_tag_or_a_commit(hf_home: Path) -> None:
    assert hub.resolve_model(f"{REPO}@v1").revision == TAGGED
    assert hub.resolve_model(f"{REPO}@{TAGGED}").path.name == TAGGED
    assert hub.resolve_model(f"{REPO}@main").revision == MAIN


def test_what_the_cache_lacks_is_refused_offline_naming_it(hf_home: Path) -> None:
    with pytest.raises(hub.ModelSourceError, match=r"tiny-org/other-model is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        hub.resolve_model("tiny-org/other-model")
    with pytest.raises(hub.ModelSourceError, match=rf"{REPO}@v2 is not in the Hugging Face cache"):
        hub.resolve_model(f"{REPO}@v2")


def test_a_local_directory_is_used_as_it_is(hf_home: Path, model_dir: Path, tmp_path: Path) -> None:
    resolved = hub.resolve_model(str(model_dir))
    assert (resolved.path, resolved.repo_id, resolved.revision, resolved.name) == (model_dir, None, None, model_dir.name)
    # A cache snapshot named by its path still says which repository and commit it is.
    snapshot = hub.resolve_model(str(hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / TAGGED))
    assert (snapshot.repo_id, snapshot.revision) == (REPO, TAGGED)
    with pytest.raises(hub.ModelSourceError, match="does not exist"):
        hub.resolve_model(str(tmp_path / "no-such-model"))


@pytest.mark.parametrize("spec", ["", "not a model", "org/name/extra", "org/name@", "org name@x"])
def test_malformed_specs_are_refused(spec: str) -> None:
    with pytest.raises(hub.ModelSourceError, match="empty|neither a directory nor a Hugging Face model id"):
        hub.parse_model_spec(spec)


def test_settings_resolve_base_model_by_id(hf_home: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_MODEL", f"{REPO}@v1")
    monkeypatch.delenv("BASE_MODEL_PATH", raising=False)
    monkeypatch.delenv("BASE_MODEL_NAME", raising=False)
    settings = settings_read(None)
    assert settings.base_model_name == REPO
    assert settings.base_model_source.path.name == TAGGED and settings.base_model_source.revision == TAGGED

    monkeypatch.setenv("BASE_MODEL_PATH", str(model_dir))
    with pytest.raises(SettingsError, match="BASE_MODEL .* or BASE_MODEL_PATH .*not both"):
        settings_read(None)
    monkeypatch.delenv("BASE_MODEL_PATH")

    monkeypatch.setenv("BASE_MODEL", "tiny-org/absent")
    with pytest.raises(SettingsError, match="BASE_MODEL: the base model tiny-org/absent is not in the Hugging Face cache"):
        _ = settings_read(None).base_model_source


def test_settings_keep_a_plain_directory(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BASE_MODEL", raising=False)
    monkeypatch.delenv("BASE_MODEL_NAME", raising=False)
    monkeypatch.setenv("BASE_MODEL_PATH", str(model_dir))
    settings = settings_read(None)
    assert (settings.base_model_source.path, settings.base_model_source.revision) == (model_dir, None)
    assert settings.base_model_name == "tiny-llama"


def test_the_worker_takes_an_id_for_model(hf_home: Path, model_dir: Path) -> None:
    args = parse_args(["--model", REPO])
    assert (args.model, args.model_revision, args.served_model_name) == (
        str(hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / MAIN), MAIN, [REPO])
    assert parse_args(["--model", f"{REPO}@v1", "--served-model-name", "base"]).served_model_name == ["base"]
    local = parse_args(["--model", str(model_dir)])
    assert (local.model, local.model_revision, local.served_model_name) == (str(model_dir), None, [])


def test_the_worker_refuses_an_unknown_model(hf_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny-org/absent"])
    assert "--model: the base model tiny-org/absent is not in the Hugging Face cache" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_command_line_honours_hf_home(hf_home: Path) -> None:
    """A fresh process reads HF_HOME and HF_HUB_OFFLINE as huggingface_hub does, at import."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "runtime.hub", "resolve", f"{REPO}@v1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{hf_home / 'hub' / 'models--tiny-org--tiny-llama' / 'snapshots' / TAGGED}\t{TAGGED}"
    missing = subprocess.run([sys.executable, "-m", "runtime.hub", "download", "tiny-org/absent"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "HF_HUB_OFFLINE is set" in missing.stderr
