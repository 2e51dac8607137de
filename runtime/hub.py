"""Base models by Hugging Face id or local directory: the one resolver every process uses.

Wherever a base model is named (BASE_MODEL, the serving worker's --model, the trainer through the
settings), either form works:

- a local directory holding a Hugging Face model (config.json, safetensors, tokenizer), used as it
  is, exactly as before ids were accepted;
- a Hugging Face id `org/name`, optionally pinned `org/name@revision` (a branch, tag or commit),
  resolved through huggingface_hub's standard cache: HF_HOME / HF_HUB_CACHE say where it is,
  HF_TOKEN authenticates gated and private repositories, HF_HUB_OFFLINE=1 forbids the network.

The cache comes first: an id whose revision (`main` when none is given) is already in the cache is
served from it without asking the Hub, so every process on a machine agrees on the commit and a
restart never moves the model under its adapters. Only an id missing from the cache is downloaded
(with huggingface_hub's progress bars); `python -m runtime.hub download ID` asks the Hub again
and moves a branch to its newest commit.

The resolved revision is always a commit hash (the snapshot's directory name): training jobs and
adapter versions record it, and the registry and the workers compare it. A local directory that
is itself a cache snapshot (`…/models--org--name/snapshots/<hash>`) reports that id and hash too.

Django-free and free of torch and transformers (the web process resolves the base at settings load);
huggingface_hub is imported only when an id is resolved.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# `org/name[@revision]` as the Hub spells repository ids (letters, digits, '-', '_', '.'); a
# revision may hold '/' (refs/pr/1).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.-][\w./-]*))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What a causal LM needs from a repository: configs, safetensors weights, the tokenizer's files.
# Left out: other weight formats (.bin, .pth, original/ consolidated checkpoints as Llama ships),
# which would double or triple the download.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
IGNORE_PATTERNS = ("original/*",)


class ModelSourceError(ValueError):
    """A base model that cannot be found or fetched; the message names it and says what to do."""


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None  # None: the default branch

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class ResolvedModel:
    """Where a named base model lies on this machine, and which commit it is."""

    spec: str  # as the operator wrote it
    path: Path  # a local directory with config.json
    repo_id: str | None  # the Hugging Face id, None for a plain directory
    revision: str | None  # the commit hash, None for a plain directory

    @property
    def name(self) -> str:
        """The model's default name in the API and on adapters: the id, else the directory's name."""
        return self.repo_id or self.path.name

    def describe(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.repo_id else str(self.path)


def parse_model_spec(spec: str) -> Path | HubId:
    """A local directory, or a Hugging Face id. A spec that exists as a directory, or reads as a path
    (absolute, or starting with `.` or `~`), is a directory; otherwise it must be `org/name[@revision]`."""
    text = spec.strip()
    if not text:
        raise ModelSourceError("the base model is empty: give a local model directory or a Hugging Face id "
                               "(org/name[@revision])")
    path = Path(text).expanduser()
    if path.is_dir() or text.startswith(("/", ".", "~")):
        return path
    match = _HUB_ID.match(text)
    if match is None:
        raise ModelSourceError(f"{spec!r} is neither a directory nor a Hugging Face model id (org/name or "
                               "org/name@revision)")
    return HubId(match["repo"], match["revision"])


def default_name(spec: str) -> str:
    """The model's default name without resolving it: the id (revision left out), or the directory's name."""
    parsed = parse_model_spec(spec)
    return parsed.repo_id if isinstance(parsed, HubId) else parsed.name


def resolve_model(spec: str, *, cache_dir: Path | None = None, refresh: bool = False) -> ResolvedModel:
    """The local directory of `spec` and its commit, downloading an id missing from the cache.

    `cache_dir` overrides huggingface_hub's cache (HF_HUB_CACHE, else HF_HOME/hub); `refresh` asks
    the Hub even when the revision is cached (a branch moves to its newest commit). Raises
    ModelSourceError naming the model when it is not there and cannot be fetched."""
    parsed = parse_model_spec(spec)
    if isinstance(parsed, Path):
        return _local(spec, parsed)
    return _from_hub(spec, parsed, cache_dir=cache_dir, refresh=refresh)


def _local(spec: str, path: Path) -> ResolvedModel:
    if not path.is_dir():
        raise ModelSourceError(f"the base model directory {path} does not exist")
    # A snapshot of the hub's cache names its repository and commit: models--org--name/snapshots/<hash>.
    repo_dir = path.resolve().parent.parent
    if path.resolve().parent.name == "snapshots" and _COMMIT.match(path.resolve().name) and repo_dir.name.startswith("models--"):
        repo_id = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        return ResolvedModel(spec=spec, path=path, repo_id=repo_id, revision=path.resolve().name)
    return ResolvedModel(spec=spec, path=path, repo_id=None, revision=None)


def _from_hub(spec: str, hub_id: HubId, *, cache_dir: Path | None, refresh: bool) -> ResolvedModel:
    # Imported here: a process naming a directory never loads huggingface_hub.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)

    def snapshot(*, local_files_only: bool) -> str:
        return snapshot_download(hub_id.repo_id, revision=hub_id.revision, cache_dir=cache,
                                 allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS),
                                 local_files_only=local_files_only)

    folder: str | None = None
    if not refresh:
        try:
            folder = snapshot(local_files_only=True)
        except LocalEntryNotFoundError:
            folder = None
    if folder is None:
        if constants.HF_HUB_OFFLINE:
            raise ModelSourceError(
                f"the base model {hub_id} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
                f"download it where the Hub can be reached (python -m runtime.hub download {hub_id}) or "
                "point HF_HOME at a cache that holds it")
        log.info("downloading %s into %s", hub_id, cache)
        try:
            folder = snapshot(local_files_only=False)
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
            local_hint = f"; no directory {spec!r} exists either" if "/" in spec else ""
            raise ModelSourceError(f"the base model {hub_id} could not be fetched from the Hugging Face Hub "
                                   f"({type(error).__name__}: {error}){local_hint}. A gated or private "
                                   "model needs HF_TOKEN") from error
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"the base model {hub_id} (snapshot {path}) has no config.json: not a Hugging Face model")
    return ResolvedModel(spec=spec, path=path, repo_id=hub_id.repo_id, revision=path.name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.hub",
        description="Resolve or download a base model (a Hugging Face id org/name[@revision] or a directory).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    download = commands.add_parser("download", help="fetch the model into the cache, asking the Hub even if cached")
    download.add_argument("model")
    resolve = commands.add_parser("resolve", help="print the model's directory and commit (downloads if missing)")
    resolve.add_argument("model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        resolved = resolve_model(args.model, refresh=args.command == "download")
    except ModelSourceError as error:
        parser.exit(1, f"error: {error}\n")
    print(f"{resolved.path}\t{resolved.revision or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
