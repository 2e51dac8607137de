"""OpenAI's Uploads: a dataset larger than one request, sent in parts and completed into a dataset.

create (filename, purpose, the total `bytes`, mime_type) → add parts (one request each, at most
PART_MAX_BYTES, stored under the upload's own storage prefix with their size and sha256; a part may
carry the sha256 its sender computed, checked as it is stored) → complete (the parts in the order
given) or cancel. An upload expires UPLOAD_TTL after its creation, as OpenAI's (`uploads_expire`,
from Celery beat).

Completion streams the parts one after another into the dataset's file through the storage layer
(never the whole file in memory), re-hashing each part against the sha256 recorded when it was
added, and hands that stream to the same service as a direct /v1/files upload
(training.datasets.dataset_create: the tier's size limit, the stored sha256, validation). The
declared total, each part's digest and the optional md5 of the whole are checked while the file
streams, so a refused completion fails inside the storage's put, which keeps nothing: no dataset,
no file. The upload then stays `pending` with its parts, so the sender may complete again (the
right order, the right md5) until it expires or is cancelled; a completed, cancelled or expired
upload's parts are deleted (parts a completion did not name included).
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from datetime import timedelta
from functools import partial
from typing import BinaryIO, cast

from django.db import transaction
from django.utils import timezone

from serving.registry.storage import get_storage
from serving.contracts.errors import InvalidInput, LimitExceeded, PayloadTooLarge, ServiceError
from runtime.storage import BlobStorage, Source
from tenants.models import Tenant
from training import conf, datasets
from training.base import after_commit
from training.models import Upload, UploadPart

logger = logging.getLogger(__name__)

UPLOAD_TTL = timedelta(hours=1)
# OpenAI's largest part.
PART_MAX_BYTES = 64 * 1024 * 1024
PURPOSE = "fine-tune"
# What a JSONL file is sent as; OpenAI's SDK makes the sender name one.
MIME_TYPES = ("application/jsonl", "application/x-jsonl", "application/x-ndjson", "application/json",
              "text/jsonl", "text/plain", "application/octet-stream")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MD5 = re.compile(r"[0-9a-f]{32}")


def upload_status(upload: Upload) -> str:
    """The status the tenant sees: a pending upload past its expiry is `expired` before the sweep ends it."""
    if upload.status == Upload.Status.PENDING and upload.expires_at <= timezone.now():
        return Upload.Status.EXPIRED
    return upload.status


def _parts_prefix(upload: Upload) -> str:
    return f"uploads/{upload.tenant.slug}/{upload.pk}"


def upload_create(*, tenant: Tenant, filename: object, purpose: object, size: object,
                  mime_type: object) -> Upload:
    """A pending upload of `size` bytes; every field is checked first, and the tenant's pending uploads counted."""
    if not purpose:
        raise InvalidInput(f"Missing required parameter: 'purpose' (use '{PURPOSE}').", code="missing_purpose",
                           param="purpose")
    if purpose != PURPOSE:
        raise InvalidInput(f"Uploads here are for fine-tuning only: 'purpose' must be '{PURPOSE}', got {purpose!r}.",
                           code="invalid_purpose", param="purpose")
    if not isinstance(filename, str) or not filename.strip() or len(filename) > 255:
        raise InvalidInput("'filename' must be a non-empty string of at most 255 characters.", param="filename")
    if mime_type not in MIME_TYPES:
        raise InvalidInput(f"'mime_type' {mime_type!r} is not one of a JSONL file's: {', '.join(MIME_TYPES)}.",
                           code="invalid_mime_type", param="mime_type")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidInput("'bytes' must be the file's size, a positive integer (an empty file cannot be trained "
                           "on).", param="bytes")
    limit = conf.dataset_max_bytes(tenant.tier.name)
    if size > limit:
        raise PayloadTooLarge(f"The file is {size} bytes; datasets on tier '{tenant.tier.name}' may be at most "
                              f"{limit} bytes. Split the file or ask for a higher tier.", code="dataset_too_large",
                              param="bytes")
    with transaction.atomic():
        locked = Tenant.objects.select_for_update(of=("self",)).get(pk=tenant.pk)
        pending = Upload.objects.for_tenant(locked).filter(status=Upload.Status.PENDING,
                                                           expires_at__gt=timezone.now()).count()
        allowed = conf.setting_int("TRAINING_MAX_PENDING_UPLOADS")
        if pending >= allowed:
            raise LimitExceeded(f"Tenant '{locked.slug}' has {pending} pending uploads (at most {allowed}); "
                                "complete or cancel one first.", code="upload_limit_reached")
        upload = Upload.objects.create(tenant=locked, filename=filename.strip(), purpose=purpose, mime_type=mime_type,
                                       size_bytes=size, expires_at=timezone.now() + UPLOAD_TTL)
        # From the row's own created_at, so the object's expires_at is created_at + one hour to the
        # second (two clock reads could fall either side of a second).
        upload.expires_at = upload.created_at + UPLOAD_TTL
        upload.save(update_fields=["expires_at"])
        return upload


