"""Hostile adapter archives (docs/security.md): how long the upload path takes to refuse them, and
the peak memory of the process doing it.

Cases, each run in a fresh subprocess so its peak RSS is its own:

- ``many-entries``: a .tar.gz of 1,000,000 empty entries (about 6 MB compressed);
- ``zeros``: a .tar.gz holding one 4 GiB entry of zeros (about 4 MB compressed).

Each archive is built once (into ``--work``), then handed to ``serving.registry.uploads.staged_upload`` as
a Django upload, on the platform's settings (ADAPTER_MAX_BYTES 1 GiB by default). ``--uploads``
loads another implementation of the module instead (say, an older commit's copy) to compare.

    python bench/upload_archives.py [--work DIR] [--uploads PATH] [--cases many-entries,zeros]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import os
import resource
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = 1_000_000
ZEROS = 4 * 1024 ** 3


def build(case: str, work: Path) -> Path:
    path = work / f"{case}.tar.gz"
    if path.exists():
        return path
    work.mkdir(parents=True, exist_ok=True)
    if case == "many-entries":
        header = tarfile.TarInfo("README.md").tobuf(format=tarfile.GNU_FORMAT)
        with gzip.open(path, "wb", compresslevel=9) as out:
            for _ in range(ENTRIES // 1000):
                out.write(header * 1000)
            out.write(b"\0" * 1024)
    else:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = ZEROS
        compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip wrapper
        chunk = b"\0" * (1024 * 1024)
        with path.open("wb") as out:
            out.write(compressor.compress(info.tobuf(format=tarfile.GNU_FORMAT)))
            for _ in range(ZEROS // len(chunk)):
                out.write(compressor.compress(chunk))
            out.write(compressor.compress(b"\0" * 1024) + compressor.flush())
    return path


def run_case(path: Path, uploads_path: str | None) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")
    # Development mode: unset is production, which refuses the development secret key (docs/operations.md).
    os.environ.setdefault("DJANGO_DEBUG", "true")
    import django

    django.setup()
    from django.core.files.uploadedfile import SimpleUploadedFile

    from serving.contracts.errors import ServiceError

    if uploads_path:
        spec = importlib.util.spec_from_file_location("alternative_uploads", uploads_path)
        uploads = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = uploads  # its dataclasses look their module up
        spec.loader.exec_module(uploads)
    else:
        from serving.registry import uploads
    upload = SimpleUploadedFile(path.name, path.read_bytes())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    try:
        with uploads.staged_upload([upload]):
            outcome = "accepted"
    except ServiceError as error:
        outcome = f"{error.status_code} {error.code}: {error.message[:120]}"
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": round(seconds, 3), "peak_rss_mb": round(peak / 1024, 1),
            "rss_growth_mb": round((peak - before) / 1024, 1), "outcome": outcome,
            "archive_mb": round(path.stat().st_size / 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/loraplex-bench-archives"))
    parser.add_argument("--uploads", help="path of an alternative serving/registry/uploads.py to measure")
    parser.add_argument("--cases", default="many-entries,zeros")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_case(Path(args.one), args.uploads)))
        return
    for case in args.cases.split(","):
        path = build(case, args.work)
        command = [sys.executable, __file__, "--one", str(path)] + (["--uploads", args.uploads] if args.uploads else [])
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        print(f"{case}: {result.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
