"""The adapter artifact contract (design.md, "Adapter artifact"): manifest.json and digests.

An artifact is a flat directory in PEFT's format (`adapter_config.json`,
`adapter_model.safetensors`, whatever else PEFT wrote) plus `manifest.json`:

    {"format": 1,
     "adapter": {"tenant", "name", "version"},
     "base_model": {"name", "config_sha256"},
     "peft": {"r", "lora_alpha", "target_modules", "kind"},   # kind: "lora" | "dora" (ADAPTER_KINDS)
     "files": {"<name>": {"sha256", "bytes"}},      # every other file of the directory
     "source": {"kind": "training_job" | "upload", "id"},
     "created_at": "2026-11-30T12:00:00+00:00"}

The training pipeline, the registry and the serving engine all use these functions, so this module
depends on the standard library only (no Django, no torch).

Content digest (`adapter_digest`), the key serving caches use for an adapter: the sha256 of the
manifest.json bytes when the directory has one (the manifest pins every file's sha256, so it
identifies the whole content); otherwise the sha256 of the lines `"<sha256>  <name>\\n"` of every
file, sorted by name (the output of `sha256sum` over the sorted files). Both change whenever any
file's bytes or name change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
ADAPTER_CONFIG_NAME = "adapter_config.json"
MANIFEST_FORMAT = 1
SOURCE_KINDS = ("training_job", "upload")
# What an adapter is (docs/adapter-kinds.md): plain LoRA, or DoRA (PEFT's use_dora: a learned magnitude
# per output feature of every adapted module beside LoRA's update).
ADAPTER_KINDS = ("lora", "dora")

# Keys of config.json that change when the same base is re-saved (another transformers version or
# dtype, a local path) without changing what an adapter must fit.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "_commit_hash", "torch_dtype", "dtype", "use_cache"}
)
_CHUNK = 1024 * 1024
# Limits on the JSON files read from an artifact (adapter_config.json, manifest.json), which come
# from tenants: PEFT writes a flat object of a few KB, a manifest lists a handful of files. Nesting
# is checked before parsing, because `json.loads` recurses once per level (a RecursionError, not a
# clear refusal) and an oversized file is refused before it is read whole.
MAX_JSON_BYTES = 1024 * 1024
MAX_JSON_DEPTH = 32
# A JSON string, escapes included; what is left between strings holds the brackets that nest.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


class AdapterError(ValueError):
    """An adapter or its artifact is unusable; the message names the file and the problem."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (adapters can be hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def base_config_sha256(model_dir: Path) -> str:
    """Hex sha256 of the base model's config.json, canonicalised.

    Canonical form: the JSON object without volatile keys (transformers version, dtype, name or
    path, use_cache), dumped with sorted keys and no whitespace. It identifies the architecture and
    layer sizes an adapter was trained against, not the weights.
    """
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path} is missing: not a Hugging Face model directory") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} is not a JSON object")
    stable = {key: value for key, value in config.items() if key not in _VOLATILE_CONFIG_KEYS}
    canonical = json.dumps(stable, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_artifact_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed JSON of one artifact file, refused with an AdapterError naming the file when it
    is over `max_bytes`, nested deeper than `max_depth` or not JSON. FileNotFoundError passes."""
    path = Path(path)
    where = f"{path.name} in {path.parent}"
    with open(path, "rb") as stream:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise AdapterError(f"{where} is larger than the {max_bytes} bytes allowed for it")
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub(b"", data)):
        depth += 1 if match.group() in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > max_depth:
                raise AdapterError(f"{where} is nested deeper than the {max_depth} levels allowed for it")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{where} is not valid JSON: {exc}") from None


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """The parsed adapter_config.json of `adapter_dir`; AdapterError if missing, over the JSON
    limits or not a JSON object."""
    try:
        config = read_artifact_json(Path(adapter_dir) / ADAPTER_CONFIG_NAME)
    except FileNotFoundError:
        raise AdapterError(
            f"{ADAPTER_CONFIG_NAME} is missing in {adapter_dir}: not a PEFT adapter directory"
        ) from None
    if not isinstance(config, dict):
        raise AdapterError(f"{ADAPTER_CONFIG_NAME} in {adapter_dir} is not a JSON object")
    return config


def artifact_files(adapter_dir: Path) -> list[str]:
    """Names of the files an artifact consists of (all but manifest.json), sorted.

    Artifacts are flat: a subdirectory or a symlink is refused, so a manifest always covers the
    whole directory and nothing outside it can be read through it.
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterError(f"adapter directory {adapter_dir} does not exist or is not a directory")
    names = []
    for entry in sorted(adapter_dir.iterdir()):
        if entry.is_symlink():
            raise AdapterError(
                f"{entry.name} in {adapter_dir} is a symlink; an adapter artifact holds files only"
            )
        if entry.is_dir():
            raise AdapterError(
                f"{entry.name} in {adapter_dir} is a directory; an adapter artifact is flat"
            )
        if entry.name != MANIFEST_NAME:
            names.append(entry.name)
    return names


def manifest_build(
    adapter_dir: Path,
    *,
    tenant: str,
    name: str,
    version: str,
    base_model_name: str,
    base_config_sha256: str,
    source_kind: str,
    source_id: str | int,
    created_at: datetime | None = None,
) -> dict[str, Any]:
    """The manifest of `adapter_dir` as a dict: its PEFT settings and every file's sha256 and size.

    `source_id` is stored as a string; `created_at` defaults to now (UTC).
    """
    for field, value in (("tenant", tenant), ("name", name), ("version", version),
                         ("base_model_name", base_model_name)):
        if not isinstance(value, str) or not value:
            raise AdapterError(f"manifest {field} must be a non-empty string, got {value!r}")
    if source_kind not in SOURCE_KINDS:
        raise AdapterError(
            f"manifest source kind must be one of {', '.join(SOURCE_KINDS)}, got {source_kind!r}"
        )
    config = read_adapter_config(adapter_dir)
    try:
        peft = {
            "r": int(config["r"]),
            "lora_alpha": config["lora_alpha"],
            "target_modules": _target_modules_field(config["target_modules"]),
            "kind": adapter_kind(config),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(
            f"{ADAPTER_CONFIG_NAME} in {adapter_dir} lacks a valid r, lora_alpha or "
            f"target_modules ({exc!r})"
        ) from None
    files = {}
    for file_name in artifact_files(adapter_dir):
        path = Path(adapter_dir) / file_name
        files[file_name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    moment = created_at or datetime.now(UTC)
    return {
        "format": MANIFEST_FORMAT,
        "adapter": {"tenant": tenant, "name": name, "version": version},
        "base_model": {"name": base_model_name, "config_sha256": base_config_sha256},
        "peft": peft,
        "files": files,
        "source": {"kind": source_kind, "id": str(source_id)},
        "created_at": moment.isoformat(timespec="seconds"),
    }


def adapter_kind(config: dict[str, Any]) -> str:
    """The kind (ADAPTER_KINDS) of the adapter whose adapter_config.json is `config`."""
    return "dora" if config.get("use_dora") else "lora"


def _target_modules_field(value: Any) -> list[str] | str:
    # PEFT stores a list of module names, or one regex string; keep a regex as it is.
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return sorted(value)
    raise TypeError(f"target_modules must be a list of names or a regex string, got {value!r}")


def manifest_dumps(manifest: dict[str, Any]) -> bytes:
    """The bytes manifest.json holds for `manifest` (sorted keys, 2-space indent, final newline)."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def manifest_write(
    adapter_dir: Path,
    *,
    tenant: str,
    name: str,
    version: str,
    base_model_name: str,
    base_config_sha256: str,
    source_kind: str,
    source_id: str | int,
    created_at: datetime | None = None,
) -> dict[str, Any]:
    """Build the manifest of `adapter_dir` (as `manifest_build`) and write it as manifest.json.

    The file is written beside its final name and renamed, so a reader sees the whole manifest or
    none. Returns the manifest; `adapter_digest(adapter_dir)` is then its sha256.
    """
    adapter_dir = Path(adapter_dir)
    manifest = manifest_build(
        adapter_dir,
        tenant=tenant,
        name=name,
        version=version,
        base_model_name=base_model_name,
        base_config_sha256=base_config_sha256,
        source_kind=source_kind,
        source_id=source_id,
        created_at=created_at,
    )
    handle, temporary = tempfile.mkstemp(prefix=f".{MANIFEST_NAME}.", dir=adapter_dir)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(manifest_dumps(manifest))
        os.chmod(temporary, 0o644)
        os.replace(temporary, adapter_dir / MANIFEST_NAME)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return manifest


def manifest_verify(adapter_dir: Path) -> dict[str, Any]:
    """Check every file of `adapter_dir` against its manifest.json; return the manifest.

    AdapterError, naming the file, when the manifest is missing or malformed, a listed file is
    missing or differs in size or sha256, or a file of the directory is not listed.
    """
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / MANIFEST_NAME
    try:
        manifest = read_artifact_json(path)
    except FileNotFoundError:
        raise AdapterError(f"{MANIFEST_NAME} is missing in {adapter_dir}") from None
    files = _manifest_files(manifest, adapter_dir)
    present = set(artifact_files(adapter_dir))
    for file_name, recorded in sorted(files.items()):
        if file_name not in present:
            raise AdapterError(
                f"{file_name} is listed in {MANIFEST_NAME} but missing in {adapter_dir}"
            )
        file_path = adapter_dir / file_name
        size = file_path.stat().st_size
        if size != recorded["bytes"]:
            raise AdapterError(
                f"{file_name} in {adapter_dir} has {size} bytes but {MANIFEST_NAME} records "
                f"{recorded['bytes']}: the file is truncated or was changed"
            )
        actual = sha256_file(file_path)
        if actual != recorded["sha256"]:
            raise AdapterError(
                f"sha256 mismatch for {file_name} in {adapter_dir}: {MANIFEST_NAME} records "
                f"{recorded['sha256']}, the file has {actual}"
            )
    unlisted = sorted(present - set(files))
    if unlisted:
        raise AdapterError(
            f"{', '.join(unlisted)} in {adapter_dir} not listed in {MANIFEST_NAME}; "
            "the artifact was changed after it was published"
        )
    verified: dict[str, Any] = manifest  # _manifest_files raised unless it is a JSON object
    return verified


def _manifest_files(manifest: Any, adapter_dir: Path) -> dict[str, dict[str, Any]]:
    where = f"{MANIFEST_NAME} in {adapter_dir}"
    if not isinstance(manifest, dict):
        raise AdapterError(f"{where} is not a JSON object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise AdapterError(
            f"{where} has format {manifest.get('format')!r}; this version reads format "
            f"{MANIFEST_FORMAT}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise AdapterError(f"{where} has no 'files' object")
    for file_name, recorded in files.items():
        if file_name in ("", ".", "..", MANIFEST_NAME) or "/" in file_name or "\\" in file_name:
            raise AdapterError(f"{where} lists an invalid file name {file_name!r}")
        valid = (
            isinstance(recorded, dict)
            and isinstance(recorded.get("sha256"), str)
            and isinstance(recorded.get("bytes"), int)
        )
        if not valid:
            raise AdapterError(f"{where} entry for {file_name} needs a sha256 string and bytes")
    return files


def adapter_digest(adapter_dir: Path) -> str:
    """The content digest caches key `adapter_dir` by (module docstring); it does not verify."""
    adapter_dir = Path(adapter_dir)
    manifest = adapter_dir / MANIFEST_NAME
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()
    lines = "".join(
        f"{sha256_file(adapter_dir / file_name)}  {file_name}\n"
        for file_name in artifact_files(adapter_dir)
    )
    return hashlib.sha256(lines.encode()).hexdigest()