def _locked_pending(upload: Upload, action: str) -> Upload:
    """The upload, locked; InvalidInput naming its status unless it is pending (and not expired)."""
    locked = Upload.objects.select_for_update(of=("self",)).select_related("tenant", "tenant__tier").get(pk=upload.pk)
    status = upload_status(locked)
    if status != Upload.Status.PENDING:
        raise InvalidInput(f"Upload upload_{locked.pk} is {status}; {action} only a pending upload.",
                           code=f"upload_{status}", param="upload_id")
    return locked


def upload_part_add(*, upload: Upload, source: Source, sha256: object = None) -> UploadPart:
    """Stores one part (streamed, hashed); refused with nothing kept past PART_MAX_BYTES, past the
    declared total, when empty, or when `sha256` is given and differs from the bytes received."""
    if sha256 is not None and (not isinstance(sha256, str) or not _SHA256.fullmatch(sha256.lower())):
        raise InvalidInput("'sha256' must be the part's SHA-256 as 64 hexadecimal digits.", param="sha256")
    declared = sha256.lower() if isinstance(sha256, str) else None
    storage = get_storage()
    with transaction.atomic():
        locked = _locked_pending(upload, "parts are added to")
        stored_so_far = sum(locked.parts.values_list("size_bytes", flat=True))
        room = locked.size_bytes - stored_so_far
        if room <= 0:
            raise InvalidInput(f"Upload upload_{locked.pk} already holds its declared {locked.size_bytes} bytes; "
                               "complete it, or cancel it and start again.", code="upload_bytes_exceeded",
                               param="data")
        key = f"{_parts_prefix(locked)}/{uuid.uuid4().hex}.part"
        try:
            stored = storage.put(key, source, max_bytes=min(room, PART_MAX_BYTES))
        except ServiceError as error:
            if error.code != "payload_too_large":
                raise
            if room < PART_MAX_BYTES:
                raise InvalidInput(f"This part would take upload upload_{locked.pk} past the {locked.size_bytes} bytes "
                                   f"declared at its creation ({stored_so_far} stored, {room} left).",
                                   code="upload_bytes_exceeded", param="data") from None
            raise PayloadTooLarge(f"A part may be at most {PART_MAX_BYTES} bytes; send the file in more parts.",
                                  code="part_too_large", param="data") from None
        try:
            if stored.size == 0:
                raise InvalidInput("The part is empty (0 bytes).", code="empty_part", param="data")
            if declared is not None and declared != stored.sha256:
                raise InvalidInput(f"The part's bytes have SHA-256 {stored.sha256}, not the {declared} sent "
                                   "with it; it was not kept. Send it again.", code="part_digest_mismatch",
                                   param="sha256")
            return UploadPart.objects.create(upload=locked, storage_key=key, size_bytes=stored.size,
                                             sha256=stored.sha256)
        except BaseException:
            storage.delete(key)
            raise


