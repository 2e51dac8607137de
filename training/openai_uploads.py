"""OpenAI's Uploads API under /v1/uploads, on training.uploads: a file larger than one request, in parts.

As OpenAI's SDK calls it (`client.uploads.create`, `.parts.create`, `.complete`, `.cancel`, and
`upload_file_chunked`): `upload_<n>` is upload n, `part_<n>` part n. Beyond OpenAI's fields a part
may carry `sha256` (a form field beside `data`), the digest its sender computed, checked as it is
stored; the Part object answers its `bytes` and `sha256` too. Another tenant's upload is as missing
as one that never was (404 `upload_not_found`).
"""

from __future__ import annotations

from typing import Any

from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.http import HttpRequest
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response

from api.parsers import JSONParser
from serving.contracts.errors import InvalidInput, NotFound, PayloadTooLarge
from training import conf, uploads
from training.models import Upload, UploadPart
from training.openai_api import OpenAIView, file_object

UPLOAD_PREFIX = "upload_"
PART_PREFIX = "part_"
# The request fields of POST /v1/uploads (OpenAI's); anything else is refused by name.
CREATE_FIELDS = frozenset({"filename", "purpose", "bytes", "mime_type", "expires_after"})
COMPLETE_FIELDS = frozenset({"part_ids", "md5"})


def _unix(moment: Any) -> int:
    return int(moment.timestamp())


def _pk(prefix: str, value: Any) -> int | None:
    number = value.removeprefix(prefix) if isinstance(value, str) and value.startswith(prefix) else ""
    return int(number) if number.isdigit() and len(number) <= 18 else None


def upload_object(upload: Upload) -> dict[str, Any]:
    """OpenAI's Upload object; `file` is the File a completion made."""
    return {"id": f"{UPLOAD_PREFIX}{upload.pk}", "object": "upload", "bytes": upload.size_bytes,
            "created_at": _unix(upload.created_at), "expires_at": _unix(upload.expires_at),
            "filename": upload.filename, "purpose": upload.purpose, "status": uploads.upload_status(upload),
            "file": file_object(upload.dataset) if upload.dataset is not None else None}


def part_object(part: UploadPart) -> dict[str, Any]:
    return {"id": f"{PART_PREFIX}{part.pk}", "object": "upload.part", "created_at": _unix(part.created_at),
            "upload_id": f"{UPLOAD_PREFIX}{part.upload_id}", "bytes": part.size_bytes, "sha256": part.sha256}


class _UploadView(OpenAIView):
    queryset = Upload.objects.all()

    def upload(self, upload_id: str) -> Upload:
        pk = _pk(UPLOAD_PREFIX, upload_id)
        found = Upload.objects.for_tenant(self.tenant).filter(pk=pk).first() if pk is not None else None
        if found is None:
            raise NotFound(f"No such upload: {upload_id!r}.", code="upload_not_found", param="upload_id")
        return found


def _json_body(request: Request, fields: frozenset[str]) -> dict[str, Any]:
    body = request.data
    if not isinstance(body, dict):
        raise InvalidInput("The request body must be a JSON object.")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise InvalidInput(f"Unrecognized request argument(s) supplied: {', '.join(unknown)}.",
                           code="unknown_parameter", param=unknown[0])
    return body


class UploadsView(_UploadView):
    parser_classes = [JSONParser]

    @extend_schema(request=OpenApiTypes.OBJECT, responses={200: OpenApiTypes.OBJECT},
                   operation_id="openai_uploads_create",
                   summary="OpenAI: start an upload in parts (filename, purpose fine-tune, bytes, mime_type); it "
                           "expires in an hour")
    def post(self, request: Request) -> Response:
        body = _json_body(request, CREATE_FIELDS)
        if body.get("expires_after") is not None:
            raise InvalidInput("Files here never expire; leave 'expires_after' out.", code="unsupported_parameter",
                               param="expires_after")
        upload = uploads.upload_create(tenant=self.tenant, filename=body.get("filename"), purpose=body.get("purpose"),
                                       size=body.get("bytes"), mime_type=body.get("mime_type"))
        return Response(upload_object(upload), status=status.HTTP_200_OK)


