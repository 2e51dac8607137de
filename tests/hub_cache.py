"""A Hugging Face hub cache laid out on disk, as huggingface_hub writes it, for offline tests:
`<cache>/models--<org>--<name>/snapshots/<commit>/<files>` and `refs/<branch or tag>` holding the
commit. Files are copied in whole (the real cache links them to blobs/, which nothing here reads)."""

from __future__ import annotations

import shutil
from pathlib import Path


def cache_model(cache: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Puts `model_dir`'s files into `cache` as `repo_id` at `commit`, named by `refs`; the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