class _PartsReader:
    """The parts, one after another, as one stream; each part's bytes checked against its recorded
    size and sha256 as it ends, and the whole's md5 at the end. A mismatch raises inside the reader,
    so the storage's put that reads it fails and keeps nothing."""

    def __init__(self, storage: BlobStorage, parts: list[UploadPart], md5: str | None) -> None:
        self._storage = storage
        self._parts = parts
        self._index = 0
        self._stream: BinaryIO | None = None
        self._digest = hashlib.sha256()
        self._size = 0
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._expected_md5 = md5

    def read(self, size: int = -1) -> bytes:
        while self._index < len(self._parts):
            part = self._parts[self._index]
            if self._stream is None:
                self._stream = self._open(part)
            chunk = self._stream.read(size if size is not None and size >= 0 else -1)
            if chunk:
                self._digest.update(chunk)
                self._size += len(chunk)
                self._md5.update(chunk)
                return chunk
            self._end_part(part)
        if self._expected_md5 is not None and self._md5.hexdigest() != self._expected_md5:
            raise InvalidInput(f"The parts, in the order given, have MD5 {self._md5.hexdigest()}, not the "
                               f"{self._expected_md5} given; nothing was kept. Check the order of 'part_ids'.",
                               code="md5_mismatch", param="md5")
        return b""

    def _open(self, part: UploadPart) -> BinaryIO:
        try:
            return self._storage.open(part.storage_key)
        except ServiceError:
            raise InvalidInput(f"Part part_{part.pk} is missing from storage; cancel the upload and send the file "
                               "again.", code="part_missing", param="part_ids") from None

    def _end_part(self, part: UploadPart) -> None:
        self.close()
        if self._size != part.size_bytes or self._digest.hexdigest() != part.sha256:
            raise InvalidInput(f"Part part_{part.pk} (number {self._index + 1} in 'part_ids') no longer matches the "
                               f"sha256 recorded when it was added ({part.sha256}); nothing was kept. Cancel the "
                               "upload and send the file again.", code="part_digest_mismatch", param="part_ids")
        self._index += 1
        self._digest, self._size = hashlib.sha256(), 0

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def upload_complete(*, upload: Upload, part_ids: list[int], md5: object = None) -> Upload:
    """Completes the upload into a dataset (module docstring); InvalidInput naming what was wrong otherwise.

    Held under the upload's row lock throughout, so a part added or a second completion meanwhile
    waits for it (and then finds the upload completed).
    """
    if md5 is not None and (not isinstance(md5, str) or not _MD5.fullmatch(md5.lower())):
        raise InvalidInput("'md5' must be the file's MD5 as 32 hexadecimal digits.", param="md5")
    if not part_ids:
        raise InvalidInput("'part_ids' must list the upload's parts in the file's order.", param="part_ids")
    if len(set(part_ids)) != len(part_ids):
        repeated = sorted({pk for pk in part_ids if part_ids.count(pk) > 1})
        raise InvalidInput(f"'part_ids' names {', '.join(f'part_{pk}' for pk in repeated)} more than once.",
                           param="part_ids")
    storage = get_storage()
    with transaction.atomic():
        locked = _locked_pending(upload, "you can complete")
        parts = {part.pk: part for part in locked.parts.all()}
        unknown = [pk for pk in part_ids if pk not in parts]
        if unknown:
            raise InvalidInput(f"{', '.join(f'part_{pk}' for pk in unknown)} is not a part of upload "
                               f"upload_{locked.pk}.", code="part_not_found", param="part_ids")
        ordered = [parts[pk] for pk in part_ids]
        total = sum(part.size_bytes for part in ordered)
        if total != locked.size_bytes:
            raise InvalidInput(f"The parts listed hold {total} bytes; upload upload_{locked.pk} was created for "
                               f"{locked.size_bytes} bytes.", code="upload_size_mismatch", param="part_ids")
        reader = _PartsReader(storage, ordered, md5.lower() if isinstance(md5, str) else None)
        try:
            # The storage's put reads a source through read() alone, which is all the reader has.
            dataset = datasets.dataset_create(tenant=locked.tenant, source=cast(BinaryIO, reader),
                                              filename=locked.filename, size=total)
        finally:
            reader.close()
        try:
            locked.status, locked.dataset = Upload.Status.COMPLETED, dataset
            locked.save(update_fields=["status", "dataset"])
            locked.parts.all().delete()
        except BaseException:
            storage.delete(dataset.storage_key)
            raise
        after_commit(partial(_parts_delete, _parts_prefix(locked)))
    return locked


def upload_cancel(*, upload: Upload) -> Upload:
    """Cancels a pending upload: its parts are deleted, and no file is made."""
    with transaction.atomic():
        locked = _locked_pending(upload, "you can cancel")
        _end(locked, Upload.Status.CANCELLED)
    return locked


def uploads_expire() -> list[int]:
    """Ends the pending uploads past their expiry (Celery beat), deleting their parts; their ids."""
    expired: list[int] = []
    for pk in Upload.objects.filter(status=Upload.Status.PENDING, expires_at__lte=timezone.now()) \
            .values_list("pk", flat=True):
        with transaction.atomic():
            # A completion in progress holds the row: it is left to that completion.
            locked = (Upload.objects.select_for_update(of=("self",), skip_locked=True).select_related("tenant")
                      .filter(pk=pk, status=Upload.Status.PENDING).first())
            if locked is None:
                continue
            _end(locked, Upload.Status.EXPIRED)
        expired.append(pk)
    return expired


def _end(upload: Upload, status: str) -> None:
    upload.status = status
    upload.save(update_fields=["status"])
    upload.parts.all().delete()
    after_commit(partial(_parts_delete, _parts_prefix(upload)))


def _parts_delete(prefix: str) -> None:
    try:
        get_storage().delete_prefix(prefix)
    except Exception:
        logger.exception("Could not delete the parts under %s of an ended upload; delete them by hand", prefix)
