"""The runs' scratch folders on this host: one per run, swept at worker start when its process is gone."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from training import conf


def scratch_create(job_id: int) -> Path:
    """A run's own scratch folder; its name carries host and pid, so a later sweep knows its owner."""
    root = conf.scratch_dir()
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"job-{job_id}-{socket.gethostname()}-{os.getpid()}-", dir=root))


def training_scratch_sweep() -> list[Path]:
    """Removes scratch folders of runs on this host whose process is gone (a killed worker); the removed.

    A run removes its own folder on every exit it lives through; a SIGKILL (or power loss) leaves
    it, holding the tenant's dataset, so each worker sweeps at start. A folder whose pid is alive is
    left alone: another worker's run on this host (pid reuse by an unrelated process keeps one a
    little longer, never removes a live one).
    """
    root = conf.scratch_dir()
    if not root.is_dir():
        return []
    host = socket.gethostname()
    removed = []
    for folder in root.iterdir():
        match = re.fullmatch(rf"job-\d+-{re.escape(host)}-(\d+)-.+", folder.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie does not: a SIGKILLed worker's pool process stays one until
    whatever adopted it reaps it, which on a loaded host (or under an init that is slow to reap) can
    outlast the next worker's start, and its run's folder would then never be swept."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        # /proc/<pid>/stat: "pid (comm) state …"; comm may hold spaces and parentheses.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): signal 0 is all there is
    return state not in ("Z", "X")