class _PartUploadHandler(TemporaryFileUploadHandler):
    """Streams a part to a temporary file on disk and stops the moment it passes PART_MAX_BYTES, or
    the tier's dataset limit where that is smaller (no part can be more than its whole), deleting
    what it wrote."""

    def __init__(self, request: HttpRequest) -> None:
        super().__init__(request)
        self.received = 0
        self.limit = uploads.PART_MAX_BYTES
        self.tier: str | None = None

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        auth = getattr(self.request, "auth", None)
        if auth is not None:
            self.tier = auth.tenant.tier.name
            self.limit = min(uploads.PART_MAX_BYTES, conf.dataset_max_bytes(self.tier))

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes | None:
        self.received += len(raw_data)
        if self.received > self.limit:
            self.file.close()  # a NamedTemporaryFile: closing deletes it
            if self.limit < uploads.PART_MAX_BYTES:
                raise PayloadTooLarge(f"A part may be at most {self.limit} bytes here: datasets on tier '{self.tier}' "
                                      f"may be at most {self.limit} bytes.", code="part_too_large", param="data")
            raise PayloadTooLarge(f"A part may be at most {uploads.PART_MAX_BYTES} bytes; send the file in more "
                                  "parts.", code="part_too_large", param="data")
        return super().receive_data_chunk(raw_data, start)


class UploadPartsView(_UploadView):
    parser_classes = [MultiPartParser, FormParser]

    def initialize_request(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Request:
        if request.method == "POST":
            request.upload_handlers = [_PartUploadHandler(request)]
        return super().initialize_request(request, *args, **kwargs)

    @extend_schema(request={"multipart/form-data": OpenApiTypes.OBJECT}, responses={200: OpenApiTypes.OBJECT},
                   operation_id="openai_uploads_parts_create",
                   summary="OpenAI: add a part (multipart `data`, at most 64 MiB; optional `sha256` of it, checked)")
    def post(self, request: Request, upload_id: str) -> Response:
        upload = self.upload(upload_id)
        data = request.FILES.get("data")
        if data is None:
            raise InvalidInput("Send the part's bytes as the multipart form field 'data'.", code="missing_data",
                               param="data")
        form = request.data if isinstance(request.data, dict) else {}  # a multipart form: a QueryDict
        part = uploads.upload_part_add(upload=upload, source=data, sha256=form.get("sha256") or None)
        return Response(part_object(part), status=status.HTTP_200_OK)


class UploadCompleteView(_UploadView):
    parser_classes = [JSONParser]

    @extend_schema(request=OpenApiTypes.OBJECT, responses={200: OpenApiTypes.OBJECT},
                   operation_id="openai_uploads_complete",
                   summary="OpenAI: complete an upload (part_ids in the file's order, optional md5) into a file, "
                           "validated as a direct upload")
    def post(self, request: Request, upload_id: str) -> Response:
        upload = self.upload(upload_id)
        body = _json_body(request, COMPLETE_FIELDS)
        given = body.get("part_ids")
        if not isinstance(given, list) or not given:
            raise InvalidInput("'part_ids' must list the upload's parts (their ids) in the file's order.",
                               param="part_ids")
        part_ids = []
        for item in given:
            pk = _pk(PART_PREFIX, item)
            if pk is None:
                raise InvalidInput(f"{item!r} in 'part_ids' is not a part id (part_<n>).", code="part_not_found",
                                   param="part_ids")
            part_ids.append(pk)
        completed = uploads.upload_complete(upload=upload, part_ids=part_ids, md5=body.get("md5") or None)
        return Response(upload_object(completed))


class UploadCancelView(_UploadView):
    @extend_schema(request=None, responses=OpenApiTypes.OBJECT, operation_id="openai_uploads_cancel",
                   summary="OpenAI: cancel a pending upload (its parts are deleted)")
    def post(self, request: Request, upload_id: str) -> Response:
        return Response(upload_object(uploads.upload_cancel(upload=self.upload(upload_id))))
